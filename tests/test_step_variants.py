"""Training settings that change how a step is computed, each checked against a run that computes
the same thing another way: the training arithmetic, so on the local harness (local_mode.py: the
workers' loop on 2 forked gloo ranks, real DDP), on the pydoc corpus."""

from __future__ import annotations

import math

import pytest

from conftest import SMALL_SETTINGS, small_config, step_losses
from local_mode import run_local

pytestmark = pytest.mark.slow

# The small model without dropout; batch and sequence length are flags here (a --set would win).
NO_DROPOUT = [s for s in SMALL_SETTINGS if not s.startswith(("model.dropout", "batch_size", "seq_len"))] + \
    ["model.dropout=0"]


def train(data, storage, name, sets=NO_DROPOUT, default_dtype=None, **flags):
    cfg = small_config(data, storage, name, sets=sets, **{"batch_size": 8, "seq_len": 64, **flags})
    rows = []
    summary = run_local(cfg, on_metrics=rows.append, default_dtype=default_dtype)
    assert summary["status"] == "completed"
    return step_losses(storage / name), rows


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("options")


def grad_norms(rows) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in rows}


@pytest.fixture(scope="module")
def whole_run(pydoc_data, storage):
    """10 eager steps of the small model without dropout, a metrics row each: what the other ways
    must match (losses, rows)."""
    return train(pydoc_data, storage, "accum-1", max_steps=10, batch_size=8, grad_accum=1, log_every=1)


@pytest.fixture(scope="module")
def whole(whole_run):
    return whole_run[0]


def test_gradient_accumulation_gives_the_losses_of_the_whole_batch(pydoc_data, storage):
    """--grad-accum 2 --batch-size 4 reads, per rank and step, the windows of --batch-size 8
    (data/sampler.py), so the losses, the gradient norms and the updates are the same up to float
    rounding (the losses alone barely move when the step forgets to divide by the micro-batches:
    AdamW's update ignores a constant factor on the gradient; the norm doubles). This run makes a
    row every step (--log-every 1) and sends at steps 1 and 10 only (--log-seconds 1000): rows 2-9
    wait on the workers and travel with step 10's report, and metrics.jsonl and the caller get
    every one of them.

    Both runs in float64 (the ranks' default dtype), so that they differ only by the order of
    float64 sums (2**-53 relative a term), which AdamW's steps amplify by at most lr / eps (it
    divides by sqrt(v) + eps). The same amplification of float32's rounding, 2**29 times larger,
    made the float32 comparison hold on one machine and not on another (issue 48)."""
    whole, whole_rows = train(pydoc_data, storage, "accum-1-fp64", max_steps=10, batch_size=8,
                              grad_accum=1, log_every=1, default_dtype="float64")
    halves, rows = train(pydoc_data, storage, "accum-2", max_steps=10, batch_size=4, grad_accum=2,
                         log_every=1, log_seconds=1000.0, default_dtype="float64")
    assert whole.keys() == halves.keys() == set(range(1, 11))
    for s in whole:
        assert halves[s] == pytest.approx(whole[s], rel=1e-6)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(len(r["step_losses"]) == 1 and "earlier_rows" not in r for r in rows)
    assert grad_norms(rows).keys() == grad_norms(whole_rows).keys() == set(range(1, 11))
    for s, norm in grad_norms(whole_rows).items():
        assert grad_norms(rows)[s] == pytest.approx(norm, rel=1e-5)


def test_a_validation_split_smaller_than_one_batch_is_evaluated(pydoc_data, storage):
    """512-token windows: pydoc's validation split has fewer of them than one batch of 64 per
    worker, the `--preset gpt2 --workers 2` case that used to evaluate nothing (NaN)."""
    from raytrain_lm.data.windows import TokenWindows

    assert len(TokenWindows(pydoc_data, "val", 512)) < 64
    sets = NO_DROPOUT + ["model.block_size=512"]
    _, rows = train(pydoc_data, storage, "small-val", sets=sets, max_steps=2, seq_len=512,
                    batch_size=64, log_every=1, eval_every=2, checkpoint_every=0)
    assert math.isfinite(rows[-1]["val_loss"]) and 3.0 < rows[-1]["val_loss"] < 6.0
    assert (storage / "small-val" / "best_checkpoint").is_dir()


def test_compile_on_cpu_trains_like_eager(whole, pydoc_data, storage):
    """The same math, fused differently by Inductor: equal within float rounding, and not bit for
    bit (an eager run repeats the eager losses exactly: a compile that fell back to eager would
    pass the first check alone)."""
    compiled, _ = train(pydoc_data, storage, "compiled", max_steps=10, batch_size=8, compile=True)
    for s in whole:
        assert compiled[s] == pytest.approx(whole[s], rel=1e-4)
    assert any(compiled[s] != whole[s] for s in whole)
