"""Search spaces from flags and files, checked against TrainConfig; sweep settings. No Ray cluster."""

import json

import pytest

from raytrain_lm.config.load import build_config
from raytrain_lm.errors import UserError
from raytrain_lm.tune.space import nest, parse_space
from raytrain_lm.tune.sweep import trial_config
from raytrain_lm.tune.sweep_config import SweepSettings, check_settings


@pytest.fixture
def base():
    return build_config()


def dims(space):
    return {d.key: d for d in space.dims}


def test_flag_specs_pick_the_range_kind_from_the_field(base):
    space = parse_space({"lr": "1e-4:1e-2", "model.dropout": "0:0.2", "warmup_steps": "0:100",
                         "batch_size": "8,16,32", "weight_decay": "log:1e-3:1e-1"}, [], None, base)
    d = dims(space)
    assert (d["lr"].kind, d["lr"].low, d["lr"].high) == ("loguniform", 1e-4, 1e-2)
    assert (d["model.dropout"].kind, d["model.dropout"].high) == ("uniform", 0.2)
    assert (d["warmup_steps"].kind, d["warmup_steps"].low, d["warmup_steps"].high) == ("randint", 0, 100)
    assert d["batch_size"].values == [8, 16, 32]  # coerced to the field's type
    assert d["weight_decay"].kind == "loguniform"


def test_samples_stay_inside_the_space(base):
    space = parse_space({"lr": "1e-4:1e-2", "warmup_steps": "0:3", "batch_size": "8,16"}, [], None, base)
    params = space.param_space("random")
    for _ in range(200):
        lr, warmup, batch = (params[k].sample() for k in ("lr", "warmup_steps", "batch_size"))
        assert 1e-4 <= lr <= 1e-2 and 0 <= warmup <= 3 and batch in (8, 16)
    # both ends of an integer range are reachable (ours is inclusive, Tune's randint is not)
    assert {params["warmup_steps"].sample() for _ in range(200)} == {0, 1, 2, 3}


