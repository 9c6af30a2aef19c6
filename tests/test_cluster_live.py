"""Clusters and jobs with real Ray processes, all on this machine:

- `cluster local-up`, training submitted as a job (our `submit` and plain `ray job submit`) over
  http://127.0.0.1:8265, `jobs`, auth errors, then `cluster local-down` leaves no process behind;
- a multi-node cluster (`ray.cluster_utils.Cluster`: a head with no CPUs, two 1-CPU nodes) with
  dataset, checkpoints (uploaded asynchronously, a worker killed mid upload), metrics and summary
  on S3 (moto's server on 127.0.0.1), one rank per node, and a resumed run that reads its
  checkpoint back from S3;
- on that same cluster (one start for both): elastic training that grows and shrinks with its
  nodes, a node preempted with notice;
- an autoscaling cluster (Ray's fake multi-node provider): a 2-worker training waits while the
  autoscaler launches the nodes, then completes.

Each starts its own Ray cluster, so these tests run last (conftest: `own_cluster`), after the
session cluster is shut down, and each stops what it started.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from raytrain_lm.cluster.connect import free_port, match_cluster_auth
from raytrain_lm.cluster.local import MARKER_ENV, cluster_processes, local_down, local_temp_dir
from raytrain_lm.data.remote import cache_dir_for
from s3_server import moto_s3, s3_keys, s3_read
from test_cli_errors import assert_clean_error

pytestmark = pytest.mark.own_cluster

LOCAL_PORT, MULTI_PORT, AUTOSCALE_PORT = 6391, 6393, 6394  # not Ray's default 6379
DASHBOARD = "http://127.0.0.1:8265"
SHORT = ["--workers", "2", "--max-steps", "20", "--log-every", "10", "--eval-every", "20",
         "--checkpoint-every", "20"]


@contextlib.contextmanager
def connected(address: str):
    """This test process as a driver of the cluster at `address` (in the cluster's auth mode)."""
    import ray

    saved = os.environ.get("RAY_AUTH_MODE")
    match_cluster_auth(address)
    ray.init(address=address, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def env_without_token(tmp_path) -> dict:
    """A client environment with no Ray token anywhere (a fresh HOME, no RAY_AUTH_* vars)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)
    return env


def run_cli_env(*args, env: dict, timeout: float = 120):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


# ---------------------------------------------------------------- local cluster + jobs




@pytest.fixture(scope="module")
def local_cluster():
    """A `cluster local-up` head started as from a shell with this interpreter's environment
    activated: its folder first on PATH, so a job's plain `python` (test_plain_ray_job_submit_works_too)
    is this one, with the project's packages, even where pytest runs as /path/to/venv/bin/python
    with another `python` first on PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    up = run_cli("cluster", "local-up", "--port", str(LOCAL_PORT), "--num-cpus", "3", timeout=180,
                 env={"PATH": path})
    try:
        assert up.returncode == 0, up.stderr
        address = re.search(r"Ray is running at (\S+);", up.stdout).group(1)
        yield {"stdout": up.stdout, "address": address}
    finally:
        if cluster_processes(local_temp_dir(LOCAL_PORT)):  # the test below failed before its down
            local_down(LOCAL_PORT, say=lambda m: None)


@pytest.fixture(scope="module")
def submitted(local_cluster, pydoc_data, tmp_path_factory):
    """Our `submit` (2 workers) and, at the same time on the same cluster, plain `ray job submit`
    (1 worker: the 3 CPUs hold both): (our result, its storage, the plain one's process and
    storage). Each job spends most of its time starting processes, so together they take little
    more than one."""
    storage, plain_storage = tmp_path_factory.mktemp("job-runs"), tmp_path_factory.mktemp("plain")
    plain = plain_ray_job_submit(pydoc_data, plain_storage)
    try:
        result = run_cli("submit", "--address", DASHBOARD, "--", *SHORT, "--data", str(pydoc_data),
                         "--storage", str(storage), "--name", "job-run", timeout=300)
    except BaseException:
        plain.kill()
        raise
    return result, storage, plain, plain_storage


def plain_ray_job_submit(pydoc_data, storage) -> subprocess.Popen:
    """What the README shows Ray users: `ray job submit --working-dir . -- python cli.py train`."""
    ray_exe = os.path.join(os.path.dirname(sys.executable), "ray")
    with (storage / "stdout").open("w") as out:  # a file: a pipe read only at the end may fill
        return subprocess.Popen(
            [ray_exe, "job", "submit", "--address", DASHBOARD, "--working-dir", ".", "--",
             "python", "cli.py", "train", "--workers", "1", "--max-steps", "2", "--log-every", "2",
             "--eval-every", "2", "--checkpoint-every", "2", "--data", str(pydoc_data),
             "--storage", str(storage), "--name", "plain"],
            cwd=ROOT, env={**os.environ, "RAY_AUTH_MODE": "token"}, stdout=out,
            stderr=subprocess.STDOUT)


def test_the_test_session_starts_its_own_cluster_beside_a_running_one(local_cluster):
    """CI once found a head left running: the session fixture joined it and every Ray test
    errored ("num_cpus ... must not be provided"). With RAY_ADDRESS naming a live head, the
    session cluster is still a fresh one of 4 CPUs."""
    probe = ("import ray, conftest; address = conftest.start_session_ray(); "
             "print(address, int(ray.cluster_resources()['CPU'])); ray.shutdown()")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT / "tests", capture_output=True,
                            text=True, timeout=120,
                            env={**os.environ, "RAY_ADDRESS": local_cluster["address"]})
    assert result.returncode == 0, result.stderr[-2000:]
    address, cpus = result.stdout.split()[-2:]
    assert address != local_cluster["address"] and cpus == "4"


def test_local_up_prints_the_addresses(local_cluster):
    out = local_cluster["stdout"]
    assert f"dashboard and jobs API: {DASHBOARD}" in out and "token auth on" in out
    assert f"python cli.py cluster local-down --port {LOCAL_PORT}" in out
    assert local_cluster["address"] == f"127.0.0.1:{LOCAL_PORT}"


def test_the_local_cluster_listens_on_127_0_0_1_only_and_its_token_is_private(local_cluster):
    """It served three Prometheus metrics endpoints (and its GCS, raylet, agents) on every
    interface; ~/.ray/auth_token, as Ray writes it, was readable by every local user."""
    import stat

    import psutil
    from ray._private.authentication.authentication_token_setup import _get_default_token_path

    pids = {p.pid for p in cluster_processes(local_temp_dir(LOCAL_PORT))}
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids}
    assert len(listening) >= 8  # GCS, raylet, dashboard, agents, metrics: all found
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening
    assert stat.S_IMODE(_get_default_token_path().stat().st_mode) == 0o600


