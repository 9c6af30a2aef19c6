"""`lr-find`: the LR range test (Smith 2017; fastai's lr_find). One short distributed training
whose learning rate rises exponentially from lr_min to lr_max, one loss per step, then a
suggestion read off the loss-vs-lr curve. A cheap first step before a sweep: it tells you which
decade of learning rates to search.

The suggestion is the point of steepest descent of the smoothed loss against log(lr): where a
step of the learning rate buys the most progress. The lr at the minimum of the smoothed loss is
reported too; it is the edge of stability, not a learning rate to train at. The other common rule,
minimum / 10, was too timid on the built-in corpus (docs/tuning.md: minimum 5.3e-3, so 5e-4, where a sweep
found 4.9e-3 best and trials near 3e-4 among the worst). The loss is smoothed with a centered
moving average: an exponential one lags, and on the long plateau this corpus shows at high
learning rates it moved the minimum by a decade and a half in one run.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import RunFailed, UserError
from raytrain_lm.ray_compat.polls import report_poll_seconds
from raytrain_lm.run.driver import run_training
from raytrain_lm.store.files import LR_FIND_PLOT, LR_FIND_RESULT
from raytrain_lm.store.storage import RunFolder

DIVERGE_FACTOR = 4.0  # stop reading the curve once the smoothed loss is 4x its minimum (as fastai)
SKIP_START = 0.1  # the first 10% of points: Adam's first steps are noisy whatever the lr
# A report every step would stall the workers (ray_compat/polls.py). Each report carries the
# loss of every step since the previous one (step_losses) and the lr of a step is known (lr_at),
# so reports can be sparse and the curve still has a point per step; a short poll keeps up.
LR_FIND_REPORT_POLL_S = 0.1
REPORT_EVERY = 10


def check_range(lr_min: float, lr_max: float, steps: int) -> None:
    if not (math.isfinite(lr_min) and math.isfinite(lr_max)):
        raise UserError(f"--lr-min and --lr-max must be finite numbers, got {lr_min:g} and {lr_max:g}")
    if lr_min <= 0 or lr_max <= 0:
        raise UserError(f"--lr-min and --lr-max must be positive, got {lr_min:g} and {lr_max:g}")
    if lr_min >= lr_max:
        raise UserError(f"--lr-min ({lr_min:g}) must be below --lr-max ({lr_max:g})")
    if steps < 20:
        raise UserError(f"--steps must be at least 20 to read a curve, got {steps}")


def smooth(values: list[float]) -> list[float]:
    """Centered moving average over ~5% of the points (at least 5), shrinking at the ends."""
    half = max(5, (len(values) // 20) | 1) // 2
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append(sum(values[lo:hi]) / (hi - lo))
    return out


def suggest_lr(lrs: list[float], losses: list[float]) -> dict:
    """Read the curve: the minimum of the smoothed loss (before it diverges), and the steepest
    descent before that minimum, which is the suggestion."""
    finite = [(lr, loss) for lr, loss in zip(lrs, losses) if math.isfinite(loss)]
    if len(finite) < 10:
        raise UserError("the LR range test produced too few finite losses to read")
    lrs, losses = [p[0] for p in finite], [p[1] for p in finite]
    sm = smooth(losses)
    start = max(1, int(len(sm) * SKIP_START))
    best = min(sm[start:])
    end = next((i for i in range(start + 1, len(sm)) if sm[i] > DIVERGE_FACTOR * best), len(sm))
    i_min = min(range(start, end), key=lambda i: sm[i])
    # Slope of the smoothed loss against log(lr), before the minimum.
    slopes = {i: (sm[i + 1] - sm[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1]))
              for i in range(start, i_min) if i + 1 < len(sm)}
    i_steep = min(slopes, key=slopes.get) if slopes else i_min
    return {
        "suggested_lr": lrs[i_steep],
        "rule": "steepest descent of the smoothed loss",
        "steepest_lr": lrs[i_steep],
        "min_loss_lr": lrs[i_min],
        "min_smoothed_loss": sm[i_min],
        "diverged_at_lr": lrs[end] if end < len(sm) else None,
        "still_falling_at_end": i_min >= len(sm) - 2,
        "smoothed": sm,
        "lrs": lrs,
        "losses": losses,
    }


def next_range(found: dict) -> tuple[float, float]:
    """The lr range to search next with `tune`: a third of the suggestion up to the minimum (the
    edge of stability), at least up to three times the suggestion."""
    return found["suggested_lr"] / 3, max(found["min_loss_lr"], found["suggested_lr"] * 3)


def plot(found: dict, title: str) -> bytes:
    from raytrain_lm.results.plots import plt, png_bytes

    lrs, losses, sm = found["lrs"], found["losses"], found["smoothed"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.plot(lrs, losses, color="0.75", lw=1, label="loss (per step)")
    ax.plot(lrs, sm, color="C0", lw=2, label="smoothed (centered moving average)")
    ax.axvline(found["min_loss_lr"], color="C3", ls=":", label=f"minimum {found['min_loss_lr']:.2e}")
    ax.axvline(found["suggested_lr"], color="C1", lw=2,
               label=f"suggested {found['suggested_lr']:.2e} (steepest descent)")
    ax.set_xscale("log")
    top = sm[0] * 1.3 if sm else None
    if top:
        ax.set_ylim(min(sm) - 0.1 * (top - min(sm)), top)
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)


def range_test_config(cfg: TrainConfig, lr_min: float, lr_max: float, steps: int) -> TrainConfig:
    """The training run of the test: exponential lr from lr_min to lr_max, a loss every step, one
    validation and one checkpoint at the end only."""
    check_range(lr_min, lr_max, steps)
    cfg.schedule, cfg.lr, cfg.min_lr_ratio = "exp_range", lr_max, lr_min / lr_max
    cfg.max_steps, cfg.log_every, cfg.eval_every = steps, REPORT_EVERY, steps
    cfg.checkpoint_every, cfg.keep_checkpoints = 0, 1
    if cfg.name is None:
        from raytrain_lm.run.preflight import default_run_name

        cfg.name = f"lrfind-{default_run_name(cfg)}"
    return cfg


def per_step_curve(rows: list[dict], cfg: TrainConfig) -> tuple[list[float], list[float]]:
    """(lr, loss) of every step, from metrics rows that each carry the losses since the last."""
    from raytrain_lm.config.schedule import lr_at

    curve: dict[int, tuple[float, float]] = {}
    for r in rows:
        first = r["step"] - len(r["step_losses"]) + 1
        for step, loss in zip(range(first, r["step"] + 1), r["step_losses"]):
            curve[step] = (lr_at(step - 1, cfg), loss)  # step s ran at the lr of 0-based step s-1
    points = [curve[s] for s in sorted(curve)]
    return [lr for lr, _ in points], [loss for _, loss in points]


def run_lr_find(cfg: TrainConfig, lr_min: float = 1e-5, lr_max: float = 1.0, steps: int = 100, *,
                verbose: bool = False, say: Callable[[str], None] = print,
                on_metrics: Optional[Callable[[dict], None]] = None) -> dict:
    cfg = range_test_config(cfg, lr_min, lr_max, steps)
    rows: list[dict] = []

    def collect(row: dict) -> None:
        rows.append(row)
        if on_metrics:
            on_metrics(row)

    try:
        summary = run_training(cfg, verbose=verbose, say=say, on_metrics=collect,
                               poll_seconds=report_poll_seconds(LR_FIND_REPORT_POLL_S))
    except RunFailed as e:  # the loss became non-finite: the curve is read up to there
        say(f"lr-find: {e}")
        summary = {"run_dir": RunFolder(cfg.storage, cfg.name).display_path()}
    lrs, losses = per_step_curve(rows, cfg)
    found = suggest_lr(lrs, losses)
    run = RunFolder(cfg.storage, cfg.name)
    run.write_bytes(LR_FIND_PLOT, plot(found, f"LR range test: {cfg.name}"))
    record = {k: v for k, v in found.items() if k not in ("smoothed",)}
    record.update(lr_min=lr_min, lr_max=lr_max, steps=steps, workers=cfg.workers,
                  tokens_per_step=cfg.tokens_per_step, run_dir=summary["run_dir"])
    run.write_json(LR_FIND_RESULT, record)
    record.update(plot=run.display_path(LR_FIND_PLOT), result=run.display_path(LR_FIND_RESULT))
    return record
