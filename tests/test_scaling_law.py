"""The scaling-law fit (plan/scaling_law.py): approach 3 recovers a known law from its own losses,
shrugs off an outlier (Huber), the optimum is the minimum along the IsoFLOP curve, the IsoFLOP
minima give the law's exponent, the bootstrap brackets the fit; Chinchilla's published
coefficients give the paper's exponents."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_lm.plan.scaling_law import CHINCHILLA, ScalingLaw, bootstrap, fit, isoflop_optima

TRUE = ScalingLaw(E=1.2, A=30.0, B=80.0, alpha=0.4, beta=0.3)
# a 5 x 5 grid of sizes and token counts, the shape of a small sweep
N = np.repeat(np.logspace(5, 7, 5), 5)
D = np.tile(np.logspace(6, 8, 5), 5)


def test_approach_3_recovers_a_known_law():
    """From the law's own losses (noiseless), every parameter to 1e-6 relative: the fit's
    optimum is the truth (the objective is 0 there), BFGS converges to it from the grid."""
    got = fit(N, D, TRUE.loss(N, D))
    for k, v in TRUE.as_dict().items():
        assert getattr(got, k) == pytest.approx(v, rel=1e-6), k


def test_the_huber_loss_ignores_an_outlier():
    """One run's loss 20% too high (a diverged run): Huber's linear tail bounds its pull, so the
    exponents stay within 0.01 of the truth; a squared loss (delta huge) is pulled further."""
    loss = TRUE.loss(N, D)
    loss[7] *= 1.2
    robust = fit(N, D, loss)
    squared = fit(N, D, loss, delta=10.0)
    assert abs(robust.alpha - TRUE.alpha) < 0.01 and abs(robust.beta - TRUE.beta) < 0.01
    err = abs(squared.alpha - TRUE.alpha) + abs(squared.beta - TRUE.beta)
    assert err > 2 * (abs(robust.alpha - TRUE.alpha) + abs(robust.beta - TRUE.beta))


def test_the_optimum_minimises_the_loss_along_the_isoflop_curve():
    """A brute-force minimum over 20001 sizes at C = 6ND lands on the closed form."""
    flops = 1e18
    n_opt, d_opt = TRUE.optimum(flops)
    sizes = np.logspace(np.log10(n_opt) - 2, np.log10(n_opt) + 2, 20001)
    best = sizes[np.argmin(TRUE.loss(sizes, flops / 6 / sizes))]
    assert best == pytest.approx(n_opt, rel=1e-3)  # the grid's spacing: 4 decades / 20000
    assert 6 * n_opt * d_opt == pytest.approx(flops)


def test_isoflop_minima_give_the_laws_exponent():
    """Runs placed at the same offsets in log N around each level's optimum: the law's loss along
    an IsoFLOP curve has one shape at every level (scaled), so the parabola's vertex is off by
    the same factor everywhere and the fitted exponent is the law's beta / (alpha + beta)."""
    n, d = [], []
    for flops in (1e15, 1e16, 1e17):
        center = TRUE.optimum(flops)[0]
        for u in (-1.0, -0.5, 0.0, 0.5, 1.0):
            n.append(center * np.exp(u))
            d.append(flops / 6 / n[-1])
    n, d = np.array(n), np.array(d)
    levels, (k, a) = isoflop_optima(n, d, TRUE.loss(n, d))
    assert len(levels) == 3 and all(g.n_opt is not None for g in levels)
    assert a == pytest.approx(TRUE.beta / (TRUE.alpha + TRUE.beta), rel=1e-9)


def test_the_bootstrap_brackets_the_fit():
    """Losses with 0.5% noise: each parameter's 5-95% interval is ordered and holds the full
    fit's value (its median resampling); the optimum's too, and the predicted loss of a run
    beyond the grid (N, D 3x its largest)."""
    rng = np.random.default_rng(0)
    loss = TRUE.loss(N, D) * np.exp(rng.normal(0, 0.005, len(N)))
    law = fit(N, D, loss)
    spread = bootstrap(N, D, loss, flops=1e15, samples=8, law=law, at=(3e7, 3e8))
    for k in ("E", "alpha", "beta"):
        lo, mid, hi = spread[k]
        assert lo <= mid <= hi
        assert lo <= getattr(law, k) <= hi, k
    assert spread["n_opt"][0] <= law.optimum(1e15)[0] <= spread["n_opt"][2]
    assert spread["loss_at"][0] <= law.loss(3e7, 3e8) <= spread["loss_at"][2]
    assert spread["loss_at"][0] < spread["loss_at"][2]  # resamplings that disagree: a spread, not a copy


def test_chinchillas_coefficients_give_its_exponents():
    """Hoffmann et al.'s Table 2, approach 3: N_opt ~ C^0.46, D_opt ~ C^0.54. The tolerance is
    the rounding: alpha and beta published to 0.01 move beta / (alpha + beta) by up to
    (0.34 + 0.28) * 0.005 / 0.62^2 = 0.008, and the exponents themselves are rounded to 0.01
    (0.005): 0.013."""
    (n1, d1), (n2, d2) = CHINCHILLA.optimum(1e21), CHINCHILLA.optimum(1e24)
    assert np.log(n2 / n1) / np.log(1e3) == pytest.approx(0.46, abs=0.013)
    assert np.log(d2 / d1) / np.log(1e3) == pytest.approx(0.54, abs=0.013)


def test_a_fit_needs_five_runs():
    with pytest.raises(ValueError, match="at least 5 runs"):
        fit(N[:4], D[:4], TRUE.loss(N[:4], D[:4]))


def test_a_start_that_runs_away_is_not_the_fit():
    """bench/scaling_holdout.py's first 12 runs, and its bootstrap's 13th resampling: BFGS from the
    full fit ran log A past exp's range, and that start had the lowest objective. It is
    discarded (it used to raise OverflowError and end the bootstrap): the fit is finite."""
    n = np.array([10688, 33664, 68928, 116480, 10688, 33664, 68928, 116480, 10688, 33664, 68928, 116480], dtype=float)
    d = np.array([155904, 49408, 24064, 14336, 311808, 99072, 48384, 28672, 623872, 198144, 96768, 57344], dtype=float)
    loss = np.array([2.600408, 2.91765, 3.238684, 3.405808, 2.498445, 2.600835, 2.705609, 3.202218, 2.412218,
                     2.464674, 2.545031, 3.029988])
    law = fit(n, d, loss)
    start = [np.log(law.A), np.log(law.B), np.log(law.E), law.alpha, law.beta]
    i = [4, 5, 5, 11, 2, 5, 0, 5, 11, 7, 4, 11]
    got = fit(n[i], d[i], loss[i], starts=1, extra_starts=[start])
    assert all(np.isfinite(v) for v in got.as_dict().values())
