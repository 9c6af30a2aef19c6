"""Goodput of a run that fails: the share of its wall-clock time that trains, given how often the
job fails, what a checkpoint costs and what a restart costs, and the checkpoint interval that
maximises it.

The model (Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
2006): failures arrive at random (a Poisson process) with the job's mean time between failures M;
the run computes `interval` seconds of work, then stops for `save` seconds to write a checkpoint; a
failure anywhere in that segment loses the segment and costs a restart of `restart` seconds
(which a failure can interrupt too) before the segment begins again. One segment then takes, on
average, M e^(R/M) (e^((t+d)/M) - 1) seconds of wall time for t seconds of work. `simulate` draws
the same process with a seeded generator over a whole run, as a check of the closed form and of
the last, partial segment it ignores.

The job's M is the GPUs' failure rate times their number: a synchronous job stops when any of its
GPUs (or their node, NIC or switch) does. The default rate is Llama 3 405B's: 419 unexpected
interruptions in a 54-day snapshot on 16,384 H100s (Llama 3 paper, arXiv:2407.21783, section
3.3.4; 78% of them hardware), one a GPU per ~50,700 GPU-hours."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from raytrain_lm.errors import UserError

# Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs (per GPU-hour)
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
DEFAULT_MTBF_GPU_HOURS = 1 / LLAMA3_FAILURES_PER_GPU_HOUR
# Llama 3's checkpoint store (Tectonic): 2 TB/s sustained for 16,384 GPUs, ~0.12 GB/s a GPU
DEFAULT_STORAGE_GBPS_PER_GPU = 2000 / 16384
# From a failure to training again, before the checkpoint is read: finding and replacing the
# node, rescheduling the job, starting its processes and NCCL. Not published for Llama 3; assumed
# (docs/planner.md#goodput shows what other values give).
DEFAULT_RESTART_S = 600.0
CHECKPOINT_BYTES_PER_PARAM = 12  # this project's checkpoint: fp32 weights and AdamW's two moments


@dataclass(frozen=True)
class Failures:
    """What failures cost a job: its mean time between failures, the seconds a checkpoint stops
    training, and the seconds from a failure to training again (the checkpoint read included)."""
    mtbf_s: float
    save_s: float
    restart_s: float

    def __post_init__(self):
        if not (self.mtbf_s > 0 and self.save_s >= 0 and self.restart_s >= 0) or not all(
                math.isfinite(x) for x in (self.mtbf_s, self.save_s, self.restart_s)):
            raise UserError(f"goodput needs a positive, finite MTBF and non-negative save and restart "
                            f"times, got {self.mtbf_s!r}, {self.save_s!r}, {self.restart_s!r}")


def job_mtbf_s(gpus: int, mtbf_gpu_hours: float) -> float:
    """The job's mean time between failures in seconds: `gpus` that each fail once per
    `mtbf_gpu_hours` on average, any of whose failures stops the job."""
    return mtbf_gpu_hours * 3600 / gpus


def job_failures(gpus: int, mtbf_gpu_hours: float, checkpoint_bytes: float, storage_gbps: float,
                 restart_s: float = DEFAULT_RESTART_S) -> Failures:
    """A job of `gpus` GPUs that each fail once per `mtbf_gpu_hours` on average, writing and
    reading `checkpoint_bytes` at `storage_gbps` GB/s in all."""
    if gpus < 1 or not mtbf_gpu_hours > 0 or not storage_gbps > 0 or not math.isfinite(mtbf_gpu_hours):
        raise UserError(f"--mtbf and --storage-gbps must be positive numbers, got {mtbf_gpu_hours!r} "
                        f"and {storage_gbps!r}")
    io_s = checkpoint_bytes / (storage_gbps * 1e9)
    return Failures(mtbf_s=job_mtbf_s(gpus, mtbf_gpu_hours), save_s=io_s, restart_s=restart_s + io_s)


def young_daly(f: Failures) -> float:
    """Young's (1974) first-order optimum interval of work between checkpoints: sqrt(2 d M)."""
    return math.sqrt(2 * f.save_s * f.mtbf_s)


def daly_interval(f: Failures) -> float:
    """Daly's (2006, eq. 37) higher-order optimum: Young's, corrected for checkpoints that are not
    short against M; M itself when a checkpoint takes 2M or more."""
    d, m = f.save_s, f.mtbf_s
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def segment_s(interval_s: float, f: Failures) -> float:
    """Expected wall seconds to compute `interval_s` of work and save it, failures included."""
    m = f.mtbf_s
    return m * math.exp(f.restart_s / m) * math.expm1((interval_s + f.save_s) / m)


def goodput(interval_s: float, f: Failures) -> float:
    """The share of wall time that trains, checkpointing every `interval_s` seconds of work."""
    try:
        return interval_s / segment_s(interval_s, f)
    except OverflowError:  # segments so long against M that none ever completes
        return 0.0


