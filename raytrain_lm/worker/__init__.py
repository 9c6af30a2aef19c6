"""What runs inside a Ray Train worker (torch): the loop, the step, the optimizer, checkpoints
from the worker's side, the metrics row, preemption notices and fault drills."""
