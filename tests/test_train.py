"""A real 2-worker Ray Train run (gloo DDP between two worker processes) on the pydoc corpus."""

import json
import math

import pytest

from raytrain_lm.config import build_config
from raytrain_lm.launch import run_training

SUMMARY_KEYS = {"status", "steps", "tokens", "final_train_loss", "final_val_loss", "val_perplexity",
                "tokens_per_second", "mfu", "wall_seconds", "workers", "use_gpu", "preset",
                "num_parameters", "checkpoint", "restarts", "resumed_from_step"}


@pytest.fixture(scope="module")
def finished_run(ray_address, pydoc_data, tmp_path_factory):
    storage = tmp_path_factory.mktemp("runs")
    cfg = build_config(flags=dict(workers=2, max_steps=60, log_every=10, eval_every=20,
                                  checkpoint_every=30, data=str(pydoc_data), storage=str(storage),
                                  name="two-workers"))
    rows = []
    summary = run_training(cfg, say=lambda m: None, on_metrics=rows.append)
    return summary, rows, storage / "two-workers"


def test_validation_loss_falls(finished_run):
    summary, rows, _ = finished_run
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 30, 40, 60]  # eval + checkpoints
    assert all(a > b for a, b in zip(vals, vals[1:]))
    # Well below a byte-level unigram model of this corpus (~3.27 nats/byte) after 60 steps.
    assert summary["final_val_loss"] < 3.0
    assert summary["val_perplexity"] == pytest.approx(math.exp(summary["final_val_loss"]))


def test_summary_and_metrics_files_complete(finished_run):
    summary, rows, run_dir = finished_run
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= on_disk.keys()
    assert on_disk["status"] == "completed" and on_disk["steps"] == 60 and on_disk["workers"] == 2
    assert on_disk["tokens"] == 60 * 2 * 16 * 128  # steps x workers x batch x seq_len
    assert on_disk["use_gpu"] is False and on_disk["mfu"] is None  # no MFU on CPU
    assert on_disk["num_parameters"] > 800_000 and on_disk["tokens_per_second"] > 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(10, 61, 10))
    for r in lines:
        for key in ("loss", "lr", "grad_norm", "tokens_per_second", "step_time", "data_wait_frac",
                    "peak_mem_gb", "tokens"):
            assert r[key] is not None and r[key] >= 0, key
    assert (run_dir / "checkpoint_00000060" / "state.pt").is_file()
    assert on_disk["checkpoint"].endswith("checkpoint_00000060")


def test_ranks_trained_one_model(finished_run):
    """DDP kept the ranks in sync: rank 0's checkpoint is the model both ranks trained, and the
    global loss logged is the mean over both ranks' batches (not rank 0's alone)."""
    import torch

    summary, rows, run_dir = finished_run
    state = torch.load(run_dir / "checkpoint_00000060" / "state.pt", weights_only=False)
    assert state["step"] == 60 and not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    assert {"rng-rank0.pt", "rng-rank1.pt"} <= {p.name for p in (run_dir / "checkpoint_00000060").iterdir()}
