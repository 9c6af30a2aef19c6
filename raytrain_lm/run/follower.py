"""The driver following a run: the workers' metrics rows, taken from Ray Train's controller, into
metrics.jsonl, TensorBoard, the tracking runs and the progress display; restarts and resizes
counted; summary.json rewritten as the run goes."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import UserError
from raytrain_lm.plan.goodput import choice_line
from raytrain_lm.run.groups import WorkerGroups
from raytrain_lm.run.tracked import row_values
from raytrain_lm.store import files
from raytrain_lm.store.row import MetricsRow
from raytrain_lm.store.storage import MetricsLog, RunFolder
from raytrain_lm.store.summary import build_summary

ROWS_POLL_S = 0.25  # how often a driver (or a sweep's trial) takes new rows from the controller


class Follower:
    """Follows a run from the driver: rows from the workers (held by the controller's callback,
    taken from the controller) go to metrics.jsonl, TensorBoard, the tracking runs (`tracking`)
    and the caller's progress display, restarts and resizes to `groups`, and summary.json is
    rewritten at every checkpoint, failure and resize."""

    tracking = None  # the run's tracking runs (run/tracked.py), None without --track

    def __init__(self, cfg: TrainConfig, run: RunFolder, t_launch: float, previous: dict,
                 resume: bool, say: Callable[[str], None],
                 on_metrics: Optional[Callable[[dict], None]]):
        """`previous`: a resumed run's summary.json so far ({} for a new run)."""
        self.cfg, self.run, self.t_launch = cfg, run, t_launch
        self.say, self.on_metrics = say, on_metrics
        self.nonfinite: Optional[str] = None  # "loss became nan at step N", when it did
        self.log = MetricsLog(run)
        last = self.log.rows[-1] if self.log.rows else {}
        self.groups = WorkerGroups(previous.get("restarts", 0) + (1 if resume else 0),
                                   previous.get("resizes"), last.get("workers"),
                                   "resumed by the driver" if resume else None)

    def write_summary(self, status: str, checkpoint: Optional[str] = None,
                      error: Optional[str] = None) -> dict:
        out = build_summary(self.cfg, self.log.rows, status, time.time() - self.t_launch,
                            self.t_launch, checkpoint, error)
        out["restarts"], out["resizes"] = self.groups.restarts, self.groups.resizes
        out["best_checkpoint"] = (self.run.display_path(files.BEST_DIR)
                                  if self.run.exists(files.BEST_DIR) else None)
        self.run.write_json(files.SUMMARY, out)
        return out

    def follow(self, trainer):
        """Run `trainer.fit()` while taking its rows (fit_following); returns (result, error)."""
        from raytrain_lm.run.tensorboard import TensorBoardLog

        tb = TensorBoardLog(self.run, self.say)  # event files beside metrics.jsonl
        try:
            return fit_following(trainer, lambda rows: [self.take(row, tb) for row in rows])
        except UserError as e:  # the run's files cannot be kept (a full disk): it stops here
            return None, e
        finally:
            tb.close()

    def stopped(self, checkpoint: Optional[str]) -> Optional[str]:
        """Why the workers stopped short (their loss became non-finite) with the last good
        checkpoint, `checkpoint` (the latest: none is saved after it), in one line; None when
        they did not."""
        if self.nonfinite is None:
            return None
        return (f"{self.nonfinite}; the last good checkpoint is "
                f"{checkpoint or 'none (the run saved none before it)'}")

    def take(self, row: MetricsRow, tb) -> None:
        """One row from the workers (rank 0's) with the rows sent with it: into metrics.jsonl,
        the progress display, TensorBoard (`tb`), the tracking runs; a restart or resize said and
        recorded."""
        if row.get("event") == "nonfinite":  # the workers stop after this row (loop.py)
            for earlier in row.pop("earlier_rows", None) or []:  # the good rows before it
                self.take(earlier, tb)
            self.nonfinite = row["error"]
            return
        if row.get("event") == "worker_failure":
            self.groups.failure(row["error"])
            self.say(f"worker failure: {row['error']}; restarting from the latest checkpoint")
            self.write_summary("running")
            return
        resized = self.groups.row(row)  # a new worker group: a restart, perhaps a resize
        if resized:
            self.say(resized)
        # the rows made since the previous report; before them, rows Ray may have lost, re-sent
        # after a resume (written again, not shown again)
        fresh = [*(row.pop("earlier_rows", None) or []), row]
        rows = [*(row.pop("resumed_rows", None) or []), *fresh]
        for r in rows:
            if r.get("checkpoint"):
                r["checkpoint"] = checkpoint_uri(self.run, r["checkpoint"])
            self.log.add(r)
        for r in fresh:
            if r.get("checkpoint_auto"):  # what --checkpoint-every auto chose, and why
                self.say(choice_line(r["checkpoint_auto"]))
        if self.on_metrics:  # shown once kept in metrics.jsonl; TensorBoard's copy is a convenience
            for r in fresh:
                self.on_metrics(r)
        for r in rows:
            tb.add(r)
            if self.tracking is not None:
                self.tracking.log_row(r, row_values(r, self.groups.restarts, len(self.groups.resizes)))
        if row.get("checkpoint") or resized:
            self.write_summary("running")


def take_rows(controller) -> Optional[list[dict]]:
    """The rows the run's controller holds (controller.take_rows); None once it is gone."""
    import ray

    try:
        return ray.get(controller.take_rows.remote())
    except ray.exceptions.RayError:  # its actor died, or Ray is going away
        return None


def fit_following(trainer, on_rows: Callable[[list[dict]], Any],
                  on_controller: Callable[[Any], Any] = lambda controller: None,
                  take: Callable[[Any], Optional[list[dict]]] = take_rows,
                  poll_s: float = ROWS_POLL_S) -> tuple[Any, Optional[BaseException]]:
    """`trainer.fit()` in a thread while this one takes the run's rows from its controller
    (`take`, every `poll_s`) and hands them to `on_rows`, the last ones after fit has returned;
    returns (fit's result, fit's error). `on_controller` gets the controller's handle as soon as
    fit has made it (`trainer.controller`). An error of `on_rows` ends the following and is
    raised here (fit's thread, a daemon, is left to the caller's process)."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # returned to the caller, on its thread
            outcome["error"] = e

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    seen, running = None, True
    while running:
        running = thread.is_alive()  # after fit returns, one last take: the rest of the rows
        thread.join(timeout=poll_s)
        controller = getattr(trainer, "controller", None)
        if controller is None:
            continue
        if controller is not seen:
            on_controller(controller)
            seen = controller
        rows = take(controller)
        if rows is None:  # the controller is gone: nothing more will come
            break
        on_rows(rows)
    thread.join()
    return outcome.get("result"), outcome.get("error")


def checkpoint_uri(run: RunFolder, path: str) -> str:
    """Where a checkpoint of `run` is, as the user would name it, from its folder name or from
    Ray's path: a path inside Ray's filesystem, which on object stores lacks the scheme
    (`bucket/...`, not `s3://bucket/...`)."""
    return run.display_path(path.rstrip("/").rsplit("/", 1)[-1])
