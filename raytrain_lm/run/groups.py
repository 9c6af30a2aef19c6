"""The worker groups of a run, as the driver sees them in the rows it receives.

Every restart (after a worker failure, after a node's preemption, or an elastic resize) starts a new
worker group, which resumes from the newest valid checkpoint. The driver tells a group by the start
time its rank 0 reports (`train_start_unix`); a new one is a restart, and one of another size a
resize: at the step it resumed from, from how many workers to how many, and why. The why is the
last thing the driver heard before it: a worker failure (Ray's callback), a preemption notice (the
row of the just-in-time checkpoint), else the cluster itself grew or shrank (Ray's elastic policy).
"""

from __future__ import annotations

from typing import Optional


class WorkerGroups:
    def __init__(self, restarts: int = 0, resizes: Optional[list[dict]] = None,
                 workers: Optional[int] = None, reason: Optional[str] = None):
        """`restarts`, `resizes`: a resumed run's so far; `workers`: the size of its last group
        (from metrics.jsonl), `reason`: why the first group starts (a resume by the driver)."""
        self.restarts, self.resizes = restarts, list(resizes or [])
        self.workers, self.reason = workers, reason
        self.group: Optional[float] = None  # rank 0's start time of the group now reporting
        self.ran = False  # a group of this driver has run (reported, or failed before it could)

    def failure(self, error: str) -> None:
        self.reason, self.ran = f"worker failure ({error})", True

    def preemption(self, notice: dict) -> None:
        nodes = notice.get("nodes") or []
        self.reason = f"preemption of {len(nodes)} node{'s' if len(nodes) != 1 else ''}"

    def row(self, row: dict) -> Optional[str]:
        """Take a row a group reported; returns what to tell the user when it shows a resize."""
        said = self._group(row)
        # why the next group starts, told by whichever row of this one (its first, too: after
        # that row's own group is reckoned, which clears the reason it started for)
        if row.get("preemption"):
            self.preemption(row["preemption"])
        return said

    def _group(self, row: dict) -> Optional[str]:
        """A new group (a restart, perhaps a resize) if the row is its first."""
        group = row.get("train_start_unix")
        if group is None or group == self.group:
            return None
        if self.ran:  # a group ran before this one (a failure may come before any row)
            self.restarts += 1
        self.group, self.ran = group, True
        workers, said = row.get("workers"), None
        if None not in (workers, self.workers) and workers != self.workers:
            why = self.reason or ("the cluster grew" if workers > self.workers else
                                  "the cluster shrank")
            step = row.get("resumed_from_step") or 0
            self.resizes.append({"step": step, "from": self.workers, "to": workers, "why": why})
            said = f"resized from {self.workers} to {workers} workers at step {step}: {why}"
        self.workers, self.reason = workers, None
        return said
