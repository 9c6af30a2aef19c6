"""Everything that makes the model distributed or memory-lean, applied from outside `model.py`
(which imports nothing from torch.distributed), in one order: activation checkpointing, then
torch.compile, then the data-parallel wrapper (DDP through Ray Train, or FSDP2).

    mesh.py   process group and device mesh; all-reduce of metrics
    ac.py     activation checkpointing (full or selective)
    ddp.py    DDP replica through ray.train.torch.prepare_model; no_sync for accumulation
    fsdp.py   FSDP2 sharding; what a rank holds
"""

from __future__ import annotations

import torch

from raytrain_lm.config import TrainConfig
from raytrain_lm.parallel import ddp, fsdp
from raytrain_lm.parallel.ac import apply_activation_checkpointing
from raytrain_lm.parallel.mesh import is_distributed


def parallelize(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """Returns the module to call for training. `model` itself stays the unwrapped module whose
    state_dict has clean keys (with FSDP it is sharded in place)."""
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.strategy == "fsdp" and is_distributed():
        return fsdp.shard(model, cfg, device)
    return ddp.replicate(model, cfg.compile)
