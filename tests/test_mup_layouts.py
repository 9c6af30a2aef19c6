"""--param mup on the layouts (the local harness, local_mode.py): muP's per-parameter groups are
found by name, so FSDP2's and ZeRO's sharded parameters, tensor parallelism's DTensor shards
and a pipeline's stages train the one-worker mup model step for step; a killed mup run resumes
(its optimizer's groups, with their lr multiples, from the checkpoint) to the uninterrupted
run's losses. The comparison is test_parallel_layouts.py's."""

from __future__ import annotations

import json

import pytest

from conftest import step_losses
from local_mode import Killed, run_local
from raytrain_lm.config.load import build_config
from test_parallel_layouts import LAYOUTS, assert_trains_the_one_worker_model, layout_config, run_config

MUP = dict(param="mup", mup_base_width=32)  # the layouts' model is 64 wide: every multiplier 1/2
MUP_LAYOUTS = {"one": LAYOUTS["one"], "fsdp": (2, dict(strategy="fsdp")),
               "zero1": (2, dict(strategy="zero1")), "tp2": LAYOUTS["tp2"],
               "pp2-1f1b": LAYOUTS["pp2-1f1b"]}


def mup_config(data, storage, name, workers, flags, **more):
    cfg = layout_config(data, storage, f"mup-{name}", workers, flags, **more)
    cfg.model.param, cfg.model.mup_base_width = MUP["param"], MUP["mup_base_width"]
    return build_config(base=cfg.to_dict())  # checked as a run's config is


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("mup-layouts")


@pytest.fixture(scope="module")
def runs(pydoc_data, storage):
    """runs(name): that layout's (per-step losses, metrics rows) under mup, trained on first use."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = run_config(mup_config(pydoc_data, storage, name, *MUP_LAYOUTS[name]))
            saved = json.loads((storage / f"mup-{name}" / "config.json").read_text())
            assert saved["model"]["param"] == "mup"  # the run records its parametrization
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in MUP_LAYOUTS if n != "one"])
def test_every_layout_trains_the_one_worker_mup_model(runs, layout):
    """Each step's loss and gradient norm within 1e-4 relative of one worker's under mup: the
    groups' lr multiples and decays reach every shard and stage, the initial values (scaled per
    rule, the final norm's gain at base/width) are filled shard by shard."""
    assert_trains_the_one_worker_model(runs(layout), runs("one"))


@pytest.mark.slow
def test_a_killed_mup_run_resumes_to_the_uninterrupted_losses(runs, pydoc_data, storage):
    """tp2 under mup killed after step 10's report, resumed from its checkpoint: steps 11 to 14
    are the uninterrupted run's, bit for bit (the optimizer's state and groups restored)."""
    workers, flags = MUP_LAYOUTS["tp2"]
    cfg = mup_config(pydoc_data, storage, "tp2-killed", workers, flags, checkpoint_every=10)
    with pytest.raises(Killed):  # right after step 10's report, its checkpoint saved
        run_local(cfg, say=lambda m: None, kill_after=10)
    summary = run_local(build_config(base=cfg.to_dict()), resume=True, say=lambda m: None)
    assert summary["resumed_from_step"] == 10
    assert step_losses(storage / "mup-tp2-killed") == runs("tp2")[0]
