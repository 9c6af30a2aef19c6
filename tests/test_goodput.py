"""Goodput under failures (plan/goodput.py): the closed form against a simulation of the same
process, the optimum interval against a brute-force search and against Young's and Daly's
formulas, Llama 3 405B's published run, and what `plan` prints of it."""

from __future__ import annotations

import json
import math

import pytest

from conftest import cli_here
from raytrain_lm.plan.goodput import (
    DEFAULT_MTBF_GPU_HOURS,
    Failures,
    best_interval,
    choice_line,
    choose_checkpoint_every,
    daly_interval,
    goodput,
    job_failures,
    plan_goodput,
    segment_s,
    simulate,
    young_daly,
)

CASES = [Failures(mtbf_s=11_135.0, save_s=2.4, restart_s=602.4),  # Llama 3 405B's scale
         Failures(mtbf_s=3600.0, save_s=60.0, restart_s=300.0),  # slow storage, frequent failures
         Failures(mtbf_s=86_400.0, save_s=5.0, restart_s=1200.0)]


@pytest.mark.parametrize("f", CASES)
def test_the_closed_form_and_a_simulation_of_the_same_failures_agree(f):
    """Over ~2,000 simulated failures (a fixed seed), the simulated goodput at the best interval
    and at half and twice it is within 2 points of Daly's closed form (the issue's target; the
    simulation's own spread at this size is a few tenths of a point)."""
    best = best_interval(f)
    for interval in (best / 2, best, 2 * best):
        sim = simulate(200 * f.mtbf_s, interval, f, runs=10, seed=1)
        assert abs(sim - goodput(interval, f)) < 0.02, (interval, sim, goodput(interval, f))


def test_a_segment_takes_its_work_and_save_when_nothing_fails():
    """With failures rare against a segment (M a million times longer), a segment costs its work
    and save and nothing else, to first order: the formula's limit."""
    f = Failures(mtbf_s=1e12, save_s=10.0, restart_s=100.0)
    assert segment_s(1000.0, f) == pytest.approx(1010.0, rel=1e-6)
    assert goodput(1000.0, f) == pytest.approx(1000 / 1010, rel=1e-6)


@pytest.mark.parametrize("f", CASES)
def test_the_best_interval_is_the_maximum_a_brute_force_search_finds(f):
    """A scan of 20,000 intervals on a log grid finds no better goodput than best_interval's
    (to the grid's resolution), and Daly's higher-order formula lands on the same optimum within
    0.1%; Young's first-order one within 2% where the save is short against M."""
    grid = [f.save_s * 1e-2 * (1e6 ** (i / 20_000)) for i in range(20_001)]
    brute = max(grid, key=lambda t: goodput(t, f))
    best = best_interval(f)
    assert goodput(best, f) >= goodput(brute, f) - 1e-12
    assert best == pytest.approx(brute, rel=1e-3)
    assert daly_interval(f) == pytest.approx(best, rel=1e-3)
    if f.save_s / f.mtbf_s < 1e-3:
        assert young_daly(f) == pytest.approx(best, rel=0.02)


def test_llama3_405b_published_run_gives_its_effective_training_time():
    """Llama 3 405B (arXiv:2407.21783, 3.3.4): 419 unexpected interruptions in 54 days on 16,384
    H100s, checkpoints to a store of 2 TB/s sustained; the paper reports over 90% effective
    training time. With this project's 12-byte-a-parameter checkpoint and the assumed 10-minute
    restart (not published), the planned goodput at the best interval, less the 47 planned
    interruptions' restarts, lies within 3 points above 90%."""
    gp = plan_goodput(16_384, 405_000_000_000, step_s=10.0, steps=1e6, mtbf_gpu_hours=DEFAULT_MTBF_GPU_HOURS,
                      storage_gbps=2000.0)
    assert gp.failures.mtbf_s / 3600 == pytest.approx(54 * 24 / 419, rel=1e-9)  # one every ~3.1 h
    planned = 47 * gp.failures.restart_s / (54 * 86_400)
    assert 0.90 < gp.goodput - planned < 0.93
    assert abs(gp.simulated - gp.goodput) < 0.02


