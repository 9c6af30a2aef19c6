"""`--scale-lr`: carry a learning rate tuned at one global batch to another (the rules:
config/schedule.py's scaled_lr; here, the run's reference batch).

The global batch is counted in tokens per optimizer step (workers x batch_size x grad_accum x
seq_len): that is what changes when `--workers` changes. The batch `lr` was chosen at is recorded in
the config as `ref_batch_tokens` (a sweep's best config carries it); without it, the preset's own
batch (its defaults, 2 workers) is the reference, since the preset's lr was chosen there.
"""

from __future__ import annotations

from typing import Optional

from raytrain_lm.config.presets import preset_config
from raytrain_lm.config.schedule import LR_SCALING, check_scaling, scaled_lr
from raytrain_lm.config.settings import TrainConfig

__all__ = ["LR_SCALING", "apply_lr_scaling", "scaled_lr"]


def apply_lr_scaling(cfg: TrainConfig, rule: str) -> Optional[str]:
    """Scale cfg.lr in place; returns a line saying what was done (None if nothing changed).

    Afterwards `ref_batch_tokens` is the new batch, so the saved config is consistent: scaling it
    again for the same batch changes nothing."""
    check_scaling(rule)
    if rule == "none":
        return None
    ref = cfg.ref_batch_tokens or preset_config(cfg.preset).tokens_per_step
    new = cfg.tokens_per_step
    old_lr = cfg.lr
    cfg.lr = scaled_lr(old_lr, ref, new, rule)
    cfg.ref_batch_tokens = new
    if new == ref:
        return None
    return (f"lr scaled ({rule}) from {old_lr:.3g} at {ref:,} tokens/step to {cfg.lr:.3g} at "
            f"{new:,} tokens/step")
