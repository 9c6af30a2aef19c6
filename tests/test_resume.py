"""Checkpoints, exact resume and surviving failures, on the session's real Ray cluster with two
gloo workers. Dropout is on, so the per-step losses only match if every RNG state is restored."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (
    ROOT,
    SMALL_SETTINGS,
    SMALL_STEPS,
    cli_here,
    kill_train_workers,
    libraries_of_pid,
    run_cli,
    small_config,
    step_losses,
)
from local_mode import run_local
from raytrain_lm.config.load import build_config
from raytrain_lm.run.driver import run_training

STEPS = SMALL_STEPS
SETTINGS = SMALL_SETTINGS
config = small_config


@pytest.fixture(scope="module")
def storage(small_storage):
    return small_storage


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


def test_stopped_driver_resumes_and_matches(reference, pydoc_data, storage, ray_address, tmp_path,
                                            monkeypatch):
    """... and its MLflow run (--track mlflow, a local store) continues: one run, every row's
    loss at its step equal to metrics.jsonl's, FINISHED."""
    args = ["train", "--address", ray_address, "--storage", str(storage), "--name", "driver",
            "--workers", "2", "--max-steps", str(STEPS), "--log-every", "5", "--eval-every", "15",
            "--checkpoint-every", "10", "--seed", "11", "--data", str(pydoc_data), "--track", "mlflow"]
    for s in SETTINGS:
        args += ["--set", s]
    mlflow_env = {"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    # Held before step 11 (the hold drill, after the step-10 checkpoint) until it is killed: the
    # run cannot finish, or checkpoint again, before the kill however fast the machine.
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **mlflow_env, "RAYTRAIN_LM_HOLD_AT": "11"})
    metrics = storage / "driver" / "metrics.jsonl"
    deadline = time.time() + 300  # only how long to wait for a run that went wrong
    while time.time() < deadline and proc.poll() is None:
        if (storage / "driver" / "hold-11.waiting").exists() and metrics.exists() and \
                any(json.loads(line)["step"] == 10 for line in metrics.read_text().splitlines()) \
                and (storage / "driver" / "tracking.json").exists():  # its MLflow run made too
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be stopped"
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == 10
    # Training, metrics rows written, TensorBoard too: the driver has done all it does in a run,
    # without torch (~2 CPU seconds of import before the run can start; the workers import it).
    assert not [lib for lib in libraries_of_pid(proc.pid) if lib.startswith("libtorch")]
    proc.send_signal(signal.SIGKILL)  # the driver dies without any cleanup ...
    # ... and its workers with it, as when the head node is lost (Ray would end them too, but
    # only after a while).
    kill_train_workers()
    proc.wait()
    assert json.loads((storage / "driver" / "summary.json").read_text())["status"] == "running"

    result = run_cli("train", "--address", ray_address, "--storage", str(storage),
                     "--name", "driver", "--resume", "--json", env=mlflow_env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["resumed_from_step"] == 10 and summary["restarts"] == 1
    assert step_losses(storage / "driver") == reference

    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(mlflow_env["MLFLOW_TRACKING_URI"])
    record = json.loads((storage / "driver" / "tracking.json").read_text())["mlflow"]
    assert [r.info.run_id for r in client.search_runs([record["experiment_id"]])] == [record["run_id"]]
    history = client.get_metric_history(record["run_id"], "loss/train")
    rows = [json.loads(line) for line in (storage / "driver" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(m.step for m in history) == [r["step"] for r in rows]  # each step once
    assert {m.step: m.value for m in history} == {r["step"]: r["loss"] for r in rows}
    assert client.get_run(record["run_id"]).info.status == "FINISHED"


def lr_steps(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["lr"]) for r in rows]


def test_truncated_checkpoint_is_skipped_and_a_longer_run_keeps_its_schedule(reference_run, storage):
    """A torn final checkpoint: the run resumes from the one before, given more --max-steps. The
    cosine had already decayed, so its horizon stays at the old end and the minimum is held: the
    resumed steps up to the old end are the reference's, bit for bit (weights, optimizer, data
    position, every RNG restored, the same learning rates).

    The same run shows that the best checkpoint after a resume is the checkpoint with the lowest
    validation loss: it compares against best_checkpoint/'s own loss, not against a better
    evaluation that was never a checkpoint (here: a summary claiming 0.0001)."""
    import shutil

    reference, reference_rows = reference_run
    shutil.copytree(storage / "reference", storage / "truncated")
    state = storage / "truncated" / f"checkpoint_{STEPS:08d}" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a torn write
    summary_path = storage / "truncated" / "summary.json"
    summary_path.write_text(json.dumps({**json.loads(summary_path.read_text()), "best_val_loss": 1e-4}))
    before = json.loads((storage / "truncated" / "best_checkpoint" / "meta.json").read_text())
    rows = []
    more = 20
    cfg = build_config(base=json.loads((storage / "truncated" / "config.json").read_text()),
                       flags={"max_steps": STEPS + more})
    cfg.name = "truncated"
    summary = run_training(cfg, resume=True, say=lambda m: None, on_metrics=rows.append)
    assert summary["resumed_from_step"] == STEPS - 10  # fell back to the previous checkpoint
    assert summary["steps"] == STEPS + more
    losses = step_losses(storage / "truncated")
    assert all(losses[s] == reference[s] for s in range(STEPS - 9, STEPS + 1))  # the resumed steps
    # No step-to-step change of the learning rate across the resume is larger than the
    # schedule's own largest change anywhere else; after the old end the minimum is held.
    old = lr_steps(reference_rows)
    after = [(s, lr) for s, lr in lr_steps(rows) if s > STEPS - 10]
    largest = max(abs(b - a) for (_, a), (_, b) in zip(old, old[1:]))
    resumed = [lr for s, lr in old if s <= STEPS - 10][-1:] + [lr for _, lr in after]
    assert max(abs(b - a) for a, b in zip(resumed, resumed[1:])) <= largest
    assert [lr for s, lr in after if s > STEPS] == [cfg.lr * cfg.min_lr_ratio] * (more // cfg.log_every)
    # The checkpoints carry the horizon: a later --resume inherits it (optim.resumed_horizon).
    final = storage / "truncated" / f"checkpoint_{STEPS + more:08d}" / "meta.json"
    saved = json.loads(final.read_text())
    assert (saved["config"]["max_steps"], saved["config"]["horizon"]) == (STEPS + more, STEPS)
    # The best checkpoint: the lowest validation loss of the old best and the new checkpoints.
    vals = {r["step"]: r["val_loss"] for r in rows if r.get("checkpoint")}
    best = json.loads((storage / "truncated" / "best_checkpoint" / "meta.json").read_text())
    best_step = min([before["step"], *vals], key=lambda s: vals.get(s, before["val_loss"]))
    assert min(vals.values()) < before["val_loss"]  # the longer run found a better checkpoint ...
    assert best["step"] == best_step and best["val_loss"] == vals[best_step]  # ... and kept it
    # Step 30 was made again where the damaged one lay: Ray kept one registration of it, so its
    # evictions removed what they should (the run failed at step 50 when it kept both).
    kept = sorted(p.name for p in (storage / "truncated").glob("checkpoint_*") if p.is_dir())
    assert kept == [f"checkpoint_{s:08d}" for s in (STEPS + more - 10, STEPS + more)]


def test_resume_without_storage_uses_the_default(reference_run, storage, ray_address, tmp_path):
    """--resume with no --storage: RAYTRAIN_LM_STORAGE, else ./runs (docs/checkpoints.md's own recovery
    command). The run resumed is finished and its driver died with the rows after step 10 still
    in flight in Ray: nothing is trained, but the rows its final checkpoint carries come back."""
    import shutil

    shared = tmp_path / "shared"
    shutil.copytree(storage / "reference", shared / "again")
    log = shared / "again" / "metrics.jsonl"
    logged = log.read_text().splitlines()
    log.write_text("".join(line + "\n" for line in logged if json.loads(line)["step"] <= 10))
    r = run_cli("train", "--name", "again", "--resume", "--address", ray_address, "--json",
                env={"RAYTRAIN_LM_STORAGE": str(shared)})
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["resumed_from_step"] == STEPS and summary["restarts"] == 1
    assert summary["final_val_loss"] == reference_run[1][-1]["val_loss"]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == len(logged)
    assert [r["checkpoint"] for r in rows if r.get("checkpoint")] == \
        [str(shared / "again" / f"checkpoint_{s:08d}") for s in (10, 20, 30)]
    assert step_losses(shared / "again") == reference_run[0]
    # Without the variable: ./runs, read before anything starts (a setting it keeps is refused).
    shutil.copytree(storage / "reference", tmp_path / "runs" / "here")
    r = run_cli("train", "--name", "here", "--resume", "--seq-len", "32", cwd=tmp_path,
                env={"RAYTRAIN_LM_STORAGE": ""})
    assert r.returncode == 2 and "keeps its --seq-len (64)" in r.stderr, r.stderr


def test_fp16_resume_of_an_fp32_run_and_more_workers(reference_run, storage):
    """--precision fp16 on a run saved without a gradient scaler starts a fresh scale instead of
    crashing every worker; 3 workers continue the 2 workers' data position. (The Ray run's
    checkpoint, continued on 3 ranks of the local harness.)"""
    import shutil

    shutil.copytree(storage / "reference", storage / "fp16")
    cfg = build_config(base=json.loads((storage / "fp16" / "config.json").read_text()),
                       flags={"max_steps": STEPS + 10, "precision": "fp16", "workers": 3,
                              "cpus_per_worker": 0.5})
    cfg.name = "fp16"
    rows = []
    summary = run_local(cfg, resume=True, on_metrics=rows.append)
    assert summary["status"] == "completed" and summary["steps"] == STEPS + 10
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["replica_spread"] == 0.0
    state = torch.load(storage / "fp16" / f"checkpoint_{STEPS + 10:08d}" / "state.pt", weights_only=True)
    assert state["scaler"]["scale"] > 0 and state["world_size"] == 3
    window = cfg.batch_size * cfg.grad_accum
    assert state["data"]["consumed"] == STEPS * 2 * window + 10 * 3 * window  # on from 2 workers'


def test_init_from_loads_weights_and_restarts_schedule(reference, pydoc_data, storage):
    rows = []
    cfg = config(pydoc_data, storage, "finetune", max_steps=5)
    cfg.log_every = 1
    summary = run_local(cfg, init_from=str(storage / "reference"), on_metrics=rows.append)
    assert rows[0]["lr"] == pytest.approx(cfg.lr / (cfg.warmup_steps + 1))  # warmup from step 0
    assert rows[0]["resumed_from_step"] is None and summary["steps"] == 5
    # A fresh model starts near ln(256) = 5.5; the loaded one where the reference ended.
    assert rows[0]["loss"] < reference[STEPS] + 0.3


def test_checkpoint_contents_and_best_copy(reference_run, storage):
    reference_rows = reference_run[1]
    run = storage / "reference"
    kept = sorted(p.name for p in run.glob("checkpoint_*") if p.is_dir())
    assert kept == [f"checkpoint_{STEPS - 10:08d}", f"checkpoint_{STEPS:08d}"]  # last 2 kept
    state = torch.load(run / kept[-1] / "state.pt", weights_only=True)  # tensors and plain data only
    assert {"scaler", "step", "tokens", "data", "config", "tokenizer"} <= state.keys()
    assert (run / kept[-1] / "dcp" / ".metadata").is_file()  # model and optimizer, any layout
    from raytrain_lm.store.checkpoint_format import load_checkpoint

    model = load_checkpoint(run / kept[-1])["model"]  # gathered in this process
    assert "wte.weight" in model and not any(k.startswith(("module.", "_orig_mod.")) for k in model)
    best = json.loads((run / "best_checkpoint" / "meta.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    vals = {r["step"]: r["val_loss"] for r in reference_rows if r.get("checkpoint")}
    assert set(vals) == {10, 20, 30}
    assert best["step"] == min(vals, key=vals.get) and best["val_loss"] == min(vals.values())
    assert summary["best_checkpoint"].endswith("best_checkpoint")


def test_bad_resume_and_init_inputs(trained_here, pydoc_data, tmp_path):
    """Refused before any Ray: no such run to resume, a run of that name exists, --init-from a
    checkpoint of another shape or a corrupted one. (A checkpoint trained in this process.)"""
    import shutil

    storage = tmp_path / "runs"
    (storage / "taken").mkdir(parents=True)
    r = cli_here("train", "--storage", str(storage), "--name", "nope", "--resume")
    assert r.returncode == 2 and "no run named 'nope'" in r.stderr
    r = cli_here("train", "--storage", str(storage), "--name", "taken")
    assert r.returncode == 2 and "already exists" in r.stderr
    ckpt = trained_here["byte"].ckpt
    r = cli_here("train", "--data", str(pydoc_data), "--storage", str(tmp_path / "r"),
                "--init-from", str(ckpt))  # tiny preset: 4 layers, not 2
    assert r.returncode == 2 and "another model shape" in r.stderr
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "state.pt").write_bytes(b"garbage")
    r = cli_here("train", "--data", str(pydoc_data), "--storage", str(tmp_path / "r"),
                "--init-from", str(broken))
    assert r.returncode == 2 and "corrupted" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()
