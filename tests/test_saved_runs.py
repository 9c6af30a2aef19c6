"""Runs saved by an older tree (tests/fixtures/pre39: written before the re-layout of issue 39)
still load and resume: config.json and a checkpoint name no module, and the models keep their
parameter names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pre39"


def saved(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_an_older_checkpoint_loads_into_this_trees_model(name):
    """Its config.json builds a config here, and its checkpoint's weights fill the model that
    config builds, name for name and shape for shape (strict)."""
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.models import build_model
    from raytrain_lm.store.checkpoint_format import load_checkpoint

    cfg = TrainConfig.from_dict(saved(name))
    state = load_checkpoint(FIXTURES / name / "checkpoint_00000004")
    model = build_model(cfg.model)
    model.load_state_dict(state["model"], strict=True)
    assert state["step"] == 4 and cfg.model.arch == name


@pytest.mark.slow
def test_an_older_run_resumes_where_it_stopped(pydoc_data, tmp_path):
    """`--resume` of the GPT run from its step-4 checkpoint (on the local harness, one rank)
    trains steps 5-8 with the losses the older tree had (weights, optimizer, data position and
    dropout's RNG all restored)."""
    from local_mode import run_local
    from raytrain_lm.config.load import build_config

    shutil.copytree(FIXTURES / "gpt", tmp_path / "gpt")
    cfg = build_config(base=saved("gpt"), flags=dict(data=str(pydoc_data), storage=str(tmp_path)))
    rows = []
    summary = run_local(cfg, resume=True, on_metrics=rows.append)
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 8
    from conftest import row_losses

    before = {int(k): v for k, v in json.loads((FIXTURES / "gpt" / "losses.json").read_text()).items()}
    # Equal to the last bit, not within a tolerance: the older tree wrote these losses on this same
    # harness (one local gloo rank on the CPU, OMP_NUM_THREADS=1), and the model, loss and AdamW
    # run the same float32 ops in the same order here, so each step's sums are the same sums (a
    # CPU kernel's result depends on its thread count and blocking, both fixed here, not on timing).
    # json keeps a float's every bit. A missed restore (data position, dropout's RNG, an Adam
    # moment) changes a loss far above the last bit; a change to the model's arithmetic that
    # reorders a sum shows here too, and must then bound its rounding instead.
    assert row_losses(rows) == {s: before[s] for s in range(5, 9)}


def test_a_sweep_saved_before_the_settings_moved_to_their_owners_loads_as_it_was():
    """tests/fixtures/pre49/sweep.json, written by the tree before issue 49 split TrainConfig and
    ModelConfig into their owners' classes (a muTransfer sweep of a Llama under fsdp and wsd):
    what `tune --resume` reads of it (tune/sweep.run_sweep) gives the same config, key for key
    and value for value (a setting added since at its default), the same space and settings,
    and the same transfer config."""
    from dataclasses import asdict

    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.track.tracking import check_trackers
    from raytrain_lm.tune.space import SearchSpace
    from raytrain_lm.tune.sweep_config import SweepSettings
    from raytrain_lm.tune.transfer import target_model

    saved = json.loads((FIXTURES.parent / "pre49" / "sweep.json").read_text())
    cfg = TrainConfig.from_dict(saved["base"])
    loaded, default = cfg.to_dict(), TrainConfig().to_dict()
    for now, then, fresh in ((loaded, saved["base"], default),
                             (loaded["model"], saved["base"]["model"], default["model"])):
        assert {k: now[k] for k in then if k != "model"} == {k: v for k, v in then.items() if k != "model"}
        # a setting added since takes its default (the sweep ran without it)
        assert {k: v for k, v in now.items() if k not in then} == {k: fresh[k] for k in now if k not in then}
    assert (cfg.strategy, cfg.schedule, cfg.model.arch, cfg.model.param) == ("fsdp", "wsd", "llama", "mup")
    assert SearchSpace.from_json(saved["space"]).to_json() == saved["space"]
    assert asdict(SweepSettings(**saved["settings"])) == saved["settings"]
    assert check_trackers(saved["track"]) == []
    wide = target_model(saved["base"], saved["settings"]["target_width"])
    assert wide["model"]["n_embd"] == 256 and wide["model"]["mup_base_width"] == 64
    assert TrainConfig.from_dict(wide).model.n_embd == 256
