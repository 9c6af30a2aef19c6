"""The learning-rate schedule, pure Python (the driver's lr-find and the workers' loop both ask
it): its settings (ScheduleSettings, part of TrainConfig), their choices, the learning rate of
each step (lr_at), what a resumed run keeps of it (resumed_horizon) and how a learning rate
carries to another batch (scaled_lr: `--scale-lr`, tune/lr_scaling.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.setting import setting

# of the learning rate (lr_at), each with its words for --help
LR_SCHEDULE_HELP = {"cosine": "warmup, then cosine decay to the end",
                    "wsd": "warmup, stable, then a linear decay over the last --decay-fraction of "
                           "the steps (a resumed run can add steps while still stable)",
                    "exp_range": "lr-find's exponential ramp"}
LR_SCHEDULES = tuple(LR_SCHEDULE_HELP)
LR_SCALING = ("none", "linear", "sqrt")  # --scale-lr's rules (scaled_lr)


@dataclass
class ScheduleSettings:
    """The learning-rate schedule's settings (TrainConfig's; lr_at also reads its max_steps)."""
    lr: float = setting(3e-3, help="Peak learning rate (after warmup).")
    min_lr_ratio: float = setting(0.1, help="The schedule decays to lr x this (exp_range starts there).")
    schedule: str = setting("cosine", help="; ".join(f"{k}: {v}" for k, v in LR_SCHEDULE_HELP.items()) + ".")
    decay_fraction: float = setting(0.2, help="wsd: the share of the steps spent decaying.")
    horizon: Optional[int] = setting(None, help="Step at which the schedule reaches its minimum "
                                     "[default: max_steps]. A resumed run given more --max-steps "
                                     "keeps its horizon where moving it would change the learning "
                                     "rate, and holds the minimum after it.")
    ref_batch_tokens: Optional[int] = setting(None, help="Tokens per step `lr` was chosen at "
                                              "(--scale-lr) [default: the preset's].")
    ref_width: Optional[int] = setting(None, help="Width (model.n_embd) `lr` was chosen at "
                                       "(--scale-lr: under sp lr x sqrt(ref_width / width); under "
                                       "mup nothing, its groups carry the width) [default: the "
                                       "preset's].")
    warmup_steps: int = setting(30, help="Steps of linear warmup.")


def check_schedule(cfg: ScheduleSettings) -> None:
    """The schedule's settings: one UserError line each (config/checks.py asks it)."""
    if cfg.lr <= 0:
        raise UserError(f"--lr must be positive, got {cfg.lr}")
    if cfg.horizon is not None and cfg.horizon < 1:
        raise UserError(f"horizon must be at least 1, got {cfg.horizon}")
    if not 0.0 < cfg.decay_fraction <= 1.0:
        raise UserError(f"decay_fraction must be in (0, 1], got {cfg.decay_fraction}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise UserError(f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.schedule not in LR_SCHEDULES:
        raise UserError(f"--schedule must be one of {', '.join(LR_SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.schedule == "exp_range" and cfg.min_lr_ratio <= 0:
        raise UserError("the exp_range schedule starts at lr * min_lr_ratio, which must be > 0")
    if cfg.ref_batch_tokens is not None and cfg.ref_batch_tokens < 1:
        raise UserError(f"ref_batch_tokens must be at least 1, got {cfg.ref_batch_tokens}")
    if cfg.ref_width is not None and cfg.ref_width < 1:
        raise UserError(f"ref_width must be at least 1, got {cfg.ref_width}")


def lr_at(step: int, cfg: ScheduleSettings) -> float:
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


def resumed_horizon(saved: ScheduleSettings, cfg: ScheduleSettings, step: int) -> ScheduleSettings:
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


def scaled_lr(lr: float, ref_tokens: int, tokens: int, rule: str) -> float:
    """linear: lr x k (Goyal et al. 2017, for SGD); sqrt: lr x sqrt(k) (the rule for Adam-family
    optimizers, Malladi et al. 2022); k = new batch / reference batch."""
    check_scaling(rule)
    k = tokens / ref_tokens
    return lr * {"none": 1.0, "linear": k, "sqrt": math.sqrt(k)}[rule]


def check_scaling(rule: str) -> None:
    """--scale-lr is one of LR_SCALING: one UserError line otherwise."""
    if rule not in LR_SCALING:
        raise UserError(f"--scale-lr must be one of {', '.join(LR_SCALING)}, got {rule!r}")
