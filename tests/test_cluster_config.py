"""cluster.yaml against Ray's own launcher validation, and the bad inputs of `cluster` / `submit`
/ `jobs` that need no running cluster."""

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, cli_here, run_cli
from raytrain_lm.cluster.jobs import job_train_args
from raytrain_lm.cluster.launcher import load_cluster_config
from raytrain_lm.cluster.local import cluster_processes, local_temp_dir
from raytrain_lm.errors import UserError
from test_cli_errors import assert_clean_error


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
    for gpu in workers:
        assert gpu["min_workers"] == 0 and 1 <= gpu["max_workers"] <= filled["max_workers"]
        assert gpu["resources"]["GPU"] >= 1
    # one GPU per node for DDP; eight in one node for tensor parallelism (its groups stay inside
    # a node), each with the training workers' role
    assert sorted(t["resources"]["GPU"] for t in workers) == [1, 8]
    assert all(t["node_config"]["IamInstanceProfile"] == {"Name": "raytrain-lm-worker"} for t in workers)
    assert 0 < filled["idle_timeout_minutes"] <= 30


def test_project_synced_requirements_installed_storage_shared(filled):
    assert filled["file_mounts"]["~/raytrain-lm/raytrain_lm"] == "./raytrain_lm"
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


def _tune_state_files() -> set[str]:
    """The files of a sweep that `Tuner.restore` (on the head) unpickles, by Ray's own names."""
    from ray.air.constants import EXPR_ERROR_PICKLE_FILE, EXPR_PARAM_PICKLE_FILE
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.impl.tuner_internal import _TUNER_PKL
    from ray.tune.search.basic_variant import BasicVariantGenerator
    from ray.tune.search.search_generator import SearchGenerator
    from ray.tune.search.searcher import Searcher

    templates = (TuneController.CKPT_FILE_TMPL, BasicVariantGenerator.CKPT_FILE_TMPL,
                 SearchGenerator.CKPT_FILE_TMPL, Searcher.CKPT_FILE_TMPL)
    return {_TUNER_PKL, EXPR_ERROR_PICKLE_FILE, EXPR_PARAM_PICKLE_FILE} | \
        {t.format("*").rsplit("*", 1)[0] + "*" for t in templates}


