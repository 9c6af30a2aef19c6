"""--scale-lr, the exponential LR-range schedule and reading the range test's curve. No Ray cluster."""

import math

import pytest

from raytrain_lm.config.load import build_config
from raytrain_lm.errors import UserError
from raytrain_lm.tune.lr_find import per_step_curve, range_test_config, smooth, suggest_lr
from raytrain_lm.tune.lr_scaling import apply_lr_scaling, scaled_lr
from raytrain_lm.worker.optim import lr_at


def test_scaling_rules():
    assert scaled_lr(1e-3, 4096, 16384, "linear") == pytest.approx(4e-3)
    assert scaled_lr(1e-3, 4096, 16384, "sqrt") == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 4096, 16384, "none") == 1e-3
    assert scaled_lr(1e-3, 4096, 1024, "sqrt") == pytest.approx(5e-4)  # smaller batch: smaller lr


def test_scale_from_the_presets_batch_when_none_is_recorded():
    cfg = build_config(flags=dict(workers=8))  # tiny preset: lr 3e-3 chosen at 2 workers
    line = apply_lr_scaling(cfg, "sqrt")
    assert cfg.lr == pytest.approx(3e-3 * 2)  # 4x the tokens per step -> 2x the lr
    assert cfg.ref_batch_tokens == cfg.tokens_per_step == 8 * 16 * 128
    assert line == "lr scaled (sqrt) from 0.003 at 4,096 tokens/step to 0.006 at 16,384 tokens/step"
    apply_lr_scaling(cfg, "sqrt")  # the reference is now this batch: scaling again is a no-op
    assert cfg.lr == pytest.approx(6e-3)


def test_scale_from_a_recorded_reference(tmp_path):
    f = tmp_path / "best.yaml"
    f.write_text("lr: 0.002\nref_batch_tokens: 2048\nworkers: 2\nbatch_size: 16\nseq_len: 128\n")
    cfg = build_config(config_file=str(f), flags=dict(workers=4))  # 8192 tokens/step: 4x
    apply_lr_scaling(cfg, "linear")
    assert cfg.lr == pytest.approx(0.008)
    same = build_config(config_file=str(f), flags=dict(workers=4))
    assert apply_lr_scaling(same, "none") is None and same.lr == 0.002
    with pytest.raises(UserError, match="--scale-lr must be one of"):
        apply_lr_scaling(same, "cubic")


def test_scale_lr_knows_mup_the_width_changes_an_sp_lr_not_a_mup_one(tmp_path):
    """A config tuned at width 64 and 4,096 tokens/step, trained at width 256 and 16,384: under
    sp the lr follows the batch's rule and x sqrt(64/256) (sp's optimum moves by less than
    1/width: tune/lr_scaling.py); under mup the batch's rule only (muP's groups carry the
    width). Scaling again for the same run changes nothing."""
    f = tmp_path / "best.yaml"
    f.write_text("lr: 0.01\nref_batch_tokens: 4096\nref_width: 64\nworkers: 2\nbatch_size: 16\n"
                 "seq_len: 128\nmodel:\n  n_embd: 256\n  n_head: 4\n")
    sp = build_config(config_file=str(f), flags=dict(workers=8))
    line = apply_lr_scaling(sp, "sqrt")
    assert sp.lr == pytest.approx(0.01 * 2 * (64 / 256) ** 0.5)
    assert (sp.ref_batch_tokens, sp.ref_width) == (16384, 256)
    assert line == ("lr scaled (sqrt) from 0.01 at 4,096 tokens/step, width 64 to 0.01 at "
                    "16,384 tokens/step, width 256 (sp: x sqrt(64/256))")
    assert apply_lr_scaling(sp, "sqrt") is None and sp.lr == pytest.approx(0.01)
    mup = build_config(config_file=str(f), flags=dict(workers=8),
                       sets=["model.param=mup", "model.mup_base_width=64"])
    apply_lr_scaling(mup, "sqrt")
    assert mup.lr == pytest.approx(0.01 * 2)
    same_batch = build_config(config_file=str(f), sets=["model.param=mup", "model.mup_base_width=64"])
    assert apply_lr_scaling(same_batch, "sqrt") is None and same_batch.lr == 0.01


def test_exp_range_schedule_rises_exponentially_to_lr():
    cfg = build_config(flags=dict(lr=1.0, max_steps=101), sets=["schedule=exp_range", "min_lr_ratio=1e-5"])
    lrs = [lr_at(s, cfg) for s in range(101)]
    assert lrs[0] == pytest.approx(1e-5) and lrs[-1] == pytest.approx(1.0)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]
    assert max(ratios) == pytest.approx(min(ratios)) and ratios[0] == pytest.approx(10 ** 0.05)
    assert lrs[50] == pytest.approx(math.sqrt(1e-5))  # halfway in log space
    with pytest.raises(UserError, match="exp_range"):
        build_config(sets=["schedule=exp_range", "min_lr_ratio=0"])
    with pytest.raises(UserError, match="--schedule must be one of cosine, wsd, exp_range"):
        build_config(sets=["schedule=linear"])


def test_range_test_config():
    cfg = range_test_config(build_config(), 1e-5, 1.0, 100)
    assert (cfg.schedule, cfg.max_steps, cfg.eval_every) == ("exp_range", 100, 100)
    assert lr_at(0, cfg) == pytest.approx(1e-5) and lr_at(99, cfg) == pytest.approx(1.0)
    # Sparse reports, each with the losses since the last: still one point per step, in order.
    rows = [{"step": 10, "step_losses": [5.0 - i / 10 for i in range(10)]},
            {"step": 20, "step_losses": [4.0 - i / 10 for i in range(10)]},
            {"step": 20, "step_losses": [4.0 - i / 10 for i in range(10)]}]  # run again after a restart
    lrs, losses = per_step_curve(rows, cfg)
    assert losses == [5.0 - i / 10 for i in range(20)]
    assert lrs == [lr_at(i, cfg) for i in range(20)] and lrs[0] == pytest.approx(1e-5)
    assert cfg.name.startswith("lrfind-tiny-")
    with pytest.raises(UserError, match="must be below"):
        range_test_config(build_config(), 1.0, 1e-3, 100)


def test_smoothing_is_centered():
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    line = [float(i) for i in range(50)]
    assert smooth(line)[2:-2] == pytest.approx(line[2:-2])  # no lag on a straight line


def test_suggestion_on_a_synthetic_curve():
    """Loss falls fastest around 1e-3, bottoms out at 1e-2, explodes beyond 1e-1."""
    lrs = [1e-5 * (1e5) ** (i / 99) for i in range(100)]

    def loss(lr):
        x = math.log10(lr)
        return 5.0 - 2.0 / (1 + math.exp(-3 * (x + 3))) + (max(0.0, x + 2) ** 2) * 3

    found = suggest_lr(lrs, [loss(lr) for lr in lrs])
    assert 5e-3 < found["min_loss_lr"] < 2e-2
    assert 5e-4 < found["suggested_lr"] < 2e-3 and found["suggested_lr"] == found["steepest_lr"]
    assert not found["still_falling_at_end"]
    rising = suggest_lr(lrs, [5.0 - 0.01 * i for i in range(100)])
    assert rising["still_falling_at_end"]
