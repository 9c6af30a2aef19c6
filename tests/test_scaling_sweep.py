"""`tune --scaling` (tune/scaling_sweep.py): a grid of sizes x lengths as Ray Tune trials, the law fitted
to their final validation losses, scaling.json (which `plan --budget --law` reads) and its
figure; refusals of grids that cannot be fitted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import cli_here
from raytrain_lm.plan.scaling_law import ScalingLaw
from raytrain_lm.store.storage import RunFolder
from raytrain_lm.tune.scaling_sweep import describe, fit_points, write_scaling

TRUE = ScalingLaw(E=1.5, A=20.0, B=60.0, alpha=0.35, beta=0.3)


def synthetic_points() -> list[dict]:
    return [{"trial": f"t{i}", "n": n, "d": d, "loss": float(TRUE.loss(n, d))}
            for i, (n, d) in enumerate((n, d) for n in (1e5, 3e5, 1e6) for d in (1e6, 3e6, 1e7))]


def test_the_scaling_fit_writes_what_plan_budget_reads(tmp_path):
    """Points from a known law: the fit recovers it, the budget's optimum is the law's, and
    scaling.json read back by `plan --budget --law` gives the same N and D."""
    out = fit_points(synthetic_points(), budget=1e16, samples=5)
    assert out["law"]["alpha"] == pytest.approx(TRUE.alpha, rel=1e-5)
    n_opt, d_opt = TRUE.optimum(1e16)
    assert out["budget"]["n_opt"] == pytest.approx(n_opt, rel=1e-4)
    files = write_scaling(RunFolder(str(tmp_path), "sweep"), out, "t")
    assert (tmp_path / "sweep" / "scaling.png").stat().st_size > 0
    assert "tokens per parameter" in describe(out)
    r = cli_here("plan", "--budget", "1e16", "--law", files["json"], "--cpu", "--gpus", "2",
                 "--vocab-size", "256", "--json")
    assert r.returncode == 0, r.stderr
    b = json.loads(r.stdout)["budget"]
    assert b["n_opt"] == pytest.approx(n_opt, rel=1e-4) and b["d_opt"] == pytest.approx(d_opt, rel=1e-4)


@pytest.mark.parametrize("args,expected", [
    (["--n-embd", "32,64"], "--scaling needs a grid of sizes and lengths"),
    (["--steps", "10,20"], "--scaling needs a grid of sizes and lengths"),
    (["--n-embd", "32,64", "--steps", "10,x"], "--steps: positive whole numbers"),
    (["--n-embd", "32,64", "--steps", "10,20"], "the grid needs at least 5 points"),
    (["--resume", "--name", "x"], "--scaling starts a new sweep"),
])
def test_tune_scaling_refuses_a_grid_it_cannot_fit(args, expected, tmp_path):
    r = cli_here("tune", "--scaling", "--storage", str(tmp_path), *args)
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr


@pytest.mark.ray
def test_tune_scaling_runs_the_grid_and_fits_it(ray_address, pydoc_data, tmp_path):
    """3 widths x 2 lengths of a 1-layer model, each a 1-worker Ray Train run to its own end: six
    points with their N (matmul parameters) and D (steps x tokens per step), the fit written."""
    from conftest import run_cli

    r = run_cli("tune", "--scaling", "--n-embd", "32,48,64", "--steps", "12,24",
                "--workers", "1", "--data", str(pydoc_data), "--storage", str(tmp_path),
                "--name", "grid", "--address", ray_address, "--budget", "1e12", "--json", "--concurrent", "3",
                "--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "batch_size=4",
                "--set", "seq_len=32", "--set", "eval_windows=16", "--set", "warmup_steps=2",
                "--set", "checkpoint_every=0", timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["scaling"]
    pts = out["points"]
    assert len(pts) == 6
    assert sorted({p["d"] for p in pts}) == [12 * 4 * 32, 24 * 4 * 32]
    assert len({p["n"] for p in pts}) == 3
    # the longer run of each width ends lower
    for n in {p["n"] for p in pts}:
        short, long_ = sorted((p["d"], p["loss"]) for p in pts if p["n"] == n)
        assert long_[1] < short[1]
    assert np.isfinite(out["budget"]["n_opt"])
    assert (tmp_path / "grid" / "scaling.json").exists() and (tmp_path / "grid" / "scaling.png").exists()


def test_a_mup_grid_shares_one_base_width_so_one_lr_carries():
    """Under --param mup every trial of the grid takes its narrowest width as its base (a trial
    that is its own base would train as sp: the lr would not carry across the sizes); a base
    width given is kept, and sp is left alone."""
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.tune.scaling_sweep import setup_scaling
    from raytrain_lm.tune.space import Dim, SearchSpace
    from raytrain_lm.tune.sweep_config import SweepSettings

    def base_width(param, given=None):
        cfg = TrainConfig()
        cfg.model.param, cfg.model.mup_base_width = param, given
        space = SearchSpace([Dim("model.n_embd", "values", values=[96, 32, 64])])
        setup_scaling(cfg, space, SweepSettings(search="grid"), "10,20")
        return cfg.model.mup_base_width

    assert base_width("mup") == 32
    assert base_width("mup", given=48) == 48
    assert base_width("sp") is None