def best_interval(f: Failures) -> float:
    """The interval of most goodput (golden-section search on log(interval), where goodput has one
    maximum), between a thousandth of the save time and ten MTBFs."""
    lo, hi = math.log(max(f.save_s, 1e-3) * 1e-3), math.log(10 * f.mtbf_s)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    ga, gb = goodput(math.exp(a), f), goodput(math.exp(b), f)
    for _ in range(200):
        if ga < gb:
            lo, a, ga = a, b, gb
            b = lo + ratio * (hi - lo)
            gb = goodput(math.exp(b), f)
        else:
            hi, b, gb = b, a, ga
            a = hi - ratio * (hi - lo)
            ga = goodput(math.exp(a), f)
        if hi - lo < 1e-9:
            break
    return math.exp((lo + hi) / 2)


def simulate(work_s: float, interval_s: float, f: Failures, runs: int = 200, seed: int = 0) -> float:
    """Goodput over `runs` simulated runs of `work_s` seconds of work (failures drawn with a
    seeded generator): the work over the mean wall time. Segments as `segment_s` models them, the
    last one shorter where `interval_s` does not divide the work; the segments that end before
    the next failure are counted at once (the cost is per failure, not per segment)."""
    if work_s <= 0 or interval_s <= 0 or runs < 1:
        raise UserError("simulate needs positive work, interval and runs")
    segments = math.ceil(work_s / interval_s)
    if segments > 10_000_000:
        raise UserError(f"{segments:,} checkpoint intervals to simulate: use a longer interval")
    rng = random.Random(seed)
    total = 0.0
    for _ in range(runs):
        wall, left = 0.0, work_s
        next_failure = rng.expovariate(1 / f.mtbf_s)
        while left > 0:
            if left > interval_s:  # the whole segments before the failure, at once
                k = min(math.ceil(left / interval_s) - 1,
                        int((next_failure - wall) // (interval_s + f.save_s)))
                if k > 0:
                    wall += k * (interval_s + f.save_s)
                    left -= k * interval_s
                    continue
            need = min(interval_s, left) + f.save_s
            if wall + need <= next_failure:
                wall += need
                left -= min(interval_s, left)
                continue
            wall = next_failure  # the segment is lost; restart (a failure may interrupt it)
            next_failure = wall + rng.expovariate(1 / f.mtbf_s)
            while wall + f.restart_s > next_failure:
                wall = next_failure
                next_failure = wall + rng.expovariate(1 / f.mtbf_s)
            wall += f.restart_s
        total += wall
    return work_s * runs / total


@dataclass(frozen=True)
class GoodputPlan:
    """The chosen layout's run under failures."""
    failures: Failures
    gpus: int
    interval_s: float  # the best interval of work between checkpoints
    young_daly_s: float
    goodput: float  # closed form, at interval_s
    simulated: float  # simulate() at interval_s
    work_s: float  # the tokens' training time with no failure
    wall_s: float  # work_s / goodput
    step_s: float

    @property
    def interval_steps(self) -> int:
        """The best interval in whole steps (at least 1): `train --checkpoint-every`."""
        return max(1, round(self.interval_s / self.step_s)) if self.step_s > 0 else 1


def plan_goodput(gpus: int, n_params: int, step_s: float, steps: float, mtbf_gpu_hours: float,
                 storage_gbps: float, restart_s: float = DEFAULT_RESTART_S) -> GoodputPlan:
    """Goodput of `steps` steps of `step_s` seconds on `gpus` GPUs, checkpointing this project's
    12 bytes a parameter at `storage_gbps` GB/s in all, at the best interval."""
    f = job_failures(gpus, mtbf_gpu_hours, CHECKPOINT_BYTES_PER_PARAM * n_params, storage_gbps, restart_s)
    work = step_s * steps
    best = best_interval(f)
    g = goodput(best, f)
    # the simulation: ten runs of 200 MTBFs' work (at most 100,000 segments each), the same process
    sim = simulate(min(200 * f.mtbf_s, 100_000 * best), best, f, runs=10)
    return GoodputPlan(failures=f, gpus=gpus, interval_s=best, young_daly_s=young_daly(f), goodput=g,
                       simulated=sim, work_s=work, wall_s=work / g if g > 0 else math.inf, step_s=step_s)


@dataclass(frozen=True)
class RunRisk:
    """`plan`'s inputs for goodput: each GPU's mean time between failures (GPU-hours), the
    storage's bandwidth in all (GB/s; None: Llama 3's per GPU, times the GPUs), the restart's
    fixed seconds, and the tokens to train (None: 20 a parameter, Chinchilla's optimum)."""
    mtbf_gpu_hours: float = DEFAULT_MTBF_GPU_HOURS
    storage_gbps: float | None = None
    restart_s: float = DEFAULT_RESTART_S
    tokens: float | None = None

    def __post_init__(self):
        def positive(x):
            return x is None or (x > 0 and math.isfinite(x))

        for flag, value in (("--mtbf", self.mtbf_gpu_hours), ("--storage-gbps", self.storage_gbps),
                            ("--tokens", self.tokens)):
            if not positive(value):
                raise UserError(f"{flag} must be a positive number, got {value!r}")
        if not (self.restart_s >= 0 and math.isfinite(self.restart_s)):
            raise UserError(f"--restart-min must be at least 0, got {self.restart_s / 60!r}")

    def plan(self, gpus: int, n_params: int, step_s: float, tokens_per_step: int) -> GoodputPlan:
        storage = self.storage_gbps if self.storage_gbps is not None else DEFAULT_STORAGE_GBPS_PER_GPU * gpus
        tokens = self.tokens if self.tokens is not None else 20.0 * n_params
        return plan_goodput(gpus, n_params, step_s, tokens / tokens_per_step, self.mtbf_gpu_hours,
                            storage, self.restart_s)


def duration(seconds: float) -> str:
    """12 s, 3.9 min, 3.1 h, 51.3 days."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size if unit == "days" else seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def goodput_lines(gp: GoodputPlan, risk: RunRisk, n_params: int) -> list[str]:
    """What `plan` prints of the recommended layout's run under failures."""
    f = gp.failures
    per_gpu = "Llama 3 405B's rate" if risk.mtbf_gpu_hours == DEFAULT_MTBF_GPU_HOURS else "given"
    tokens = risk.tokens if risk.tokens is not None else 20.0 * n_params
    said = "20 a parameter, " if risk.tokens is None else ""
    io = f.save_s
    return [
        f"goodput: a failure every {duration(f.mtbf_s)} on {gp.gpus:,} GPUs (--mtbf "
        f"{risk.mtbf_gpu_hours:,.0f} GPU-hours each, {per_gpu}); a checkpoint of "
        f"{CHECKPOINT_BYTES_PER_PARAM * n_params / 1e12:.3g} TB ({CHECKPOINT_BYTES_PER_PARAM} bytes a "
        f"parameter) takes {duration(io)} at {CHECKPOINT_BYTES_PER_PARAM * n_params / 1e9 / io if io else 0:,.4g} "
        f"GB/s (--storage-gbps); a restart {duration(f.restart_s - io)} (--restart-min) + its read",
        f"  --checkpoint-every {gp.interval_steps} (steps: {duration(gp.interval_s)} of training; Young/Daly "
        f"{duration(gp.young_daly_s)}): {gp.goodput:.1%} goodput (simulated {gp.simulated:.1%}); "
        f"{tokens:.3g} tokens ({said}--tokens) in {duration(gp.wall_s)} ({duration(gp.work_s)} with no "
        f"failure)"]


@dataclass(frozen=True)
class CheckpointChoice:
    """`train --checkpoint-every auto`'s decision: the whole number of steps between checkpoints
    of most goodput, from what the run measured. `every`: steps; `step_s`: the slowest rank's
    step; `stop_s`: what one checkpoint stopped training (its validation and its save, the
    slowest rank's); `mtbf_s`: the job's (each worker's --mtbf over the workers); `restart_s`:
    a restart's (it sets the goodput, not the interval: e^(R/M) scales every segment alike)."""
    every: int
    step_s: float
    stop_s: float
    mtbf_s: float
    restart_s: float
    goodput: float
    optimum_s: float  # best_interval's, in seconds of work

    def as_row(self) -> dict:
        return dict(self.__dict__)


def choice_line(row: dict) -> str:
    """What the run says of its choice: `row`, a CheckpointChoice's as_row() and the step it was
    made at (`at`), as the metrics row carries it."""
    c = CheckpointChoice(**{k: v for k, v in row.items() if k != "at"})
    return (f"--checkpoint-every auto: {c.every} steps ({duration(c.every * c.step_s)} of training; "
            f"the optimum {duration(c.optimum_s)}), decided at step {row['at']}: a step takes "
            f"{duration(c.step_s)}, a checkpoint stops training {duration(c.stop_s)} (measured, its "
            f"validation included), a failure every {duration(c.mtbf_s)} (--mtbf over the "
            f"workers), a restart {duration(c.restart_s)} (this group's start-up): {c.goodput:.1%} "
            f"goodput expected")


def choose_checkpoint_every(step_s: float, stop_s: float, workers: int, mtbf_gpu_hours: float,
                            restart_s: float) -> CheckpointChoice:
    """The whole number of steps k >= 1 whose interval k x `step_s` has the most goodput: goodput
    has one maximum in the interval, so it is the floor or the ceiling of the optimum in steps."""
    if not step_s > 0 or not math.isfinite(step_s):
        raise UserError(f"a step time must be positive to choose a checkpoint interval, got {step_s!r}")
    f = Failures(mtbf_s=job_mtbf_s(workers, mtbf_gpu_hours), save_s=stop_s, restart_s=restart_s)
    best = best_interval(f)
    low = max(1, math.floor(best / step_s))
    every = max((low, low + 1), key=lambda k: (goodput(k * step_s, f), -k))
    return CheckpointChoice(every=every, step_s=step_s, stop_s=stop_s, mtbf_s=f.mtbf_s,
                            restart_s=restart_s, goodput=goodput(every * step_s, f), optimum_s=best)
