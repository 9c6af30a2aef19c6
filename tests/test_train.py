"""A real 2-worker Ray Train run (gloo DDP between two worker processes) on the pydoc corpus:
the session's shared tiny run (120 steps, validation and checkpoints at 60 and 120)."""

import json
import math

import pytest

from conftest import TINY_RUN_ACTORS, TINY_RUN_CONTROLLER_LIBS, TINY_STEPS

SUMMARY_KEYS = {"status", "steps", "tokens", "final_train_loss", "final_val_loss", "val_perplexity",
                "tokens_per_second", "mfu", "wall_seconds", "workers", "use_gpu", "preset",
                "num_parameters", "checkpoint", "restarts", "resumed_from_step"}


@pytest.fixture(scope="module")
def finished_run(tiny_run):
    _, run_dir = tiny_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), rows, run_dir


def test_a_run_starts_no_helper_processes_it_does_without(finished_run):
    """Ray starts each of these by default, a process that costs ~1.5-2.5 CPU seconds of
    start-up: a dataset manager with no Ray Datasets to manage, a cleaner for a driver that
    outlives its controller, which `train`'s does not, and a preemption watcher, which is a
    thread of the controller here (controller.py); nor a queue for the metrics rows, which the
    driver takes from the controller (callbacks.HeldRows)."""
    assert TINY_RUN_ACTORS.count("RayTrainWorker") == 2 and "Controller" in TINY_RUN_ACTORS
    assert "DatasetManager" not in TINY_RUN_ACTORS
    assert "PlacementGroupCleaner" not in TINY_RUN_ACTORS
    assert "PreemptionWatcher" not in TINY_RUN_ACTORS
    assert "_QueueActor" not in TINY_RUN_ACTORS  # the rows come from the controller


def test_the_controller_does_not_import_torch(finished_run):
    """Ray's TorchConfig, which the controller unpickles, imports torch (~390 MB, over a CPU
    second before any worker starts); ours does not (backend.py)."""
    assert any(lib.startswith("_raylet") for lib in TINY_RUN_CONTROLLER_LIBS)  # it was found
    assert not [lib for lib in TINY_RUN_CONTROLLER_LIBS if "torch" in lib]


def test_loss_falls(finished_run):
    summary, rows, _ = finished_run
    vals = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    assert [s for s, _ in vals] == [60, 120]
    assert vals[0][1] > vals[1][1]
    # An untrained byte model starts near ln(256) = 5.5; after 120 steps it is well below the
    # corpus's byte unigram entropy (~3.27 nats/byte).
    assert rows[0]["step_losses"][0] > 5.0
    assert summary["final_val_loss"] < 2.8
    assert summary["val_perplexity"] == pytest.approx(math.exp(summary["final_val_loss"]))


def test_summary_and_metrics_files_complete(finished_run):
    summary, rows, run_dir = finished_run
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["status"] == "completed" and summary["steps"] == TINY_STEPS
    assert summary["workers"] == 2 and summary["tokens"] == TINY_STEPS * 2 * 16 * 128
    assert summary["use_gpu"] is False and summary["mfu"] is None  # no MFU on CPU
    assert summary["num_parameters"] > 800_000 and summary["tokens_per_second"] > 0
    assert [r["step"] for r in rows] == list(range(10, TINY_STEPS + 1, 10))
    for r in rows:
        for key in ("loss", "lr", "grad_norm", "tokens_per_second", "step_time", "data_wait_frac",
                    "peak_mem_gb", "tokens"):
            assert r[key] is not None and r[key] >= 0, key
        assert len(r["step_losses"]) == 10
    assert summary["checkpoint"].endswith(f"checkpoint_{TINY_STEPS:08d}")
    assert (run_dir / f"checkpoint_{TINY_STEPS:08d}" / "state.pt").is_file()


def test_ranks_trained_one_model(finished_run):
    """Both DDP replicas hold the same weights at every checkpoint (a float64 checksum of each
    rank's parameters, compared across ranks), and the checkpoint holds the unwrapped model;
    both ranks committed their part."""
    _, rows, run_dir = finished_run
    spreads = [r["replica_spread"] for r in rows if r.get("checkpoint")]
    assert spreads == [0.0, 0.0]  # steps 60 and 120
    folder = run_dir / f"checkpoint_{TINY_STEPS:08d}"
    from raytrain_lm.store.checkpoint_format import load_checkpoint

    state = load_checkpoint(folder)  # state.pt, with the model gathered from dcp/
    assert state["step"] == TINY_STEPS and state["world_size"] == 2
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    assert {"rng-rank0.pt", "rng-rank1.pt", "rank0.json", "rank1.json", "meta.json"} <= {
        p.name for p in folder.iterdir()}
