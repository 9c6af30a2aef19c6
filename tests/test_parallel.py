"""The layouts on real Ray Train workers: a pipeline schedule trains the harness's one-worker
model (the layouts' arithmetic: test_parallel_layouts.py), a killed Llama run resumes bit for bit,
and a model built sharded (FSDP x TP) never has a whole copy on any rank."""

from __future__ import annotations

import pytest

from conftest import step_losses
from raytrain_lm.config.load import build_config
from raytrain_lm.run.driver import run_training
from test_parallel_layouts import LAYOUTS, assert_trains_the_one_worker_model, hf_llama, layout_config, run_layout


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts-on-ray")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, pydoc_data, storage):
    return hf_llama(tmp_path_factory.mktemp("hf-llama"), pydoc_data, storage)


@pytest.fixture(scope="module")
def one(pydoc_data, storage, request):
    """one(arch): the one-worker run's per-step losses and rows on the harness (the reference of
    this module's Ray runs), made on first use."""
    done = {}

    def get(arch):
        if arch not in done:
            init_from = str(request.getfixturevalue("hf_folder")[0]) if arch == "llama" else None
            done[arch] = run_layout(pydoc_data, storage, f"{arch}-one", 1, {}, arch, init_from)
        return done[arch]

    return get


def test_a_pipeline_on_ray_workers_trains_the_one_worker_model(ray_address, one, pydoc_data, storage):
    """--pp 2 with the 1F1B schedule on two Ray Train workers: each step's loss and each reported
    gradient norm within 1e-4 of the harness's one-worker run, and its validation loss. (With the Ray runs of other
    modules, each of DDP, FSDP, FSDP x TP and a pipeline schedule runs on Ray at least once.)"""
    workers, flags = LAYOUTS["pp2-1f1b"]
    run = run_layout(pydoc_data, storage, "pp2-1f1b-ray", workers, flags, train=run_training)
    assert_trains_the_one_worker_model(run, one("gpt"))
    rows = run[1]
    assert 0.0 < rows[-1]["bubble"] < 1.0


def test_a_killed_llama_run_resumes_bit_identically(ray_address, one, hf_folder, pydoc_data, storage,
                                                    monkeypatch):
    """The one-worker Llama run again, its worker killed after step 13: restarted from step 10's
    checkpoint (not from --init-from again), every step's loss is the uninterrupted run's, bit for
    bit. (A Ray run of its own, with the restart.)"""
    reference = one("llama")[0]  # before the drill's variable, which the harness's ranks see too
    monkeypatch.setenv("RAYTRAIN_LM_FAIL_AT", "0:13")
    cfg = layout_config(pydoc_data, storage, "llama-killed", 1, {}, arch="llama", max_failures=1,
                        checkpoint_every=10)
    summary = run_training(cfg, init_from=str(hf_folder[0]), say=lambda m: None)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 10
    assert step_losses(storage / "llama-killed") == reference


def test_built_sharded_no_rank_holds_the_whole_model(ray_address, pydoc_data, storage):
    """gpt2-medium's width at half its depth (12 layers: 152M parameters with bytes) on 4
    workers, FSDP over 2 x TP over 2: each builds only its quarter, and its peak memory through a
    training step stays under 0.4x of what a full replica needs for parameters, gradients and
    AdamW (16 bytes per parameter), measured as peak RSS with freed memory returned to the OS.
    (All 24 layers took 110 s here against 65 s, most of it the one step and the final
    checkpoint, which it now skips: --checkpoint-every -1; the fixed ~90 MB per rank weighs more
    at smaller sizes.)"""
    cfg = build_config(preset="gpt2-medium", sets=["model.n_layer=12"], flags=dict(
        workers=4, cpus_per_worker=0.5, tp=2, strategy="fsdp", max_steps=1, batch_size=1,
        seq_len=64, log_every=1, eval_every=1, eval_windows=1, checkpoint_every=-1,  # none: 1.8 GB unread
        data=str(pydoc_data), storage=str(storage), name="big-fsdp2xtp2"))
    rows = []
    # Peak RSS counts what glibc keeps of freed memory too (it grows step by step: 0.63-0.67x after
    # one 2-way FSDP step here, 0.78x after two); with large blocks mmapped, freed memory goes
    # back to the OS and the peak is the memory the run holds. (40% slower steps: not a default.)
    run_training(cfg, say=lambda m: None, on_metrics=rows.append, force=True,
                 worker_env={"MALLOC_MMAP_THRESHOLD_": "1048576"})
    full_replica_gb = 16 * rows[-1]["num_parameters"] / 1e9
    assert rows[-1]["param_fraction"] == pytest.approx(0.25, abs=0.01)
    # Building it added half the full fp32 weights at most (measured: 0.39x at 12 layers, 0.32x
    # at 24; a full build, then sharding: >= 1x), and the step 0.4x of a replica (measured 0.31x
    # at 12 layers, 0.28x at 24, 2026-12-01).
    assert rows[-1]["build_mem_gb"] < 0.5 * 4 * rows[-1]["num_parameters"] / 1e9
    assert rows[-1]["mem_above_baseline_gb"] < 0.4 * full_replica_gb
    assert not list((storage / "big-fsdp2xtp2").glob("checkpoint_*"))  # --checkpoint-every -1


