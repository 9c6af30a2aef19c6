"""Every environment variable the project reads, one accessor each, read when called (never at
import: a test or a parent process may set one after the import). Pure Python: no torch, no Ray.

Writes stay where they are about a child process (the local cluster's marker, Ray's TLS and auth
settings for the processes this one starts, MASTER_ADDR/PORT for torch's rendezvous)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

# ours
STORAGE_ENV = "RAYTRAIN_LM_STORAGE"  # the default --storage
CACHE_ENV = "RAYTRAIN_LM_CACHE"  # a node's cache of datasets on shared storage
CACHE_GB_ENV = "RAYTRAIN_LM_CACHE_GB"  # that cache's bound
FAULT_ENV = "RAYTRAIN_LM_FAIL_AT"  # the fault drill (worker/drills.py)
WINDOWS_ENV = "RAYTRAIN_LM_LOG_WINDOWS"  # the window log drill (worker/drills.py)
NAN_ENV = "RAYTRAIN_LM_NAN_AT"  # the non-finite loss drill (worker/drills.py)
HOLD_ENV = "RAYTRAIN_LM_HOLD_AT"  # the hold drill (worker/drills.py)
# Ray's and others' that we read too
RAY_ADDRESS_ENV = "RAY_ADDRESS"
RAY_API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_USE_TLS_ENV = "RAY_USE_TLS"
HEALTH_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
PREEMPTION_POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
OMP_ENV = "OMP_NUM_THREADS"
# torchrun's (torch.distributed's env:// rendezvous), which Ray Train's local mode reads too
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# the trackers' own (train --track; track/)
MLFLOW_URI_ENV = "MLFLOW_TRACKING_URI"
MLFLOW_FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"
MLFLOW_EXPERIMENT_ID_ENV = "MLFLOW_EXPERIMENT_ID"
MLFLOW_EXPERIMENT_NAME_ENV = "MLFLOW_EXPERIMENT_NAME"
WANDB_PROJECT_ENV = "WANDB_PROJECT"
WANDB_MODE_ENV = "WANDB_MODE"


def _get(name: str) -> Optional[str]:
    """The variable's value; unset and empty are the same (None)."""
    return os.environ.get(name) or None


def storage() -> Optional[str]:
    """$RAYTRAIN_LM_STORAGE: where runs go when --storage is not given."""
    return _get(STORAGE_ENV)


def cache_dir() -> Path:
    """$RAYTRAIN_LM_CACHE, else ~/.cache/raytrain-lm: a node's cache of remote datasets."""
    return Path(_get(CACHE_ENV) or Path.home() / ".cache" / "raytrain-lm")


def cache_gb(default: float) -> float:
    """$RAYTRAIN_LM_CACHE_GB, else `default`: the bound of that cache, in GB."""
    return float(_get(CACHE_GB_ENV) or default)


def fail_at() -> Optional[str]:
    """$RAYTRAIN_LM_FAIL_AT: the fault drill's spec (worker/drills.py), None when off."""
    return _get(FAULT_ENV)


def nan_at() -> Optional[int]:
    """$RAYTRAIN_LM_NAN_AT: the step whose loss the non-finite drill makes nan (worker/drills.py),
    None when off."""
    value = _get(NAN_ENV)
    return int(value) if value else None


def hold_at() -> Optional[str]:
    """$RAYTRAIN_LM_HOLD_AT: the hold drill's spec (worker/drills.py), None when off."""
    return _get(HOLD_ENV)


def drills() -> dict[str, str]:
    """The drill variables set here, to hand on to a process that builds a run's workers' inputs
    (a Tune trial runs in a process of the cluster, which does not inherit this environment)."""
    return {k: v for k in (FAULT_ENV, WINDOWS_ENV, NAN_ENV, HOLD_ENV) if (v := _get(k))}


def set_drills(values: dict[str, str]) -> None:
    """Set the drill variables `values` (drills()'s, from another process) for this one."""
    os.environ.update({k: v for k, v in values.items() if k in (FAULT_ENV, WINDOWS_ENV, NAN_ENV, HOLD_ENV)})


def log_windows() -> bool:
    """$RAYTRAIN_LM_LOG_WINDOWS set: every rank logs which windows it read (worker/drills.py)."""
    return bool(_get(WINDOWS_ENV))


