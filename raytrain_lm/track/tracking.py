"""One run's tracking runs (`--track mlflow`, `--track wandb`), fed by the driver.

Every call is queued and made, in order, by one background thread: a slow or unreachable
tracking server never holds the driver's loop, and so never training. The first call of a
tracker that fails (a server that does not answer, credentials it refuses) is one warning line;
that tracker is dropped for the rest of this process and the run goes on, every row still in
metrics.jsonl. At the end, `close` waits at most CLOSE_WAIT_S for what is queued.

What continues a tracking run (MLflow's run id, W&B's run id) is handed to `on_records` as soon as
the tracking run exists; the driver keeps it in the run's tracking.json, so `train --resume`
continues the same tracking run. A tracking run takes each step once: a row for a step it already
has (a restart from a checkpoint recomputes the steps after it) is not sent again; metrics.jsonl
keeps the recomputed row, which an exact resume makes equal.
"""

from __future__ import annotations

import importlib
import importlib.util
import queue
import sys
import threading
from typing import Any, Callable, Optional, Sequence

from raytrain_lm import env
from raytrain_lm.errors import UserError, last_line

# tracker -> (the package it needs, our module that drives it)
TRACKERS = {"mlflow": ("mlflow", "raytrain_lm.track.mlflow_run"),
            "wandb": ("wandb", "raytrain_lm.track.wandb_run")}
EXTRA = "pip install 'raytrain-lm[track]'"
CLOSE_WAIT_S = 60.0  # the most the end of a run waits for the trackers to send what they hold
# What our statuses are in the trackers' terms: summary.json's "completed" / "failed", and a
# driver stopped by Ctrl-C.
STATUSES = ("completed", "failed", "killed")


def check_trackers(names: Optional[Sequence[str]]) -> list[str]:
    """--track's values, each known and its client installed (else one line naming the extra),
    without duplicates; checked before anything starts."""
    out: list[str] = []
    for name in names or []:
        name = name.strip().lower()
        if name not in TRACKERS:
            raise UserError(f"--track must be one of {', '.join(TRACKERS)}, got {name!r}")
        if not installed(TRACKERS[name][0]):
            raise UserError(f"--track {name} needs the {TRACKERS[name][0]} client, which is not "
                            f"installed: {EXTRA}")
        if name == "mlflow":
            check_mlflow_store()
        if name not in out:
            out.append(name)
    return out


def installed(package: str) -> bool:
    """Whether `package` can be imported (found without importing it; a None in sys.modules is
    Python's way to keep a package from being imported)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def check_mlflow_store() -> None:
    """MLflow's store must be one its installed client can write, checked before the run: without
    MLFLOW_TRACKING_URI, MLflow's default is a SQLite file (needs the full `mlflow` package); a
    local folder needs MLflow's own opt-in (MLFLOW_ALLOW_FILE_STORE=true)."""
    uri = env.mlflow_uri() or ""
    if not uri and not installed("sqlalchemy"):
        raise UserError("--track mlflow: set MLFLOW_TRACKING_URI to your MLflow server "
                        "(http://host:5000), or `pip install mlflow` for its local SQLite store")
    local_folder = uri.startswith("file:") or (":" not in uri and uri not in ("", "databricks"))
    if local_folder and not env.mlflow_file_store_allowed():
        raise UserError(f"--track mlflow: MLFLOW_TRACKING_URI={env.redacted(uri)} is a local folder, which MLflow "
                        f"writes only with MLFLOW_ALLOW_FILE_STORE=true (or use a server, or "
                        f"sqlite:///mlflow.db with `pip install mlflow`)")


