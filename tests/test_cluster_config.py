"""cluster.yaml against Ray's own launcher validation, and the bad inputs of `cluster` / `submit`
/ `jobs` that need no running cluster."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_cli
from test_cli_errors import assert_clean_error

from raytrain_lm.cluster.jobs import job_train_args
from raytrain_lm.cluster.launcher import load_cluster_config
from raytrain_lm.cluster.local import cluster_processes, local_temp_dir
from raytrain_lm.errors import UserError


@pytest.fixture(scope="module")
def filled():
    """cluster.yaml after the launcher's schema check and fill-out of defaults (no cloud calls)."""
    return load_cluster_config(ROOT / "cluster.yaml")


def test_cluster_yaml_passes_ray_launcher_validation(filled):
    from ray.autoscaler._private.util import validate_config

    validate_config(filled)  # again, explicitly: raises on any schema violation
    assert filled["provider"]["type"] == "aws"
    # the fill-out merged the AWS defaults in (keys cluster.yaml leaves out) and set per-type limits
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert {"docker", "rsync_filter"} <= set(filled) - set(raw)
    assert "max_workers" not in raw["available_node_types"]["gpu_worker"]


def test_head_schedules_no_training_and_gpu_workers_autoscale(filled):
    types = filled["available_node_types"]
    head = types[filled["head_node_type"]]
    assert head["resources"] == {"CPU": 0} and head["max_workers"] == 0
    workers = [t for name, t in types.items() if name != filled["head_node_type"]]
    assert len(workers) == 1
    gpu = workers[0]
    assert gpu["min_workers"] == 0 and gpu["max_workers"] == filled["max_workers"] >= 1
    assert gpu["resources"]["GPU"] >= 1
    assert 0 < filled["idle_timeout_minutes"] <= 30


def test_project_synced_requirements_installed_storage_shared(filled):
    assert filled["file_mounts"]["~/raytrain-lm"] == "."
    assert {"runs", "data", ".git"} <= set(filled["rsync_exclude"])
    setup = "\n".join(filled["setup_commands"])
    assert "cd ~/raytrain-lm && ~/.local/bin/uv pip install --python ~/venv/bin/python -r requirements.txt" in setup
    assert "RAYTRAIN_LM_STORAGE=s3://" in setup


