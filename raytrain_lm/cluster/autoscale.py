"""Waiting for an autoscaling cluster to grow before training starts.

Left alone, Ray Train would retry starting its worker group every 60 s, forever, while the
autoscaler adds nodes or, when it never can, with no word to the user. Instead, before the
trainer starts, the driver asks the autoscaler for the workers' resources
(`ray.autoscaler.sdk.request_resources`), says what it waits for, and gives up with a clear
error after `--scale-timeout` seconds.

How we know the cluster autoscales (Ray has two autoscalers):
- autoscaler v2 publishes its cluster config (node types, resources, max counts) to the GCS;
  `ray._private.state.state.get_max_resources_from_cluster_config()` reads it back (the check
  Ray Train makes before placing workers), which also tells how far the cluster can grow;
- autoscaler v1 (the default of `ray up` clusters) publishes no config, but its monitor writes a
  status report to the GCS every few seconds. On a cluster without an autoscaling config the
  same monitor only mirrors the nodes that exist, each as an anonymous node type named
  `node_<node id>` (`format_readonly_node_type`); a report naming any other node type comes
  from a real autoscaling config.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

from raytrain_lm.errors import UserError


def autoscaler_limits() -> Optional[dict[str, float]]:
    """The most of each resource an autoscaler v2 may bring up (None: not published)."""
    from ray._private.state import state

    try:
        return state.get_max_resources_from_cluster_config()
    except Exception:  # an older GCS without the call: fall back to the v1 check
        return None


def _v1_status(wait: float) -> Optional[dict]:
    """The v1 monitor's latest status report (written every few seconds; a fresh head may take
    a moment to write the first one)."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    deadline = time.monotonic() + wait
    while True:
        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        if raw:
            status = json.loads(raw)
            if status.get("autoscaler_report"):
                return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def has_autoscaler(wait: float = 10.0) -> bool:
    """Whether an autoscaler with a real cluster config runs on the connected cluster."""
    from ray.autoscaler._private.util import format_readonly_node_type

    if autoscaler_limits() is not None:
        return True
    status = _v1_status(wait)
    if status is None:
        return False
    report = status["autoscaler_report"]
    types = set(report.get("active_nodes") or {}) | set(report.get("idle_nodes") or {})
    types |= set(report.get("pending_launches") or {})
    types |= {entry[1] for entry in report.get("pending_nodes") or []}
    anonymous = format_readonly_node_type("")
    return any(not t.startswith(anonymous) for t in types)


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()))


def _missing(need: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in need.items() if have.get(k, 0) < v}


def wait_for_resources(per_worker: dict[str, float], workers: int, timeout: float,
                       say: Callable[[str], None], poll: float = 1.0,
                       report_every: float = 30.0) -> bool:
    """Wait until the cluster holds `workers` x `per_worker`. Returns False at once when the
    cluster has no autoscaler (the caller fails with its own error), True when the resources
    are up; raises UserError when the autoscaler cannot or did not provide them in time."""
    import ray
    from ray.autoscaler.sdk import request_resources

    if not has_autoscaler():
        return False
    need = {k: v * workers for k, v in per_worker.items()}
    limits = autoscaler_limits()  # known for autoscaler v2 only
    beyond = {k: v for k, v in need.items() if limits is not None and limits.get(k, 0) < v}
    if beyond:
        k = sorted(beyond)[0]
        raise UserError(f"{workers} workers need {need[k]:g} {k} but the autoscaler can grow this "
                        f"cluster to at most {(limits or {}).get(k, 0):g} {k}; lower --workers or raise "
                        f"max_workers in the cluster config")
    request_resources(bundles=[dict(per_worker) for _ in range(workers)])
    start = last_report = time.monotonic()
    try:
        have = ray.cluster_resources()
        say(f"waiting for the autoscaler to add nodes: training needs {_fmt(need)}, the cluster "
            f"has {_fmt({k: have.get(k, 0) for k in need})} (up to {timeout:g} s; "
            f"`ray status` shows progress)")
        while True:
            have = ray.cluster_resources()
            if not _missing(need, have):
                say(f"the cluster is ready after {time.monotonic() - start:.0f} s: "
                    f"{_fmt({k: have.get(k, 0) for k in need})}")
                return True
            now = time.monotonic()
            if now - start >= timeout:
                raise UserError(
                    f"the autoscaler did not provide {_fmt(need)} within {timeout:g} s (the cluster "
                    f"has {_fmt({k: have.get(k, 0) for k in need})}); see `ray status` or "
                    f"`python cli.py cluster status`, or raise --scale-timeout")
            if now - last_report >= report_every:
                last_report = now
                say(f"  still waiting ({now - start:.0f} s): "
                    f"{_fmt({k: have.get(k, 0) for k in need})} of {_fmt(need)}")
            time.sleep(poll)
    finally:
        # The request is a standing floor on the cluster's size: drop it, or the nodes would never
        # go idle. Ray Train's placement group holds the nodes from here on.
        request_resources(bundles=[])
