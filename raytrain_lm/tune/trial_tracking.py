"""A sweep's tracking (`tune --track mlflow|wandb`), from the sweep's driver: a Tune callback
that gets every trial's reports (rank 0's metrics rows, forwarded to Tune) and gives each trial a
tracking run of its own with the trial's config and hyperparameters, its rows at their steps, its
summary and status, grouped by the sweep (an MLflow parent run named after the sweep, the trials
its children; a W&B group of the sweep's name). Trial processes and workers never import a
tracking client.

The tracking runs' ids are kept in the sweep's tracking.json ({"sweep": ..., "trials": {trial id:
...}}), so `tune --resume` continues them. Tune pickles its callbacks into the sweep's state:
TrackTrials keeps its module path (tests/test_layout.py) and pickles its settings only.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from ray import tune

from raytrain_lm.store import files
from raytrain_lm.store.row import chart_values
from raytrain_lm.store.storage import RunFolder
from raytrain_lm.track import Tracking, flat_params

SINK: dict[str, Callable[[str], None]] = {"say": print}  # where warning lines go (run_sweep sets it)
SUMMARY_KEYS = {"loss": "final_train_loss", "val_loss": "final_val_loss", "val_bpb": "final_val_bpb"}


class TrackTrials(tune.Callback):
    def __init__(self, names: list[str], storage: str, sweep: str, base: dict[str, Any],
                 space: str):
        """`names`: the trackers; the sweep's folder `<storage>/<sweep>`; its base config and
        search space (the parent run's parameters)."""
        self.names, self.storage, self.sweep, self.base, self.space = names, storage, sweep, base, space
        self.lock = threading.Lock()
        self.parent: Optional[Tracking] = None
        self.trials: dict[str, Tracking] = {}
        self.last: dict[str, dict] = {}  # trial id -> its latest value of each metric

    def __getstate__(self):  # pickled into tuner.pkl: the settings only
        return {k: getattr(self, k) for k in ("names", "storage", "sweep", "base", "space")}

    def __setstate__(self, state):
        self.__init__(**state)

    # ---------------------------------------------------------------- tracking.json

    def _folder(self) -> RunFolder:
        return RunFolder(self.storage, self.sweep)

    def _saved(self) -> dict:
        folder = self._folder()
        try:
            found = folder.read_json(files.TRACKING) if folder.exists(files.TRACKING) else {}
        except Exception:  # damaged: new tracking runs
            found = {}
        return found if isinstance(found, dict) else {}

    def _keep(self, trial_id: Optional[str], records: dict) -> None:
        with self.lock:
            saved = self._saved()
            if trial_id is None:
                saved["sweep"] = records
            else:
                saved.setdefault("trials", {})[trial_id] = records
            self._folder().write_json(files.TRACKING, saved)

    # ---------------------------------------------------------------- Tune's calls

    def setup(self, **info):
        self.parent = Tracking(self.names, self.sweep, {**flat_params(self.base), "search_space": self.space},
                               say=SINK["say"], records=self._saved().get("sweep"), kind="sweep",
                               on_records=lambda records: self._keep(None, records))

    def on_trial_start(self, iteration, trials, trial, **info):
        tid = trial.trial_id
        params = {**flat_params(self.base), **flat_params(trial.config)}
        parent = self.parent.opened_records() if self.parent else None  # the children name it
        self.trials[tid] = Tracking(
            self.names, f"trial_{tid}", params, say=SINK["say"],
            records=self._saved().get("trials", {}).get(tid), parent=parent,
            group=self.sweep, kind="trial", on_records=lambda records: self._keep(tid, records))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        tracking = self.trials.get(trial.trial_id)
        if tracking is None or result.get("step") is None:
            return
        self.last.setdefault(trial.trial_id, {}).update(
            {k: v for k, v in result.items() if k in SUMMARY_KEYS or k == "step"})
        tracking.log_row(result, chart_values(result))

    def _close(self, trial, status: str) -> None:
        tracking = self.trials.pop(trial.trial_id, None)
        if tracking is None:
            return
        last = self.last.pop(trial.trial_id, {})
        tracking.log_summary({"status": status, "steps": last.get("step"),
                              **{name: last.get(key) for key, name in SUMMARY_KEYS.items()}})
        tracking.close(status)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._close(trial, "completed")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._close(trial, "failed")

    def on_experiment_end(self, trials, **info):
        for trial in trials:
            if trial.trial_id in self.trials:  # still open: the sweep stopped first
                self._close(trial, "killed")
        if self.parent is not None:
            self.parent.log_summary({"status": "completed", "trials": len(trials)})
            self.parent.close("completed")
            self.parent = None
