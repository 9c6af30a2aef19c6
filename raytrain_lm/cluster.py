"""Ray clusters and jobs: a local head, `cluster.yaml` through Ray's own launcher, and training
sent as a Ray job.

- `local_up` / `local_down`: a Ray head on this machine (dashboard and jobs API on 127.0.0.1,
  token authentication on) and its clean stop: only the processes of *that* cluster are stopped,
  never other Ray instances on the machine (which `ray stop` would kill).
- `load_cluster_config` + `launcher`: validate a cluster-launcher YAML the way `ray up` does
  (schema and fill-out of defaults, no cloud calls), then run `ray up/down/exec/dashboard`.
- `submit`, `list_jobs`, `job_logs`, `stop_job`: `python cli.py train ...` as a Ray job through
  `JobSubmissionClient`, with the project as working dir.

Ray 2.60 authentication: a cluster started with a token (`~/.ray/auth_token`, RAY_AUTH_TOKEN or
RAY_AUTH_TOKEN_PATH) rejects clients without it, and a client only sends it when RAY_AUTH_MODE
is `token`. `use_token_auth_if_available` sets that mode for this process when a token exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlparse

from raytrain_lm.errors import UserError

ROOT = Path(__file__).resolve().parent.parent  # the project: the working dir of a job
DEFAULT_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_JOBS_ADDRESS = f"http://127.0.0.1:{DEFAULT_DASHBOARD_PORT}"
MARKER_ENV = "RAYTRAIN_LM_LOCAL_CLUSTER"  # inherited by every process of a local cluster
# Not uploaded with a job: results, prepared datasets and caches, VCS and tool folders.
JOB_EXCLUDES = ["runs/", "data/", ".cache/", ".git/", ".hg/", ".svn/", "__pycache__/",
                ".pytest_cache/", ".venv/", "venv/", "*.egg-info/", ".ipynb_checkpoints/"]
# Forwarded to a job so that its driver and workers reach the same S3-compatible endpoint (no
# secrets: credentials come from the cluster's own environment or instance role).
FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION")

Say = Callable[[str], None]


# ---------------------------------------------------------------- authentication


def token_available() -> bool:
    from ray._raylet import AuthenticationTokenLoader

    return AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)


def use_token_auth_if_available() -> bool:
    """Send the token on every request of this process when one exists (RAY_AUTH_MODE=token).

    A cluster without authentication ignores it; one with authentication needs it."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:  # the user chose explicitly
        return mode.lower() == "token"
    if not token_available():
        return False
    _set_auth_mode("token")
    return True


NO_TOKEN = ("has token authentication on and no token was found here: set RAY_AUTH_TOKEN, or "
            "RAY_AUTH_TOKEN_PATH to a file holding it (a cluster from cluster.yaml uses your "
            "~/.ray/auth_token; a local one the ~/.ray/auth_token of its machine)")


def _is_auth_error(error: BaseException) -> bool:
    e: Optional[BaseException] = error
    while e is not None:
        text = f"{type(e).__name__} {e}"
        if "AuthenticationError" in text or "InvalidAuthToken" in text or \
                "Unauthorized" in text or "Authentication required" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def connect_error(address: str, error: BaseException) -> UserError:
    """The one-line error for a failed connection to a cluster."""
    if _is_auth_error(error):
        return UserError(f"the Ray cluster at {address} {NO_TOKEN}")
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return UserError(f"cannot connect to Ray at {address}: {lines[0] if lines else type(error).__name__}")


