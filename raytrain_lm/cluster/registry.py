"""Where the local clusters of `cluster local-up` are recorded, and finding one that runs.

Each local cluster keeps its Ray temp dir (sessions, logs, sockets) at a path named by its port,
with a small JSON record (address, dashboard, auth) that `train` reads to join it."""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path
from typing import Optional

DEFAULT_PORT = 6379
STATE_FILE = "raytrain-lm-cluster.json"
PREFIX = "raytrain-lm-ray-"


def local_temp_dir(port: int = DEFAULT_PORT) -> Path:
    """The Ray temp dir of the local cluster on `port`: its sessions, logs and sockets."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{port}"


def record(port: int, info: dict) -> None:
    (local_temp_dir(port) / STATE_FILE).write_text(json.dumps(info, indent=2))


def read_record(port: int) -> Optional[dict]:
    path = local_temp_dir(port) / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def forget(port: int) -> None:
    (local_temp_dir(port) / STATE_FILE).unlink(missing_ok=True)


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def running_local_cluster() -> Optional[dict]:
    """The record of a `cluster local-up` cluster that still answers on its port (the lowest
    port when several do), else None. A record left by a cluster that died is ignored."""
    for folder in sorted(Path(tempfile.gettempdir()).glob(f"{PREFIX}*")):
        port = folder.name[len(PREFIX):]
        if not port.isdigit():
            continue
        info = read_record(int(port))
        if info and port_in_use(int(port)):
            return info
    return None
