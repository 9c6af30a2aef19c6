"""The Weights & Biases side of tracking. Where runs go is W&B's own setting: WANDB_PROJECT
(else the project "raytrain-lm"), WANDB_ENTITY, WANDB_MODE (`offline`: run files under
WANDB_DIR, else ./wandb, for `wandb sync` later), WANDB_API_KEY / `wandb login`, WANDB_BASE_URL.

A run: the flat config as its config, metrics at their steps (`run.log(..., step=)`), the summary
in `run.summary`, files as one artifact (type `run-results`), and its end: exit code 0 when
completed, 1 when failed, 130 when stopped by Ctrl-C (W&B shows the latter two as failed; the
summary's `status` says which). Several runs live side by side in one process (a sweep's trials:
`reinit="create_new"`), each in W&B's group named after the sweep; the sweep itself has no run.
A resumed run is `wandb.init(id=..., resume="allow")`: the same run online; offline, a second local
folder with the same id, which `wandb sync` uploads into the same run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional

from raytrain_lm import env

DEFAULT_PROJECT = "raytrain-lm"
EXIT_CODE = {"completed": 0, "failed": 1, "killed": 130}


class Backend:
    def __init__(self):
        env.set_default("WANDB_SILENT", "true")  # its notices would break the progress lines
        import wandb

        self.wandb = wandb
        self.run = None
        self.where = f"W&B {env.wandb_mode() or 'online'}"

    def open(self, name: str, record: Optional[dict], params: dict[str, Any], kind: str,
             group: Optional[str], parent: Optional[dict]) -> dict:
        if kind == "sweep":
            return {}
        wandb = self.wandb
        run_id = record.get("id") if record else None  # None: W&B makes one
        project = (record or {}).get("project") or env.wandb_project() or DEFAULT_PROJECT
        self.run = wandb.init(
            project=project, name=name, id=run_id, resume="allow", group=group,
            job_type="trial" if kind == "trial" else "train", reinit="create_new",
            # the driver's console is not W&B's to capture; nor are the machine's stats its to sample
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                    disable_git=True, save_code=False))
        # after init, not in it: a resumed run's config may change (more --max-steps)
        self.run.config.update(params, allow_val_change=True)
        return {"id": self.run.id, "project": project, "entity": self.run.entity, "group": group}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in values.items() if v is not None})

    def artifacts(self, files: dict[str, bytes]) -> None:
        artifact = self.wandb.Artifact(f"{self.run.name}-results", type="run-results")
        with tempfile.TemporaryDirectory(prefix="raytrain-lm-wandb-") as tmp:
            for name, data in files.items():
                Path(tmp, name).parent.mkdir(parents=True, exist_ok=True)
                Path(tmp, name).write_bytes(data)
            artifact.add_dir(tmp)  # copied into W&B's staging area: tmp may go
        self.run.log_artifact(artifact)  # uploaded before finish() returns

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=EXIT_CODE[status])
