"""--virtual-stages: interleaved 1F1B with three stages per worker trains the one-worker model
(the workers' loop on gloo ranks of the local harness: the schedule's arithmetic, not Ray), and a
bad value is refused before anything starts."""

import pytest

from conftest import step_losses
from raytrain_lm.config.checks import validate
from raytrain_lm.config.layout import Layout
from raytrain_lm.config.load import build_config
from raytrain_lm.errors import UserError

MODEL = ["model.n_layer=6", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
         "model.dropout=0"]


def config(data, storage, name, workers, **flags):
    return build_config(sets=MODEL, flags=dict(
        workers=workers, cpus_per_worker=1.0, max_steps=6, batch_size=8, seq_len=32, lr=3e-3,
        warmup_steps=2, log_every=3, eval_every=6, checkpoint_every=0, data=str(data),
        storage=str(storage), name=name, seed=5, **flags))


def test_virtual_stages_are_checked():
    base = dict(workers=2, pp=2, seq_len=32, batch_size=8, microbatches=4)
    cfg = build_config(sets=MODEL, flags=dict(base, pp_schedule="interleaved-1f1b", virtual_stages=3))
    validate(cfg)
    assert Layout.of(cfg).stages == 6
    with pytest.raises(UserError, match="--virtual-stages needs --pp-schedule interleaved-1f1b"):
        validate(build_config(sets=MODEL, flags=dict(base, virtual_stages=3)))
    with pytest.raises(UserError, match="fewer than the 8 pipeline stages"):
        validate(build_config(sets=MODEL, flags=dict(base, virtual_stages=4,
                                                     pp_schedule="interleaved-1f1b")))
    with pytest.raises(UserError, match="--virtual-stages must be 0"):
        validate(build_config(sets=MODEL, flags=dict(base, virtual_stages=1,
                                                     pp_schedule="interleaved-1f1b")))


@pytest.mark.slow
def test_three_stages_per_worker_train_the_one_worker_model(pydoc_data, tmp_path):
    from local_mode import run_local

    for name, workers, flags in (("one", 1, {}), ("v3", 2, dict(
            pp=2, pp_schedule="interleaved-1f1b", virtual_stages=3, microbatches=4))):
        summary = run_local(config(pydoc_data, tmp_path, name, workers, **flags))
        assert summary["status"] == "completed"
    one, v3 = step_losses(tmp_path / "one"), step_losses(tmp_path / "v3")
    assert one.keys() == v3.keys() == set(range(1, 7))
    for s in one:
        assert v3[s] == pytest.approx(one[s], rel=1e-4), s
