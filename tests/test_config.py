import json

import pytest

from raytrain_lm.config.load import build_config, parse_set_args
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import UserError


def test_layering_preset_file_flags_set(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 0.01\nbatch_size: 4\nmodel:\n  n_layer: 3\n")
    cfg = build_config(preset="small", config_file=str(f), flags={"batch_size": 8},
                       sets=["model.dropout=0.1", "lr=2e-3"])
    assert cfg.preset == "small" and cfg.model.n_embd == 384  # from the preset
    assert cfg.model.n_layer == 3  # file
    assert cfg.batch_size == 8  # flag beats file
    assert cfg.lr == 2e-3 and cfg.model.dropout == 0.1  # --set beats everything


@pytest.mark.parametrize("suffix,text", [(".toml", 'lr = 0.02\n[model]\nn_head = 2\n'),
                                          (".json", json.dumps({"lr": 0.02, "model": {"n_head": 2}}))])
def test_toml_and_json_files(tmp_path, suffix, text):
    f = tmp_path / f"c{suffix}"
    f.write_text(text)
    cfg = build_config(config_file=str(f))
    assert cfg.lr == 0.02 and cfg.model.n_head == 2


def test_round_trip_through_dict():
    cfg = build_config(preset="gpt2")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("sets,message", [
    (["nope=1"], "unknown key 'nope'"),
    (["model.nope=1"], "unknown key 'model.nope'"),
    (["lr=abc"], "lr must be float"),
    (["workers=1.5"], "workers must be int"),
    (["compile=maybe"], "compile must be bool"),
    (["lr"], "key=value"),
])
def test_bad_overrides(sets, message):
    with pytest.raises(UserError, match=message):
        build_config(sets=sets)


def test_validation():
    with pytest.raises(UserError, match="--workers must be at least 1"):
        build_config(flags={"workers": 0})
    with pytest.raises(UserError, match="larger than the model's context"):
        build_config(flags={"seq_len": 512})
    with pytest.raises(UserError, match="divisible"):
        build_config(sets=["model.n_head=5"])
    with pytest.raises(UserError, match="unknown preset"):
        build_config(preset="huge")


def test_parse_set_nests():
    assert parse_set_args(["model.n_layer=6", "lr=1"]) == {"model": {"n_layer": "6"}, "lr": "1"}


def test_the_gpt_gelu_is_exact_except_in_gpt2s_presets():
    assert build_config().model.gelu == "exact" and build_config(preset="small").model.gelu == "exact"
    assert build_config(preset="gpt2").model.gelu == "tanh"
    assert build_config(preset="gpt2-medium").model.gelu == "tanh"
    with pytest.raises(UserError, match="model.gelu must be one of exact, tanh"):
        build_config(sets=["model.gelu=relu"])


def test_a_saved_config_from_before_the_gelu_setting_resumes_with_tanh():
    """Every GPT saved before `model.gelu` existed trained with tanh: its config.json (and a
    checkpoint's config) without the key resumes, exports and samples with tanh, and a resume
    of it passes the same-model check."""
    saved = build_config(preset="small").to_dict()
    del saved["model"]["gelu"]
    assert TrainConfig.from_dict(saved).model.gelu == "tanh"
    assert build_config(base=saved, flags={"max_steps": 10}).model.gelu == "tanh"
    assert TrainConfig.from_dict({"lr": 1e-3}).model.gelu == "exact"  # no saved model: defaults


def test_a_refused_value_is_shown_by_its_start():
    """The message names a refused value by its start (errors.brief): a list that stands for
    10^6 strings (what a YAML alias bomb parses to, cheaply) is refused in a short line at once,
    not printed whole."""
    import time

    from raytrain_lm.config.settings import TrainConfig, apply_overrides

    value = ["lol"] * 10
    for _ in range(5):
        value = [value] * 10
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^f: lr must be float, got \[\[\[") as e:
        apply_overrides(TrainConfig(), {"lr": value}, source="f")
    assert len(str(e.value)) < 200 and time.monotonic() - t0 < 1