def test_file_with_nested_keys_and_distributions(base, tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("lr: {loguniform: [1.0e-4, 1.0e-2]}\nmodel:\n  n_layer: [2, 4]\n  dropout: {uniform: [0, 0.1]}\n"
                 "weight_decay: '0,0.1'\n")
    d = dims(parse_space({}, [], str(f), base))
    assert d["lr"].kind == "loguniform" and d["model.n_layer"].values == [2, 4]
    assert d["model.dropout"].kind == "uniform" and d["weight_decay"].values == [0.0, 0.1]
    j = tmp_path / "space.json"
    j.write_text(json.dumps({"lr": {"grid": [1e-3, 3e-3]}}))
    assert dims(parse_space({}, [], str(j), base))["lr"].values == [1e-3, 3e-3]


def test_flags_override_the_file_and_space_args(base, tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("lr: [1.0e-3]\n")
    space = parse_space({"lr": "5e-3,6e-3"}, ["beta2=0.95,0.99"], str(f), base)
    assert dims(space)["lr"].values == [5e-3, 6e-3] and dims(space)["beta2"].values == [0.95, 0.99]


def test_no_space_given_searches_the_learning_rate_around_the_presets(base):
    space = parse_space({}, [], None, base)
    (lr,) = space.dims
    assert (lr.key, lr.kind) == ("lr", "loguniform") and space.chosen
    assert (lr.low, lr.high) == (pytest.approx(base.lr / 10), pytest.approx(base.lr * 3))
    assert "the default" in space.describe()
    assert not parse_space({"lr": "1e-3,2e-3"}, [], None, base).chosen


@pytest.mark.parametrize("specs,space_args,message", [
    ({"lr": "fast"}, [], "lr must be float"),
    ({"lr": "1e-2:1e-4"}, [], "LOW must be below HIGH"),
    ({"lr": "0:1e-2"}, [], "needs LOW > 0"),
    ({"lr": "1:2:3"}, [], "a range is LOW:HIGH"),
    ({"model.n_layer": "1.5:3"}, [], "is an integer"),
    ({"model.dropout": "0,1.5"}, [], "model.dropout must be in [0, 1)"),
    ({"model.n_embd": "100,130"}, [], "must be divisible by model.n_head"),
    ({}, ["workers=1,2"], "workers cannot be tuned"),
    ({}, ["max_steps=10,20"], "max_steps cannot be tuned"),
    ({}, ["nope=1"], "unknown setting 'nope'"),
    ({}, ["compile=0:1"], "give a list of values, not a range"),
    ({}, ["lr"], "--space expects key=spec"),
    ({"batch_size": "8,,16"}, [], "empty value"),
])
def test_bad_spaces_are_refused(base, specs, space_args, message):
    with pytest.raises(UserError, match=None) as e:
        parse_space(specs, space_args, None, base)
    assert message in str(e.value)


def test_bad_file_spaces(base, tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("lr: {gaussian: [0, 1]}\n")
    with pytest.raises(UserError, match="expected one of loguniform"):
        parse_space({}, [], str(f), base)
    f.write_text("lr: []\n")
    with pytest.raises(UserError, match="list of values is empty"):
        parse_space({}, [], str(f), base)
    with pytest.raises(UserError, match="config file not found"):
        parse_space({}, [], str(tmp_path / "missing.yaml"), base)


def test_settings_defaults_and_checks(base):
    space = parse_space({"lr": "1e-3,3e-3", "model.dropout": "0,0.1"}, [], None, base)
    s = SweepSettings(search="grid")
    check_settings(base, space, s, eval_every_given=False)
    assert s.trials == 4  # every grid point once
    assert s.grace_steps == base.max_steps // 10 and base.eval_every == s.grace_steps

    mixed = parse_space({"lr": "1e-4:1e-2", "model.dropout": "0,0.1"}, [], None, base)
    s = SweepSettings(search="random")
    check_settings(base, mixed, s, eval_every_given=False)
    assert s.trials == 8
    # Lists alone: 8 independent samples of 4 points cannot all differ.
    with pytest.raises(UserError, match="8 random samples of a space of 4 points must repeat"):
        check_settings(base, space, SweepSettings(search="random"), eval_every_given=False)
    check_settings(base, space, SweepSettings(search="random", trials=4), eval_every_given=False)

    for settings, given, message in [
        (SweepSettings(grace_steps=400), False, "is larger than --max-steps"),
        (SweepSettings(search="grid", trials=3), False, "runs every point of the grid once"),
        (SweepSettings(concurrent=0), False, "--concurrent must be at least 1"),
        (SweepSettings(reduction_factor=1), False, "--reduction-factor must be at least 2"),
        (SweepSettings(grace_steps=25), True, "must be a multiple of --eval-every"),
        (SweepSettings(search="hyperopt"), False, "--search must be random or grid"),
    ]:
        cfg = build_config(flags=dict(eval_every=10))
        with pytest.raises(UserError) as e:
            check_settings(cfg, space, settings, eval_every_given=given)
        assert message in str(e.value)

    ranges = parse_space({"lr": "1e-4:1e-2"}, [], None, base)
    with pytest.raises(UserError, match="grid search needs lists of values"):
        check_settings(base, ranges, SweepSettings(search="grid"), eval_every_given=False)


def test_trial_config_applies_the_point_and_records_its_batch(base):
    cfg = trial_config(base.to_dict(), {"lr": 1e-3, "model.n_layer": 2, "batch_size": 8,
                                        "model.n_embd": 96})
    assert cfg.lr == 1e-3 and cfg.model.n_layer == 2 and cfg.batch_size == 8
    assert cfg.ref_batch_tokens == cfg.workers * 8 * cfg.grad_accum * cfg.seq_len
    assert cfg.ref_width == 96  # and its width (--scale-lr under sp)
    assert nest({"model.n_layer": 2, "lr": 1}) == {"model": {"n_layer": 2}, "lr": 1}