@contextlib.contextmanager
def _stderr_silenced():
    """Hide what Ray's C++ core writes straight to fd 2 (retry warnings) during a probe."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _probe_gcs(address: str) -> None:
    from ray._raylet import GcsClient

    with _stderr_silenced():
        GcsClient(address=address)


def _set_auth_mode(mode: str) -> None:
    from ray._raylet import Config

    os.environ["RAY_AUTH_MODE"] = mode
    Config.initialize("")  # refresh the cached config so this process sees the mode


def match_cluster_auth(address: str) -> None:
    """Make this process use the authentication mode of the cluster at `address`, before
    `ray.init(address=...)`.

    The modes must match both ways: a driver without the token is refused (after ray.init has
    retried for 20 s, printing a warning a second), and a driver in token mode refuses the
    cluster's own calls back to it when the cluster has no authentication, so the cluster takes
    it for dead and cancels its actors. One fast probe of the GCS without a token tells which."""
    if address == "auto" or "://" in address:
        use_token_auth_if_available()
        return
    _set_auth_mode("disabled")
    try:
        _probe_gcs(address)
        return  # no authentication on this cluster
    except Exception as e:
        if not _is_auth_error(e):
            return  # unreachable or else: ray.init reports it in its own words
    if not token_available():
        raise UserError(f"the Ray cluster at {address} {NO_TOKEN}")
    _set_auth_mode("token")
    try:
        _probe_gcs(address)
    except Exception as e:
        if _is_auth_error(e):
            raise UserError(f"the Ray cluster at {address} refused the token found here; set "
                            f"RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the cluster's token") from None


def check_listening(host: str, port: int, what: str, timeout: float = 3.0) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError:
        raise UserError(f"nothing answers at {what}; start a cluster with `python cli.py cluster "
                        f"local-up`, open the tunnel to a remote one with `python cli.py cluster "
                        f"dashboard`, or check the address") from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------- local cluster


def local_temp_dir(port: int = DEFAULT_PORT) -> Path:
    """The Ray temp dir of the local cluster on `port`: its sessions, logs and sockets."""
    return Path(tempfile.gettempdir()) / f"raytrain-lm-ray-{port}"


def _ray_cli() -> list[str]:
    exe = Path(sys.executable).with_name("ray")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "ray.scripts.scripts"]


def local_up(port: int = DEFAULT_PORT, dashboard_port: int = DEFAULT_DASHBOARD_PORT,
             num_cpus: Optional[int] = None, say: Say = print) -> dict:
    """Start a Ray head on this machine; returns its addresses."""
    for p, what in ((port, "--port"), (dashboard_port, "--dashboard-port")):
        if not 1024 <= p <= 65535:
            raise UserError(f"{what} must be between 1024 and 65535, got {p}")
        if _port_in_use(p):
            raise UserError(f"port {p} is already in use (a Ray cluster running? stop it with "
                            f"`python cli.py cluster local-down --port {port}`), or choose another {what}")
    if num_cpus is not None and num_cpus < 1:
        raise UserError(f"--num-cpus must be at least 1, got {num_cpus}")
    env = dict(os.environ)
    auth = env.get("RAY_AUTH_MODE", "token").lower() == "token"
    if auth:
        env["RAY_AUTH_MODE"] = "token"
        if not token_available():
            from ray._private.authentication.authentication_token_setup import generate_and_save_token

            generate_and_save_token()
            say("generated an authentication token in ~/.ray/auth_token")
    temp_dir = local_temp_dir(port)
    env[MARKER_ENV] = str(temp_dir)
    cmd = _ray_cli() + [
        "start", "--head", f"--port={port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        # The job agent's port: a free one, not the fixed default another Ray may still hold
        # (then jobs fail with "No available agent to submit job").
        f"--dashboard-agent-listen-port={free_port()}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ] + ([f"--num-cpus={num_cpus}"] if num_cpus else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        raise UserError(f"`ray start` failed: {lines[-1] if lines else proc.returncode}")
    from ray._private.services import get_node_ip_address

    info = {"address": f"{get_node_ip_address()}:{port}", "dashboard": f"http://127.0.0.1:{dashboard_port}",
            "temp_dir": str(temp_dir), "auth": auth}
    (temp_dir / "raytrain-lm-cluster.json").write_text(json.dumps(info, indent=2))
    return info


def _psutil():
    import ray  # noqa: F401  (puts the psutil Ray bundles on sys.path)
    import psutil

    return psutil


def cluster_processes(temp_dir: Path) -> list:
    """The processes of the local cluster whose temp dir is `temp_dir`: those started with it
    (their command line names it, or they inherited MARKER_ENV) and all their descendants
    (Ray workers rename themselves `ray::...`; a job's driver is a child of its supervisor)."""
    psutil = _psutil()

    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    roots = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid in me:
            continue
        try:
            if any(str(temp_dir) in part for part in (p.info["cmdline"] or [])) or \
                    p.environ().get(MARKER_ENV) == str(temp_dir):
                roots.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    found = {p.pid: p for p in roots}
    for p in roots:
        try:
            for c in p.children(recursive=True):
                if c.pid not in me:
                    found.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def local_down(port: int = DEFAULT_PORT, grace: float = 5.0, say: Say = print) -> int:
    """Stop the local cluster on `port` (its jobs first, then its processes); returns how many
    processes were stopped. Other Ray instances on this machine are left alone."""
    psutil = _psutil()

    temp_dir = local_temp_dir(port)
    state = temp_dir / "raytrain-lm-cluster.json"
    if state.is_file():  # stop jobs through the API, so their drivers end cleanly
        try:
            dashboard = json.loads(state.read_text())["dashboard"]
            client = job_client(dashboard, check=False)
            for job in client.list_jobs():
                if not job.status.is_terminal():
                    client.stop_job(job.submission_id)
        except Exception:  # the head may already be gone: the processes are stopped below
            pass
    stopped = 0
    for _ in range(3):  # processes can appear while we stop others (a raylet starting workers)
        procs = cluster_processes(temp_dir)
        if not procs:
            break
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        gone, alive = psutil.wait_procs(procs, timeout=grace)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        stopped += len(procs)
    left = cluster_processes(temp_dir)
    if left:
        raise UserError(f"{len(left)} processes of the local cluster did not stop: "
                        f"{', '.join(str(p.pid) for p in left)}")
    if state.is_file():
        state.unlink()
    return stopped


# ---------------------------------------------------------------- cluster.yaml


def load_cluster_config(path: str | Path) -> dict:
    """Read and validate a cluster-launcher config like `ray up` does before any cloud call:
    Ray's JSON schema, the fill-out of the provider's defaults, the launcher's own checks."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"cluster config not found: {p} (the project's template is cluster.yaml)")
    try:
        config = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{p} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict) or not isinstance(config.get("provider"), dict) or \
            "type" not in config["provider"]:
        raise UserError(f"{p} is not a Ray cluster config (it needs a provider: type: ...)")
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    import logging

    quiet = logging.getLogger("ray.autoscaler")  # prepare_config logs its fill-out at INFO
    level, quiet.level = quiet.level, logging.WARNING
    try:
        filled = prepare_config(config)
        validate_config(filled)
    except jsonschema.ValidationError as e:
        where = "/".join(str(x) for x in e.absolute_path) or "top level"
        raise UserError(f"{p}: {where}: {e.message}") from None
    except (ValueError, RuntimeError, KeyError, TypeError, NotImplementedError) as e:
        raise UserError(f"{p}: {' '.join(str(e).split())}") from None
    finally:
        quiet.setLevel(level)
    return filled


LAUNCHER = {
    "up": lambda cfg, yes: ["up", cfg] + (["--yes"] if yes else []),
    "down": lambda cfg, yes: ["down", cfg] + (["--yes"] if yes else []),
    "status": lambda cfg, yes: ["exec", cfg, "ray status"],
    "dashboard": lambda cfg, yes: ["dashboard", cfg],
}


def launcher_command(action: str, config_path: str | Path, yes: bool = False) -> list[str]:
    """The `ray ...` command for `action` on a validated cluster config."""
    config = load_cluster_config(config_path)
    if action == "up":
        _ensure_token_for(config)
    return _ray_cli() + LAUNCHER[action](str(config_path), yes)


def _ensure_token_for(config: dict) -> None:
    """cluster.yaml copies the laptop's token to every node: make sure there is one to copy."""
    sources = [os.path.expanduser(str(v)) for v in (config.get("file_mounts") or {}).values()]
    default = str(Path.home() / ".ray" / "auth_token")
    if default in sources and not Path(default).is_file():
        from ray._private.authentication.authentication_token_setup import generate_and_save_token

        generate_and_save_token()


def run_launcher(action: str, config_path: str | Path, yes: bool = False) -> int:
    """Run Ray's cluster launcher (`ray up/down/exec/dashboard`) from the project root, so the
    config's relative file mounts (`.` = the project) resolve; returns its exit code."""
    load_cluster_config(config_path)  # errors name the path as the user gave it
    cmd = launcher_command(action, Path(config_path).resolve(), yes)
    try:
        return subprocess.call(cmd, cwd=ROOT)
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------- jobs


def jobs_address(address: Optional[str]) -> str:
    """--address, else RAY_API_SERVER_ADDRESS, else an http RAY_ADDRESS, else the local default."""
    address = address or os.environ.get("RAY_API_SERVER_ADDRESS")
    if not address and os.environ.get("RAY_ADDRESS", "").startswith(("http://", "https://")):
        address = os.environ["RAY_ADDRESS"]
    address = (address or DEFAULT_JOBS_ADDRESS).rstrip("/")
    if "://" not in address:
        address = f"http://{address}"
    parsed = urlparse(address)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UserError(f"--address must be the dashboard's http://HOST:PORT (e.g. "
                        f"{DEFAULT_JOBS_ADDRESS}), got {address}")
    return address


def is_local_address(address: str) -> bool:
    return urlparse(jobs_address(address)).hostname in ("127.0.0.1", "localhost", "::1")


def job_client(address: Optional[str] = None, check: bool = True):
    """A JobSubmissionClient for the cluster's dashboard, with the token when one exists."""
    address = jobs_address(address)
    parsed = urlparse(address)
    if check:
        check_listening(parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80),
                        address)
    use_token_auth_if_available()
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as e:  # connection, version or authentication failure
        raise connect_error(address, e) from None