def test_train_joins_the_running_local_cluster(local_cluster, pydoc_data, tmp_path):
    """Without --address or RAY_ADDRESS, `train` uses the cluster `local-up` started (its token
    included) instead of starting a second Ray: --workers 9 is refused for the 3 CPUs that
    cluster has (a Ray of its own would have started with 10 and trained)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = run_cli_env("train", "--workers", "9", "--data", str(pydoc_data), "--storage",
                         str(tmp_path), "--name", "joined", env=env, timeout=240)
    assert_clean_error(result, "--workers 9 needs 9 CPUs but the cluster has 3")
    assert f"using the local Ray cluster at {local_cluster['address']}" in result.stdout
    assert not (tmp_path / "joined").exists()


def test_submitted_training_succeeds_with_logs_and_results(submitted):
    result, storage, *_ = submitted
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    job_id = re.search(r"submitted job (raysubmit_\w+)", out).group(1)
    assert "step 20/20" in out and "val perplexity" in out  # the job's logs came back
    assert f"job {job_id} SUCCEEDED; results: {storage}/job-run/summary.json" in out
    summary = json.loads((storage / "job-run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 20 and summary["workers"] == 2
    assert (storage / "job-run" / "checkpoint_00000020" / "state.pt").is_file()
    assert [json.loads(x)["step"] for x in (storage / "job-run" / "metrics.jsonl").read_text().splitlines()] == [10, 20]


def test_jobs_lists_and_prints_logs(submitted):
    result, *_ = submitted
    job_id = re.search(r"submitted job (raysubmit_\w+)", result.stdout).group(1)
    listed = run_cli("jobs", "--address", DASHBOARD)
    assert listed.returncode == 0, listed.stderr
    assert re.search(rf"{job_id}\s+SUCCEEDED\s.*cli\.py train --workers 2", listed.stdout)
    logs = run_cli("jobs", "logs", job_id, "--address", DASHBOARD)
    assert logs.returncode == 0 and "step 20/20" in logs.stdout
    assert_clean_error(run_cli("jobs", "stop", "raysubmit_nope", "--address", DASHBOARD),
                       "no job raysubmit_nope")


def test_plain_ray_job_submit_works_too(submitted):
    """The README's plain `ray job submit`, run beside our `submit` (the fixture)."""
    *_, plain, storage = submitted
    plain.wait(timeout=300)
    out = (storage / "stdout").read_text()
    assert plain.returncode == 0, out[-3000:]
    assert "succeeded" in out.lower() and "step 2/2" in out
    assert json.loads((storage / "plain" / "summary.json").read_text())["status"] == "completed"


