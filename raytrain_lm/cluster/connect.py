"""Reaching a Ray cluster: token authentication as Ray does it, a fast reachability check,
and `connect_ray`, which joins a cluster or starts a local Ray for this process.

Ray's authentication: a cluster started with a token (`~/.ray/auth_token`, RAY_AUTH_TOKEN or
RAY_AUTH_TOKEN_PATH) rejects clients without it, and a client only sends it when RAY_AUTH_MODE
is `token`. `use_token_auth_if_available` sets that mode for this process when a token exists.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
from typing import Optional

from raytrain_lm import env
from raytrain_lm.cluster.registry import SINGLE_MACHINE_ENV, read_record, running_local_cluster
from raytrain_lm.errors import UserError


def token_available() -> bool:
    from ray._raylet import AuthenticationTokenLoader

    return AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)


def use_token_auth_if_available() -> bool:
    """Send the token on every request of this process when one exists (RAY_AUTH_MODE=token).

    A cluster without authentication ignores it; one with authentication needs it."""
    mode = env.ray_auth_mode()
    if mode is not None:  # the user chose explicitly
        return mode.lower() == "token"
    if not token_available():
        return False
    _set_auth_mode("token")
    return True


NO_TOKEN = ("has token authentication on and no token was found here: set RAY_AUTH_TOKEN, or "
            "RAY_AUTH_TOKEN_PATH to a file holding it (a cluster from cluster.yaml uses your "
            "~/.ray/auth_token; a local one the ~/.ray/auth_token of its machine)")


def is_auth_error(error: BaseException) -> bool:
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
    if is_auth_error(error):
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
        if not is_auth_error(e):
            return  # unreachable or else: ray.init reports it in its own words
    if not token_available():
        raise UserError(f"the Ray cluster at {address} {NO_TOKEN}")
    _set_auth_mode("token")
    try:
        _probe_gcs(address)
    except Exception as e:
        if is_auth_error(e):
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


def join_loopback_cluster(address: str) -> None:
    """A `cluster local-up` cluster without --public runs in Ray's single-machine mode (its node
    is 127.0.0.1: cluster/local.py); a driver joins it only in the same mode, else Ray resolves
    127.0.0.1 to this machine's network address, where nothing of that cluster listens."""
    port = address.rpartition(":")[2]
    info = read_record(int(port)) if port.isdigit() else None
    if not (info and info.get("loopback") and info["address"] == address):
        return
    import ray._private.ray_constants as ray_constants

    os.environ[SINGLE_MACHINE_ENV] = "0"  # for the processes this one starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # read when Ray looks up this node's address


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# A Ray head's GCS speaks gRPC, i.e. HTTP/2: to the client's connection preface (and an empty
# SETTINGS frame) it answers at once with a SETTINGS frame of its own (frame type 4, the 4th byte).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail in seconds, not minutes, when nothing listens at a host:port address, or something
    that is not a Ray cluster does (Ray's client would retry for minutes, printing warnings):
    the listener must answer an HTTP/2 preface as gRPC servers do (not checked with RAY_USE_TLS,
    where the first bytes are TLS's)."""
    hostport = address.split("://", 1)[-1]
    if address == "auto" or ":" not in hostport:
        return
    host, _, port = hostport.rpartition(":")
    try:
        conn = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError):
        raise UserError(f"no Ray cluster answers at {address}; start one with "
                        f"`python cli.py cluster local-up` or check the address") from None
    with conn:
        if env.ray_use_tls():
            return
        try:
            conn.sendall(_HTTP2_PREFACE)
            reply = conn.recv(9)
        except OSError:
            reply = b""
    if len(reply) < 4 or reply[3] != _SETTINGS:
        raise UserError(f"something listens at {address} but it is not a Ray cluster (it did not "
                        f"answer as one within {timeout:g} s); check the address: a Ray head's "
                        f"port, 6379 by default") from None


def starts_own_ray(address: Optional[str]) -> bool:
    """Whether `connect_ray(address, ...)` would start a Ray for this process (nothing to join:
    no address, RAY_ADDRESS or running `cluster local-up` cluster; or `local`)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or env.ray_address()
    return address == "local" or (not address and running_local_cluster() is None)


def connect_ray(address: Optional[str], min_cpus: float, verbose: bool = False,
                say=lambda message: None) -> bool:
    """Connect to `address` (or RAY_ADDRESS), else to a running `cluster local-up` cluster, else
    start a local Ray for this process. Returns True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = address or env.ray_address()
    quiet = dict(log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.WARNING)
    if not address and (running := running_local_cluster()):
        address = running["address"]  # already up: joining it saves a Ray start
        say(f"using the local Ray cluster at {address} (`cluster local-up`; "
            f"--address local starts a fresh one)")
    if address and address != "local":
        check_reachable(address)
        join_loopback_cluster(address)
        match_cluster_auth(address)  # a token when the cluster wants one, else none
        try:
            ray.init(address=address, **quiet)
        except Exception as e:  # ConnectionError, RuntimeError, AuthenticationError, ...
            raise connect_error(address, e) from None
        return False
    # Logical CPUs are bookkeeping: give the workers their share and keep one for Ray's own tasks,
    # so small machines don't deadlock (see docs: a 2-core laptop running 2 workers).
    num_cpus = max(os.cpu_count() or 1, math.ceil(min_cpus) + 1)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
    return True


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.starts)


_quieted = False


def quiet_ray_logging() -> None:
    """Drop Ray's driver-side notices that tell a user nothing they must act on.

    Ray announces on every local start that token authentication is on (it is, and it is
    what we want). The opposite warning, that authentication is *off*, is a real security notice
    and stays. Worker logs are kept off the terminal separately (`log_to_driver=verbose`).
    """
    global _quieted
    if _quieted:
        return
    _quieted = True
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        _DropMessages("Token authentication is enabled"))