def test_token_auth_on_and_dashboard_only_on_localhost(filled):
    assert filled["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    head = " ".join(filled["head_start_ray_commands"])
    worker = " ".join(filled["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token ray start --head" in head
    assert "RAY_AUTH_MODE=token ray start --address" in worker
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head


def _statements(policy_file: str) -> list[dict]:
    statements = json.loads((ROOT / "docs" / "aws" / policy_file).read_text())["Statement"]
    for s in statements:  # one shape for every statement: lists of actions and resources
        s["Action"] = [s["Action"]] if isinstance(s["Action"], str) else s["Action"]
        s["Resource"] = [s["Resource"]] if isinstance(s.get("Resource"), str) else s.get("Resource", [])
    return statements


def test_gpu_workers_get_a_least_privilege_role_and_the_head_keeps_rays(filled):
    """Training code runs on the workers: their role may touch only the project's S3 prefixes.
    The head keeps Ray's default role (the launcher's EC2 rights), which Ray gives it only when
    its node type names none (ray/autoscaler/_private/aws/config.py: _configure_iam_role)."""
    from ray.autoscaler._private.aws.config import DEFAULT_RAY_INSTANCE_PROFILE

    types = filled["available_node_types"]
    assert "IamInstanceProfile" not in types[filled["head_node_type"]]["node_config"]
    profile = types["gpu_worker"]["node_config"]["IamInstanceProfile"]
    assert profile == {"Name": "raytrain-lm-worker"} and profile["Name"] != DEFAULT_RAY_INSTANCE_PROFILE

    setup = "\n".join(filled["setup_commands"])
    bucket, runs = re.search(r"RAYTRAIN_LM_STORAGE=s3://([^/]+)/(\S+?)'", setup).groups()
    datasets = set(re.findall(rf"s3://{bucket}/(\S+?)/", (ROOT / "README.md").read_text())) - {"raytrain-lm"}
    assert runs.startswith("raytrain-lm/") and datasets == {"data"}
    allowed = {"raytrain-lm": {"s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                               "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"},
               "data": {"s3:GetObject"}}
    for s in _statements("worker-policy.json"):
        assert s["Effect"] == "Allow" and all(a.startswith("s3:") and "*" not in a for a in s["Action"])
        if s["Resource"] == [f"arn:aws:s3:::{bucket}"]:  # listing, only under the two prefixes
            assert s["Action"] == ["s3:ListBucket"]
            assert {p.split("/")[0] for p in s["Condition"]["StringLike"]["s3:prefix"]} == set(allowed)
            continue
        for resource in s["Resource"]:
            prefix = re.fullmatch(rf"arn:aws:s3:::{bucket}/([^/*]+)/\*", resource).group(1)
            assert set(s["Action"]) <= allowed[prefix], (prefix, s["Action"])
    trust = _statements("worker-trust-policy.json")
    assert [(s["Principal"], s["Action"]) for s in trust] == [({"Service": "ec2.amazonaws.com"}, ["sts:AssumeRole"])]
    passing = _statements("head-pass-worker-role.json")
    assert [(s["Action"], s["Resource"]) for s in passing] == \
        [(["iam:PassRole"], ["arn:aws:iam::YOUR-ACCOUNT-ID:role/raytrain-lm-worker"])]


def test_a_broken_config_is_refused_with_the_schema_error(tmp_path):
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["available_node_types"]["gpu_worker"]["min_workers"] = "two"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(UserError, match="available_node_types/gpu_worker/min_workers: 'two' is not of type 'integer'"):
        load_cluster_config(bad)


@pytest.mark.parametrize("text,expected", [
    (None, "cluster config not found: missing.yaml"),
    ("provider: {type: aws\n", "is not valid YAML"),
    ("- just\n- a list\n", "is not a Ray cluster config"),
    ("provider: {type: aws, region: us-west-2}\nmax_workers: -1\n", "max_workers: -1 is less than the minimum of 0"),
])
def test_cluster_up_with_missing_or_invalid_yaml(tmp_path, text, expected):
    path = Path("missing.yaml")
    if text is not None:
        path = tmp_path / "cluster.yaml"
        path.write_text(text)
    result = run_cli("cluster", "up", str(path), "--yes", cwd=tmp_path)
    assert_clean_error(result, expected)


def test_submit_without_training_args():
    assert_clean_error(run_cli("submit"), "submit needs the training arguments after `--`")
    assert_clean_error(run_cli("submit", "--"), "submit needs the training arguments after `--`")


@pytest.mark.parametrize("args", [
    ["submit", "--address", "http://127.0.0.1:9", "--", "--workers", "2"],
    ["jobs", "--address", "http://127.0.0.1:9"],
    ["jobs", "logs", "raysubmit_x", "--address", "127.0.0.1:9"],
])
def test_unreachable_jobs_address(args):
    assert_clean_error(run_cli(*args), "nothing answers at http://127.0.0.1:9")


def test_unreachable_train_address(tmp_path, pydoc_data):
    result = run_cli("train", "--address", "127.0.0.1:9", "--data", str(pydoc_data),
                     "--storage", str(tmp_path / "runs"))
    assert_clean_error(result, "no Ray cluster answers at 127.0.0.1:9")
    assert not (tmp_path / "runs").exists()


def test_bad_jobs_address_and_scale_timeout():
    assert_clean_error(run_cli("jobs", "--address", "ftp://host:21"), "--address must be the dashboard's")
    assert_clean_error(run_cli("train", "--scale-timeout", "-5"), "--scale-timeout must be >= 0")


def test_job_arguments_make_local_paths_absolute(tmp_path, monkeypatch):
    """What the job's `train` parses from the arguments `submit` sends."""
    from raytrain_lm.cli.train import parse_train_args, train_paths

    monkeypatch.delenv("RAYTRAIN_LM_STORAGE", raising=False)

    def job(args, address="http://127.0.0.1:8265"):
        sent = job_train_args(args, train_paths(args), address, tmp_path)
        return sent, parse_train_args(sent)

    sent, seen = job(["train", "--workers", "2", "--data=data/x", "--storage", "out"])
    assert sent[:4] == ["--workers", "2", "--data=data/x", "--storage"]  # as given, then the fixes
    assert (seen["workers"], seen["data"], seen["storage"]) == (2, f"{tmp_path}/data/x", f"{tmp_path}/out")
    assert job(["--workers", "2"], "127.0.0.1:8265")[1]["storage"] == f"{tmp_path}/runs"
    # a config file's relative paths become flags too (flags win over the file)
    (tmp_path / "run.yaml").write_text("data: data/y\nstorage: out2\nlr: 0.001\n")
    _, seen = job(["--config", "run.yaml", "--data", "/abs/d"], "127.0.0.1:8265")
    assert (str(seen["config"]), seen["data"], seen["storage"]) == \
        (f"{tmp_path}/run.yaml", "/abs/d", f"{tmp_path}/out2")
    # a remote cluster gets the arguments as given (its storage must be shared anyway)
    assert job(["--workers", "2", "--data", "data/x"], "http://10.1.2.3:8265")[0] == \
        ["--workers", "2", "--data", "data/x"]


def test_local_up_refuses_a_busy_or_bad_port():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert_clean_error(run_cli("cluster", "local-up", "--port", str(port)),
                           f"port {port} is already in use")
    assert_clean_error(run_cli("cluster", "local-up", "--port", "80"), "--port must be between 1024")


def test_local_down_without_a_cluster_says_so():
    result = run_cli("cluster", "local-down", "--port", "6399")
    assert result.returncode == 0 and "no local Ray cluster was running on port 6399" in result.stdout


def test_local_down_finds_only_the_processes_of_its_own_temp_dir():
    """Real processes whose command lines name the cluster's temp dir (as Ray's do) are its own;
    one of the cluster on port 63790 is not the cluster on port 6379's."""
    mine, other = local_temp_dir(6379), local_temp_dir(63790)
    args = {"own": [f"--temp-dir={mine}", f"{mine}/session_latest/logs"],
            "other": [f"--temp-dir={other}", str(other), f"{other}/session_latest", f"--x={mine}0"]}
    procs = {(who, arg): subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", arg])
             for who, names in args.items() for arg in names}
    try:
        found = {p.pid for p in cluster_processes(mine)}
        for (who, arg), proc in procs.items():
            assert (proc.pid in found) == (who == "own"), arg
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_a_job_uploads_every_module_and_leaves_results_and_datasets_behind(tmp_path):
    """The job's working_dir as Ray's own packaging walks it (excludes and .gitignore): every
    module of the package goes, raytrain_lm/data/ included, while the project's runs/ and data/
    (results, prepared datasets) stay here."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    from raytrain_lm.cluster.jobs import JOB_EXCLUDES

    def uploaded(root: Path) -> set[str]:
        seen: set[str] = set()
        def add(p: Path) -> None:
            if p.is_file():  # the files go into the zip (an excluded folder's files are matched one by one)
                seen.add(p.relative_to(root).as_posix())

        _dir_travel(root, [_get_excludes(root, JOB_EXCLUDES)], add, include_gitignore=True)
        return seen

    shipped = uploaded(ROOT)
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "raytrain_lm").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert "raytrain_lm/data/loaders.py" in modules and modules <= shipped, sorted(modules - shipped)
    for rel in ("raytrain_lm/data/x.py", "data/pydoc/manifest.json", "runs/r/summary.json",
                "raytrain_lm/__pycache__/x.pyc"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    got = uploaded(tmp_path)
    assert "raytrain_lm/data/x.py" in got
    assert got == {"raytrain_lm/data/x.py"}


def test_a_running_local_cluster_is_found_and_a_dead_ones_record_ignored(tmp_path, monkeypatch):
    """`train` joins a `local-up` cluster only while its port answers: a record left behind by a
    cluster that died must not send training to a dead address."""
    import socket
    import tempfile

    from raytrain_lm.cluster import registry
    from raytrain_lm.cluster.connect import free_port

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        live = listener.getsockname()[1]
        dead = free_port()
        for port in (dead, live):
            registry.local_temp_dir(port).mkdir()
            registry.record(port, {"address": f"127.0.0.1:{port}"})
        assert registry.running_local_cluster() is None  # bound, not listening: nothing answers
        listener.listen()
        assert registry.running_local_cluster() == {"address": f"127.0.0.1:{live}"}
    assert registry.running_local_cluster() is None

