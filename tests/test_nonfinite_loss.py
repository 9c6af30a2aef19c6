"""A loss (or gradient norm) that becomes nan or inf stops the run at the next report, in one
line naming the step and the last good checkpoint, without saving a non-finite checkpoint; that
checkpoint resumes. fp16's scaler skipping an overflowing step is not such a failure. Read off
device tensors at the report only: the step itself reads nothing on the host."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import MeteredStep, cli_here, small_config, step_losses
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import RunFailed
from raytrain_lm.worker.metrics import Meter, first_nonfinite
from raytrain_lm.worker.step import TrainStep


def meter(scaler_skips: bool = False) -> Meter:
    return Meter(torch.device("cpu"), 1, 1.0, None, 6, 0.0, scaler_skips=scaler_skips)


def test_the_first_nonfinite_step_is_named():
    nan, inf = math.nan, math.inf
    assert first_nonfinite(5, [1.0, 2.0], [1.0, 1.0], [False, False]) is None
    assert first_nonfinite(5, [1.0, nan, inf], [1.0, nan, 1.0], [False, True, False]) == \
        "loss became nan at step 6"
    assert first_nonfinite(5, [1.0, 2.0], [1.0, inf], [False, True]) == \
        "the gradient norm became inf at step 6"
    assert first_nonfinite(5, [1.0, 2.0], [], []) is None  # fp16: the norms are the scaler's


def test_the_meter_reads_nothing_per_step_and_finds_the_nan_at_the_report():
    """A step's loss and norm stay device tensors until the report: meta tensors, which the host
    cannot read, go through add_step; the report names the first non-finite step and the next
    interval starts clean."""
    m = meter()
    m.add_step(torch.ones((), device="meta"), 10, torch.ones((), device="meta"))
    m = meter()
    for step, (loss, norm) in enumerate([(2.0, 1.0), (float("nan"), float("nan")), (3.0, 1.0)], 11):
        m.add_step(torch.tensor(loss), 10, torch.tensor(norm))
    row = m.row(13, 1e-3, 1.0, MeteredStep())
    assert m.nonfinite == "loss became nan at step 12" and math.isnan(row["step_losses"][1])
    m.next_interval(exclude_since_row=False)
    m.add_step(torch.tensor(1.0), 10, torch.tensor(float("inf")))
    m.row(14, 1e-3, 1.0, MeteredStep())
    assert m.nonfinite == "the gradient norm became inf at step 14"
    skips = meter(scaler_skips=True)  # fp16: an overflowing gradient is the scaler's to skip
    skips.add_step(torch.tensor(1.0), 10, torch.tensor(float("inf")))
    skips.row(1, 1e-3, 1.0, MeteredStep())
    assert skips.nonfinite is None


def test_an_fp16_step_the_scaler_skips_is_not_a_failure():
    """A real fp16 step whose scaled gradients overflow: the scaler skips it (the weights stay,
    the scale halves), its gradient norm is not finite, and the meter does not call it a
    failure."""
    cfg = TrainConfig()
    cfg.precision, cfg.batch_size, cfg.seq_len, cfg.workers = "fp16", 2, 16, 1
    m = cfg.model
    m.vocab_size, m.n_layer, m.n_embd, m.n_head, m.block_size = 64, 1, 32, 2, 16
    step = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda model: model)
    assert step.scaler.is_enabled()
    step.load_scaler_state({**step.scaler_state(), "scale": 3e38})  # overflows on backward

    class Batches:
        def next(self):
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            return x, x

    before = [p.detach().clone() for p in step.parts[0].parameters()]
    loss, norm = step(Batches(), 1e-3)
    assert math.isfinite(loss.item()) and not math.isfinite(norm.item())
    assert all(torch.equal(a, b) for a, b in zip(before, step.parts[0].parameters()))
    assert step.scaler.get_scale() == pytest.approx(1.5e38)
    watch = meter(scaler_skips=step.scaler.is_enabled())
    watch.add_step(loss, 32, norm)
    watch.row(1, 1e-3, norm.item(), step)
    assert watch.nonfinite is None


def test_a_failed_run_is_one_line_and_exit_code_1(monkeypatch, tmp_path):
    """The CLI's boundary: a run that stopped (RunFailed) is its line, exit code 1, not an
    unexpected error."""
    from raytrain_lm.run import driver

    line = "loss became nan at step 7; the last good checkpoint is runs/r/checkpoint_00000004"

    def stopped(*args, **kwargs):
        raise RunFailed(line)

    monkeypatch.setattr(driver, "run_training", stopped)
    r = cli_here("train", "--storage", str(tmp_path), "--name", "r")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [f"error: {line}"]


def test_the_rows_sent_with_the_stop_are_kept_and_shown(tmp_path):
    """The stop's report carries the good rows made since the previous report (earlier_rows):
    the driver's Follower writes them to metrics.jsonl and shows them, then names the stop."""
    import time

    from raytrain_lm.config.load import build_config
    from raytrain_lm.run.follower import Follower
    from raytrain_lm.store.storage import RunFolder

    cfg = build_config(flags=dict(storage=str(tmp_path), name="r", max_steps=8))
    shown = []
    follower = Follower(cfg, RunFolder(str(tmp_path), "r"), time.time(), {}, False, print, shown.append)

    class NoTensorBoard:
        def add(self, row) -> None:
            pass

    good = [{"step": s, "loss": 3.0, "step_losses": [3.0], "workers": 1} for s in (2, 4)]
    follower.take({**good[0]}, NoTensorBoard())
    follower.take({"step": 6, "event": "nonfinite", "error": "loss became nan at step 5",
                   "earlier_rows": [good[1]]}, NoTensorBoard())
    assert [r["step"] for r in shown] == [2, 4]
    assert step_losses(tmp_path / "r") == {2: 3.0, 4: 3.0}
    assert follower.stopped(None).startswith("loss became nan at step 5; the last good checkpoint")


@pytest.mark.slow
def test_a_run_whose_loss_becomes_nan_stops_and_its_last_checkpoint_resumes(
        pydoc_data, tmp_path, monkeypatch):
    """On the local harness, 2 gloo ranks: the drill makes step 5's loss nan; the run stops at
    the report of step 6 with the line, keeps its step-4 checkpoint (keep_checkpoints 1: a
    non-finite one at 6 would have rotated it out) and saves none after; resumed without the
    drill, it trains on from step 4 to the end with finite losses."""
    from local_mode import run_local
    from raytrain_lm.store.checkpoint_format import read_meta

    cfg = small_config(pydoc_data, tmp_path, "nan", max_steps=8, log_every=2, eval_every=4,
                       checkpoint_every=2, keep_checkpoints=1, sets=[
                           "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                           "model.block_size=32", "batch_size=4", "seq_len=32", "eval_windows=8"])
    monkeypatch.setenv("RAYTRAIN_LM_NAN_AT", "5")
    with pytest.raises(RunFailed) as failed:
        run_local(cfg)
    run = tmp_path / "nan"
    assert str(failed.value) == f"loss became nan at step 5; the last good checkpoint is " \
                                f"{run / 'checkpoint_00000004'}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == str(failed.value)
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_00000004"]
    assert read_meta(run / "checkpoint_00000004")["step"] == 4
    assert max(step_losses(run)) == 4  # rows up to the last finite report; none with a nan

    monkeypatch.delenv("RAYTRAIN_LM_NAN_AT")
    resumed = run_local(cfg, resume=True)
    assert resumed["status"] == "completed" and resumed["resumed_from_step"] == 4
    losses = step_losses(run)
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