def test_no_token_is_a_clean_error(local_cluster, tmp_path, pydoc_data):
    env = env_without_token(tmp_path)
    assert_clean_error(run_cli_env("jobs", "--address", DASHBOARD, env=env),
                       "has token authentication on and no token was found here")
    result = run_cli_env("train", "--address", local_cluster["address"], "--data", str(pydoc_data),
                         "--storage", str(tmp_path / "runs"), env=env)
    assert_clean_error(result, "has token authentication on and no token was found here")
    assert not (tmp_path / "runs").exists()


def test_local_down_leaves_no_ray_process(local_cluster, submitted):
    assert cluster_processes(local_temp_dir(LOCAL_PORT))
    down = run_cli("cluster", "local-down", "--port", str(LOCAL_PORT), timeout=120)
    assert down.returncode == 0, down.stderr
    assert re.search(r"stopped the local Ray cluster on port \d+ \((\d+) processes\)", down.stdout)
    assert cluster_processes(local_temp_dir(LOCAL_PORT)) == []
    assert_clean_error(run_cli("jobs", "--address", DASHBOARD), "nothing answers at")


# ---------------------------------------------------------------- multi-node + S3


BUCKET = "rtl-cluster"
DATA_URI, RUNS_URI = f"s3://{BUCKET}/data/pydoc", f"s3://{BUCKET}/runs"


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    """Head with 0 CPUs and two 1-CPU worker nodes, all seeing the S3 server's environment."""
    from ray.cluster_utils import Cluster

    cache = tmp_path_factory.mktemp("dataset-cache")
    with moto_s3(BUCKET) as env, pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYTRAIN_LM_CACHE", str(cache))  # before the nodes start: they inherit it
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=0, gcs_server_port=MULTI_PORT, include_dashboard=False,
            dashboard_agent_listen_port=free_port()))
        try:
            workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
            cluster.wait_for_nodes()
            yield {"cluster": cluster, "workers": {n.node_id for n in workers},
                   "head": cluster.head_node.node_id, "env": env, "cache": cache}
        finally:
            cluster.shutdown()


