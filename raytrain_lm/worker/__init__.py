"""What runs inside a Ray Train worker (torch): the loop, the step, the optimizer, checkpoints
from the worker's side, what it measures (metrics), preemption notices and fault drills."""