def _call(address: str, fn, *args):
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as e:
        if _is_auth_error(e):
            raise UserError(f"the Ray cluster at {address} {NO_TOKEN}") from None
        text = " ".join(str(e).split())
        if "does not exist" in text or "404" in text:
            raise UserError(f"no job {args[0] if args else ''} on {address}; "
                            f"`python cli.py jobs` lists them") from None
        raise UserError(f"{address}: {text[:300]}") from None


def _option_value(args: list[str], flag: str) -> tuple[Optional[int], Optional[str]]:
    """(index of the value, value) of `--flag VALUE` or `--flag=VALUE` in args."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return i + 1, args[i + 1]
        if a.startswith(flag + "="):
            return i, a.split("=", 1)[1]
    return None, None


def _set_option(args: list[str], flag: str, value: str) -> list[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[:i + 1] + [value] + args[i + 2:]
        if a.startswith(flag + "="):
            return args[:i] + [f"{flag}={value}"] + args[i + 1:]
    return args + [flag, value]


def job_train_args(train_args: list[str], address: str, cwd: Path) -> list[str]:
    """The `train` arguments a job runs. A job's working dir is a copy of the project without
    runs/ and data/, so on a cluster on this machine (127.0.0.1) local paths are made absolute
    and results go to this project's runs/; remote clusters need shared storage anyway."""
    args = list(train_args)
    if args and args[0] == "train":
        args = args[1:]
    if not is_local_address(address):
        return args
    config = _option_value(args, "--config")[1]
    if config is not None:  # the file's paths become flags (flags win over it), made absolute below
        from raytrain_lm.config import load_config_file

        settings = load_config_file(cwd / config)
        for key in ("data", "storage"):
            if isinstance(settings.get(key), str) and _option_value(args, f"--{key}")[1] is None:
                args = _set_option(args, f"--{key}", settings[key])
    for flag in ("--storage", "--data", "--config", "--init-from"):
        _, value = _option_value(args, flag)
        if value is not None and "://" not in value and not os.path.isabs(value):
            args = _set_option(args, flag, str((cwd / value).resolve()))
    if _option_value(args, "--storage")[1] is None:
        storage = os.environ.get("RAYTRAIN_LM_STORAGE", "runs")
        args = _set_option(args, "--storage",
                           storage if "://" in storage else str((cwd / storage).resolve()))
    return args


