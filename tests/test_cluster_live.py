"""Clusters and jobs with real Ray processes, all on this machine:

- `cluster local-up`, training submitted as a job (our `submit` and plain `ray job submit`) over
  http://127.0.0.1:8265, `jobs`, auth errors, then `cluster local-down` leaves no process behind;
- a multi-node cluster (`ray.cluster_utils.Cluster`: a head with no CPUs, two 1-CPU nodes) with
  dataset, checkpoints, metrics and summary on S3 (moto's server on 127.0.0.1), one rank per
  node, and a resumed run that reads its checkpoint back from S3;
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

import pytest

from conftest import ROOT, run_cli
from s3_server import moto_s3, s3_keys, s3_read
from test_cli_errors import assert_clean_error

from raytrain_lm.cluster.connect import free_port, match_cluster_auth
from raytrain_lm.cluster.local import MARKER_ENV, cluster_processes, local_down, local_temp_dir
from raytrain_lm.data.remote import cache_dir_for

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
    up = run_cli("cluster", "local-up", "--port", str(LOCAL_PORT), "--num-cpus", "3", timeout=180)
    try:
        assert up.returncode == 0, up.stderr
        address = re.search(r"Ray is running at (\S+);", up.stdout).group(1)
        yield {"stdout": up.stdout, "address": address}
    finally:
        if cluster_processes(local_temp_dir(LOCAL_PORT)):  # the test below failed before its down
            local_down(LOCAL_PORT, say=lambda m: None)


@pytest.fixture(scope="module")
def submitted(local_cluster, pydoc_data, tmp_path_factory):
    storage = tmp_path_factory.mktemp("job-runs")
    result = run_cli("submit", "--address", DASHBOARD, "--", *SHORT, "--data", str(pydoc_data),
                     "--storage", str(storage), "--name", "job-run", timeout=300)
    return result, storage


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
    result, storage = submitted
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
    result, _ = submitted
    job_id = re.search(r"submitted job (raysubmit_\w+)", result.stdout).group(1)
    listed = run_cli("jobs", "--address", DASHBOARD)
    assert listed.returncode == 0, listed.stderr
    assert re.search(rf"{job_id}\s+SUCCEEDED\s.*cli\.py train --workers 2", listed.stdout)
    logs = run_cli("jobs", "logs", job_id, "--address", DASHBOARD)
    assert logs.returncode == 0 and "step 20/20" in logs.stdout
    assert_clean_error(run_cli("jobs", "stop", "raysubmit_nope", "--address", DASHBOARD),
                       "no job raysubmit_nope")


def test_plain_ray_job_submit_works_too(submitted, pydoc_data, tmp_path):
    """What the README shows Ray users: `ray job submit --working-dir . -- python cli.py train`."""
    ray_exe = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    result = subprocess.run(
        [ray_exe, "job", "submit", "--address", DASHBOARD, "--working-dir", ".", "--",
         "python", "cli.py", "train", "--workers", "1", "--max-steps", "2", "--log-every", "2",
         "--eval-every", "2", "--checkpoint-every", "2", "--data", str(pydoc_data),
         "--storage", str(tmp_path), "--name", "plain"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout.lower() and "step 2/2" in result.stdout
    assert json.loads((tmp_path / "plain" / "summary.json").read_text())["status"] == "completed"


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


def train_on(address: str, *args, timeout: float = 300):
    result = run_cli("train", "--address", address, "--json", *args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def s3_run(multinode):
    prep = run_cli("prepare", "--out", DATA_URI)
    assert prep.returncode == 0, prep.stderr
    summary = train_on(multinode["cluster"].address, *SHORT, "--eval-every", "10",
                       "--checkpoint-every", "10", "--data", DATA_URI, "--storage", RUNS_URI,
                       "--name", "s3-run")
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
    metrics = [json.loads(x) for x in s3_read(BUCKET, "runs/s3-run/metrics.jsonl").splitlines()]
    assert [m["step"] for m in metrics] == [10, 20]


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
    """Evidence from the GCS's actor table: the run's two Train workers lived on different
    nodes, neither of them the head."""
    with connected(multinode["cluster"].address) as ray:
        actors = ray._private.state.actors().values()
        nodes = [a["Address"]["NodeID"] for a in actors if a["ActorClassName"] == "RayTrainWorker"]
    assert len(nodes) == 2 and set(nodes) == multinode["workers"]
    assert multinode["head"] not in nodes


def test_resumed_run_reads_its_checkpoint_back_from_s3(s3_run, multinode):
    summary = train_on(multinode["cluster"].address, *SHORT, "--max-steps", "30",
                       "--eval-every", "10", "--checkpoint-every", "10", "--data", DATA_URI,
                       "--storage", RUNS_URI, "--name", "s3-run", "--resume")
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["resumed_from_step"] == 20
    metrics = [json.loads(x) for x in s3_read(BUCKET, "runs/s3-run/metrics.jsonl").splitlines()]
    assert [m["step"] for m in metrics] == [10, 20, 30]
    assert "runs/s3-run/checkpoint_00000030/state.pt" in s3_keys(BUCKET, "runs/s3-run/")


def test_without_an_autoscaler_too_few_cpus_fail_at_once(multinode, pydoc_data, tmp_path):
    start = time.monotonic()
    result = run_cli("train", "--address", multinode["cluster"].address, "--workers", "3",
                     "--data", str(pydoc_data), "--storage", str(tmp_path / "runs"))
    assert_clean_error(result, "--workers 3 needs 3 CPUs but the cluster has 2")
    assert time.monotonic() - start < 60


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
        local_down(AUTOSCALE_PORT, say=lambda m: None)
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
