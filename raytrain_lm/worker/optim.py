"""AdamW with decoupled weight decay on matrices only (per-parameter groups under muP). The
learning-rate schedule it follows (lr_at, resumed_horizon) is config/schedule.py's, pure Python."""

from __future__ import annotations

import torch

from raytrain_lm.config.schedule import lr_at, resumed_horizon
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.models import mup


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `model` (a whole decoder, a pipeline stage, sharded or wrapped). Weight decay on
    2-D and larger weights (matmuls, embeddings, experts), never on biases or norm gains. Under
    --param mup each parameter's lr and decay are scaled by its rule (models/mup.py), looked up
    by its name: `optimizer.lr_mults[i]` multiplies the schedule's lr of group i at every step
    (TrainStep). The multiples stay out of the groups themselves, so that the optimizer's state
    dict (and a checkpoint's) holds the keys it always did: a run saved before muP resumes."""
    by_group: dict = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        r = mup.rule(cfg.model, name)
        key = (p.dim() >= 2, r.lr, r.wd, getattr(p, "device_mesh", None))
        by_group.setdefault(key, []).append(p)
    # Decayed groups first, then the others, each at least one (empty) group: the order a saved
    # optimizer state's groups are matched by.
    groups, lr_mults = [], []
    for decay in (True, False):
        keys = [k for k in by_group if k[0] == decay] or [(decay, 1.0, 1.0, None)]
        groups += [{"params": by_group.get(k, []), "weight_decay": cfg.weight_decay * k[2] if decay else 0.0}
                   for k in keys]
        lr_mults += [k[1] for k in keys]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    optimizer.lr_mults = lr_mults
    return optimizer


__all__ = ["build_optimizer", "lr_at", "resumed_horizon"]
