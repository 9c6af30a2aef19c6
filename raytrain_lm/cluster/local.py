"""A Ray head on this machine (dashboard and jobs API on 127.0.0.1, token authentication on) and
its clean stop: only the processes of *that* cluster are stopped, never other Ray instances on the
machine (which `ray stop` would kill)."""

from __future__ import annotations

import importlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from raytrain_lm import env
from raytrain_lm.cluster.connect import free_port, token_available
from raytrain_lm.cluster.jobs import DEFAULT_DASHBOARD_PORT, job_client
from raytrain_lm.cluster.registry import (
    DEFAULT_PORT,
    SINGLE_MACHINE_ENV,
    forget,
    local_temp_dir,
    port_in_use,
    read_record,
    record,
)
from raytrain_lm.errors import UserError

MARKER_ENV = "RAYTRAIN_LM_LOCAL_CLUSTER"  # inherited by every process of a local cluster

Say = Callable[[str], None]


def ray_cli() -> list[str]:
    exe = Path(sys.executable).with_name("ray")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "ray.scripts.scripts"]




def local_up(port: int = DEFAULT_PORT, dashboard_port: int = DEFAULT_DASHBOARD_PORT,
             num_cpus: Optional[int] = None, public: bool = False, say: Say = print) -> dict:
    """Start a Ray head on this machine, token authentication on; returns its addresses. Every
    port listens on 127.0.0.1 only unless `public` (other machines may then join it; the
    dashboard and jobs API stay on 127.0.0.1 either way)."""
    for p, what in ((port, "--port"), (dashboard_port, "--dashboard-port")):
        if not 1024 <= p <= 65535:
            raise UserError(f"{what} must be between 1024 and 65535, got {p}")
        if port_in_use(p):
            raise UserError(f"port {p} is already in use (a Ray cluster running? stop it with "
                            f"`python cli.py cluster local-down --port {port}`), or choose another {what}")
    if num_cpus is not None and num_cpus < 1:
        raise UserError(f"--num-cpus must be at least 1, got {num_cpus}")
    mode = env.ray_auth_mode()
    mode = "token" if mode is None else mode
    if mode.lower() != "token":
        raise UserError(f"RAY_AUTH_MODE={mode} would start a cluster without authentication, on "
                        f"which anyone who reaches its ports runs code as you; unset RAY_AUTH_MODE "
                        f"(local-up turns token authentication on)")
    temp_dir = local_temp_dir(port)
    # Ray makes its temp dir writable by everyone (0777: ray/_common/utils.py,
    # try_make_directory_shared), so only its owner is checked; nothing we trust is kept in it.
    if temp_dir.is_symlink() or temp_dir.exists() and temp_dir.stat().st_uid != os.getuid():
        raise UserError(f"{temp_dir} belongs to another user (or is a link); a cluster of yours "
                        f"cannot keep its sockets and logs there: remove it, or choose another "
                        f"--port")
    child_env = {**os.environ, "RAY_AUTH_MODE": "token", MARKER_ENV: str(temp_dir)}
    if not token_available():
        from ray._private.authentication.authentication_token_setup import generate_and_save_token

        generate_and_save_token()
        say("generated an authentication token in ~/.ray/auth_token")
    if (tightened := keep_token_private()):
        say(tightened)
    if public:
        say("warning: --public: the cluster's ports listen on every network interface (token "
            "authentication on); the dashboard and jobs API stay on 127.0.0.1")
    else:
        child_env[SINGLE_MACHINE_ENV] = "0"
    cmd = ray_cli() + [
        "start", "--head", f"--port={port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        # The job agent's port: a free one, not the fixed default another Ray may still hold
        # (then jobs fail with "No available agent to submit job").
        f"--dashboard-agent-listen-port={free_port()}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ] + ([f"--num-cpus={num_cpus}"] if num_cpus else [])
    proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        raise UserError(f"`ray start` failed: {lines[-1] if lines else proc.returncode}")
    from ray._private.services import get_node_ip_address

    host = get_node_ip_address() if public else "127.0.0.1"
    info = {"address": f"{host}:{port}", "dashboard": f"http://127.0.0.1:{dashboard_port}",
            "temp_dir": str(temp_dir), "auth": True, "loopback": not public}
    record(port, info)
    return info


def keep_token_private() -> Optional[str]:
    """Ray writes ~/.ray/auth_token readable by every local user (mode 0644), and whoever reads
    it may run code on the cluster: made owner-only (0600) when it is this user's file. Returns
    what was done, for the user, or None."""
    from ray._private.authentication.authentication_token_setup import _get_default_token_path

    path = _get_default_token_path()
    try:
        st = path.lstat()
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(path, 0o600)
            return (f"made {path} readable by you only (it was mode {stat.S_IMODE(st.st_mode):o}: "
                    f"any local user could read the cluster's token)")
    except OSError:
        pass
    return None


def _psutil():
    """psutil as Ray bundles it: `import ray` puts ray/thirdparty_files on sys.path first, and
    psutil is not one of our own dependencies (an import sorter must not put psutil first)."""
    import ray  # noqa: F401

    return importlib.import_module("psutil")


def _stop_stage(proc) -> int:
    """When `proc` is stopped, in `ray stop`'s order: raylets first (their agents and workers end
    with them), the GCS last. A process still running when the GCS ends waits on it at SIGTERM
    (the autoscaler's monitor reports its own end to the GCS) until the grace runs out."""
    psutil = _psutil()
    try:
        name = proc.name()
    except psutil.Error:  # ended meanwhile
        return 1
    return {"raylet": 0, "gcs_server": 2}.get(name, 1)


def _terminate(procs: list, grace: float) -> None:
    """SIGTERM to `procs`, and SIGKILL to those still running after `grace` seconds."""
    psutil = _psutil()
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    for p in _wait_stopped(procs, grace):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_stopped(procs, 5)


def _wait_stopped(procs: list, timeout: float) -> list:
    """Waits until every one of `procs` has exited or `timeout` passes; returns those still
    running. An exited process counts at once, not when it is reaped: the cluster's processes
    are children of init, which in a container may reap late or never (psutil.wait_procs
    waits for the reaping)."""
    psutil = _psutil()

    def running(p) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    alive = [p for p in procs if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if running(p)]
    return alive


def names_dir(arg: str, folder: Path) -> bool:
    """Whether a command-line argument names `folder` or a path inside it, alone or as an option's
    value (`--temp-dir=/tmp/x`): /tmp/raytrain-lm-ray-63790 is not inside .../raytrain-lm-ray-6379."""
    value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
    return value == str(folder) or value.startswith(f"{folder}/")


def cluster_processes(temp_dir: Path) -> list:
    """The processes of the local cluster whose temp dir is `temp_dir`: those started with it
    (their command line names it, or they inherited MARKER_ENV) and all their descendants
    (Ray workers rename themselves `ray::...`; a job's driver is a child of its supervisor)."""
    psutil = _psutil()

    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    roots = []
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        if p.pid in me or p.info["uids"] is None or p.info["uids"].real != os.getuid():
            continue  # only this user's processes are its clusters
        try:
            if any(names_dir(arg, temp_dir) for arg in (p.info["cmdline"] or [])) or \
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
    temp_dir = local_temp_dir(port)
    info = read_record(port)
    if info:  # stop jobs through the API, so their drivers end cleanly
        try:
            dashboard = info["dashboard"]
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
        stages = [_stop_stage(p) for p in procs]  # before any ends: an ended one has no name
        for stage in range(3):
            _terminate([p for p, s in zip(procs, stages) if s == stage], grace)
        stopped += len(procs)
    left = cluster_processes(temp_dir)
    if left:
        raise UserError(f"{len(left)} processes of the local cluster did not stop: "
                        f"{', '.join(str(p.pid) for p in left)}")
    forget(port)
    return stopped
