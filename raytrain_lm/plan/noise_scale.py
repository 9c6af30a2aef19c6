"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A), from the squared norms of one gradient measured at two batch sizes.

A mean gradient over B independent samples has E|G_B|^2 = |G|^2 + tr(Sigma)/B (G the true
gradient, Sigma the per-sample covariance). Two batch sizes b < B give two equations, whose
solution is unbiased for each unknown:

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

Either is very noisy on one step (either may be negative), so the paper averages each over
steps and only then divides: B_simple = tr(Sigma) / |G|^2, the batch size beyond which a bigger
batch buys little. Data parallelism gives both batch sizes at every step: b is one worker's
batch (its gradient before the all-reduce), B the global batch (after). Pure arithmetic, no
torch: the worker and the planner share it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def two_batch_estimates(small_sq: float, big_sq: float, b: float, big_b: float) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) estimated from |G_b|^2 = `small_sq` and |G_B|^2 = `big_sq`, b < B.
    `small_sq` may be the mean of several independent batch-b gradients' squared norms (each
    worker's): the formula is linear, so the mean is unbiased too, and less noisy."""
    if not 0 < b < big_b:
        raise ValueError(f"two batch sizes 0 < b < B are needed, got b={b}, B={big_b}")
    g2 = (big_b * big_sq - b * small_sq) / (big_b - b)
    trace = (small_sq - big_sq) / (1.0 / b - 1.0 / big_b)
    return g2, trace


@dataclass
class NoiseScale:
    """Exponential moving averages of the two estimates (not of their ratio), and B_simple from
    them. `decay`: the weight of the past at each step (0.95: about the last 20 steps count).
    The averages are bias-corrected as Adam's moments (they start at 0)."""

    decay: float = 0.95
    g2: float = 0.0  # the raw (uncorrected) moving averages
    trace: float = 0.0
    steps: int = 0

    def update(self, small_sq: float, big_sq: float, b: float, big_b: float) -> Optional[float]:
        """One step's squared norms at the two batch sizes in; B_simple after it out."""
        return self.add(*two_batch_estimates(small_sq, big_sq, b, big_b))

    def add(self, g2: float, trace: float) -> Optional[float]:
        """One step's estimates of |G|^2 and tr(Sigma) in (two_batch_estimates', or a sum of
        them over disjoint parameter sets measured at different batch sizes); B_simple out."""
        self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
        self.trace = self.decay * self.trace + (1 - self.decay) * trace
        self.steps += 1
        return self.b_simple

    @property
    def _correction(self) -> float:
        return 1.0 - self.decay ** self.steps if self.steps else 1.0

    @property
    def grad_sq(self) -> float:
        """The smoothed |G|^2."""
        return self.g2 / self._correction

    @property
    def trace_sigma(self) -> float:
        """The smoothed tr(Sigma), per sample."""
        return self.trace / self._correction

    @property
    def b_simple(self) -> Optional[float]:
        """tr(Sigma)/|G|^2 in the unit of b and B (samples); None before any step or while the
        smoothed |G|^2 is not positive (noise larger than the signal so far)."""
        if not self.steps or self.g2 <= 0:
            return None
        return self.trace / self.g2


def batch_hint(batch: float, b_simple: Optional[float], factor: float = 4.0) -> Optional[str]:
    """A line for the user when the run's global `batch` (samples) is more than `factor` away from
    B_simple (the same unit); None when it is within, or when there is no estimate."""
    if b_simple is None or b_simple <= 0:
        return None
    if batch > factor * b_simple:
        return (f"the global batch ({batch:g} sequences) is {batch / b_simple:.0f}x the gradient "
                f"noise scale B_simple ~ {b_simple:.3g}: a smaller batch (more steps) would reach "
                "this loss with fewer tokens")
    if batch * factor < b_simple:
        return (f"the global batch ({batch:g} sequences) is {b_simple / batch:.0f}x below the "
                f"gradient noise scale B_simple ~ {b_simple:.3g}: a larger batch (over more "
                "workers) would take fewer steps for about the same tokens")
    return None


class BatchAdvice:
    """The batch hint for a run's rows as they come: once during the run, as soon as the estimate
    has settled and the batch is `factor` away from it (a user watching a long run can stop it
    and restart at a better batch), and at the end with the last estimate.

    `settle`: steps after the first row with an estimate before a hint; 60 is three time constants
    of the moving averages (decay 0.95), where their first steps' weight has fallen to 5% (the
    bias correction makes the early averages unbiased but noisy). `batch`: the run's global batch
    in sequences."""

    def __init__(self, batch: float, settle: int = 60, factor: float = 4.0):
        self.batch, self.settle, self.factor = batch, settle, factor
        self.first_step: Optional[int] = None
        self.b_simple: Optional[float] = None  # the last row's
        self.said = False

    def update(self, row: dict) -> Optional[str]:
        """The hint to print after this row (its step named), or None: not settled yet, within
        the factor, or said already."""
        if row.get("noise_scale") is None and "noise_grad_sq" not in row:
            return None
        self.b_simple = row.get("noise_scale")
        if self.first_step is None:
            self.first_step = row["step"]
        if self.said or row["step"] - self.first_step < self.settle:
            return None
        hint = batch_hint(self.batch, self.b_simple, self.factor)
        if hint is None:
            return None
        self.said = True
        return f"at step {row['step']}, {hint}"

    def after_run(self) -> Optional[str]:
        """The hint from the run's last estimate (None: within the factor, or no estimate)."""
        return batch_hint(self.batch, self.b_simple, self.factor)
