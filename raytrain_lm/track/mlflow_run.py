"""The MLflow side of tracking, through `MlflowClient` (no global active run: a sweep's trials are
tracked side by side from one process). Where runs go is MLflow's own setting:
MLFLOW_TRACKING_URI (a server, `http://host:5000`; or a local store), MLFLOW_EXPERIMENT_NAME or
MLFLOW_EXPERIMENT_ID (else the experiment "raytrain-lm"), and its credentials
(MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD).

A run: parameters (the flat config), metrics at their steps, the summary's numbers as
`summary/<key>` metrics and its status as a tag, files as artifacts, and its end as FINISHED,
FAILED or KILLED. A Tune trial is a child of the sweep's run (the `mlflow.parentRunId` tag:
MLflow's UI nests it there).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from raytrain_lm import env
from raytrain_lm.track.tracking import numbers

DEFAULT_EXPERIMENT = "raytrain-lm"
STATUS = {"completed": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
# MLflow retries an unanswered request for minutes by default; a run's tracking gives up sooner
# (one warning line, the run goes on). The user's own settings of these win.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
PARAMS_PER_CALL = 100  # MLflow's limit for log_batch
VALUE_CHARS = 6000  # MLflow's limit for a parameter's value


class Backend:
    def __init__(self):
        for key, value in HTTP_DEFAULTS.items():
            env.set_default(key, value)
        import mlflow
        from mlflow import MlflowClient

        self.client = MlflowClient()
        self.where = env.redacted(mlflow.get_tracking_uri())  # shown, and kept in tracking.json
        self.run_id: Optional[str] = None

    def open(self, name: str, record: Optional[dict], params: dict[str, Any], kind: str,
             group: Optional[str], parent: Optional[dict]) -> dict:
        if record and record.get("run_id"):  # a resumed run: the same MLflow run, running again
            self.run_id = record["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            known = self.client.get_run(self.run_id).data.params
            params = {k: v for k, v in params.items() if k not in known}  # MLflow's are set once
            experiment_id = record.get("experiment_id")
        else:
            experiment_id = self._experiment()
            tags = {"raytrain_lm.kind": kind}
            if group:
                tags["raytrain_lm.sweep"] = group
            if parent and parent.get("run_id"):
                tags["mlflow.parentRunId"] = parent["run_id"]
            self.run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        self._params(params)
        return {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": self.where}

    def _experiment(self) -> str:
        experiment_id, name = env.mlflow_experiment()
        if experiment_id:
            return experiment_id
        name = name or DEFAULT_EXPERIMENT
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def _params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:VALUE_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=items[i:i + PARAMS_PER_CALL])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def summary(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        now, step = int(time.time() * 1000), int(values.get("steps") or 0)
        self.client.log_batch(
            self.run_id, metrics=[Metric(f"summary/{k}", v, now, step) for k, v in numbers(values).items()],
            tags=[RunTag(f"summary.{k}", str(v)[:VALUE_CHARS]) for k, v in values.items()
                  if isinstance(v, str)])

    def artifacts(self, files: dict[str, bytes]) -> None:
        with tempfile.TemporaryDirectory(prefix="raytrain-lm-mlflow-") as tmp:
            for name, data in files.items():  # a name may hold folders: eval/<task>.json
                Path(tmp, name).parent.mkdir(parents=True, exist_ok=True)
                Path(tmp, name).write_bytes(data)
            self.client.log_artifacts(self.run_id, tmp)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=STATUS[status])