def flat_params(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as flat parameters: {"model": {"n_layer": 2}} -> {"model.n_layer": 2}."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def numbers(values: dict) -> dict[str, float]:
    """The finite-or-not numbers of a flat dict (bools and None left out)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def open_backend(name: str):
    """The client side of tracker `name` (its package imported only now)."""
    return importlib.import_module(TRACKERS[name][1]).Backend()


class Tracking:
    """The tracking runs of one training run (or one Tune trial, or a sweep's parent run).

    `records`: {tracker: what continues its tracking run} from an earlier driver (tracking.json);
    `parent`: the sweep's records, for a trial (an MLflow child run, a W&B group); `group`: the
    sweep's name; `kind`: "run", "trial" or "sweep" (W&B has no run for a sweep: its trials'
    group is the sweep); `last_step`: the last step the tracking runs already have."""

    def __init__(self, names: Sequence[str], name: str, params: dict[str, Any], *,
                 say: Callable[[str], None] = print, records: Optional[dict] = None,
                 on_records: Optional[Callable[[dict], None]] = None,
                 parent: Optional[dict] = None, group: Optional[str] = None, kind: str = "run",
                 last_step: Optional[int] = None, backends: Optional[dict] = None):
        self.names = list(names)
        self.say, self.on_records = say, on_records
        self.records: dict[str, dict] = dict(records or {})
        self.last_step = last_step
        self.dropped: set[str] = set()
        self.backends: dict[str, Any] = dict(backends or {})
        self.calls: queue.Queue = queue.Queue()
        self.opened = threading.Event()  # set once every tracker has opened its run, or failed to
        self.thread = threading.Thread(target=self._work, name="raytrain-lm-tracking", daemon=True)
        self.thread.start()
        for tracker in self.names:
            self._call(tracker, "open", name, self.records.get(tracker), params, kind, group,
                       (parent or {}).get(tracker))
        self.calls.put("opened")

    # ---------------------------------------------------------------- what the driver calls

    def log_row(self, row: dict, values: dict[str, float]) -> None:
        """`values` (chart name -> number) at the row's step, unless the tracking runs have it."""
        step = int(row["step"])
        if self.last_step is not None and step <= self.last_step:
            return
        self.last_step = step
        for tracker in self.names:
            self._call(tracker, "log", step, dict(values))

    def log_summary(self, values: dict[str, Any], files: Optional[dict[str, bytes]] = None) -> None:
        """Summary values (a flat dict; each tracker keeps what it can) and files to keep with
        the tracking run (name -> bytes)."""
        for tracker in self.names:
            self._call(tracker, "summary", dict(values))
            if files:
                self._call(tracker, "artifacts", dict(files))

    def close(self, status: str, wait: float = CLOSE_WAIT_S) -> None:
        """Mark the tracking runs `status` (STATUSES) and wait at most `wait` seconds for every
        queued call; a tracker still sending then is left behind with one warning line."""
        assert status in STATUSES, status
        for tracker in self.names:
            self._call(tracker, "finish", status)
        self.calls.put(None)
        self.thread.join(timeout=wait)
        if self.thread.is_alive():
            self.say(f"warning: {', '.join(self.names)} tracking still sending after {wait:g} s; "
                     f"left behind (every row is in metrics.jsonl)")

    def opened_records(self, wait: float = CLOSE_WAIT_S) -> dict:
        """The records, once every tracker has opened its run (or failed to): what a sweep's
        trials name as their parent."""
        self.opened.wait(timeout=wait)
        return dict(self.records)

    # ---------------------------------------------------------------- the background thread

    def _call(self, tracker: str, method: str, *args: Any) -> None:
        self.calls.put((tracker, method, args))

    def _work(self) -> None:
        while (item := self.calls.get()) is not None:
            if item == "opened":
                self.opened.set()
                continue
            tracker, method, args = item
            if tracker in self.dropped:
                continue
            try:
                if tracker not in self.backends:
                    self.backends[tracker] = open_backend(tracker)
                result = getattr(self.backends[tracker], method)(*args)
            except Exception as e:  # never let tracking fail a run
                self.dropped.add(tracker)
                where = getattr(self.backends.get(tracker), "where", tracker)
                self.say(env.redacted(f"warning: {tracker} tracking stopped ({where}: {last_line(e)}); "
                                      f"the run goes on, every row is in metrics.jsonl"))
                continue
            if method == "open" and result:
                self.records[tracker] = result
                if self.on_records:
                    try:
                        self.on_records(dict(self.records))
                    except Exception as e:  # e.g. a full disk: the run's own files say so
                        self.say(f"warning: could not keep the tracking runs' ids: {last_line(e)}")
