"""The gradient noise scale's estimators (plan/noise_scale.py) on synthetic per-sample gradients
whose mean and covariance are known: expectations computed exactly, by enumerating every batch
drawn with replacement from a small population (each batch's sample is independent and
identically distributed, as the estimators assume)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raytrain_lm.plan.noise_scale import BatchAdvice, NoiseScale, batch_hint, two_batch_estimates

# A population of 3 per-sample gradients in 2 dimensions (float64): its mean G and its (population)
# covariance Sigma are what sampling with replacement sees.
POP = np.array([[1.0, 2.0], [-0.5, 0.25], [3.0, -1.0]])
G = POP.mean(0)
TRUE_G2 = float(G @ G)
TRUE_TRACE = float(((POP - G) ** 2).sum(1).mean())


def _batches(size: int):
    """Every ordered batch of `size` draws, each as the mean gradient (all equally likely)."""
    for idx in itertools.product(range(len(POP)), repeat=size):
        yield idx, POP[list(idx)].mean(0)


def _sq(v) -> float:
    return float(v @ v)


def test_two_batch_estimates_are_unbiased():
    """E over all batches of each size: the estimators give |G|^2 and tr(Sigma) exactly."""
    b, big = 2, 4
    small = np.mean([_sq(g) for _, g in _batches(b)])
    large = np.mean([_sq(g) for _, g in _batches(big)])
    g2, trace = two_batch_estimates(small, large, b, big)
    assert g2 == pytest.approx(TRUE_G2, rel=1e-12)
    assert trace == pytest.approx(TRUE_TRACE, rel=1e-12)


@pytest.mark.parametrize("workers,micro", [(2, 2), (1, 3)])
def test_estimates_from_one_step_are_unbiased(workers, micro):
    """A step of `workers` data-parallel workers, each with a batch of `micro` samples: the small
    batch is each worker's gradient (the mean of their squared norms), the big one the step's
    (the mean over the workers, as the all-reduce). With one worker and accumulation, the small
    batch is the first micro-batch of the step (here `micro`=3 draws of a 2-micro-batch step).
    Either way the joint expectation over every step is exact."""
    accum = 2 if workers == 1 else 1
    b, big = micro, micro * max(workers, accum)
    g2s, traces = [], []
    for idx, step_grad in _batches(big):
        parts = [POP[list(idx[i * micro:(i + 1) * micro])].mean(0) for i in range(big // micro)]
        small = np.mean([_sq(p) for p in parts[:workers]])  # one worker: its first micro-batch
        g2, trace = two_batch_estimates(small, _sq(step_grad), b, big)
        g2s.append(g2)
        traces.append(trace)
    assert np.mean(g2s) == pytest.approx(TRUE_G2, rel=1e-12)
    assert np.mean(traces) == pytest.approx(TRUE_TRACE, rel=1e-12)


def test_noise_scale_averages_the_estimates_not_their_ratio():
    """Two steps whose estimates differ: B_simple is the ratio of the averages (bias-corrected
    averages of a constant are the constant; with two steps, their weighted means)."""
    ns = NoiseScale(decay=0.5)
    # step 1: |G|^2 = 1, tr = 10 ; step 2: |G|^2 = 3, tr = 2 (inputs built from the inverse map)
    for g2, tr in [(1.0, 10.0), (3.0, 2.0)]:
        b, big = 2.0, 8.0
        ns.update(g2 + tr / b, g2 + tr / big, b, big)
    # weights after bias correction: 0.5*0.5 and 0.5 over 0.75 -> 1/3 and 2/3
    assert ns.grad_sq == pytest.approx(1 / 3 * 1 + 2 / 3 * 3)
    assert ns.trace_sigma == pytest.approx(1 / 3 * 10 + 2 / 3 * 2)
    assert ns.b_simple == pytest.approx(ns.trace_sigma / ns.grad_sq)
    ratio_mean = 1 / 3 * 10 + 2 / 3 * (2 / 3)  # what averaging the ratio would give instead
    assert ns.b_simple != pytest.approx(ratio_mean)


def test_noise_scale_of_gaussian_gradients():
    """Gaussian gradients of known G and Sigma, drawn at b and B: the smoothed B_simple lands
    within 5% of tr(Sigma)/|G|^2. The bound: here one step's estimates have relative standard
    deviations of about 0.18 (|G|^2) and 0.38 (tr Sigma) (measured over 20000 draws); decay 0.999
    averages over (1 + d)/(1 - d) ~ 2000 effective steps, so the ratio's relative error is about
    sqrt(0.18^2 + 0.38^2)/sqrt(2000) ~ 1%: 5% is five standard deviations."""
    rng = np.random.default_rng(0)
    dims, b, big = 50, 4, 32
    g = np.full(dims, 0.5)
    scales = np.linspace(0.5, 2.0, dims)  # Sigma diagonal: std per dim
    truth = float((scales ** 2).sum() / (g @ g))
    ns = NoiseScale(decay=0.999)
    steps = 20000
    small = g + rng.standard_normal((steps, dims)) * scales / np.sqrt(b)
    large = g + rng.standard_normal((steps, dims)) * scales / np.sqrt(big)
    for s, l_ in zip((small ** 2).sum(1), (large ** 2).sum(1)):
        ns.update(float(s), float(l_), b, big)
    assert ns.b_simple == pytest.approx(truth, rel=0.05)


def test_noise_scale_none_until_signal():
    ns = NoiseScale()
    assert ns.b_simple is None
    ns.update(1.0, 2.0, 1, 2)  # |G|^2 estimate 3 - ... : (2*2 - 1)/1 = 3 > 0, trace negative
    assert ns.b_simple is not None and ns.b_simple < 0
    ns2 = NoiseScale()
    ns2.update(10.0, 1.0, 1, 2)  # (2 - 10) < 0: no signal yet
    assert ns2.b_simple is None
    with pytest.raises(ValueError):
        two_batch_estimates(1.0, 1.0, 4, 4)


def test_batch_hint():
    assert batch_hint(64, 60) is None
    assert "smaller batch" in batch_hint(1024, 32)
    assert "larger batch" in batch_hint(8, 400)
    assert batch_hint(8, None) is None


def test_batch_advice_speaks_once_when_settled_and_after_the_run():
    """During the run: one hint, at the first row `settle` steps after the first row with an
    estimate (a row whose |G|^2 is not yet positive counts: its B_simple is None), naming its
    step; after the run: the last estimate's. Within the factor, or without estimates: none."""
    rows = [{"step": 10, "noise_scale": None, "noise_grad_sq": -1.0, "noise_trace": 5.0}] + \
        [{"step": s, "noise_scale": 32.0, "noise_grad_sq": 1.0, "noise_trace": 32.0}
         for s in range(20, 200, 10)]
    advice = BatchAdvice(1024, settle=60)
    said = {r["step"]: advice.update(r) for r in rows}
    assert [s for s, h in said.items() if h] == [70]
    assert said[70].startswith("at step 70, ") and "smaller batch" in said[70]
    assert "smaller batch" in advice.after_run()
    near = BatchAdvice(64, settle=60)
    assert all(near.update(r) is None for r in rows) and near.after_run() is None
    none = BatchAdvice(1024, settle=60)
    assert none.update({"step": 100, "loss": 2.0}) is None and none.after_run() is None
