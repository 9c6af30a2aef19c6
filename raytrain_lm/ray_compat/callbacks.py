"""Ray Train callbacks. They run in Ray Train's controller actor, once per report of all ranks."""

from __future__ import annotations

import math
from typing import Optional

import pyarrow.fs as pafs
from ray.train import UserCallback

from raytrain_lm.errors import last_line
from raytrain_lm.store.files import BEST_DIR
from raytrain_lm.store.row import MetricsRow
from raytrain_lm.store.storage import copy_commit_last, share_folder, staged_folder


class HeldRows:
    """Where ForwardMetrics puts rows for `train`'s driver: a list in the controller's process,
    which the driver empties through the controller (`Controller.take_rows`). A Ray queue would
    be one more process per run (~1-2 CPU seconds of start-up)."""

    rows: list[dict] = []  # class-wide: one run per controller process

    def put(self, row: dict) -> None:
        HeldRows.rows.append(row)

    @staticmethod
    def take() -> list[dict]:
        rows, HeldRows.rows = HeldRows.rows, []
        return rows


class ForwardMetrics(UserCallback):
    """Sends rank 0's metrics (global: the loop all-reduces them) to the driver, plus an event
    when workers fail, through `queue` (HeldRows, or anything with `put`). Ray's `Result` would
    keep only checkpointed reports."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint):
        row: MetricsRow = dict(metrics[0])  # type: ignore[assignment]
        if checkpoint is not None:
            row["checkpoint"] = checkpoint.path
        self.queue.put(row)

    def after_exception(self, run_context, worker_exceptions):
        self.queue.put({"event": "worker_failure", "error": describe_failures(worker_exceptions)})


def describe_failures(failures: dict) -> str:
    """One line for a worker group failure. A dead process is the cause; the other ranks'
    collective errors ("connection reset by peer") are only its symptoms."""
    import ray.exceptions

    dead = sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.ActorDiedError))
    if dead:
        return f"worker process of rank {', '.join(map(str, dead))} died"
    rank, exc = sorted(failures.items())[0]
    return f"rank {rank}: {last_line(exc)}"


class KeepBest(UserCallback):
    """Ray keeps the last `num_to_keep` checkpoints; this keeps, in addition, the one with the
    lowest validation loss in `<run>/best_checkpoint/`, replaced when beaten: on a local disk its
    files linked into a folder that takes the old one's place in one rename; on object stores,
    which cannot rename a folder, copied into it with meta.json last (storage.copy_commit_last)."""

    def __init__(self, best_val_loss: Optional[float] = None):
        self.best = best_val_loss if best_val_loss is not None else math.inf

    def after_report(self, run_context, metrics, checkpoint):
        val = metrics[0].get("val_loss")
        if checkpoint is None or val is None or not val < self.best:
            return
        try:
            self._keep(checkpoint)
            self.best = val
        except Exception as e:  # losing the extra copy must not end the training run
            print(f"[raytrain-lm] could not update {BEST_DIR}: {e}", flush=True)

    @staticmethod
    def _keep(checkpoint) -> None:
        fs, src = checkpoint.filesystem, checkpoint.path.rstrip("/")
        best = f"{src.rsplit('/', 1)[0]}/{BEST_DIR}"
        if not isinstance(fs, pafs.LocalFileSystem):
            copy_commit_last(src, best, fs)
            return
        with staged_folder(best, fs) as tmp:
            share_folder(src, tmp, fs)
