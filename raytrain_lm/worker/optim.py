"""AdamW with decoupled weight decay on matrices only (per-parameter groups under muP), and the
warmup + cosine schedule."""

from __future__ import annotations

import math

import torch

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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based). After a linear warmup:
    - cosine: cosine decay from lr to lr * min_lr_ratio at the horizon;
    - wsd (warmup-stable-decay): lr until the last `decay_fraction` of the horizon, then a linear
      decay to lr * min_lr_ratio at the horizon. Adding steps before the decay starts moves the
      decay without changing any learning rate already used;
    - exp_range (the LR range test of `lr-find`): from lr * min_lr_ratio up to lr, exponentially,
      over max_steps.
    The horizon is max_steps unless set; after it the minimum is held."""
    max_lr, min_lr = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "exp_range":
        return min_lr * (max_lr / min_lr) ** (min(step, cfg.max_steps - 1) / max(1, cfg.max_steps - 1))
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / (cfg.warmup_steps + 1)
    horizon = cfg.horizon or cfg.max_steps
    if step >= horizon:
        return min_lr
    if cfg.schedule == "wsd":
        decay_start = max(cfg.warmup_steps, horizon - round(cfg.decay_fraction * horizon))
        if step < decay_start:
            return max_lr
        return max_lr - (max_lr - min_lr) * (step - decay_start) / max(1, horizon - decay_start)
    progress = (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def resumed_horizon(saved: TrainConfig, cfg: TrainConfig, step: int) -> TrainConfig:
    """A run resumed at `step` from a checkpoint saved with `saved` keeps the learning rates it
    has used. If --max-steps changed and moving the horizon to the new max_steps would change the
    learning rate at `step` (a cosine already decaying, a wsd already in its decay), the old
    horizon stays and the minimum is held after it; otherwise (still warming up, a wsd still
    stable) the schedule stretches to the new end. An earlier resume's horizon is inherited.
    Returns `cfg`, its horizon set."""
    if cfg.horizon is None:
        cfg.horizon = saved.horizon
    if cfg.horizon is not None or cfg.max_steps == saved.max_steps:
        return cfg  # the user's or an earlier resume's horizon, or nothing moved
    moved = lr_at(step, cfg)
    cfg.horizon = saved.max_steps
    if math.isclose(lr_at(step, cfg), moved, rel_tol=1e-12):
        cfg.horizon = None
    return cfg