def train_on(address: str, *args, timeout: float = 300, env: dict | None = None):
    result = run_cli("train", "--address", address, "--json", *args, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


# Checkpoints every 5 steps, uploaded asynchronously; one failure allowed for the drill.
S3_RUN = ["--workers", "2", "--log-every", "5", "--eval-every", "10", "--checkpoint-every", "5",
          "--checkpoint-upload", "async", "--max-failures", "1", "--data", DATA_URI,
          "--storage", RUNS_URI, "--name", "s3-run"]


@pytest.fixture(scope="module")
def s3_run(multinode):
    """20 steps on the dataset on S3, into S3, one rank per node; rank 1 dies while it uploads
    checkpoint 10 in the background (before its commit record); every rank holds the upload of
    checkpoint 15 until training has reported step 20 (the hold drill: a sync upload, inside the
    report, would fail its rank)."""
    prep = run_cli("prepare", "--out", DATA_URI)
    assert prep.returncode == 0, prep.stderr
    summary = train_on(multinode["cluster"].address, *S3_RUN, "--max-steps", "20",
                       env={"RAYTRAIN_LM_FAIL_AT": "1:10:upload", "RAYTRAIN_LM_HOLD_AT": "15:upload"})
    return summary


def test_checkpoints_metrics_summary_land_in_s3(s3_run):
    keys = s3_keys(BUCKET, "runs/s3-run/")
    for rel in ("summary.json", "metrics.jsonl", "checkpoint_00000020/state.pt",
                "checkpoint_00000020/meta.json", "checkpoint_00000020/rng-rank0.pt",
                "checkpoint_00000020/rng-rank1.pt"):
        assert f"runs/s3-run/{rel}" in keys, rel
    summary = json.loads(s3_read(BUCKET, "runs/s3-run/summary.json"))
    assert summary["status"] == "completed" and summary["steps"] == 20
    assert summary["checkpoint"] == f"{RUNS_URI}/s3-run/checkpoint_00000020"
    steps = [json.loads(x)["step"] for x in s3_read(BUCKET, "runs/s3-run/metrics.jsonl").splitlines()]
    assert sorted(set(steps)) == [5, 10, 15, 20] and steps[-3:] == [10, 15, 20]  # 10 on: after the restart


def test_async_uploads_to_s3_survive_a_worker_killed_mid_upload(s3_run):
    """Checkpoint 10 is incomplete (its upload was cut), so the run resumes from 5, and completes:
    with checkpoint 15's upload held until training reported step 20, so the uploads overlap
    training. Each row after a checkpoint of its worker group says what that checkpoint stood
    training still for."""
    from raytrain_lm.store.runs import checkpoint_folders, latest_checkpoint
    from raytrain_lm.store.storage import RunFolder

    assert s3_run["status"] == "completed" and s3_run["steps"] == 20
    assert s3_run["restarts"] == 1 and s3_run["resumed_from_step"] == 5
    run = RunFolder(RUNS_URI, "s3-run")
    kept = [step for step, _ in checkpoint_folders(run.fs, run.path)]
    # The newest two are complete (the torn 10 was skipped: resumed from 5). Ray keeps the last
    # two it registered, but after this restart it once left 5 as well: not asserted.
    assert kept[-2:] == [15, 20]
    assert latest_checkpoint(run.fs, run.path).step == 20
    # the resumed group checkpointed at 10 and 15 (every 5 steps from 5): its rows 15 and 20
    rows = {r["step"]: r for r in run.read_jsonl("metrics.jsonl")}
    every = int(S3_RUN[S3_RUN.index("--checkpoint-every") + 1])
    after = [step for step in rows if step > s3_run["resumed_from_step"] + every]
    assert after == [15, 20] and all(rows[step]["checkpoint_wait_s"] >= 0 for step in after)


def test_the_dataset_on_s3_trained_from_a_verified_local_cache(s3_run, multinode):
    local = cache_dir_for(DATA_URI)
    assert str(local).startswith(str(multinode["cache"]))
    manifest = json.loads((local / "manifest.json").read_text())
    assert manifest["source"] == "pydoc"
    assert json.loads(s3_read(BUCKET, "runs/s3-run/summary.json"))["config"]["data"] == DATA_URI
    # It learned those shards' token distribution: 20 steps take the validation loss from
    # uniform guessing (ln V) most of the way to the shards' unigram entropy (~3.25 nats).
    uniform, unigram = math.log(manifest["vocab_size"]), unigram_entropy(local, "val")
    assert s3_run["final_val_loss"] < (uniform + unigram) / 2


def unigram_entropy(data_dir, split: str) -> float:
    import numpy as np
    import pyarrow as pa

    manifest = json.loads((data_dir / "manifest.json").read_text())
    counts = sum(np.bincount(pa.ipc.open_file(pa.memory_map(str(data_dir / s["file"]))).get_batch(0)
                             .column(0).to_numpy(), minlength=manifest["vocab_size"])
                 for s in manifest[split]["shards"])
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_one_rank_on_each_worker_node(s3_run, multinode):
    """Evidence from the GCS's actor table: each group of the run's two Train workers (the first
    and the one after the restart) lived on different nodes, neither of them the head."""
    from collections import Counter

    with connected(multinode["cluster"].address) as ray:
        actors = ray._private.state.actors().values()
        nodes = [a["Address"]["NodeID"] for a in actors if a["ActorClassName"] == "RayTrainWorker"]
    groups = s3_run["restarts"] + 1
    assert set(nodes) == multinode["workers"] and sorted(Counter(nodes).values()) == [groups, groups]
    assert multinode["head"] not in nodes


def test_resumed_run_reads_its_checkpoint_back_from_s3(s3_run, multinode):
    summary = train_on(multinode["cluster"].address, *S3_RUN, "--max-steps", "30", "--resume")
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["resumed_from_step"] == 20
    steps = [json.loads(x)["step"] for x in s3_read(BUCKET, "runs/s3-run/metrics.jsonl").splitlines()]
    assert steps[-5:] == [10, 15, 20, 25, 30]
    assert "runs/s3-run/checkpoint_00000030/state.pt" in s3_keys(BUCKET, "runs/s3-run/")


def test_without_an_autoscaler_too_few_cpus_fail_at_once(multinode, pydoc_data, tmp_path):
    start = time.monotonic()
    result = run_cli("train", "--address", multinode["cluster"].address, "--workers", "3",
                     "--data", str(pydoc_data), "--storage", str(tmp_path / "runs"))
    assert_clean_error(result, "--workers 3 needs 3 CPUs but the cluster has 2")
    assert time.monotonic() - start < 60


# ---------------------------------------------------------------- elastic and preemption, same cluster
# On the multi-node cluster above (its S3 server too), once its own tests are done with it:
#
# - `--workers 1-3` starts on the two nodes present, grows to three when a node is added, shrinks
#   to two when a node is removed, and completes; the window log shows every window of every epoch
#   used exactly once across both resizes, and every step took the same global batch;
# - a node drained for preemption (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`): a
#   checkpoint of the current step lands before the deadline, the run resumes from that step on
#   the remaining node, and `--max-failures 0` did not end it;

MODEL = ["--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=2",
         "--batch-size", "8", "--seq-len", "64", "--set", "warmup_steps=5"]


@pytest.fixture(scope="module")
def cluster(multinode):
    """The multi-node cluster, for the tests that add, remove and drain its nodes."""
    return multinode["cluster"]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """~30 KB of text: ~430 training windows of 64 tokens, an epoch every ~18 steps of 24."""
    from pydoc_data.topics import topics

    from raytrain_lm.data.prepare import prepare_dataset

    folder = tmp_path_factory.mktemp("small-data")
    text = "\n\n".join(topics[k] for k in sorted(topics))[:30_000]
    (folder / "corpus.txt").write_text(text)
    prepare_dataset(str(folder / "corpus.txt"), folder / "data")
    return folder / "data"


def worker_nodes(cluster) -> list:
    return sorted(cluster.worker_nodes, key=lambda node: node.node_id)


def ensure_worker_nodes(cluster, n: int) -> None:
    """`n` live worker nodes; a drained node's raylet exits by itself once idle: forget it."""
    for node in [x for x in cluster.worker_nodes if not x.remaining_processes_alive()]:
        cluster.remove_node(node)
    while len(cluster.worker_nodes) < n:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()


def start_train(cluster, name: str, storage, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), "train", "--address", cluster.address, "--name", name,
         "--storage", str(storage), "--json", *MODEL, *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})})


