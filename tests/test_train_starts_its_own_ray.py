"""`train` with no cluster to join, as the README's first command runs on a laptop: the driver
starts a Ray for itself, trains on it and stops it. The other tests run on the session's cluster
or on clusters of their own; this one is the cold path, whole, in a process of its own
(conftest's cold_run)."""

import json
import os
from pathlib import Path

import pytest

from conftest import processes_where


def _actor_classes(ray_tmp: Path) -> list[str]:
    """The class of every actor that Ray (with RAY_TMPDIR=ray_tmp) ran: each worker's log
    starts with ':actor_name:<class>'."""
    return [line.split(":actor_name:", 1)[1]
            for log in ray_tmp.glob("ray/session_latest/logs/worker-*.out")
            for line in log.read_text(errors="replace").splitlines()
            if line.startswith(":actor_name:")]


@pytest.mark.own_cluster  # a Ray of its own: after the session cluster is gone, in the Ray tier
def test_train_on_a_ray_of_its_own(cold_run):
    """It trains, its launch line says it runs on a local Ray (`--workers 0` says local mode:
    tests/test_workers_0.py), its one worker runs as many torch threads as the machine has
    cores, as that line says (Ray's default would be one), it starts no actor it does without (no
    autoscaler runs on a Ray the driver started, so Ray Data's autoscaling coordinator, which Ray
    Train starts to ask one for the workers' resources, would only be one more process beside
    the workers), and when it is done nothing of its Ray is left running."""
    r, run_dir, ray_tmp = cold_run.result, cold_run.run_dir, cold_run.ray_tmp
    cores = len(os.sched_getaffinity(0))
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert f"local Ray: 1 worker x {cores} CPU{'s' if cores > 1 else ''} ({cores} torch thread" in r.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [row["threads"] for row in rows] == [cores] * len(rows) and rows
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["cpus_per_worker"] is None  # a resume decides again, wherever it runs
    actors = _actor_classes(ray_tmp)
    assert actors.count("RayTrainWorker") == 1 and "Controller" in actors, actors
    assert "_AutoscalingCoordinatorActor" not in actors, actors
    assert processes_where(lambda entry: str(ray_tmp).encode() in (entry / "cmdline").read_bytes()) == []
