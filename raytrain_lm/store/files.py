"""The names of what raytrain-lm writes, in one place: a run's folder, its checkpoints, a
dataset's folder. Everything that reads or writes these files takes the names from here.

    <storage>/<run>/
        summary.json                status, losses, throughput, ... (kept current while training)
        config.json                 the run's TrainConfig (what --resume continues with)
        metrics.jsonl               one line per logged step
        checkpoint_00000200/        a Ray Train checkpoint: state.pt, meta.json, rank*.json, ...
        best_checkpoint/            a copy of the checkpoint with the lowest validation loss
        tracking.json               the run's MLflow / W&B runs (--track), continued by --resume
        eval/<task>.json            `evaluate`'s results, one file per task
"""

from __future__ import annotations

import re
from typing import Optional

# ---------------------------------------------------------------- a run's folder
SUMMARY = "summary.json"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINT_PREFIX = "checkpoint_"
CLAIM_PREFIX = ".claim-"  # a driver's claim on the folder while it runs (storage.RunClaim)
BEST_DIR = "best_checkpoint"
TRACKING = "tracking.json"  # {tracker: what continues its tracking run} (track/tracking.py)
EVAL_DIR = "eval"  # evaluate's results: eval/<task>.json

# ---------------------------------------------------------------- inside a checkpoint
STATE = "state.pt"  # rank 0: step, data position, config; model and optimizer unless sharded
META = "meta.json"  # rank 0's commit record, written last
DCP_DIR = "dcp"  # sharded model and optimizer (torch.distributed.checkpoint)

# ---------------------------------------------------------------- a dataset's folder
MANIFEST = "manifest.json"
# A BPE's vocabulary and merges (Hugging Face's format). The same file, byte for byte, goes into
# every checkpoint of a run on that dataset and into an export, so each is usable on its own.
TOKENIZER = "tokenizer.json"
# In a node's cache of a dataset on shared storage: where the shards come from when first read.
REMOTE_SOURCE = "source.json"

def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(name: str) -> Optional[int]:
    """The step of a `checkpoint_00000200` folder name; None for any other name."""
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX):]
    return int(digits) if digits.isascii() and digits.isdigit() else None  # not '²': int() refuses it


def rank_record(rank: int) -> str:
    return f"rank{rank}.json"


def is_rank_record(name: str) -> bool:
    return re.fullmatch(r"rank\d+\.json", name) is not None


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


# ---------------------------------------------------------------- a sweep's folder (tune)
SWEEP = "sweep.json"  # base config, search space and settings: what --resume reuses
SWEEP_RESULTS = "results.json"
BEST_CONFIG = "best.yaml"
TRANSFER_CONFIG = "transfer.yaml"  # tune --target-width: best.yaml at the target width (muTransfer)
VAL_CURVES = "val_curves.png"
TRIAL_CONFIG = "train_config.json"

# ---------------------------------------------------------------- lr-find's, in its run's folder
LR_FIND_RESULT = "lr_find.json"
LR_FIND_PLOT = "lr_find.png"