def test_a_job_fails_as_often_as_all_its_gpus_together():
    f = job_failures(64, 6400.0, checkpoint_bytes=12e9, storage_gbps=4.0, restart_s=100.0)
    assert f.mtbf_s == pytest.approx(100 * 3600)
    assert f.save_s == pytest.approx(3.0) and f.restart_s == pytest.approx(103.0)


PLAN = ("plan", "--preset", "small", "--gpus", "16", "--top", "1")


def test_plan_prints_the_recommended_layouts_goodput_and_checkpoint_interval():
    """`plan` shows the job's MTBF, the checkpoint's cost, the interval in steps and the goodput,
    and --json carries the same figures; a shorter MTBF asks for more frequent checkpoints."""
    r = cli_here(*PLAN)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("goodput:"))
    assert "on 16 GPUs" in line and "--storage-gbps" in line
    data = json.loads(cli_here(*PLAN, "--json").stdout)["goodput"]
    assert f"--checkpoint-every {max(1, round(data['interval_s'] / data['step_s']))} " in r.stdout
    assert f"{data['goodput']:.1%} goodput" in r.stdout
    assert data["mtbf_s"] == pytest.approx(DEFAULT_MTBF_GPU_HOURS * 3600 / 16)
    fragile = json.loads(cli_here(*PLAN, "--json", "--mtbf", "100").stdout)["goodput"]
    assert fragile["interval_s"] < data["interval_s"] and fragile["goodput"] < data["goodput"]
    assert math.isfinite(fragile["wall_s"])


@pytest.mark.parametrize("flag,value", [("--mtbf", "0"), ("--mtbf", "-3"), ("--storage-gbps", "0"),
                                        ("--restart-min", "-1"), ("--tokens", "0"), ("--mtbf", "nan")])
def test_plan_refuses_a_failure_model_it_cannot_compute(flag, value):
    r = cli_here(*PLAN, flag, value)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert flag.lstrip("-").split("-")[0] in r.stderr


@pytest.mark.parametrize("step_s,stop_s,workers,mtbf,restart_s", [
    (10.0, 30.0, 16_384, DEFAULT_MTBF_GPU_HOURS, 600.0),  # Llama 3's scale: many steps
    (0.05, 0.4, 2, 1e-4, 3.0),  # a tiny run told a tiny --mtbf: a few steps
    (1.0, 500.0, 8, 0.01, 60.0),  # a checkpoint far longer than the job's MTBF: every step
    (0.3, 0.3, 64, 1000.0, 0.0)])
def test_auto_checkpoint_every_is_the_whole_step_count_of_most_goodput(step_s, stop_s, workers, mtbf,
                                                                       restart_s):
    """`--checkpoint-every auto`'s choice: no whole number of steps (a brute-force scan) has more
    goodput, and it lies within one step of plan/goodput's optimum in seconds (or is 1 where
    that optimum is under a step); the restart time moves the goodput, not the interval."""
    c = choose_checkpoint_every(step_s, stop_s, workers, mtbf, restart_s)
    f = Failures(mtbf_s=mtbf * 3600 / workers, save_s=stop_s, restart_s=restart_s)
    ks = range(1, max(10, 3 * c.every))
    assert max(goodput(k * step_s, f) for k in ks) == goodput(c.every * step_s, f) == c.goodput
    best = best_interval(f)
    assert abs(c.every * step_s - best) <= step_s or (c.every == 1 and best < step_s)
    assert c.optimum_s == best and c.mtbf_s == f.mtbf_s
    assert choose_checkpoint_every(step_s, stop_s, workers, mtbf, 10 * restart_s + 1).every == c.every
    line = choice_line({**c.as_row(), "at": 5})
    assert line.startswith(f"--checkpoint-every auto: {c.every} steps") and "decided at step 5" in line
    assert f"{c.goodput:.1%} goodput" in line