def ray_address() -> Optional[str]:
    """$RAY_ADDRESS: the cluster to join when no --address is given."""
    return _get(RAY_ADDRESS_ENV)


def ray_api_server() -> Optional[str]:
    """$RAY_API_SERVER_ADDRESS: a job server's address (cluster/jobs.py)."""
    return _get(RAY_API_SERVER_ENV)


def ray_auth_mode() -> Optional[str]:
    """$RAY_AUTH_MODE: Ray's authentication mode ("token"; None: unset, not chosen)."""
    return os.environ.get(RAY_AUTH_MODE_ENV)


def ray_use_tls() -> bool:
    """$RAY_USE_TLS: Ray's gRPC over TLS."""
    return (_get(RAY_USE_TLS_ENV) or "0").lower() in ("1", "true")


def health_poll() -> Optional[str]:
    """$RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: the user's poll of the workers, None: ours."""
    return _get(HEALTH_POLL_ENV)


def preemption_poll() -> Optional[str]:
    """$RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S: the user's poll for preemption, None: ours."""
    return _get(PREEMPTION_POLL_ENV)


def omp_threads() -> Optional[str]:
    """$OMP_NUM_THREADS of this process."""
    return _get(OMP_ENV)


def torchrun_vars() -> Optional[dict[str, str]]:
    """torchrun's variables as set (unchecked: run/in_process.local_place checks them) when this
    process is a rank of a torchrun: every one of them present, as Ray Train's local mode decides
    it (`has_torchrun_env`); else None."""
    if any(name not in os.environ for name in TORCHRUN_ENV):
        return None
    return {name: os.environ[name] for name in TORCHRUN_ENV}


def mlflow_uri() -> Optional[str]:
    """$MLFLOW_TRACKING_URI: where MLflow tracks (None: MLflow's default)."""
    return _get(MLFLOW_URI_ENV)


def mlflow_file_store_allowed() -> bool:
    """$MLFLOW_ALLOW_FILE_STORE: MLflow's opt-in to its local folder store."""
    return (_get(MLFLOW_FILE_STORE_ENV) or "").lower() in ("1", "true")


def mlflow_experiment() -> tuple[Optional[str], Optional[str]]:
    """($MLFLOW_EXPERIMENT_ID, $MLFLOW_EXPERIMENT_NAME)."""
    return _get(MLFLOW_EXPERIMENT_ID_ENV), _get(MLFLOW_EXPERIMENT_NAME_ENV)


def wandb_project() -> Optional[str]:
    """$WANDB_PROJECT."""
    return _get(WANDB_PROJECT_ENV)


def wandb_mode() -> Optional[str]:
    """$WANDB_MODE: online, offline or disabled (None: W&B's default, online)."""
    return _get(WANDB_MODE_ENV)


def set_default(name: str, value: str) -> None:
    """Set `name` for this process and its children unless the user set it."""
    os.environ.setdefault(name, value)


def plain_terminal() -> bool:
    """$NO_COLOR set or $TERM=dumb: no colours, no live lines."""
    return bool(_get("NO_COLOR")) or os.environ.get("TERM") == "dumb"


def state_home() -> Path:
    """$XDG_STATE_HOME, else ~/.local/state."""
    return Path(_get("XDG_STATE_HOME") or Path.home() / ".local" / "state")


def present(names) -> dict[str, str]:
    """Those of `names` that are set, with their values (what a job forwards to its cluster)."""
    return {k: os.environ[k] for k in names if _get(k)}


# Credentials inside a URI (MLFLOW_TRACKING_URI=https://alice:pw@host, https://TOKEN@host,
# ...?token=...&sig=...): shown and stored only as ***. The URI itself reaches only the process
# environment it was set in, and a job's environment (`submit`, cluster/jobs.FORWARDED_ENV).
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
_SECRET_PARAM = re.compile(r"(?P<key>[?&;][^=&#;\s]*(?:token|key|secret|pass|pwd|sig|auth|credential|"
                           r"session|code)[^=&#;\s]*=)[^&#;\s]*", re.IGNORECASE)


def redacted(text: str) -> str:
    """`text` (a URI, or a message that holds one) with a URI's user information and the values
    of its query parameters named like secrets (token, key, secret, password, sig, auth, ...)
    replaced by ***."""
    return _SECRET_PARAM.sub(r"\g<key>***", _USERINFO.sub(r"\g<scheme>***@", text))
