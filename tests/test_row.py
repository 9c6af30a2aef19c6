"""The typed contracts between the driver and the workers: the metrics row every side spells the
same way (store/row.py), and the worker's inputs (config/inputs.py; torch-free, picklable)."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import torch

import raytrain_lm
from conftest import MeteredStep
from raytrain_lm.config.inputs import WorkerInputs
from raytrain_lm.store.row import CHART_NAMES, ROW_KEYS
from raytrain_lm.worker.metrics import Meter

PACKAGE = Path(raytrain_lm.__file__).parent
# every module that builds, completes or reads a metrics row, and its names for a row
ROW_MODULES = {"worker/metrics.py": "row", "worker/loop.py": "row", "worker/checkpointer.py": "row",
               "run/driver.py": "row|r", "run/groups.py": "row", "store/summary.py": r"r|last|evals\[-1\]",
               "run/tensorboard.py": "row", "results/tables.py": "row", "results/plots.py": "r",
               "ray_compat/callbacks.py": "row"}


def keys_spelt(path: Path, names: str) -> set[str]:
    text = path.read_text()
    keys = set(re.findall(rf'(?<![\w.])(?:{names})(?:\[|\.get\(|\.pop\()"(\w+)"', text))
    for update in re.findall(r"(?<![\w.])row\.update\(([^)]*)\)", text):
        keys |= set(re.findall(r"(\w+)=", update))
    return keys


def test_every_row_key_the_code_spells_is_declared():
    spelt = set().union(*(keys_spelt(PACKAGE / m, names) for m, names in ROW_MODULES.items()))
    assert spelt and spelt - ROW_KEYS == set()
    assert set(CHART_NAMES) <= ROW_KEYS


def test_the_meters_row_has_only_declared_keys():
    meter = Meter(torch.device("cpu"), 1, 1.0, None, 6, 0.0)
    meter.add_step(torch.tensor(1.0), 10)
    # a mixture of experts' keys are declared too
    moe = MeteredStep(moe={"aux_loss": 1.0, "z_loss": 0.0, "expert_load": [1.2, 1.1]})
    assert set(meter.row(1, 1e-3, 1.0, moe)) <= ROW_KEYS


def test_the_worker_inputs_pickle_without_torch():
    inputs = WorkerInputs(train={"lr": 1e-3}, run_name="r", force=True)
    assert pickle.loads(pickle.dumps(inputs)) == inputs
    code = "import sys, raytrain_lm.config.inputs, raytrain_lm.store.row; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
