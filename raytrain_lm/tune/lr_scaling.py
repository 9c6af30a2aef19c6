"""`--scale-lr`: carry a learning rate tuned at one global batch to another (the rules:
config/schedule.py's scaled_lr; here, the run's reference batch).

The global batch is counted in tokens per optimizer step (workers x batch_size x grad_accum x
seq_len): that is what changes when `--workers` changes. The batch `lr` was chosen at is recorded in
the config as `ref_batch_tokens` (a sweep's best config carries it); without it, the preset's own
batch (its defaults, 2 workers) is the reference, since the preset's lr was chosen there.

The rules know the parametrization. The width `lr` was chosen at is `ref_width` (a sweep's trial
records it; else the preset's). Under --param sp a wider model wants a smaller lr, by a factor
between 1 (embeddings, norms: muP leaves their Adam lr alone) and ref_width / width (hidden
matrices: Adam moves their output by ~lr x fan_in per step); one lr for all of them sits in
between, and sp's optimum measured across widths 64 to 512 (docs/benchmarks.md, section 24)
moved 2-4x for 8x the width: lr x sqrt(ref_width / width). Under --param mup nothing: its
per-parameter groups carry the width (models/mup.py), which is what muTransfer is. Either way
the batch's rule applies on top.
"""

from __future__ import annotations

import math
from typing import Optional

from raytrain_lm.config.presets import preset_config
from raytrain_lm.config.schedule import LR_SCALING, check_scaling, scaled_lr
from raytrain_lm.config.settings import TrainConfig

__all__ = ["LR_SCALING", "apply_lr_scaling", "scaled_lr"]


def width_factor(cfg: TrainConfig) -> float:
    """What the width asks of `lr`: sqrt(ref_width / n_embd) under sp, 1 under mup (see above)."""
    if cfg.model.param == "mup":
        return 1.0
    ref = cfg.ref_width or preset_config(cfg.preset).model.n_embd
    return math.sqrt(ref / cfg.model.n_embd)


def apply_lr_scaling(cfg: TrainConfig, rule: str) -> Optional[str]:
    """Scale cfg.lr in place for the batch (`rule`) and, under sp, the width; returns a line
    saying what was done (None if nothing changed).

    Afterwards `ref_batch_tokens` and `ref_width` are the new batch and width, so the saved
    config is consistent: scaling it again for the same run changes nothing."""
    check_scaling(rule)
    if rule == "none":
        return None
    ref = cfg.ref_batch_tokens or preset_config(cfg.preset).tokens_per_step
    ref_width = cfg.ref_width or preset_config(cfg.preset).model.n_embd
    new = cfg.tokens_per_step
    old_lr = cfg.lr
    widths = width_factor(cfg)
    cfg.lr = scaled_lr(old_lr, ref, new, rule) * widths
    cfg.ref_batch_tokens, cfg.ref_width = new, cfg.model.n_embd
    if new == ref and widths == 1.0:
        return None
    line = f"lr scaled ({rule}) from {old_lr:.3g} at {ref:,} tokens/step"
    if widths != 1.0:
        line += f", width {ref_width:,}"
    line += f" to {cfg.lr:.3g} at {new:,} tokens/step"
    if widths != 1.0:
        line += f", width {cfg.model.n_embd:,} (sp: x sqrt({ref_width:,}/{cfg.model.n_embd:,}))"
    return line
