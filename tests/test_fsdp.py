"""FSDP2, ZeRO-1/2 and activation checkpointing on two real gloo workers, against DDP on the same
data. The arithmetic (each strategy's losses, its shards, an exact resume) runs on the local
harness (the DDP reference is a Ray run). Ray's restart of a sharded run after a killed worker is
test_moe_ray.py's (ep2 on ZeRO-1: the same dcp checkpoint)."""

import shutil

import pytest

from conftest import SMALL_SETTINGS, SMALL_STEPS, row_losses, small_config, step_losses
from local_mode import run_local
from raytrain_lm.config.load import build_config
from raytrain_lm.models.gpt.gpt import GPT
from raytrain_lm.store.checkpoint_format import load_checkpoint

STEPS = SMALL_STEPS
pytestmark = pytest.mark.slow  # Ray runs and the harness's, every test here


def train(data, storage, name, on=run_local, resume=False, **flags):
    rows = []
    summary = on(small_config(data, storage, name, **flags), resume=resume, say=lambda m: None,
                 on_metrics=rows.append)
    assert summary["status"] == "completed"
    return step_losses(storage / name), rows


@pytest.fixture(scope="module")
def storage(small_storage):
    return small_storage


@pytest.fixture(scope="module")
def ddp(reference_run):
    """The shared uninterrupted DDP run (same data, seed and model as every run here)."""
    return reference_run


@pytest.fixture(scope="module")
def fsdp(pydoc_data, storage):
    return train(pydoc_data, storage, "fsdp", on=run_local, strategy="fsdp")


def test_fsdp_matches_ddp_and_shards_the_model(ddp, fsdp):
    (ddp_losses, ddp_rows), (fsdp_losses, fsdp_rows) = ddp, fsdp
    assert ddp_losses.keys() == fsdp_losses.keys() == set(range(1, STEPS + 1))
    for s in ddp_losses:  # reduce-scatter sums in another order than all-reduce: float tolerance
        assert fsdp_losses[s] == pytest.approx(ddp_losses[s], rel=1e-4, abs=1e-5)
    assert ddp_rows[-1]["param_fraction"] == 1.0
    assert fsdp_rows[-1]["param_fraction"] == pytest.approx(0.5, abs=0.02)  # rank 0 holds ~half
    ratio = fsdp_rows[-1]["model_state_gb"] / ddp_rows[-1]["model_state_gb"]
    assert 0.45 < ratio < 0.6


def test_fsdp_checkpoint_loads_in_one_process(fsdp, storage):
    folder = storage / "fsdp" / f"checkpoint_{STEPS:08d}"
    assert (folder / "dcp" / ".metadata").is_file()
    assert {"rank0.json", "rank1.json"} <= {p.name for p in folder.iterdir()}
    state = load_checkpoint(folder)
    cfg = build_config(sets=SMALL_SETTINGS).model
    cfg.vocab_size = 256
    model = GPT(cfg)
    model.load_state_dict(state["model"])  # strict: every tensor present, full shapes
    assert state["model"]["wte.weight"].shape == (256, 64)
    assert state["step"] == STEPS and state["format"] == "dcp"


def test_fsdp_resumes_exactly_with_selective_recompute(fsdp, pydoc_data, storage):
    """The FSDP run's folder without its final checkpoint, resumed from step 20 with selective
    activation recompute (dropout on: a recomputed block draws the masks of its forward): steps
    21-30 have the uninterrupted run's losses. Ray's restart of a sharded run after a killed
    worker: test_moe_ray.py (ep2 on ZeRO-1, the same dcp checkpoint)."""
    assert_resumes_exactly(pydoc_data, storage, "fsdp", fsdp[0], activation_checkpointing="selective")


def assert_resumes_exactly(data, storage, name, reference, **flags):
    """Copies run `name`'s folder without its final checkpoint and resumes it on the harness
    with `flags`: steps 21-30 must have `reference`'s losses."""
    shutil.copytree(storage / name, storage / f"{name}-resumed")
    shutil.rmtree(storage / f"{name}-resumed" / f"checkpoint_{STEPS:08d}")
    flags.setdefault("strategy", name)
    _, rows = train(data, storage, f"{name}-resumed", on=run_local, resume=True, **flags)
    assert rows[-1]["resumed_from_step"] == STEPS - 10
    # this run's rows only: the copied folder's metrics.jsonl also holds the first run's
    losses = row_losses(rows)
    assert losses.keys() == set(range(STEPS - 9, STEPS + 1))
    for s in losses:
        assert losses[s] == pytest.approx(reference[s], rel=1e-6, abs=1e-7)


def test_full_activation_checkpointing_gives_the_same_losses(ddp, pydoc_data, storage):
    losses, _ = train(pydoc_data, storage, "ddp-ac", on=run_local, activation_checkpointing="full")
    for s in ddp[0]:
        assert losses[s] == pytest.approx(ddp[0][s], rel=1e-6, abs=1e-7)


def test_an_fsdp_checkpoint_exports_its_tied_embedding_once(fsdp, storage, tmp_path):
    """A sharded checkpoint gathers the tied embedding and output weights as two tensors; the
    export stores one and says so in "tied", as docs/results.md promises."""
    import json

    from safetensors.torch import load_file

    from conftest import cli_here

    r = cli_here("export", str(storage / "fsdp"), "--out", str(tmp_path / "e"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tied"] == {"lm_head.weight": "wte.weight"}
    assert "lm_head.weight" not in load_file(str(tmp_path / "e" / "model.safetensors"))


# ZeRO-1 and ZeRO-2 (FSDP2 with reshard_after_forward=False; ZeRO-1 keeps the parameters
# gathered through a step's micro-steps) on the same two workers: the DDP run's losses, and each resumes
# exactly from its checkpoint.
@pytest.fixture(scope="module")
def zero_runs(pydoc_data, storage):
    return {s: train(pydoc_data, storage, s, on=run_local, strategy=s) for s in ("zero1", "zero2")}


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_matches_ddp_and_shards_the_optimizer(ddp, zero_runs, strategy):
    (ddp_losses, ddp_rows), (losses, rows) = ddp, zero_runs[strategy]
    assert losses.keys() == ddp_losses.keys() == set(range(1, STEPS + 1))
    for s in ddp_losses:  # a reduce-scatter of the gradients in place of DDP's all-reduce
        assert losses[s] == pytest.approx(ddp_losses[s], rel=1e-4, abs=1e-5)
    ratio = rows[-1]["model_state_gb"] / ddp_rows[-1]["model_state_gb"]
    assert 0.45 < ratio < 0.6  # everything sharded at rest, as fsdp


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_resumes_exactly_from_its_checkpoint(zero_runs, pydoc_data, storage, strategy):
    """Each ZeRO run's folder without its final checkpoint, resumed: from step 20, steps 21-30
    have the uninterrupted run's losses."""
    assert_resumes_exactly(pydoc_data, storage, strategy, zero_runs[strategy][0])