def rows_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def controller_decisions() -> str:
    """What Ray's controller decided and the errors it met (its log, newest run), to say why a
    run ended: the driver's stderr holds only the last line."""
    logs = sorted(Path("/tmp/ray/session_latest/logs/train").glob("ray-train-app-controller-*.log"),
                  key=lambda p: p.stat().st_mtime)
    lines = []
    for line in logs[-1].read_text().splitlines() if logs else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("levelname") in ("WARNING", "ERROR") or "[FailurePolicy]" in r.get("message", ""):
            tail = (r.get("exc_text") or "").strip().splitlines()[-1:]
            lines.append(f"{r['asctime']} {r['message'].splitlines()[0][:200]} {tail}")
    return "\n".join(lines[-20:])


def wait_for(proc: subprocess.Popen, run_dir: Path, what, timeout: float = 180) -> dict:
    """The first metrics row for which `what(row)` holds; fails if the run ends or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = next((r for r in rows_of(run_dir) if what(r)), None)
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"the run ended first: {proc.stderr.read()[-3000:]}\n"
                        f"controller:\n{controller_decisions()}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"timed out; rows: {[(r['step'], r.get('workers')) for r in rows_of(run_dir)]}\n"
                f"controller:\n{controller_decisions()}")


def actor_nodes(address: str) -> dict[str, set[str]]:
    """The nodes each class of live actor of the cluster at `address` runs on."""
    out: dict[str, set[str]] = {}
    with connected(address) as ray:
        for a in ray._private.state.actors().values():
            if a["State"] == "ALIVE":
                out.setdefault(a["ActorClassName"], set()).add(a["Address"]["NodeID"])
    return out


def finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out)


ELASTIC_STEPS = 60


@pytest.fixture(scope="module")
def elastic_run(cluster, small_data, tmp_path_factory):
    """`--workers 1-3` on two nodes; a node added once it trains, one removed once it grew.

    Held (the hold drill) where each change must find it, not raced: before step 21 (after
    checkpoint 20) until the group of 3 that the added node makes is there, before step 41 until
    the group of 2 that the lost node leaves is there. One failure allowed, for the one node lost
    (docs/checkpoints.md: one per node)."""
    storage = tmp_path_factory.mktemp("elastic")
    run_dir = storage / "elastic"
    ensure_worker_nodes(cluster, 2)
    proc = start_train(cluster, "elastic", storage, "--workers", "1-3", "--data", str(small_data),
                       "--max-steps", str(ELASTIC_STEPS), "--log-every", "5", "--eval-every", "10000",
                       "--checkpoint-every", "10", "--max-failures", "1", "--resize-interval", "1",
                       env={"RAYTRAIN_LM_LOG_WINDOWS": "1", "RAYTRAIN_LM_HOLD_AT": "21,41"})
    try:
        held(proc, run_dir, 21, world=2)
        helpers = actor_nodes(cluster.address)
        cluster.add_node(num_cpus=1)
        held(proc, run_dir, 21, world=3)
        (run_dir / "hold-21.release").touch()
        held(proc, run_dir, 41, world=3)
        cluster.remove_node(worker_nodes(cluster)[0])  # its raylet and worker processes die
        held(proc, run_dir, 41, world=2)
        (run_dir / "hold-41.release").touch()
        return finish(proc), run_dir, helpers
    finally:
        proc.kill()


def test_the_runs_own_actors_live_on_the_drivers_node(cluster, elastic_run):
    """The driver runs on the head: its controller (which holds the rows until the driver takes
    them) stays there, so a worker node's loss costs a restart, never the run (a metrics queue
    once sat on the removed node and the run ended; the run has none now: test_train.py)."""
    helpers = elastic_run[2]
    assert helpers["Controller"] == {cluster.head_node.node_id}


def test_the_run_grows_and_shrinks_with_the_cluster_and_completes(elastic_run):
    summary, run_dir, _ = elastic_run
    assert summary["status"] == "completed" and summary["steps"] == ELASTIC_STEPS
    assert summary["workers"] == "1-3"
    grew, shrank = summary["resizes"]
    assert (grew["from"], grew["to"], grew["why"]) == (2, 3, "the cluster grew")
    assert (shrank["from"], shrank["to"]) == (3, 2) and shrank["why"].startswith("worker failure")
    assert (grew["step"], shrank["step"]) == (20, 40) and summary["restarts"] >= 2
    # Each group resumed from a checkpoint: it reports the step it started from.
    rows = rows_of(run_dir)
    sizes = [r["workers"] for r in rows]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2
    assert all(r["tokens"] == r["step"] * 24 * 64 for r in rows)  # the same batch at every size


def test_every_window_of_every_epoch_was_used_exactly_once_across_the_resizes(elastic_run, small_data):
    from raytrain_lm.data.sampler import epoch_order
    from raytrain_lm.data.windows import TokenWindows
    from raytrain_lm.worker.drills import read_window_log

    summary, run_dir, _ = elastic_run
    kept = read_window_log(run_dir)
    n, batch = len(TokenWindows(small_data, "train", 64)), 24
    per_epoch = n // batch
    # The steps the run kept are its max_steps consecutive positions of the global order ...
    expected = [(s // per_epoch, (s % per_epoch) * batch) for s in range(ELASTIC_STEPS)]
    assert sorted(kept) == expected
    assert {kept[p]["world"] for p in kept} == {2, 3}
    # ... and each read exactly the windows of its place in the epoch's permutation.
    seed = json.loads((run_dir / "config.json").read_text())["seed"]
    for epoch in range(ELASTIC_STEPS // per_epoch):
        order = epoch_order(n, seed, epoch).tolist()
        used = [w for start in range(0, per_epoch * batch, batch) for w in kept[(epoch, start)]["windows"]]
        assert sorted(used) == sorted(order[:per_epoch * batch])  # every window once, none twice
        assert len(set(used)) == per_epoch * batch and n - len(used) < batch  # the rest: < a batch


def drain(cluster, node_id: str, seconds: int) -> float:
    """Mark a node as being preempted, as a cloud's spot notice does; returns the deadline."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    deadline = time.time() + seconds
    r = subprocess.run([ray_cli, "drain-node", "--address", cluster.address, "--node-id", node_id,
                        "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
                        "--deadline-remaining-seconds", str(seconds)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return deadline


def held(proc: subprocess.Popen, run_dir: Path, step: int, world: int, timeout: float = 180) -> None:
    """Wait until a worker group of `world` workers is held before `step` (the hold drill)."""
    marker, limit = run_dir / f"hold-{step}.waiting", time.monotonic() + timeout
    while not (marker.exists() and json.loads(marker.read_text())["world"] == world):
        if proc.poll() is not None or time.monotonic() > limit:
            proc.kill()
            pytest.fail(f"no group of {world} held before step {step}: {proc.stderr.read()[-3000:]}\n"
                        f"controller:\n{controller_decisions()}")
        time.sleep(0.2)


SPOT_STEPS = 30
SPOT_NOTICE_S = 10  # the drained node's deadline: the checkpoint must land before it


def test_a_preempted_node_checkpoints_before_its_deadline_and_the_run_resumes_there(
        cluster, small_data, tmp_path):
    ensure_worker_nodes(cluster, 2)
    run_dir = tmp_path / "spot"
    # Held (the hold drill) where the test wants the run, not raced: the group of 2 before step 5
    # until Ray tells it of the preemption (it asks at every step up to step 11, so the notice is
    # taken at step 5), then before step 6 until released, so that it still runs at the deadline
    # (a run that ends first is never resized) and the group of 1 that follows is seen to start.
    # No checkpoint but the final one, so the only one to resume from is the preemption's.
    proc = start_train(cluster, "spot", tmp_path, "--workers", "1-2", "--data", str(small_data),
                       "--max-steps", str(SPOT_STEPS), "--log-every", "5", "--eval-every", "10000",
                       "--checkpoint-every", "0", "--max-failures", "0", "--resize-interval", "1",
                       env={"RAYTRAIN_LM_HOLD_AT": "5:preemption,6"})
    node = worker_nodes(cluster)[-1]
    try:
        held(proc, run_dir, 5, world=2)
        deadline = drain(cluster, node.node_id, SPOT_NOTICE_S)
        # The drained node lingers (nothing reclaims it here): the group must not grow back
        # onto it (it did, and timed out starting there, again and again: scaling.py).
        held(proc, run_dir, 6, world=1)
        (run_dir / "hold-6.release").touch()
        notice = wait_for(proc, run_dir, lambda r: r.get("preemption"))
        resumed = wait_for(proc, run_dir, lambda r: r.get("workers") == 1)
        summary = finish(proc)
    finally:
        proc.kill()
        cluster.remove_node(node)  # what the cloud does at the deadline

    saved = run_dir / f"checkpoint_{notice['step']:08d}"
    assert notice["step"] == 5
    assert notice["checkpoint"] == str(saved) and notice["preemption"]["seconds_left"] > 0
    assert (saved / "meta.json").stat().st_mtime < deadline  # landed before the node's deadline
    assert resumed["resumed_from_step"] == notice["step"]  # from that step, not an older one
    assert summary["status"] == "completed" and summary["steps"] == SPOT_STEPS  # --max-failures 0
    assert summary["resizes"] == [{"step": notice["step"], "from": 2, "to": 1,
                                   "why": "preemption of 1 node"}]


# ---------------------------------------------------------------- autoscaling


def fake_autoscaling_config(gcs_address: str) -> dict:
    """Ray's fake multi-node provider: 'nodes' are raylets the autoscaler starts on this machine."""
    return {
        "cluster_name": "raytrain-lm-fake", "max_workers": 2, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs_address},
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {}, "node_config": {}, "max_workers": 0},
            "cpu_worker": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0,
                           "max_workers": 2},
        },
        "head_node_type": "ray.head.default",
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


