"""`tune --scaling`: a grid of model sizes x training lengths run as a Ray Tune sweep (tune/sweep.py,
every trial a full distributed training, none stopped early), then the scaling law fitted to the
trials' final validation losses (plan/scaling_law.py: approach 3, the IsoFLOP minima beside it,
the bootstrap spread) and its compute-optimal N and D for `--budget`. Writes scaling.json (what
`plan --budget --law` reads) and scaling.png into the sweep's folder.

N of a trial: its model's matmul parameters (the N of 6N FLOPs per token); D: its steps x tokens
per step. Every trial keeps the base config's learning rate: a grid over sizes needs no lr sweep
per size only where the lr carries across width (muP); without it, pick an lr that suits the
widest model and say so."""

from __future__ import annotations

from typing import Optional

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import UserError
from raytrain_lm.models import family
from raytrain_lm.plan.scaling_law import ScalingLaw, bootstrap, fit, isoflop_optima
from raytrain_lm.store.files import TRIAL_CONFIG
from raytrain_lm.store.storage import RunFolder
from raytrain_lm.tune.space import Dim, SearchSpace
from raytrain_lm.tune.sweep_config import SweepSettings

SCALING_JSON, SCALING_PNG = "scaling.json", "scaling.png"
SIZE_KEYS = ("model.n_embd", "model.n_layer")


def setup_scaling(cfg: TrainConfig, space: SearchSpace, sweep: SweepSettings, steps: Optional[str]) -> None:
    """A scaling grid, in place: model sizes (model.n_embd and/or model.n_layer in `space`) x
    lengths (`steps`: "S1,S2,..." added to the space as max_steps), every point run (grid) to its
    own end (no trial stopped: ASHA's grace is the longest run), validated at its last step.
    Under --param mup the grid's narrowest width is every trial's base (unless given)."""
    lengths = []
    for part in (steps or "").split(","):
        part = part.strip()
        if part:
            if not part.isdigit() or int(part) < 1:
                raise UserError(f"--steps: positive whole numbers of steps, e.g. 100,200,400; got {steps!r}")
            lengths.append(int(part))
    if not lengths or not any(d.key in SIZE_KEYS for d in space.dims):
        raise UserError("--scaling needs a grid of sizes and lengths: --n-embd A,B,C (or --n-layer) "
                        "and --steps S1,S2,S3")
    if sweep.search != "grid":
        raise UserError("--scaling runs every point of its grid: drop --search random")
    space.dims.append(Dim("max_steps", "values", values=sorted(set(lengths))))
    if space.grid_size() < 5:
        raise UserError(f"--scaling fits 5 parameters: the grid needs at least 5 points, has "
                        f"{space.grid_size()}")
    sweep.trials = space.grid_size()
    cfg.max_steps = cfg.eval_every = sweep.grace_steps = max(lengths)
    widths = next((d.values for d in space.dims if d.key == "model.n_embd"), None)
    if cfg.model.param == "mup" and cfg.model.mup_base_width is None and widths:
        # one base for the whole grid, so its one lr is every width's (muTransfer); a trial
        # that is its own base would be sp at its width
        cfg.model.mup_base_width = min(widths)


def scaling_points(folder: RunFolder, trials: list[dict]) -> list[dict]:
    """(N, D, final validation loss) of each trial that ran all its own steps (the sweep's table
    calls the shorter ones "stopped": its max_steps is the longest trial's)."""
    points = []
    for t in trials:
        if t["status"] == "error" or t.get("final_val_loss") is None:
            continue
        cfg = TrainConfig.from_dict(RunFolder(folder.storage_uri, f"{folder.name}/{t['dir']}")
                                    .read_json(TRIAL_CONFIG))
        if t["steps"] < cfg.max_steps:
            continue
        points.append({"trial": t["trial"], "n": family(cfg.model).matmul_params(cfg.model),
                       "d": cfg.max_steps * cfg.tokens_per_step, "loss": t["final_val_loss"],
                       "n_layer": cfg.model.n_layer, "n_embd": cfg.model.n_embd})
    return points


