"""Spot nodes: noticing, at a step boundary, that a node of this run is about to be taken away.

Ray Train's preemption watcher (in the controller) sees a node being drained for preemption
(a cloud's spot notice, or `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`) and tells every
worker; `ray.train.get_preemption_info()` returns it, the same on every rank (it is a barrier that
hands out rank 0's answer). The loop then checkpoints at once, before the node's deadline, and
trains on: when the deadline passes Ray restarts the group without that node, from that checkpoint,
and counts the restart against `--max-preemptions`, not `--max-failures`.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import ray.train

# Asking is a barrier through Ray's synchronization actor, which a short step notices. Asking more
# often than the watcher looks (ray_compat/polls.py) is no use, so the loop asks about once a second.
ASK_EVERY_S = 1.0
PACING_STEPS = 10  # steps timed (asking at each) before the pace is set


class PreemptionWatch:
    """Asks Ray at step boundaries whether a node of the run is being preempted, about once a
    second: every step for the first PACING_STEPS, then every k steps, k from rank 0's step time
    (the same k on every rank: it is broadcast). Answers once per notice (a later notice for more
    nodes is a new one)."""

    def __init__(self):
        self.every: Optional[int] = None  # steps between questions, once paced
        self.started: Optional[tuple[int, float]] = None
        self.seen: set[tuple[str, ...]] = set()

    def check(self, step: int) -> Optional[dict[str, Any]]:
        """What to record with a just-in-time checkpoint at this step, or None. Every rank calls
        this at every step and gets the same answer."""
        if self.every is None:
            self._pace(step)
        elif step % self.every:
            return None
        info = ray.train.get_preemption_info()  # a barrier: rank 0's answer on every rank
        if info is None or tuple(info.preempted_node_ids) in self.seen:
            return None
        self.seen.add(tuple(info.preempted_node_ids))
        left = None if info.deadline_ms is None else round(info.deadline_ms / 1000 - time.time(), 1)
        return {"nodes": info.preempted_node_ids, "ranks": info.preempted_ranks,
                "seconds_left": left}

    def _pace(self, step: int) -> None:
        if self.started is None:
            self.started = (step, time.perf_counter())
        elif step - self.started[0] >= PACING_STEPS:
            from ray.train.collective import broadcast_from_rank_zero

            per_step = (time.perf_counter() - self.started[1]) / (step - self.started[0])
            self.every = broadcast_from_rank_zero(max(1, round(ASK_EVERY_S / per_step)))
