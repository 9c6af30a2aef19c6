"""`train --workers 0`: Ray Train's local mode, in the process the user started (no Ray cluster),
alone and under torchrun: the same loop, the same files and results as `--workers N` on Ray, loss
for loss. The Ray runs they are compared with are the suite's own (conftest's cold_run and
tiny_run), not runs of their own."""

import json
import os
import subprocess
import sys

import pytest

from conftest import COLD_FLAGS, ROOT, TINY_STEPS, run_cli

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


@pytest.mark.own_cluster  # its reference is the cold run, on a Ray of its own (run last)
def test_workers_0_trains_checkpoints_resumes_and_reports_like_workers_1(cold_run, pydoc_data,
                                                                         tmp_path, monkeypatch):
    """In a process of its own with no Ray running, with the cold run's flags and, like it, no
    thread count set: the launch line says so; a run killed after step 3 (the fault drill)
    resumes from its checkpoint of step 2; every step's loss equals the cold `--workers 1` Ray
    run's bit for bit, the run's folder and summary hold what Ray's do, and its config.json
    leaves the threads to the launch that resumes it, as Ray's does."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    storage = tmp_path / "runs"
    flags = ["--workers", "0", *COLD_FLAGS, "--data", str(pydoc_data), "--storage", str(storage),
             "--name", "here"]
    killed = run_cli("train", *flags, env={"RAY_ADDRESS": "", "RAYTRAIN_LM_FAIL_AT": "0:3"}, timeout=240)
    assert killed.returncode == 1, killed.stderr[-2000:]
    assert killed.stdout.splitlines()[0].startswith(
        f"local mode: training in this process, no Ray cluster (Ray Train's local mode; {cores} torch "
        f"thread{'s' if cores > 1 else ''}: this machine's {cores} cores)")
    assert "[fault drill] rank 0 exiting at step 3" in killed.stdout
    run_dir = storage / "here"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"
    assert json.loads((run_dir / "config.json").read_text())["cpus_per_worker"] is None

    done = run_cli("train", "--workers", "0", "--resume", "--name", "here", "--storage", str(storage),
                   env={"RAY_ADDRESS": ""}, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming here from its newest checkpoint, step 2" in done.stdout
    assert losses_by_step(run_dir) == losses_by_step(cold_run.run_dir)
    assert set(losses_by_step(run_dir)) == set(range(1, 5))
    ours, rays = (json.loads((d / "summary.json").read_text()) for d in (run_dir, cold_run.run_dir))
    assert ours["status"] == "completed" and ours["resumed_from_step"] == 2 and ours["workers"] == 1
    assert ours.keys() == rays.keys() and ours["final_val_loss"] == rays["final_val_loss"]
    assert run_files(run_dir) == run_files(cold_run.run_dir)
    assert {"best_checkpoint", "checkpoint_00000004"} <= run_files(run_dir)


def test_a_torchrun_of_2_ranks_trains_like_2_ray_workers(tiny_run, pydoc_data, tmp_path):
    """`torchrun --nproc_per_node 2 cli.py train --workers 0`: two ranks over gloo, rank 0 the
    only one that prints and writes the run's files (each rank its checkpoint shard), nothing
    on stderr but torchrun's own lines, every step's loss the session's 2-worker Ray run's (the
    first 4 of its steps: the same learning rates with its horizon)."""
    _, ray_run = tiny_run
    storage = tmp_path / "runs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "cli.py"), "train", "--workers", "0", "--max-steps", "4", "--set",
           f"horizon={TINY_STEPS}", "--log-every", "2", "--eval-every", "60", "--checkpoint-every", "60",
           "--set", "eval_windows=8", "--data", str(pydoc_data), "--storage", str(storage), "--name",
           "torchrun"]
    env = {**os.environ, "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("torchrun: 2 ranks, Ray Train's local mode on torch.distributed") == 1
    assert r.stdout.count("status                completed") == 1  # rank 0's table only
    assert "Warning" not in r.stderr, r.stderr[-3000:]
    run_dir = storage / "torchrun"
    ours, rays = losses_by_step(run_dir), losses_by_step(ray_run)
    assert list(ours) == list(range(1, 5)) and ours == {s: rays[s] for s in ours}
    checkpoint = {p.name for p in (run_dir / "checkpoint_00000004").iterdir()}
    assert {"meta.json", "rank0.json", "rank1.json"} <= checkpoint


def test_local_mode_keeps_the_newest_checkpoints_counting_a_resumed_runs(tmp_path):
    """Local mode's retention (what Ray's checkpoint manager does on Ray): with keep 2, a resumed
    run whose folder holds the checkpoints of steps 2 and 4 deletes step 2's when it registers
    step 6; a checkpoint made again at the same path (step 6 after a resume from 4) is one entry,
    not two; keep None keeps all."""
    import pyarrow.fs as pafs

    from raytrain_lm.ray_compat.local_controller import Retention

    fs = pafs.LocalFileSystem()
    for step in (2, 4):
        (tmp_path / f"checkpoint_{step:08d}").mkdir()
    kept = Retention(fs, str(tmp_path), keep=2)
    (tmp_path / "checkpoint_00000006").mkdir()
    kept.register(str(tmp_path / "checkpoint_00000006"))
    kept.register(str(tmp_path / "checkpoint_00000006") + "/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_00000004", "checkpoint_00000006"]
    everything = Retention(fs, str(tmp_path), keep=None)
    (tmp_path / "checkpoint_00000008").mkdir()
    everything.register(str(tmp_path / "checkpoint_00000008"))
    assert len(list(tmp_path.iterdir())) == 3
