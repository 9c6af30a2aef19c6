"""Scaling laws (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models"): the final
loss of a model of N parameters trained on D tokens, L(N, D) = E + A/N^alpha + B/D^beta, fitted to
a grid of small runs, and the N and D that minimise it for a compute budget C = 6ND.

- Approach 3 (`fit`): the paper's fit, a Huber loss (delta 1e-3) between the predicted and the
  observed log L, the prediction written as log-sum-exp(a - alpha log N, b - beta log D, e) with
  A = exp(a), B = exp(b), E = exp(e); minimised by BFGS from the best points of a grid of starts.
- IsoFLOP minima (`isoflop_optima`, the paper's approach 2): at each compute level, a parabola of
  L in log N through its runs; its vertex is that level's optimal N; N_opt = k C^a across levels.
- `bootstrap`: the spread of approach 3's parameters and of the optimum over runs resampled.

numpy only (the driver side imports no torch, and scipy is no dependency): a small BFGS with a
backtracking line search is enough for five parameters."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

HUBER_DELTA = 1e-3  # the paper's
LOG_LIMIT = 100.0  # |log A|, |log B|, |log E| beyond it: a diverged start (exp overflows at 709)


@dataclass(frozen=True)
class ScalingLaw:
    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n, d):
        """The predicted loss of N parameters trained on D tokens (numbers or arrays)."""
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    def optimum(self, flops: float) -> tuple[float, float]:
        """(N, D) minimising the loss at C = 6ND (the paper's eq. 4): N = G (C/6)^(beta/(alpha +
        beta)), D = (C/6)^(alpha/(alpha + beta)) / G, G = (alpha A / (beta B))^(1/(alpha + beta))."""
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / s)
        n = g * (flops / 6) ** (self.beta / s)
        return n, flops / 6 / n

    def as_dict(self) -> dict:
        return asdict(self)


# Hoffmann et al.'s published (rounded) approach-3 fit, section 3.3.
CHINCHILLA = ScalingLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


def _unpack(theta) -> ScalingLaw:
    a, b, e, alpha, beta = theta
    return ScalingLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta))


def _objective(theta: np.ndarray, log_n, log_d, log_l, delta: float):
    """The summed Huber loss of log L and its gradient in (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = terms.max(0)
    w = np.exp(terms - top)
    total = w.sum(0)
    r = top + np.log(total) - log_l
    w /= total  # d(log-sum-exp)/d(each term)
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum()
    dr = np.where(small, r, delta * np.sign(r))
    grad = np.array([(dr * w[0]).sum(), (dr * w[1]).sum(), (dr * w[2]).sum(),
                     -(dr * w[0] * log_n).sum(), -(dr * w[1] * log_d).sum()])
    return value, grad


def _bfgs(f, x0: np.ndarray, iters: int = 300, tol: float = 1e-12) -> tuple[np.ndarray, float]:
    """Minimise f (returning value and gradient) from x0: BFGS, Armijo backtracking."""
    x, (fx, g) = x0.astype(float), f(x0)
    h = np.eye(len(x0))
    for _ in range(iters):
        p = -h @ g
        if g @ p >= 0:  # not a descent direction: restart from the gradient
            h, p = np.eye(len(x0)), -g
        t = 1.0
        while True:
            x_new = x + t * p
            f_new, g_new = f(x_new)
            if f_new <= fx + 1e-4 * t * (g @ p) or t < 1e-12:
                break
            t *= 0.5
        s, y = x_new - x, g_new - g
        x, g, f_old, fx = x_new, g_new, fx, f_new
        # converged: the value stalls and the step vanishes (Huber's linear part keeps the
        # gradient away from zero at a kink, so no gradient test)
        if abs(f_old - fx) <= tol * max(1.0, abs(fx)) and np.abs(s).max() < 1e-9:
            break
        sy = s @ y
        if sy > 1e-16:
            rho = 1 / sy
            i = np.eye(len(x))
            h = (i - rho * np.outer(s, y)) @ h @ (i - rho * np.outer(y, s)) + rho * np.outer(s, s)
    return x, fx


# The grid of starts (the paper's is finer: alpha, beta in 0..2, e in -1..1.5, a, b in 0..25);
# the objective is evaluated on all of it at once and BFGS starts from the best few.
GRID = {"a": np.linspace(0, 25, 6), "b": np.linspace(0, 25, 6), "e": np.linspace(-1, 1.5, 6),
        "alpha": np.linspace(0.05, 2.0, 8), "beta": np.linspace(0.05, 2.0, 8)}


def fit(n: Sequence[float], d: Sequence[float], loss: Sequence[float], delta: float = HUBER_DELTA,
        starts: int = 8, extra_starts: Optional[list] = None) -> ScalingLaw:
    """Approach 3 on runs of `n` parameters, `d` tokens, final loss `loss`."""
    log_n, log_d, log_l = (np.log(np.asarray(v, dtype=float)) for v in (n, d, loss))
    if len(log_l) < 5:
        raise ValueError(f"a fit of 5 parameters needs at least 5 runs, got {len(log_l)}")
    grid = np.stack(np.meshgrid(*GRID.values(), indexing="ij"), -1).reshape(-1, 5)
    values = _grid_values(grid, log_n, log_d, log_l, delta)
    candidates = [grid[i] for i in np.argsort(values)[:starts]] + list(extra_starts or [])
    best, best_value = None, math.inf
    for x0 in candidates:
        x, value = _bfgs(lambda t: _objective(t, log_n, log_d, log_l, delta), np.asarray(x0, float))
        # a run away to A, B or E beyond e^LOG_LIMIT is a term the data cannot pin, not a fit
        if value < best_value and np.all(np.isfinite(x)) and np.abs(x[:3]).max() < LOG_LIMIT:
            best, best_value = x, value
    if best is None:
        raise ValueError("the scaling-law fit found no finite optimum: the runs do not pin one "
                         "of its terms (too few sizes or lengths)")
    return _unpack(best)


def _grid_values(grid: np.ndarray, log_n, log_d, log_l, delta) -> np.ndarray:
    """The objective at every grid point (rows of (a, b, e, alpha, beta)), vectorised."""
    a, b, e, alpha, beta = (grid[:, i:i + 1] for i in range(5))
    terms = np.stack([a - alpha * log_n, b - beta * log_d, e + 0 * log_n])
    top = terms.max(0)
    r = top + np.log(np.exp(terms - top).sum(0)) - log_l
    return np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum(1)


def bootstrap(n, d, loss, flops: Optional[float] = None, samples: int = 100, seed: int = 0,
              law: Optional[ScalingLaw] = None, at: Optional[tuple[float, float]] = None) -> dict:
    """Approach 3 refitted on `samples` resamplings of the runs (with replacement), each started
    from the full fit `law` and the grid's best point: {parameter: (5th, 50th, 95th percentile)},
    with N_opt and D_opt at `flops` when given, and the predicted loss of N, D = `at` (a run not
    in the fit) as "loss_at"."""
    n, d, loss = (np.asarray(v, dtype=float) for v in (n, d, loss))
    law = law or fit(n, d, loss)
    start = [math.log(law.A), math.log(law.B), math.log(law.E), law.alpha, law.beta]
    rng = np.random.default_rng(seed)
    draws: dict[str, list] = {k: [] for k in ("E", "A", "B", "alpha", "beta")}
    if flops:
        draws.update(n_opt=[], d_opt=[])
    if at:
        draws["loss_at"] = []
    for _ in range(samples):
        i = rng.integers(0, len(n), len(n))
        if len(set(zip(n[i], d[i]))) < 5:  # too few distinct runs to fix five parameters
            continue
        try:
            one = fit(n[i], d[i], loss[i], starts=1, extra_starts=[start])
        except ValueError:  # a resampling that cannot pin every term: left out, as one with too few runs
            continue
        for k in ("E", "A", "B", "alpha", "beta"):
            draws[k].append(getattr(one, k))
        if flops:
            no, do = one.optimum(flops)
            draws["n_opt"].append(no)
            draws["d_opt"].append(do)
        if at:
            draws["loss_at"].append(float(one.loss(*at)))
    return {k: tuple(float(x) for x in np.percentile(v, [5, 50, 95])) for k, v in draws.items() if v}


@dataclass(frozen=True)
class IsoFlop:
    """One compute level's runs and the vertex of the parabola through them (in log N)."""
    flops: float
    n: tuple
    loss: tuple
    n_opt: Optional[float]  # None when the parabola opens downwards (no minimum in range)
    coefficients: tuple  # (c2, c1, c0) of loss = c2 x^2 + c1 x + c0, x = log N


def isoflop_optima(n, d, loss, rel: float = 0.05) -> tuple[list[IsoFlop], Optional[tuple[float, float]]]:
    """Runs grouped by compute 6ND (within `rel` of each other), each group of 3 runs or more
    fitted with a parabola in log N; and (k, a) of N_opt = k C^a over the groups with a minimum
    (None with fewer than two)."""
    n, d, loss = (np.asarray(v, dtype=float) for v in (n, d, loss))
    c = 6 * n * d
    levels: list[list[int]] = []
    for i in np.argsort(c):
        if levels and c[i] <= c[levels[-1][0]] * (1 + rel):
            levels[-1].append(int(i))
        else:
            levels.append([int(i)])
    out = []
    for idx in levels:
        if len(idx) < 3:
            continue
        x = np.log(n[idx])
        c2, c1, c0 = np.polyfit(x, loss[idx], 2)
        vertex = -c1 / (2 * c2) if c2 > 0 else None
        out.append(IsoFlop(float(np.exp(np.log(c[idx]).mean())), tuple(n[idx]), tuple(loss[idx]),
                           float(np.exp(vertex)) if vertex is not None else None, (c2, c1, c0)))
    good = [g for g in out if g.n_opt is not None]
    if len(good) < 2:
        return out, None
    slope, intercept = np.polyfit(np.log([g.flops for g in good]), np.log([g.n_opt for g in good]), 1)
    return out, (float(np.exp(intercept)), float(slope))
