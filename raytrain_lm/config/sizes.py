"""An elastic run's sizes (pure Python: no Ray, no torch): `--workers MIN-MAX`, which worker
counts it may train on, and how a worker group of any of those sizes keeps the global batch (the
layout itself, its stages and microbatches: layout.py).

The global batch is fixed by the largest size: `batch_size x grad_accum x` the data-parallel size at
MAX workers. A smaller group takes the same number of sequences per step, each data-parallel rank
more of them, in more micro-steps of at most `--batch-size` (gradient accumulation; with `--pp`,
more pipeline microbatches of the same size). So the tokens per step, and with them the meaning of
the learning-rate schedule, are the same at every size. A size whose data-parallel ranks cannot
split the global batch evenly (3 ranks and 64 sequences) is not used: the run takes the next smaller
size that can (`worker_counts`), and `--workers MIN-MAX` is refused when MIN itself cannot.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Optional

from raytrain_lm.config.layout import Layout
from raytrain_lm.errors import UserError

if TYPE_CHECKING:
    from raytrain_lm.config.settings import TrainConfig


def parse_workers(text: str) -> tuple[int, int]:
    """`--workers N` (fixed: MIN = MAX = N) or `--workers MIN-MAX` -> (MIN, MAX); the errors say
    what is wrong with `text` (the caller names the flag)."""
    text = str(text).strip()
    low, sep, high = text.partition("-") if not text.startswith("-") else ("", "", text)
    try:
        if not sep:
            n = int(text)
            return n, n
        lo, hi = int(low), int(high)
    except ValueError:
        raise UserError(f"{text!r} is neither a number of workers nor a range MIN-MAX "
                        f"(e.g. 2-8)") from None
    if lo < 1:
        raise UserError(f"{text}: MIN must be at least 1 (--workers 0 alone: no Ray cluster, "
                        f"Ray Train's local mode in this process)")
    if lo > hi:
        raise UserError(f"{text}: MIN ({lo}) is larger than MAX ({hi})")
    return lo, hi


def is_elastic(cfg: TrainConfig) -> bool:
    return cfg.min_workers is not None and cfg.min_workers < cfg.workers


def workers_text(cfg: TrainConfig) -> str:
    """"2-8" for an elastic run, "4" for a fixed one."""
    return f"{cfg.min_workers}-{cfg.workers}" if is_elastic(cfg) else str(cfg.workers)


def dp_size(cfg: TrainConfig, world: int) -> int:
    """The data-parallel size of `world` workers (a multiple of Layout.unit)."""
    return Layout.of(cfg, world).dp


def global_batch(cfg: TrainConfig) -> int:
    """Sequences per optimizer step, at every size: the batch of MAX workers."""
    lay = Layout.of(cfg, cfg.workers)
    return lay.sequences * lay.dp


def fit_to_world(cfg: TrainConfig, world: int) -> Optional[TrainConfig]:
    """The config a group of `world` workers trains with: `cfg` with the micro-batch and the
    accumulation (with --pp: the per-rank batch and its microbatches) that make up the same
    global batch. None if `world` cannot (not a multiple of tp x pp, or its data-parallel ranks
    cannot split the global batch evenly into micro-batches of at most --batch-size)."""
    if world < 1 or world % Layout.unit(cfg):
        return None
    dp = dp_size(cfg, world)
    total = global_batch(cfg)
    if total % dp:
        return None
    per_rank = total // dp
    fitted = copy.deepcopy(cfg)
    fitted.workers, fitted.min_workers = world, None  # a fixed group of this size, same batch
    if cfg.pp > 1:  # the pipeline accumulates: more microbatches of the configured size
        size = Layout.of(cfg).micro_batch
        if per_rank % size:
            return None
        fitted.batch_size, fitted.microbatches = per_rank, per_rank // size
        return fitted if Layout.of(fitted, world).rounds_fit else None
    # The fewest micro-steps whose equal micro-batches fit in --batch-size.
    accum = next(a for a in range(-(-per_rank // cfg.batch_size), per_rank + 1) if per_rank % a == 0)
    fitted.batch_size, fitted.grad_accum = per_rank // accum, accum
    return fitted


def worker_counts(cfg: TrainConfig) -> list[int]:
    """The sizes this run trains at, smallest first: every count from MIN to MAX that keeps the
    global batch (a fixed run: its one size)."""
    low = cfg.min_workers if is_elastic(cfg) else cfg.workers
    return [w for w in range(low, cfg.workers + 1) if fit_to_world(cfg, w) is not None]


def usable_workers(counts: list[int], available: int) -> int:
    """The largest size of `counts` that `available` workers' resources can hold (0: none)."""
    return max((c for c in counts if c <= available), default=0)


def check_elastic(cfg: TrainConfig) -> None:
    """A range must be one the run can start at: MIN a size that keeps the global batch."""
    if cfg.min_workers is None:
        return
    text = f"--workers {cfg.min_workers}-{cfg.workers}"
    if cfg.min_workers < 1:
        raise UserError(f"{text}: MIN must be at least 1")
    if cfg.min_workers > cfg.workers:
        raise UserError(f"{text}: MIN ({cfg.min_workers}) is larger than MAX ({cfg.workers})")
    if not is_elastic(cfg):
        return
    unit = Layout.unit(cfg)
    if cfg.min_workers % unit:
        raise UserError(f"{text}: both ends must be multiples of {Layout.unit_text(cfg)} = {unit} (resizes "
                        f"change the data-parallel size only)")
    if fit_to_world(cfg, cfg.min_workers) is None:
        sizes = ", ".join(map(str, worker_counts(dataclasses.replace(cfg, min_workers=unit))))
        raise UserError(f"{text}: {dp_size(cfg, cfg.min_workers)} data-parallel ranks cannot split "
                        f"the global batch of {global_batch(cfg)} sequences (--batch-size x "
                        f"--grad-accum x the data-parallel size at MAX) evenly; sizes that can: "
                        f"{sizes}")


def sizes_line(cfg: TrainConfig) -> str:
    """What an elastic run says at launch: the sizes it uses and the batch it keeps."""
    counts, unit = worker_counts(cfg), Layout.unit(cfg)
    skipped = [w for w in range(cfg.min_workers, cfg.workers + 1) if w % unit == 0 and w not in counts]
    shapes = []
    for w in counts:
        f = fit_to_world(cfg, w)
        steps = f.microbatches if cfg.pp > 1 else f.grad_accum
        shapes.append(f"{w} ({steps} x {f.batch_size // steps if cfg.pp > 1 else f.batch_size})")
    what = "pipeline microbatches" if cfg.pp > 1 else "micro-steps"
    line = (f"elastic: {workers_text(cfg)} workers, {global_batch(cfg)} sequences per step at every "
            f"size; sizes ({what} x sequences, per data-parallel rank): {', '.join(shapes)}")
    if skipped:
        line += f"; not {', '.join(map(str, skipped))} (the batch does not split evenly)"
    return line
