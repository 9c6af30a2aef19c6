"""`WorkerInputs`: what the driver hands every worker's `train_loop_per_worker` (run/driver.py's
loop_config), torch-free and picklable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class WorkerInputs:
    """What every worker is given."""
    train: dict[str, Any]  # TrainConfig.to_dict(): the run's config
    run_name: str
    init_from: Optional[str] = None  # --init-from: a checkpoint or a Hugging Face folder
    fail_at: Optional[str] = None  # the fault drill (worker/drills.py)
    force: bool = False  # --force: past the memory check
    log_windows: bool = False  # the window log drill (worker/drills.py)
    nan_at: Optional[int] = None  # the non-finite loss drill (worker/drills.py)
    hold_at: Optional[str] = None  # the hold drill (worker/drills.py)