@pytest.fixture(scope="module")
def autoscaling_head(tmp_path_factory):
    from ray._private.services import get_node_ip_address

    address = f"{get_node_ip_address()}:{AUTOSCALE_PORT}"
    config = tmp_path_factory.mktemp("autoscaler") / "fake.yaml"
    config.write_text(json.dumps(fake_autoscaling_config(address)))
    temp_dir = local_temp_dir(AUTOSCALE_PORT)  # so that local_down finds every process of it
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           MARKER_ENV: str(temp_dir)}
    start = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
         f"--port={AUTOSCALE_PORT}", "--num-cpus=0", "--include-dashboard=false",
         f"--dashboard-agent-listen-port={free_port()}",
         f"--temp-dir={temp_dir}", f"--autoscaling-config={config}", "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, start.stderr[-3000:]
        yield address
    finally:
        local_down(AUTOSCALE_PORT, say=lambda m: None)  # if the test below did not
        assert cluster_processes(temp_dir) == []


def test_autoscaler_launches_nodes_for_training(autoscaling_head, pydoc_data, tmp_path):
    result = run_cli("train", "--address", autoscaling_head, "--workers", "2", "--max-steps", "10",
                     "--log-every", "5", "--eval-every", "10", "--checkpoint-every", "10",
                     "--data", str(pydoc_data), "--storage", str(tmp_path), "--name", "scaled",
                     "--scale-timeout", "180", timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "waiting for the autoscaler to add nodes: training needs 2 CPU, the cluster has 0 CPU" \
        in result.stdout
    assert re.search(r"the cluster is ready after \d+ s: 2 CPU", result.stdout)
    summary = json.loads((tmp_path / "scaled" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 10

    with connected(autoscaling_head) as ray:
        alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 3  # the head and the two nodes the autoscaler launched
    assert sorted(n["Resources"].get("CPU", 0) for n in alive) == [0, 1, 1]


def test_local_down_stops_every_process_at_its_sigterm(autoscaling_head):
    """In Ray's own order: the raylet first, the GCS last. Stopped with the GCS, the autoscaler's
    monitor waits on it at SIGTERM (it reports its own end there) until the grace runs out and
    it is killed, so a stop took the whole grace."""
    temp_dir = local_temp_dir(AUTOSCALE_PORT)
    assert cluster_processes(temp_dir)
    started = time.monotonic()
    local_down(AUTOSCALE_PORT, grace=60, say=lambda m: None)
    assert cluster_processes(temp_dir) == []
    assert time.monotonic() - started < 30  # none waited out the grace