def fit_points(points: list[dict], budget: Optional[float], samples: int = 100) -> dict:
    """The fit of `points`: approach 3 with its bootstrap, the IsoFLOP minima, and the optimum
    for `budget` when given."""
    if len(points) < 5:
        raise UserError(f"the scaling fit needs at least 5 finished trials, got {len(points)}")
    n, d, loss = ([p[k] for p in points] for k in ("n", "d", "loss"))
    law = fit(n, d, loss)
    levels, isoflop = isoflop_optima(n, d, loss)
    out = {
        "points": points, "law": law.as_dict(),
        "spread": bootstrap(n, d, loss, flops=budget, samples=samples, law=law),
        "isoflop": [{"flops": g.flops, "n_opt": g.n_opt, "n": list(g.n), "loss": list(g.loss),
                     "coefficients": list(g.coefficients)} for g in levels],
        "isoflop_fit": {"k": isoflop[0], "a": isoflop[1]} if isoflop else None,
        "law_exponent_a": law.beta / (law.alpha + law.beta),
    }
    if budget:
        n_opt, d_opt = law.optimum(budget)
        out["budget"] = {"flops": budget, "n_opt": n_opt, "d_opt": d_opt,
                         "tokens_per_param": d_opt / n_opt,
                         "predicted_loss": float(law.loss(n_opt, d_opt))}
        if isoflop:
            out["budget"]["n_opt_isoflop"] = isoflop[0] * budget ** isoflop[1]
    return out


def write_scaling(folder: RunFolder, result: dict, title: str) -> dict:
    """scaling.json and scaling.png into the sweep's folder; returns their paths."""
    folder.write_json(SCALING_JSON, result)
    folder.write_bytes(SCALING_PNG, plot_scaling(result, title))
    return {"json": folder.display_path(SCALING_JSON), "plot": folder.display_path(SCALING_PNG)}


def plot_scaling(result: dict, title: str) -> bytes:
    """Left: each size's loss against tokens, with the law's curve. Right: the IsoFLOP levels,
    loss against N, their parabolas and minima."""
    import numpy as np

    from raytrain_lm.results.plots import plt, png_bytes

    law = ScalingLaw(**result["law"])
    fig, (ax_d, ax_iso) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110)
    sizes = sorted({p["n"] for p in result["points"]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(sizes):
        pts = sorted((p["d"], p["loss"]) for p in result["points"] if p["n"] == n)
        c = colors[i % len(colors)]
        ax_d.plot(*zip(*pts), "o", color=c, label=f"N = {n:.3g}")
        ds = np.logspace(np.log10(pts[0][0]) - 0.2, np.log10(pts[-1][0]) + 0.2, 50)
        ax_d.plot(ds, law.loss(n, ds), "-", color=c, lw=1)
    ax_d.set(xscale="log", xlabel="tokens D", ylabel="final validation loss",
             title=f"L = {law.E:.3g} + {law.A:.3g}/N^{law.alpha:.2f} + {law.B:.3g}/D^{law.beta:.2f}")
    ax_d.legend(fontsize=7)
    for i, g in enumerate(result["isoflop"]):
        c = colors[i % len(colors)]
        ax_iso.plot(g["n"], g["loss"], "o", color=c, label=f"C = {g['flops']:.2g}")
        xs = np.linspace(np.log(min(g["n"])) - 0.3, np.log(max(g["n"])) + 0.3, 50)
        ax_iso.plot(np.exp(xs), np.polyval(g["coefficients"], xs), "--", color=c, lw=1)
        if g["n_opt"]:
            ax_iso.axvline(g["n_opt"], color=c, lw=0.8, alpha=0.6)
    ax_iso.set(xscale="log", xlabel="parameters N", ylabel="final validation loss",
               title="IsoFLOP profiles (vertical: minima)")
    if result["isoflop"]:
        ax_iso.legend(fontsize=7)
    for ax in (ax_d, ax_iso):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return png_bytes(fig)


def describe(result: dict) -> str:
    """The fit in a few lines: the law with its spread, the IsoFLOP exponent, the budget's N, D."""
    law, spread = result["law"], result["spread"]

    def p(k: str, fmt: str = ".3g") -> str:
        lo, _, hi = spread.get(k, (None, None, None))
        return f"{law[k]:{fmt}}" + (f" [{lo:{fmt}}, {hi:{fmt}}]" if lo is not None else "")

    lines = [f"fit of {len(result['points'])} runs (approach 3, Huber on log L; 5-95% bootstrap): "
             f"E {p('E')}, A {p('A')}, B {p('B')}, alpha {p('alpha')}, beta {p('beta')}",
             f"N_opt ~ C^{result['law_exponent_a']:.3f} (law)"
             + (f", C^{result['isoflop_fit']['a']:.3f} (IsoFLOP minima)" if result["isoflop_fit"] else
                ", IsoFLOP minima: fewer than 2 levels with 3 runs and a minimum")]
    b = result.get("budget")
    if b:
        lines.append(f"budget {b['flops']:.3g} FLOPs: N {b['n_opt']:.3g}, D {b['d_opt']:.3g} "
                     f"({b['tokens_per_param']:.1f} tokens per parameter), predicted loss "
                     f"{b['predicted_loss']:.4f}")
    return "\n".join(lines)
