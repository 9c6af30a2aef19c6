"""`train --workers 0`: Ray Train's local mode, in the process the user started (no Ray cluster),
alone and under torchrun: the same loop, the same files and results as `--workers N` on Ray, loss
for loss."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli

# A short run of the tiny preset with a checkpoint halfway and reports every 2 steps.
SHORT = dict(max_steps=8, log_every=2, eval_every=4, checkpoint_every=4, eval_windows=16)
SHORT_FLAGS = ["--max-steps", "8", "--log-every", "2", "--eval-every", "4", "--checkpoint-every", "4",
               "--set", "eval_windows=16"]
# What Ray's own storage context and checkpoint manager keep in a run's folder, beside ours.
RAYS_OWN = {".validate_storage_marker", "checkpoint_manager_snapshot.json"}


def losses_by_step(run_dir) -> dict[int, float]:
    """Each step's global loss, from metrics.jsonl (a step run again after a resume: its last)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps = range(row["step"] - len(row["step_losses"]) + 1, row["step"] + 1)
        out.update(zip(steps, row["step_losses"]))
    return out


def run_files(run_dir) -> set[str]:
    return {p.name if not p.name.startswith("events.out") else "events.out..."
            for p in run_dir.iterdir()} - RAYS_OWN


@pytest.fixture(scope="module")
def one_worker_on_ray(ray_address, pydoc_data, tmp_path_factory):
    """`--workers 1` of SHORT on the session's Ray: its run folder."""
    from raytrain_lm.config.load import build_config
    from raytrain_lm.run.driver import run_training

    storage = tmp_path_factory.mktemp("runs")
    cfg = build_config(flags=dict(workers=1, data=str(pydoc_data), storage=str(storage), name="ray-1"),
                       sets=[f"{k}={v}" for k, v in SHORT.items()])
    assert run_training(cfg, say=lambda m: None)["status"] == "completed"
    return storage / "ray-1"


def test_workers_0_trains_checkpoints_resumes_and_reports_like_workers_1(one_worker_on_ray, pydoc_data,
                                                                         tmp_path):
    """In a process of its own with no Ray running: the launch line says so; a run killed after
    step 6 (the fault drill) resumes from its checkpoint of step 4; every step's loss equals the
    1-worker Ray run's bit for bit, and the run's folder and summary hold what Ray's do."""
    storage = tmp_path / "runs"
    flags = ["--workers", "0", *SHORT_FLAGS, "--data", str(pydoc_data), "--storage", str(storage),
             "--name", "here"]
    env = {"RAY_ADDRESS": "", "RAYTRAIN_LM_FAIL_AT": "0:6"}
    killed = run_cli("train", *flags, env=env, timeout=240)
    assert killed.returncode == 1, killed.stderr[-2000:]
    assert killed.stdout.splitlines()[0].startswith("local mode: training in this process, no Ray "
                                                    "cluster (Ray Train's local mode; 1 torch thread")
    assert "[fault drill] rank 0 exiting at step 6" in killed.stdout
    assert json.loads((storage / "here" / "summary.json").read_text())["status"] == "running"

    done = run_cli("train", "--workers", "0", "--resume", "--name", "here", "--storage", str(storage),
                   env={"RAY_ADDRESS": ""}, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming here from its newest checkpoint, step 4" in done.stdout
    run_dir = storage / "here"
    assert losses_by_step(run_dir) == losses_by_step(one_worker_on_ray)
    assert set(losses_by_step(run_dir)) == set(range(1, 9))
    ours, rays = (json.loads((d / "summary.json").read_text()) for d in (run_dir, one_worker_on_ray))
    assert ours["status"] == "completed" and ours["resumed_from_step"] == 4 and ours["workers"] == 1
    assert ours.keys() == rays.keys() and ours["final_val_loss"] == rays["final_val_loss"]
    assert run_files(run_dir) == run_files(one_worker_on_ray)
    assert {"best_checkpoint", "checkpoint_00000004", "checkpoint_00000008"} <= run_files(run_dir)


def test_a_torchrun_of_2_ranks_trains_like_2_ray_workers(tiny_run, pydoc_data, tmp_path):
    """`torchrun --nproc_per_node 2 cli.py train --workers 0`: two ranks over gloo, rank 0 the
    only one that prints and writes the run's files (each rank its checkpoint shard), every
    step's loss the session's 2-worker Ray run's (the first 10 of its 120 steps: the same
    learning rates with its horizon)."""
    _, ray_run = tiny_run
    storage = tmp_path / "runs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "cli.py"), "train", "--workers", "0", "--max-steps", "10", "--set", "horizon=120",
           "--log-every", "10", "--eval-every", "60", "--checkpoint-every", "60", "--data",
           str(pydoc_data), "--storage", str(storage), "--name", "torchrun"]
    env = {**os.environ, "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("torchrun: 2 ranks, Ray Train's local mode on torch.distributed") == 1
    assert r.stdout.count("status                completed") == 1  # rank 0's table only
    run_dir = storage / "torchrun"
    ours, rays = losses_by_step(run_dir), losses_by_step(ray_run)
    assert list(ours) == list(range(1, 11)) and ours == {s: rays[s] for s in ours}
    checkpoint = {p.name for p in (run_dir / "checkpoint_00000010").iterdir()}
    assert {"meta.json", "rank0.json", "rank1.json"} <= checkpoint
