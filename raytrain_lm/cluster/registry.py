"""Where the local clusters of `cluster local-up` are recorded, and finding one that runs.

Each local cluster keeps its Ray temp dir (sessions, logs, sockets) at a path named by its port,
and a small JSON record (address, dashboard, auth) that `train` reads to join it and
`local-down` reads to stop its jobs. The records live in the user's own folder
(`~/.local/state/raytrain-lm/clusters/`, or under $XDG_STATE_HOME), not in the temp dir every
local user can write: a record is trusted only if it, and its folder, belong to this user and
nobody else can write them, and only if its addresses are on this machine, so no planted record
can send `train` (or the token `local-down` sends) anywhere else."""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from raytrain_lm import env

DEFAULT_PORT = 6379

# Ray's single-machine mode (its default on macOS and Windows): the node's address is 127.0.0.1,
# so the GCS, raylets, agents and the three Prometheus metrics endpoints (dashboard, autoscaler,
# agent) listen on 127.0.0.1 only. A driver joining such a cluster must be in the same mode
# (connect.join_loopback_cluster).
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
PREFIX = "raytrain-lm-ray-"


def local_temp_dir(port: int = DEFAULT_PORT) -> Path:
    """The Ray temp dir of the local cluster on `port`: its sessions, logs and sockets."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{port}"


def records_dir() -> Path:
    return env.state_home() / "raytrain-lm" / "clusters"


def _record_path(port: int) -> Path:
    return records_dir() / f"{port}.json"


def owned_privately(path: Path) -> bool:
    """`path` is this user's (not a link) and nobody else may write it."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (not stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def record(port: int, info: dict) -> None:
    folder = records_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    tmp = folder / f".{port}.json.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info, indent=2))
    os.replace(tmp, _record_path(port))


def read_record(port: int) -> Optional[dict]:
    """The record of the cluster on `port` if it is to be trusted (see the module), else None."""
    path = _record_path(port)
    if not (owned_privately(records_dir()) and owned_privately(path)):
        return None
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return info if _addresses_here(info, port) else None


def _addresses_here(info, port: int) -> bool:
    """The record's cluster address is `port` on an address of this machine, and its dashboard
    is on 127.0.0.1 (where local-up puts it)."""
    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in ("address", "dashboard")):
        return False
    host, _, p = info["address"].rpartition(":")
    dash = urlparse(info["dashboard"])
    return p == str(port) and is_this_machine(host) and dash.scheme == "http" and \
        dash.hostname in ("127.0.0.1", "localhost")


def is_this_machine(host: str) -> bool:
    """Whether `host` is an IP address of this machine (a socket can be bound to it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
        return True
    except (OSError, ValueError):
        return False


def forget(port: int) -> None:
    _record_path(port).unlink(missing_ok=True)


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def running_local_cluster() -> Optional[dict]:
    """The record of a `cluster local-up` cluster that still answers on its port (the lowest
    port when several do), else None. A record left by a cluster that died is ignored."""
    try:
        # ASCII digits only ('²0'.isdigit() is True, int() refuses it) and a port's range
        found = [p for p in records_dir().glob("*.json")
                 if p.stem.isascii() and p.stem.isdigit() and 0 < int(p.stem) < 65536]
    except OSError:
        return None
    for path in sorted(found, key=lambda p: int(p.stem)):
        info = read_record(int(path.stem))
        if info and port_in_use(int(path.stem)):
            return info
    return None