def test_each_node_has_a_least_privilege_role_and_ssh_only_from_the_users_network(filled):
    """Training code runs on the workers: their role may touch only the project's S3 prefixes,
    and never write the files a resumed sweep unpickles on the head. The head has its own role
    (not Ray's ray-autoscaler-v1: full EC2 and S3), which Ray keeps when its node type names one
    (ray/autoscaler/_private/aws/config.py: _configure_iam_role): the autoscaler's EC2 calls,
    terminating only this cluster's nodes, passing only the workers' role, S3 on the prefixes.
    Every node is in the user's security group (Ray's own opens SSH to 0.0.0.0/0)."""
    from ray.autoscaler._private.aws.config import DEFAULT_RAY_INSTANCE_PROFILE

    types = filled["available_node_types"]
    head = types[filled["head_node_type"]]["node_config"]
    assert head["IamInstanceProfile"] == {"Name": "raytrain-lm-head"}
    profile = types["gpu_worker"]["node_config"]["IamInstanceProfile"]
    assert profile == {"Name": "raytrain-lm-worker"} and profile["Name"] != DEFAULT_RAY_INSTANCE_PROFILE
    groups = {tuple(t["node_config"]["SecurityGroupIds"]) for t in types.values()}
    assert groups == {("sg-YOUR-SECURITY-GROUP",)}

    setup = "\n".join(filled["setup_commands"])
    bucket, runs = re.search(r"RAYTRAIN_LM_STORAGE=s3://([^/]+)/(\S+?)'", setup).groups()
    docs = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    datasets = set(re.findall(rf"s3://{bucket}/(\S+?)/", docs)) - {"raytrain-lm"}
    assert runs.startswith("raytrain-lm/") and datasets == {"data"}
    write = {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
             "s3:ListMultipartUploadParts"}

    def check_s3(statements, allowed):
        for s in statements:
            assert all(a.startswith("s3:") and "*" not in a for a in s["Action"])
            if s["Resource"] == [f"arn:aws:s3:::{bucket}"]:  # listing, only under the two prefixes
                assert s["Action"] == ["s3:ListBucket"]
                assert {p.split("/")[0] for p in s["Condition"]["StringLike"]["s3:prefix"]} == set(allowed)
                continue
            for resource in s["Resource"]:
                prefix = re.fullmatch(rf"arn:aws:s3:::{bucket}/([^/*]+)/\*", resource).group(1)
                assert set(s["Action"]) <= allowed[prefix], (prefix, s["Action"])

    worker = _statements("worker-policy.json")
    check_s3([s for s in worker if s["Effect"] == "Allow"],
             {"raytrain-lm": write, "data": {"s3:GetObject"}})
    [deny] = [s for s in worker if s["Effect"] == "Deny"]
    assert deny["Action"] == ["s3:PutObject"]
    assert {r.rsplit("/", 1)[1] for r in deny["Resource"]} == _tune_state_files()
    assert all(r.startswith(f"arn:aws:s3:::{bucket}/raytrain-lm/*/") for r in deny["Resource"])

    policy = _statements("head-policy.json")
    assert all(s["Effect"] == "Allow" and not any(a.endswith("*") for a in s["Action"]) for s in policy)
    ec2 = {a for s in policy for a in s["Action"] if a.startswith("ec2:")}
    assert ec2 - {a for a in ec2 if a.startswith("ec2:Describe")} == \
        {"ec2:RunInstances", "ec2:CreateTags", "ec2:TerminateInstances"}
    [terminate] = [s for s in policy if "ec2:TerminateInstances" in s["Action"]]
    assert terminate["Condition"] == {"StringEquals": {"ec2:ResourceTag/ray-cluster-name":
                                                       filled["cluster_name"]}}
    assert [(s["Action"], s["Resource"]) for s in policy if "iam:PassRole" in s["Action"]] == \
        [(["iam:PassRole"], ["arn:aws:iam::YOUR-ACCOUNT-ID:role/raytrain-lm-worker"])]
    check_s3([s for s in policy if s["Action"][0].startswith("s3:")],
             {"raytrain-lm": write, "data": write})
    trust = _statements("worker-trust-policy.json")
    assert [(s["Principal"], s["Action"]) for s in trust] == [({"Service": "ec2.amazonaws.com"}, ["sts:AssumeRole"])]


@pytest.mark.parametrize("drop,expected", [
    ("head SecurityGroupIds", "node type head has no SecurityGroupIds, so Ray would create a "
                              "security group with SSH open to 0.0.0.0/0"),
    ("gpu_worker SecurityGroupIds", "node type gpu_worker has no SecurityGroupIds"),
    ("head IamInstanceProfile", "the head node has no IamInstanceProfile, so Ray would give it "
                                "full EC2 and S3 access"),
])
def test_cluster_up_refuses_ray_s_open_defaults(tmp_path, drop, expected):
    node, key = drop.split()
    text = (ROOT / "cluster.yaml").read_text()
    config = yaml.safe_load(text)
    del config["available_node_types"][node]["node_config"][key]
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(config))
    assert_clean_error(cli_here("cluster", "up", str(tmp_path / "cluster.yaml"), "--yes"), expected)


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
    result = cli_here("cluster", "up", str(path), "--yes", cwd=tmp_path)
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
    assert_clean_error(cli_here(*args), "nothing answers at http://127.0.0.1:9")


def test_unreachable_train_address(tmp_path, pydoc_data):
    result = cli_here("train", "--address", "127.0.0.1:9", "--data", str(pydoc_data),
                     "--storage", str(tmp_path / "runs"))
    assert_clean_error(result, "no Ray cluster answers at 127.0.0.1:9")
    assert not (tmp_path / "runs").exists()


def test_bad_jobs_address_and_scale_timeout():
    assert_clean_error(cli_here("jobs", "--address", "ftp://host:21"), "--address must be the dashboard's")
    assert_clean_error(cli_here("train", "--scale-timeout", "-5"), "--scale-timeout must be >= 0")


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
        assert_clean_error(cli_here("cluster", "local-up", "--port", str(port)),
                           f"port {port} is already in use")
    assert_clean_error(cli_here("cluster", "local-up", "--port", "80"), "--port must be between 1024")


