"""Checkpoints, exact resume and surviving failures, on the session's real Ray cluster with two
gloo workers. Dropout is on, so the per-step losses only match if every RNG state is restored."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (ROOT, SMALL_SETTINGS, SMALL_STEPS, kill_train_workers, run_cli,
                      small_config, step_losses)
from raytrain_lm.config import build_config
from raytrain_lm.driver import run_training

STEPS = SMALL_STEPS
SETTINGS = SMALL_SETTINGS
config = small_config


@pytest.fixture(scope="module")
def storage(small_storage):
    return small_storage


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


def test_killed_worker_recovers_and_matches_uninterrupted(reference, pydoc_data, storage, monkeypatch):
    monkeypatch.setenv("RAYTRAIN_LM_FAIL_AT", "1:15")  # rank 1's process exits at step 15
    messages = []
    summary = run_training(config(pydoc_data, storage, "killed", max_failures=1), say=messages.append)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 10
    assert any(m.startswith("worker failure") for m in messages), messages
    assert step_losses(storage / "killed") == reference  # bit-identical, every step


def test_stopped_driver_resumes_and_matches(reference, pydoc_data, storage, ray_address):
    args = ["train", "--address", ray_address, "--storage", str(storage), "--name", "driver",
            "--workers", "2", "--max-steps", str(STEPS), "--log-every", "5", "--eval-every", "15",
            "--checkpoint-every", "10", "--seed", "11", "--data", str(pydoc_data)]
    for s in SETTINGS:
        args += ["--set", s]
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = storage / "driver" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(l)["step"] >= 10 for l in metrics.read_text().splitlines()):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(signal.SIGKILL)  # the driver dies without any cleanup ...
    # ... and its workers with it, as when the head node is lost. Ray would end them too, but only
    # after a while, in which they might write the final checkpoint and leave nothing to resume.
    kill_train_workers()
    proc.wait()
    assert json.loads((storage / "driver" / "summary.json").read_text())["status"] == "running"

    result = run_cli("train", "--address", ray_address, "--storage", str(storage),
                     "--name", "driver", "--resume", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["resumed_from_step"] in (10, 20) and summary["restarts"] == 1
    assert step_losses(storage / "driver") == reference


def test_truncated_checkpoint_is_skipped(reference, pydoc_data, storage):
    import shutil

    shutil.copytree(storage / "reference", storage / "truncated")
    state = storage / "truncated" / f"checkpoint_{STEPS:08d}" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a torn write
    cfg = build_config(base=json.loads((storage / "truncated" / "config.json").read_text()),
                       flags={"max_steps": STEPS + 10})
    cfg.name = "truncated"
    summary = run_training(cfg, resume=True, say=lambda m: None)
    assert summary["resumed_from_step"] == STEPS - 10  # fell back to the previous checkpoint
    assert summary["steps"] == STEPS + 10
    losses = step_losses(storage / "truncated")
    # Steps up to the fallback point are the reference's; later steps follow a longer schedule.
    assert all(losses[s] == reference[s] for s in range(1, STEPS - 9))


def test_resuming_from_the_final_checkpoint_brings_back_lost_rows(reference_run, storage):
    import shutil

    shutil.copytree(storage / "reference", storage / "finished")
    log = storage / "finished" / "metrics.jsonl"
    logged = log.read_text().splitlines()
    # The driver died with the rows after step 10 still in flight in Ray: it never logged them.
    log.write_text("".join(line + "\n" for line in logged if json.loads(line)["step"] <= 10))
    cfg = build_config(base=json.loads((storage / "finished" / "config.json").read_text()))
    cfg.name = "finished"
    summary = run_training(cfg, resume=True, say=lambda m: None)
    # Nothing was trained, but the rows the final checkpoint carries came back: the run reads as
    # finished and its metrics are whole.
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["resumed_from_step"] == STEPS and summary["restarts"] == 1
    assert summary["final_val_loss"] == reference_run[1][-1]["val_loss"]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == len(logged)
    assert [r["checkpoint"] for r in rows if r.get("checkpoint")] == \
        [str(storage / "finished" / f"checkpoint_{s:08d}") for s in (10, 20, 30)]
    assert step_losses(storage / "finished") == reference_run[0]


def test_init_from_loads_weights_and_restarts_schedule(reference, pydoc_data, storage):
    rows = []
    cfg = config(pydoc_data, storage, "finetune", max_steps=5)
    cfg.log_every = 1
    summary = run_training(cfg, init_from=str(storage / "reference"), say=lambda m: None,
                           on_metrics=rows.append)
    assert rows[0]["lr"] == pytest.approx(cfg.lr / (cfg.warmup_steps + 1))  # warmup from step 0
    assert rows[0]["resumed_from_step"] is None and summary["steps"] == 5
    # A fresh model starts near ln(256) = 5.5; the loaded one where the reference ended.
    assert rows[0]["loss"] < reference[STEPS] + 0.3


def test_checkpoint_contents_and_best_copy(reference, storage):
    run = storage / "reference"
    kept = sorted(p.name for p in run.glob("checkpoint_*") if p.is_dir())
    assert kept == [f"checkpoint_{STEPS - 10:08d}", f"checkpoint_{STEPS:08d}"]  # last 2 kept
    state = torch.load(run / kept[-1] / "state.pt", weights_only=False)
    assert {"model", "optimizer", "scaler", "step", "tokens", "data", "config", "tokenizer"} <= state.keys()
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    best = json.loads((run / "best_checkpoint" / "meta.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert best["step"] in (10, 20, 30) and summary["best_checkpoint"].endswith("best_checkpoint")


def test_bad_resume_and_init_inputs(reference, pydoc_data, storage, tmp_path):
    r = run_cli("train", "--storage", str(storage), "--name", "nope", "--resume")
    assert r.returncode == 2 and "no run named 'nope'" in r.stderr
    r = run_cli("train", "--storage", str(storage), "--name", "reference")
    assert r.returncode == 2 and "already exists" in r.stderr
    r = run_cli("train", "--data", str(pydoc_data), "--storage", str(tmp_path / "r"),
                "--init-from", str(storage / "reference"))  # tiny preset: 4 layers, not 2
    assert r.returncode == 2 and "another model shape" in r.stderr
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(storage / "reference" / f"checkpoint_{STEPS:08d}", broken)
    (broken / "state.pt").write_bytes(b"garbage")
    r = run_cli("train", "--data", str(pydoc_data), "--storage", str(tmp_path / "r"),
                "--init-from", str(broken))
    assert r.returncode == 2 and "corrupted" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()
