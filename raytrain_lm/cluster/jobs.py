"""`python cli.py train ...` as a Ray job through `JobSubmissionClient`, with the project as the
job's working dir; following, listing and stopping jobs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlparse

from raytrain_lm import env
from raytrain_lm.cluster.connect import (
    NO_TOKEN,
    check_listening,
    connect_error,
    is_auth_error,
    use_token_auth_if_available,
)
from raytrain_lm.config.settings import default_storage
from raytrain_lm.errors import UserError

PACKAGE = Path(__file__).resolve().parents[1]  # raytrain_lm, wherever it is installed
PROJECT = PACKAGE.parent  # the project, when it is a checkout (cli.py beside the package)
DEFAULT_DASHBOARD_PORT = 8265  # the dashboard serves the jobs API
DEFAULT_JOBS_ADDRESS = f"http://127.0.0.1:{DEFAULT_DASHBOARD_PORT}"
# The job's cli.py where the package is installed without the project around it.
CLI_SHIM = "from raytrain_lm.cli import main\n\nif __name__ == \"__main__\":\n    main()\n"
# Forwarded to a job so that its driver and workers reach the same S3-compatible endpoint, and its
# driver the same tracking server, project and experiment (`train --track`). No secrets of their
# own: credentials come from the cluster's own environment, Secrets or instance role. A tracking
# URI that holds credentials (https://user:password@host) reaches the job only as this, its
# environment; the job shows and stores it redacted (env.redacted), never in its arguments.
FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
                 "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_BASE_URL")

Say = Callable[[str], None]


def jobs_address(address: Optional[str]) -> str:
    """--address, else RAY_API_SERVER_ADDRESS, else an http RAY_ADDRESS, else the local default."""
    address = address or env.ray_api_server()
    if not address and (env.ray_address() or "").startswith(("http://", "https://")):
        address = env.ray_address()
    address = (address or DEFAULT_JOBS_ADDRESS).rstrip("/")
    if "://" not in address:
        address = f"http://{address}"
    parsed = urlparse(address)
    try:
        parsed.port  # noqa: B018  (raises on a port that is not one: past 65535, not a number)
    except ValueError:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
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
        if is_auth_error(e):
            raise UserError(f"the Ray cluster at {address} {NO_TOKEN}") from None
        text = " ".join(str(e).split())
        if "does not exist" in text or "404" in text:
            raise UserError(f"no job {args[0] if args else ''} on {address}; "
                            f"`python cli.py jobs` lists them") from None
        raise UserError(f"{address}: {text[:300]}") from None


PATH_SETTINGS = ("storage", "data", "config", "init_from")


def job_train_args(train_args: list[str], given: dict, address: str, cwd: Path) -> list[str]:
    """The `train` arguments a job runs. A job's working dir is a copy of the project without
    runs/ and data/, so on a cluster on this machine (127.0.0.1) local paths are made absolute
    and results go to this project's runs/; remote clusters need shared storage anyway.

    `given`: the PATH_SETTINGS as `train` parsed them from `train_args` (None where absent).
    Absolute paths are appended as flags: the last of a repeated flag wins, and flags win over a
    --config file."""
    args = list(train_args[1:] if train_args[:1] == ["train"] else train_args)
    if not is_local_address(address):
        return args
    paths = {key: given.get(key) for key in PATH_SETTINGS}
    if paths["config"] is not None:  # the file's paths count as given
        from raytrain_lm.config.load import load_config_file

        settings = load_config_file(cwd / paths["config"])
        for key in ("data", "storage"):
            if paths[key] is None and isinstance(settings.get(key), str):
                paths[key] = settings[key]
    paths["storage"] = paths["storage"] or default_storage()
    extra: list[str] = []
    for key, value in paths.items():
        flag = f"--{key.replace('_', '-')}"
        if value is not None and "://" not in value and not os.path.isabs(value):
            extra += [flag, str((cwd / value).resolve())]
        elif key == "storage" and given.get("storage") is None:
            extra += [flag, value]  # the default, made explicit for the job's driver
    return args + extra


def submit(train_args: list[str], given: dict, address: Optional[str] = None, follow: bool = True,
           say: Say = print, out: Callable[[str], None] = None, cwd: Optional[Path] = None) -> dict:
    """Submit `python cli.py train ARGS` as a Ray job; follow its logs if `follow`. `given`: as for
    job_train_args.

    Returns {"job_id", "status", "message", "results"}; `results` is the `results: ...` line the
    training printed (where its summary and checkpoints are)."""
    if not train_args or train_args == ["train"]:
        raise UserError("submit needs the training arguments after `--`, e.g. "
                        "`python cli.py submit -- --workers 2 --max-steps 300`")
    address = jobs_address(address)
    uploaded_config(given.get("config"), cwd or Path.cwd())  # before the file is read
    args = job_train_args(train_args, given, address, cwd or Path.cwd())
    client = job_client(address)
    python = shlex.quote(sys.executable) if is_local_address(address) else "python"
    entrypoint = f"{python} cli.py train {shlex.join(args)}"
    env_vars = env.present(FORWARDED_ENV)
    with job_working_dir(given, cwd or Path.cwd()) as (working_dir, uploaded):
        say(uploaded)
        runtime_env = {"working_dir": str(working_dir), **({"env_vars": env_vars} if env_vars else {})}
        # No entrypoint resources: the driver runs on the head node and takes no CPU or GPU
        # there, so training workers get every GPU of the cluster.
        job_id = _submit_with_retry(address, lambda: client.submit_job(
            entrypoint=entrypoint, runtime_env=runtime_env, metadata={"app": "raytrain-lm"}))
    say(f"submitted job {job_id} to {address}: {entrypoint}")
    if not follow:
        say(f"follow it with `python cli.py jobs logs {job_id} --follow`")
        return {"job_id": job_id, "status": "PENDING", "message": None, "results": None}
    return follow_job(job_id, address, client=client, say=say, out=out)


@contextlib.contextmanager
def job_working_dir(given: dict, cwd: Path, root: Path = PROJECT, package: Path = PACKAGE):
    """The job's working dir, made of only what the job runs: the package's files (its modules
    and the tables it reads, such as plan/gpu_kinds.json), cli.py (the
    project's, else a two-line one) and a --config file named by a relative path (the job finds
    it where `train` was told it is). Never the project folder as a whole, which may hold
    .env, credentials, keys, datasets and runs. Yields (folder, the line saying what goes and
    how large it is); the folder is removed after the block (Ray has zipped it by then)."""
    files = {f"{package.name}/{p.relative_to(package).as_posix()}": p
             for p in sorted(package.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    config = uploaded_config(given.get("config"), cwd)
    if config is not None:
        files[config.relative_to(cwd).as_posix()] = config
    with tempfile.TemporaryDirectory(prefix="raytrain-lm-job-") as tmp:
        for rel, src in files.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, Path(tmp) / rel)
        cli = Path(tmp) / "cli.py"
        if (root / "cli.py").is_file():
            shutil.copyfile(root / "cli.py", cli)
        else:
            cli.write_text(CLI_SHIM)
        size = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        modules = [r for r in files if r.startswith(f"{package.name}/")]
        named = ", ".join(["cli.py", *(r for r in files if r not in modules)])
        yield Path(tmp), (f"uploading {package.name}/ ({len(modules)} files) and {named}: "
                          f"{size / 1024:.0f} KB")


def uploaded_config(config: Optional[str], cwd: Path) -> Optional[Path]:
    """The --config file a job takes along (None: none, or an absolute path, which the job reads
    where it is): a regular file inside this folder, reached through no symlink, of at most
    MAX_CONFIG_BYTES. Only its path's text was checked before, and a symlink inside the project
    sent whatever it pointed to (a key, a credentials file) to the cluster."""
    from raytrain_lm.config.load import MAX_CONFIG_BYTES

    if not config or os.path.isabs(config):
        return None
    rel = Path(os.path.normpath(config))
    if rel.parts[:1] == ("..",):
        raise UserError(f"--config {config} is outside this folder, so the job cannot have "
                        f"it at that path: give a path inside it, or an absolute one on "
                        f"shared storage")
    path = cwd / rel
    for step in [cwd / Path(*rel.parts[:i]) for i in range(1, len(rel.parts) + 1)]:
        if step.is_symlink():
            raise UserError(f"--config {config}: {step.relative_to(cwd)} is a symlink; a job takes "
                            f"only files of this folder itself (give the file it points to)")
    if not path.is_file():
        raise UserError(f"config file not found: {config}" if not path.exists() else
                        f"config file {config} is not a regular file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise UserError(f"config file {config} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a "
                        f"file of settings")
    return path


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

