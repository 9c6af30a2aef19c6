"""FSDP2, ZeRO-1/2 and activation checkpointing on two real gloo workers, against DDP on the same
data. The arithmetic (each strategy's losses, its shards, an exact resume) runs on the local
harness; FSDP and ZeRO-1 also run on Ray Train workers, each with a worker killed and restarted
from its checkpoint by Ray."""

import shutil

import pytest

from conftest import SMALL_SETTINGS, SMALL_STEPS, row_losses, small_config, step_losses
from local_mode import run_local
from raytrain_lm.config.load import build_config
from raytrain_lm.models.gpt.gpt import GPT
from raytrain_lm.run.driver import run_training
from raytrain_lm.store.checkpoint_format import load_checkpoint

STEPS = SMALL_STEPS
pytestmark = pytest.mark.slow  # Ray runs and the harness's, every test here


def train(data, storage, name, on=run_training, resume=False, **flags):
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


def test_fsdp_resume_after_killed_worker_with_selective_recompute(ray_address, fsdp, pydoc_data, storage,
                                                                  monkeypatch):
    """On Ray Train workers: rank 0 dies after step 13, Ray restarts the group, and the run goes
    on from step 10's checkpoint with the uninterrupted (harness) run's losses."""
    monkeypatch.setenv("RAYTRAIN_LM_FAIL_AT", "0:13")
    losses, rows = train(pydoc_data, storage, "fsdp-killed", strategy="fsdp", max_failures=1,
                         activation_checkpointing="selective")
    assert rows[-1]["resumed_from_step"] == 10
    reference = fsdp[0]
    for s in reference:
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
# exactly from its checkpoint (ZeRO-1 after a killed worker on Ray, ZeRO-2 on the harness: its
# checkpoint is FSDP's, whose restart on Ray is tested above).
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


def test_zero1_resumes_after_a_killed_worker(ray_address, zero_runs, pydoc_data, storage, monkeypatch):
    """On Ray Train workers: rank 1's process exits after step
    13, the user is told, Ray restarts the group once, and the run goes on from step 10's
    checkpoint with the uninterrupted (harness) run's losses."""
    monkeypatch.setenv("RAYTRAIN_LM_FAIL_AT", "1:13")
    messages = []
    summary = run_training(small_config(pydoc_data, storage, "zero1-killed", strategy="zero1",
                                        max_failures=1), say=messages.append)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 10
    assert any(m.startswith("worker failure") for m in messages), messages
    losses, reference = step_losses(storage / "zero1-killed"), zero_runs["zero1"][0]
    for s in reference:
        assert losses[s] == pytest.approx(reference[s], rel=1e-6, abs=1e-7)


def test_zero2_resumes_exactly_from_its_checkpoint(zero_runs, pydoc_data, storage):
    """The ZeRO-2 run's folder without its final checkpoint, resumed: from step 20, steps 21-30
    have the uninterrupted run's losses."""
    shutil.copytree(storage / "zero2", storage / "zero2-resumed")
    shutil.rmtree(storage / "zero2-resumed" / f"checkpoint_{STEPS:08d}")
    _, rows = train(pydoc_data, storage, "zero2-resumed", on=run_local, resume=True, strategy="zero2")
    assert rows[-1]["resumed_from_step"] == STEPS - 10
    # this run's rows only: the copied folder's metrics.jsonl also holds the first run's
    losses, reference = row_losses(rows), zero_runs["zero2"][0]
    assert losses.keys() == set(range(STEPS - 9, STEPS + 1))
    for s in losses:
        assert losses[s] == pytest.approx(reference[s], rel=1e-6, abs=1e-7)
