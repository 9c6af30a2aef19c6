"""Debugging aids that a test (or a user who wants proof) switches on from the driver's
environment; off, they cost one `if` where they hook in.

- Fault drill, RAYTRAIN_LM_FAIL_AT=RANK:STEP: that rank's process exits when it finishes that step,
  as on a lost node. RANK:STEP:upload: it exits while uploading its checkpoint of that step, after
  half of its files and before its commit record (the checkpoint stays incomplete). Once per run.
- Non-finite loss, RAYTRAIN_LM_NAN_AT=STEP: before that step every rank scales its first
  parameter by infinity, so the step's loss is nan (how the non-finite guard is tested: the run
  stops at its next report and its last checkpoint resumes). Every run it is set for.
- Window log, RAYTRAIN_LM_LOG_WINDOWS=1: every rank appends the window indices of each micro-batch
  it reads, with the data position of the step they belong to, to `<run>/windows/` (local storage
  only): what shows that a run, across restarts and resizes, used every window of an epoch once.
- Hold, RAYTRAIN_LM_HOLD_AT=STEP[:preemption][,...]: before that step every rank waits, so that a
  test makes the run stand where it wants it instead of racing it (local storage only). Rank 0
  first writes `hold-STEP.waiting` into the run's folder, JSON {step, world}: where the run
  stands. STEP: until the file `hold-STEP.release` appears there. STEP:preemption: until Ray tells
  of a node of the run being preempted (for a step up to PreemptionWatch's PACING_STEPS, where the
  loop asks Ray at every step: the notice is then taken at that step). Every worker group of every
  run it is set for (a resumed group past the step is not held again).
  STEP:upload (any storage; `UploadHold`): not the step but the upload of that step's checkpoint
  (a checkpoint step before the run's last), which waits until training has made its next report:
  the upload can finish only while training goes on, as `--checkpoint-upload async` lets it. A
  sync upload runs inside the report, so it would wait for itself: the rank raises instead. Every
  worker group that uploads that checkpoint.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Optional

from raytrain_lm.env import WINDOWS_ENV

WINDOWS_DIR = "windows"


def fault_due(spec: Optional[str], rank: int, step: int, phase: str = "step") -> bool:
    """Whether the drill `spec` ("R:K" or "R:K:upload") is for this rank, step and phase."""
    if not spec:
        return False
    r, k, *rest = spec.split(":")
    return int(r) == rank and int(k) == step and (rest[0] if rest else "step") == phase


def fault_drill(spec: Optional[str], step: int, rank: int, run_name: str, phase: str = "step") -> None:
    """Exit this process if the drill is due, once per run. "Once" is remembered in the cluster's
    key-value store, so the restarted worker group gets past the step. Without a cluster (Ray
    Train's local mode: nothing restarts) it exits whenever due; a resume is a new command."""
    if not fault_due(spec, rank, step, phase):
        return
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        key = f"raytrain_lm:fault:{run_name}:{spec}".encode()
        if internal_kv._internal_kv_get(key):
            return
        internal_kv._internal_kv_put(key, b"1")
    print(f"[fault drill] rank {rank} exiting at step {step} ({phase})", flush=True)
    os._exit(1)  # the process dies: no exception, no cleanup, as on a lost node


HOLD_POLL_S = 0.1  # how often a held rank looks again


def hold_drill(spec: Optional[str], step: int, rank: int, world: int, fs, run_path: str) -> None:
    """Before step `step` (1-based): if the drill `spec` holds the run there, wait (every rank
    alike) until it is released (module docstring). `fs`, `run_path`: the run's storage."""
    if not spec:
        return
    import pyarrow.fs as pafs

    holds = _holds(spec)
    if holds.get(str(step), UPLOAD) == UPLOAD:  # not held here (an upload hold: UploadHold)
        return
    if not isinstance(fs, pafs.LocalFileSystem):
        raise RuntimeError(f"the hold drill needs a local --storage, not {type(fs).__name__}")
    folder = Path(run_path)
    if rank == 0:
        waiting = folder / f"hold-{step}.waiting"
        waiting.with_suffix(".tmp").write_text(json.dumps({"step": step, "world": world}))
        waiting.with_suffix(".tmp").replace(waiting)  # whole or absent to a reader
    if holds[str(step)] == "preemption":
        import ray.train

        # a barrier that hands rank 0's answer to every rank: all ranks ask equally often
        while ray.train.get_preemption_info() is None:
            time.sleep(HOLD_POLL_S)
        return
    while not (folder / f"hold-{step}.release").exists():
        time.sleep(HOLD_POLL_S)


def _holds(spec: Optional[str]) -> dict[str, str]:
    """The hold drill's spec: step -> "" (until released), "preemption" or "upload"."""
    return dict(item.partition(":")[::2] for item in (spec or "").split(",") if item)


UPLOAD = "upload"
UPLOAD_HOLD_LIMIT_S = 600.0  # a held upload never released fails its rank rather than hang


class UploadHold:
    """The hold drill's STEP:upload items on one rank (module docstring): the training thread
    says each report it makes (`reporting`), the thread uploading a checkpoint waits in
    `before_upload` until a report after that checkpoint's step has been made."""

    def __init__(self, spec: Optional[str]):
        self.steps = {int(step) for step, kind in _holds(spec).items() if kind == UPLOAD}
        self.reported = 0  # the step of training's latest report
        self.training_thread: Optional[int] = None  # the thread that makes the reports
        self.waiting: Optional[int] = None  # the checkpoint whose upload is held now
        self.changed = threading.Condition()

    def reporting(self, step: int) -> None:
        """Training (on its own thread) is about to report `step`."""
        with self.changed:
            self.training_thread, self.reported = threading.get_ident(), step
            self.changed.notify_all()

    def before_upload(self, step: int, rank: int) -> None:
        """Before the upload of checkpoint `step`: if held, wait until training has reported a
        later step (RuntimeError if this is training's own thread: a sync upload)."""
        if step not in self.steps:
            return
        with self.changed:
            if threading.get_ident() == self.training_thread:
                raise RuntimeError(f"the hold drill holds the upload of checkpoint {step} until training "
                                   f"goes on, but it runs on training's thread (--checkpoint-upload sync)")
            self.waiting = step
            went_on = self.changed.wait_for(lambda: self.reported > step, timeout=UPLOAD_HOLD_LIMIT_S)
            self.waiting = None
        if not went_on:
            raise RuntimeError(f"the hold drill held the upload of checkpoint {step} and training made "
                               f"no later report")
        print(f"[hold drill] rank {rank}: checkpoint {step} uploaded after training reported step "
              f"{self.reported}", flush=True)


def nan_drill(at: Optional[int], step: int, step_fn) -> None:
    """Before step `step` (1-based): if it is the drill's, scale this rank's first parameter by
    infinity (its local shard: no collective)."""
    if at is None or step != at:
        return
    import torch

    p = next(step_fn.parts[0].parameters())
    with torch.no_grad():
        (p.to_local() if hasattr(p, "to_local") else p).mul_(float("inf"))


class WindowLog:
    """One file per rank and worker group: JSON lines {epoch, start, world, windows}, where
    (epoch, start) is the data position of the step the micro-batch belongs to (windows of the
    epoch consumed before it: the same at any worker count), so a reader keeps, for every step,
    only the lines of the last group that ran it (a restart repeats the steps after its
    checkpoint)."""

    def __init__(self, run_path: str, rank: int, world: int, group: int):
        """`group`: the same number on every rank of a worker group, larger for a later group."""
        folder = Path(run_path) / WINDOWS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.world = world
        self.path = folder / f"{group:020d}-rank{rank}.jsonl"

    @classmethod
    def for_group(cls, fs, run_path: str, rank: int, world: int) -> Optional["WindowLog"]:
        """Called on every rank of a worker group (a collective): its files are named after rank
        0's start time, so they sort in the order the groups ran. None (and a note) when the
        run's storage `fs` is not a local disk: object stores cannot append."""
        import pyarrow.fs as pafs
        from ray.train.collective import broadcast_from_rank_zero

        if not isinstance(fs, pafs.LocalFileSystem):
            if rank == 0:
                print(f"[drills] {WINDOWS_ENV} needs a local --storage; no window log", flush=True)
            return None
        return cls(run_path, rank, world, broadcast_from_rank_zero(time.time_ns()))

    def add(self, epoch: int, start: int, windows: list[int]) -> None:
        # One write per line, unbuffered: a process killed later keeps every line before.
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": epoch, "start": start, "world": self.world,
                                "windows": windows}) + "\n")


def read_window_log(run_dir: Path) -> dict[tuple[int, int], dict]:
    """{(epoch, start): {"world": w, "windows": [...]}} of the steps the run kept: for each step,
    the lines of the last worker group that ran it (the files in the order the groups started)."""
    by_group: dict[str, list[dict]] = {}
    for path in sorted((run_dir / WINDOWS_DIR).glob("*.jsonl")):
        group = path.name.split("-rank")[0]
        by_group.setdefault(group, []).extend(json.loads(line) for line in path.read_text().splitlines())
    steps: dict[tuple[int, int], dict] = {}
    for group in sorted(by_group):
        ran: dict[tuple[int, int], dict] = {}
        for line in by_group[group]:
            key = (line["epoch"], line["start"])
            ran.setdefault(key, {"world": line["world"], "windows": []})["windows"].extend(line["windows"])
        steps.update(ran)  # a later group's steps replace the earlier group's
    return steps