def submit(train_args: list[str], address: Optional[str] = None, follow: bool = True,
           say: Say = print, out: Callable[[str], None] = None, cwd: Optional[Path] = None) -> dict:
    """Submit `python cli.py train ARGS` as a Ray job; follow its logs if `follow`.

    Returns {"job_id", "status", "message", "results"}; `results` is the `results: ...` line the
    training printed (where its summary and checkpoints are)."""
    if not train_args or train_args == ["train"]:
        raise UserError("submit needs the training arguments after `--`, e.g. "
                        "`python cli.py submit -- --workers 2 --max-steps 300`")
    address = jobs_address(address)
    args = job_train_args(train_args, address, cwd or Path.cwd())
    client = job_client(address)
    python = shlex.quote(sys.executable) if is_local_address(address) else "python"
    entrypoint = f"{python} cli.py train {shlex.join(args)}"
    env_vars = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    runtime_env = {"working_dir": str(ROOT), "excludes": JOB_EXCLUDES,
                   **({"env_vars": env_vars} if env_vars else {})}
    # No entrypoint resources: the driver runs on the head node and takes no CPU or GPU there,
    # so training workers get every GPU of the cluster.
    job_id = _submit_with_retry(address, lambda: client.submit_job(
        entrypoint=entrypoint, runtime_env=runtime_env, metadata={"app": "raytrain-lm"}))
    say(f"submitted job {job_id} to {address}: {entrypoint}")
    if not follow:
        say(f"follow it with `python cli.py jobs logs {job_id} --follow`")
        return {"job_id": job_id, "status": "PENDING", "message": None, "results": None}
    return follow_job(job_id, address, client=client, say=say, out=out)


