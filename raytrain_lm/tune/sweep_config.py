"""A sweep's settings (SweepSettings: the search, ASHA's, the metric) and its base config and
search space, checked from `tune`'s flags before anything starts (or, for `--resume`, taken from
the sweep's own sweep.json)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from raytrain_lm.config.checks import check_name
from raytrain_lm.config.load import build_config, load_config_file, parse_set_args
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import UserError
from raytrain_lm.tune.space import SearchSpace, parse_space
from raytrain_lm.tune.transfer import check_target

# What ASHA compares and the sweep ranks by: the validation loss, or the same in bits per byte.
# Within a sweep both give the same order (every trial evaluates the same windows of the same
# dataset); bits per byte also compares with sweeps on data of other tokenizers.
SWEEP_METRICS = ("val_loss", "val_bpb")


@dataclass
class SweepSettings:
    search: str = "random"  # random | grid
    trials: Optional[int] = None  # random: samples (default 8); grid: every point once
    concurrent: int = 1
    grace_steps: Optional[int] = None  # default: max_steps // 10
    reduction_factor: int = 2
    seed: Optional[int] = None  # random searcher's seed
    metric: str = "val_loss"  # val_loss | val_bpb
    target_width: Optional[int] = None  # muTransfer: also write the best config at this width


def check_settings(cfg: TrainConfig, space: SearchSpace, s: SweepSettings,
                   eval_every_given: bool) -> None:
    """Fill defaults and refuse bad combinations, in place. Needs no cluster."""
    if s.search not in ("random", "grid"):
        raise UserError(f"--search must be random or grid, got {s.search!r}")
    if s.metric not in SWEEP_METRICS:
        raise UserError(f"--metric must be one of {', '.join(SWEEP_METRICS)}, got {s.metric!r}")
    space.check_searcher(s.search)
    if s.search == "grid":
        if s.trials is not None and s.trials != space.grid_size():
            raise UserError(f"grid search runs every point of the grid once ({space.grid_size()}); "
                            f"drop --trials or use --search random")
        s.trials = space.grid_size()
    elif s.trials is None:
        s.trials = 8
    if s.trials < 1:
        raise UserError(f"--trials must be at least 1, got {s.trials}")
    if s.concurrent < 1:
        raise UserError(f"--concurrent must be at least 1, got {s.concurrent}")
    if s.reduction_factor < 2:
        raise UserError(f"--reduction-factor must be at least 2, got {s.reduction_factor}")
    if s.grace_steps is None:
        unit = cfg.eval_every if eval_every_given else 1
        s.grace_steps = max(unit, round(cfg.max_steps / 10 / unit) * unit)
    if s.grace_steps < 1:
        raise UserError(f"--grace-steps must be at least 1, got {s.grace_steps}")
    if s.grace_steps > cfg.max_steps:
        raise UserError(f"--grace-steps ({s.grace_steps}) is larger than --max-steps "
                        f"({cfg.max_steps}): no trial could ever be stopped early")
    if not eval_every_given:
        cfg.eval_every = s.grace_steps
    elif s.grace_steps % cfg.eval_every:
        raise UserError(f"--grace-steps ({s.grace_steps}) must be a multiple of --eval-every "
                        f"({cfg.eval_every}), so ASHA compares validation losses of the same step")
    points = space.grid_size() if all(d.kind == "values" for d in space.dims) else math.inf
    if s.search == "random" and s.trials > points:
        raise UserError(f"--trials {s.trials} random samples of a space of {points} "
                        f"point{'s' if points > 1 else ''} must repeat points; "
                        f"use --search grid to run each point once")


def new_sweep(settings: dict, specs: dict, space_args: list[str], space_file: Optional[str],
              config_file: Optional[str], sets: Optional[list[str]],
              sweep: SweepSettings) -> tuple[TrainConfig, SearchSpace]:
    """The base config and search space of a new sweep from `tune`'s flags, checked (and
    `sweep`'s defaults filled) before anything starts."""
    cfg = build_config(config_file=config_file, flags=settings, sets=sets)
    space = parse_space(specs, space_args, space_file, cfg)
    given = (settings.get("eval_every") is not None or "eval_every" in parse_set_args(sets or [])
             or "eval_every" in (load_config_file(config_file) if config_file else {}))
    check_settings(cfg, space, sweep, eval_every_given=given)
    check_target(cfg, sweep.target_width, space.keys)
    return cfg, space


def resumed_sweep(settings: dict, others_given: list[str]) -> TrainConfig:
    """What `tune --resume` needs: the sweep's name, storage and address. Everything else comes
    from the sweep's own sweep.json, so other flags are refused rather than ignored."""
    given = others_given + [k for k, v in settings.items()
                            if v is not None and k not in ("name", "storage", "address")]
    if given:
        raise UserError(f"--resume continues the sweep as it was started; drop {', '.join(given)}")
    check_name(settings.get("name"))
    return TrainConfig.from_dict({k: settings[k] for k in ("name", "storage", "address")
                                  if settings.get(k) is not None})