def test_local_down_without_a_cluster_says_so():
    result = cli_here("cluster", "local-down", "--port", "6399")
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


def test_local_down_finds_processes_in_a_fresh_interpreter():
    """psutil is not ours to install: Ray bundles it, on sys.path once `ray` is imported. A fresh
    interpreter (as `cluster local-down` is) must find it; this test process has long imported Ray."""
    code = ("from pathlib import Path; from raytrain_lm.cluster.local import cluster_processes; "
            "print(len(cluster_processes(Path('/no/such/ray/temp'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "0", result.stderr


SECRETS = [".env", ".aws/credentials", ".ssh/id_rsa", ".netrc", "deploy.pem", "tls.key",
           "runs/r/summary.json", "data/pydoc/manifest.json", "notes/private.txt"]


def _project_with_secrets(root: Path) -> None:
    """A project folder as a user's may be: the code, a config, and what must never leave."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cli.py").write_text((ROOT / "cli.py").read_text())
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "run.yaml").write_text("lr: 0.001\n")
    for rel in SECRETS:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("secret")


def _zipped(folder: Path, tmp: Path) -> set[str]:
    """What Ray's own packaging puts into the job's zip for this working dir."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    create_package(str(folder), tmp / "pkg.zip", include_gitignore=True)
    return {n for n in zipfile.ZipFile(tmp / "pkg.zip").namelist() if not n.endswith("/")}


def test_a_job_uploads_the_package_cli_and_its_config_and_no_secret(tmp_path):
    """The project folder went up with an exclude list: .env, .aws/credentials, .ssh/*, .netrc,
    *.pem and *.key were packed. Now only the package's modules, cli.py and the --config file
    named go (as Ray zips them), and one line says so with the size. The package goes whole:
    sending only its *.py left plan/gpu_kinds.json behind and every submitted train failed."""
    from raytrain_lm.cluster.jobs import PACKAGE, job_working_dir

    project = tmp_path / "project"
    _project_with_secrets(project)
    modules = {f"raytrain_lm/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert {"raytrain_lm/data/loaders.py", "raytrain_lm/plan/gpu_kinds.json"} <= modules
    with job_working_dir({"config": "configs/run.yaml"}, cwd=project, root=project) as (folder, line):
        sent = _zipped(folder, tmp_path)
    assert sent == modules | {"cli.py", "configs/run.yaml"}, sorted(sent ^ (modules | {"cli.py"}))
    assert re.fullmatch(rf"uploading raytrain_lm/ \({len(modules)} files\) and cli.py, "
                        rf"configs/run.yaml: \d+ KB", line), line
    assert not folder.exists()  # the staging folder is gone once Ray has zipped it


def test_a_job_from_a_non_editable_install_uploads_no_site_packages(tmp_path):
    """Installed in site-packages (no project around it), the package's parent is
    site-packages: it must not go up; a cli.py that runs the package does."""
    from raytrain_lm.cluster.jobs import CLI_SHIM, PACKAGE, job_working_dir

    site = tmp_path / "site-packages"
    import shutil

    shutil.copytree(PACKAGE, site / "raytrain_lm", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("")
    with job_working_dir({}, cwd=tmp_path, root=site, package=site / "raytrain_lm") as (folder, _):
        sent = _zipped(folder, tmp_path)
        assert (folder / "cli.py").read_text() == CLI_SHIM
    assert "cli.py" in sent and not [n for n in sent if n.split("/")[0] not in ("raytrain_lm", "cli.py")]


def test_a_config_outside_the_folder_cannot_go_with_the_job(tmp_path):
    """Neither by its path nor through a symlink (of the file, or of a folder on its way) that
    leads elsewhere: only the path's text was checked, and the job took what the symlink pointed
    to. Nor a file far larger than settings are."""
    import crafted
    from raytrain_lm.cluster.jobs import job_working_dir

    with pytest.raises(UserError, match=r"--config \.\./run.yaml is outside this folder"):
        with job_working_dir({"config": "../run.yaml"}, cwd=tmp_path):
            pass
    crafted.config_symlinks(tmp_path)
    for config, link in (("run.yaml", "run.yaml"), ("conf/run.yaml", "conf")):
        with pytest.raises(UserError, match=f"--config {config}: {link} is a symlink"):
            with job_working_dir({"config": config}, cwd=tmp_path):
                pass
    (tmp_path / "big.yaml").write_bytes(b"#" * (2 << 20))
    with pytest.raises(UserError, match="config file big.yaml is larger than 1 MiB"):
        with job_working_dir({"config": "big.yaml"}, cwd=tmp_path):
            pass


def test_cluster_yaml_copies_only_what_the_nodes_run(filled, tmp_path):
    """`file_mounts: {~/raytrain-lm: .}` copied the same secrets to every node. Each mount's
    files, as rsync would send them from a project holding secrets, are the code and what
    installs it."""
    import fnmatch

    project = tmp_path / "project"
    _project_with_secrets(project)
    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        (project / name).write_text("x")
    shutil_tree = __import__("shutil").copytree
    shutil_tree(ROOT / "raytrain_lm", project / "raytrain_lm",
                ignore=__import__("shutil").ignore_patterns("__pycache__"))
    excluded = filled.get("rsync_exclude") or []
    sent = set()
    for remote, local in filled["file_mounts"].items():
        if not remote.startswith("~/raytrain-lm"):
            continue
        src = project / local
        found = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file()]
        for p in found:
            rel = p.relative_to(project).as_posix()
            if not any(fnmatch.fnmatch(part, pattern) for part in rel.split("/") for pattern in excluded):
                sent.add(rel)
    assert not [rel for rel in sent if rel in SECRETS or rel.startswith("configs/")], sorted(sent)
    assert {"cli.py", "pyproject.toml", "requirements.txt", "raytrain_lm/data/loaders.py"} <= sent


@pytest.fixture
def own_state(tmp_path, monkeypatch):
    """This test's records folder and temp dir (not the user's): where local-up would keep them."""
    import tempfile

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path


def test_a_running_local_cluster_is_found_and_a_dead_ones_record_ignored(own_state):
    """`train` joins a `local-up` cluster only while its port answers: a record left behind by a
    cluster that died must not send training to a dead address."""
    import socket

    from raytrain_lm.cluster import registry
    from raytrain_lm.cluster.connect import free_port

    def info(port):
        return {"address": f"127.0.0.1:{port}", "dashboard": "http://127.0.0.1:8265"}

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        live = listener.getsockname()[1]
        dead = free_port()
        for port in (dead, live):
            registry.record(port, info(port))
        assert registry.running_local_cluster() is None  # bound, not listening: nothing answers
        listener.listen()
        assert registry.running_local_cluster() == info(live)
        # names that are no port: digits of another script ('²'.isdigit() is True, int() refuses
        # it), past 65535; every train without --address looked through them
        for name in ("\u00b20", "\u0660", "99999", "0"):
            (registry.records_dir() / f"{name}.json").write_text(json.dumps(info(live)))
        assert registry.running_local_cluster() == info(live)
    assert registry.running_local_cluster() is None


def test_a_planted_cluster_record_is_never_trusted(own_state):
    """Records lived in the temp dir every local user can write: a planted one made `train`
    join its address. Only a record of this user's, that nobody else can write, naming this
    machine, counts."""
    import os
    import socket

    from raytrain_lm.cluster import registry

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        good = {"address": f"127.0.0.1:{port}", "dashboard": "http://127.0.0.1:8265"}
        # where every local user can write: the cluster's temp dir
        planted = registry.local_temp_dir(port)
        planted.mkdir(mode=0o777)
        (planted / "raytrain-lm-cluster.json").write_text(json.dumps(good))
        assert registry.running_local_cluster() is None
        path = registry.records_dir() / f"{port}.json"
        for mischief, record in [
                *([("another user's", lambda: os.chown(path, 4242, 4242))] if os.getuid() == 0 else []),
                ("writable by others", lambda: os.chmod(path, 0o666)),
                ("a folder others may write", lambda: os.chmod(registry.records_dir(), 0o777)),
                ("an address elsewhere", lambda: path.write_text(json.dumps(
                    {**good, "address": f"192.0.2.77:{port}"}))),
                ("a dashboard elsewhere", lambda: path.write_text(json.dumps(
                    {**good, "dashboard": "http://192.0.2.77:8265"}))),
                ("another port's address", lambda: path.write_text(json.dumps(
                    {**good, "address": "127.0.0.1:1"})))]:
            registry.record(port, good)
            os.chmod(registry.records_dir(), 0o700)
            assert registry.running_local_cluster() == good  # as local-up writes it
            record()
            assert registry.running_local_cluster() is None, mischief


def test_local_down_sends_the_token_to_no_planted_address(own_state, tmp_path):
    """A planted record made `cluster local-down` send `Authorization: Bearer <token>` to the
    planted dashboard URL. It must send nothing to an address no record of ours names."""
    import http.server
    import threading

    seen = []

    class Catch(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(dict(self.headers))
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Catch)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        planted = {"address": "127.0.0.1:6398",
                   "dashboard": f"http://127.0.0.1:{server.server_address[1]}"}
        folder = tmp_path / "tmp" / "raytrain-lm-ray-6398"
        folder.mkdir(mode=0o777)
        (folder / "raytrain-lm-cluster.json").write_text(json.dumps(planted))
        result = cli_here("cluster", "local-down", "--port", "6398",
                         env={"TMPDIR": str(tmp_path / "tmp"), "XDG_STATE_HOME": str(tmp_path / "state"),
                              "RAY_AUTH_TOKEN": "s3cret-token-value"})
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    assert not [h for h in seen if "s3cret-token-value" in str(h)], seen


def test_an_efa_node_type_names_its_security_group_on_each_interface(filled, tmp_path):
    """cluster.yaml's EFA recipe: the groups move onto the interfaces (Ray allows no
    SecurityGroupIds beside NetworkInterfaces); the privilege check accepts that, not a missing
    group."""
    from raytrain_lm.cluster.launcher import check_privileges

    config = copy.deepcopy(filled)
    node = config["available_node_types"]["gpu_8x"]["node_config"]
    del node["SecurityGroupIds"]
    node["NetworkInterfaces"] = [{"DeviceIndex": min(i, 1), "NetworkCardIndex": i,
                                  "InterfaceType": "efa", "SubnetId": "subnet-1",
                                  "Groups": ["sg-YOUR-SECURITY-GROUP"]} for i in range(4)]
    check_privileges(config, tmp_path / "c.yaml")
    node["NetworkInterfaces"][2]["Groups"] = []
    with pytest.raises(UserError, match="node type gpu_8x has no SecurityGroupIds"):
        check_privileges(config, tmp_path / "c.yaml")


@pytest.mark.parametrize("torch_cuda, driver, says", [
    ("12.8", 12080, None), ("12.8", 13000, None), (None, 12040, None), ("12.8", None, None),
    ("12.8", 12040, "minor-version compatibility"), ("13.0", 12080, "CUDA will not start"),
])
def test_setup_says_in_one_line_when_torchs_cuda_needs_a_newer_driver(torch_cuda, driver, says):
    from raytrain_lm.plan.gpus import cuda_mismatch

    line = cuda_mismatch(torch_cuda, driver)
    assert (line is None) if says is None else (says in line and "\n" not in line)


def test_every_data_file_of_the_package_goes_into_a_wheel():
    """A wheel takes a package's non-Python files only when pyproject.toml names them: built
    without package-data, it held no plan/*.json and its planner could not start."""
    import fnmatch

    import tomllib

    from raytrain_lm.cluster.jobs import PACKAGE

    declared = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = {f"{pkg.replace('.', '/')}/{g}" for pkg, gs in declared.get("package-data", {}).items() for g in gs}
    data = [p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "the package reads tables of its own"
    missing = [d for d in data if not any(fnmatch.fnmatch(d, g) for g in globs)]
    assert not missing, f"add them to [tool.setuptools.package-data]: {missing}"