def test_the_cadence_of_auto_measures_once_then_checkpoints_at_its_choice():
    """Before deciding, auto checkpoints only 5 steps after the group's start (the measurement)
    and at the end; after, every `every` steps from the measurement; a resumed group measures
    again from its own start; int values keep their meaning."""
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.worker.cadence import Cadence

    cfg = TrainConfig(max_steps=40, checkpoint_every="auto", mtbf=1e-4)
    cad = Cadence(cfg, start=10)
    assert [s for s in range(11, 41) if cad.checkpoints(s)] == [15, 40]
    assert cad.measures(15) and not cad.measures(14)
    said = cad.decide(15, step_s=0.05, stop_s=0.4, workers=2, restart_s=3.0)
    every = choose_checkpoint_every(0.05, 0.4, 2, 1e-4, 3.0).every
    assert cad.every == every and not cad.measures(15)
    assert [s for s in range(16, 41) if cad.checkpoints(s)] == [*range(15 + every, 40, every), 40]
    assert cad.take_note()["checkpoint_auto"]["every"] == every and cad.take_note() == {}
    assert said == choice_line({**choose_checkpoint_every(0.05, 0.4, 2, 1e-4, 3.0).as_row(), "at": 15})
    for n, expected in ((7, [7, 14, 21, 28, 35, 40]), (0, [40]), (-1, [])):
        fixed = Cadence(TrainConfig(max_steps=40, checkpoint_every=n))
        assert [s for s in range(1, 41) if fixed.checkpoints(s)] == expected and not fixed.measures(5)


def test_checkpoint_every_takes_auto_and_keeps_its_numbers():
    """The setting is a number of steps (as every saved config has it) or auto; anything else is
    refused in one line, and so is a --mtbf that is not a positive number."""
    from raytrain_lm.config.load import build_config
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.errors import UserError

    assert build_config(flags={"checkpoint_every": "auto"}).checkpoint_every == "auto"
    assert build_config(flags={"checkpoint_every": "25"}).checkpoint_every == 25
    assert TrainConfig.from_dict({"checkpoint_every": 7}).checkpoint_every == 7
    for bad in ("atuo", "-2", 1.5):
        with pytest.raises(UserError, match="checkpoint.every"):
            build_config(flags={"checkpoint_every": bad})
    with pytest.raises(UserError, match="--mtbf"):
        build_config(flags={"checkpoint_every": "auto", "mtbf": "0"})


@pytest.mark.slow
def test_a_run_with_auto_checkpoints_at_the_interval_it_chose(pydoc_data, tmp_path):
    """On the local harness (2 gloo ranks), `--checkpoint-every auto` with a tiny --mtbf: the run
    checkpoints 5 steps in, says what it chose and from which measured numbers, and checkpoints
    at that interval after it and at the end; the choice is choose_checkpoint_every's on the
    numbers it logged. (The --mtbf makes the interval a few steps at this machine's step and
    checkpoint times, 2-6 as measured; the claims hold for any.)"""
    from conftest import small_config
    from local_mode import run_local

    cfg = small_config(pydoc_data, tmp_path, "auto", max_steps=30, log_every=0, eval_every=1000,
                       checkpoint_every="auto", mtbf=3e-4, sets=[
                           "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
                           "batch_size=4", "seq_len=32", "eval_windows=4", "keep_checkpoints=100"])
    said, rows = [], []
    summary = run_local(cfg, say=said.append, on_metrics=rows.append)
    assert summary["status"] == "completed"
    chosen = [r["checkpoint_auto"] for r in rows if r.get("checkpoint_auto")]
    assert len(chosen) == 1 and chosen[0]["at"] == 5
    c = chosen[0]
    again = choose_checkpoint_every(c["step_s"], c["stop_s"], 2, 3e-4, c["restart_s"])
    assert again.as_row() == {k: v for k, v in c.items() if k != "at"}
    assert choice_line(c) in said
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "auto").glob("checkpoint_*"))
    assert saved == sorted({5, *range(5 + c["every"], 30, c["every"]), 30}), (saved, c)
