"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine schedule."""

from __future__ import annotations

import math

import torch

from raytrain_lm.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # Decay 2-D weights (matmuls, embeddings); never biases or LayerNorm gains.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=device.type == "cuda")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine decay to
    lr * min_lr_ratio at max_steps. schedule="exp_range" (the LR range test of `lr-find`): from
    lr * min_lr_ratio up to lr, exponentially, over max_steps."""
    max_lr, min_lr = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "exp_range":
        return min_lr * (max_lr / min_lr) ** (min(step, cfg.max_steps - 1) / max(1, cfg.max_steps - 1))
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= cfg.max_steps:
        return min_lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