def _submit_with_retry(address: str, submit_fn, wait: float = 60.0) -> str:
    """Submit, retrying while the head's job agent is still starting (a fresh cluster answers
    "No available agent to submit job, please try again later" for some seconds)."""
    import logging

    ray_log = logging.getLogger("ray")  # the upload's INFO/WARNING lines are noise here
    level, ray_log.level = ray_log.level, logging.ERROR
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                return _call(address, submit_fn)
            except UserError as e:
                if "try again later" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(2)
    finally:
        ray_log.setLevel(level)


def follow_job(job_id: str, address: Optional[str] = None, client=None, say: Say = print,
               out: Optional[Callable[[str], None]] = None) -> dict:
    """Stream a job's logs until it ends; returns its outcome."""
    address = jobs_address(address)
    client = client or job_client(address)
    out = out or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    seen: list[str] = []

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            seen.append(chunk)
            out(chunk)

    try:
        _call(address, lambda: asyncio.run(tail()))
    except KeyboardInterrupt:
        say(f"\nstopped following; job {job_id} keeps running (`python cli.py jobs logs {job_id}`, "
            f"`python cli.py jobs stop {job_id}`)")
        raise
    info = _call(address, client.get_job_info, job_id)
    while not info.status.is_terminal():  # the log stream can end just before the status
        time.sleep(0.5)
        info = _call(address, client.get_job_info, job_id)
    results = [line for line in "".join(seen).splitlines() if line.startswith("results: ")]
    return {"job_id": job_id, "status": str(info.status), "message": info.message,
            "results": results[-1][len("results: "):] if results else None}


def job_exit_code(outcome: dict) -> int:
    """0 when the job succeeded; else the training's own exit code when the job says it."""
    if outcome["status"] == "SUCCEEDED":
        return 0
    message = outcome.get("message") or ""
    marker = "exit code "
    if marker in message:
        tail = message.split(marker, 1)[1]
        digits = "".join(ch for ch in tail[:4] if ch.isdigit())
        if digits:
            return int(digits)
    return 1


def list_jobs(address: Optional[str] = None) -> list[dict]:
    address = jobs_address(address)
    client = job_client(address)
    jobs = _call(address, client.list_jobs)
    rows = []
    for j in sorted(jobs, key=lambda j: j.start_time or 0):
        if j.submission_id is None:  # a driver connected directly, not a submitted job
            continue
        rows.append({"job_id": j.submission_id, "status": str(j.status),
                     "start_time": j.start_time, "end_time": j.end_time,
                     "entrypoint": j.entrypoint, "message": j.message})
    return rows


def job_logs(job_id: str, address: Optional[str] = None) -> str:
    address = jobs_address(address)
    client = job_client(address)
    return _call(address, client.get_job_logs, job_id)


def stop_job(job_id: str, address: Optional[str] = None) -> bool:
    address = jobs_address(address)
    client = job_client(address)
    _call(address, client.get_job_info, job_id)  # a clear error for an unknown id
    return _call(address, client.stop_job, job_id)

