"""Shared fixtures. One real local Ray cluster per test session: Ray Train's helper actors fail
when two local clusters run on one machine, so tests never start their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "own_cluster: starts its own Ray cluster(s); runs last, "
                                       "after the session cluster is shut down")


def pytest_collection_modifyitems(config, items):
    """Tests that start their own Ray clusters run after all others (a stable sort), so the
    session cluster of `ray_address` never has to coexist with them or restart."""
    items.sort(key=lambda item: item.get_closest_marker("own_cluster") is not None)


@pytest.fixture(autouse=True)
def _session_ray_stopped_for_own_cluster(request):
    if request.node.get_closest_marker("own_cluster"):
        import ray

        if ray.is_initialized():
            ray.shutdown()  # stops the session cluster; nothing after this test needs it
    yield


@pytest.fixture(scope="session")
def ray_address():
    """Start the session's Ray cluster; yields its address for subprocesses (`--address`)."""
    import ray

    # 4 logical CPUs on a 2-core machine: 2 training workers plus room for Ray's own tasks.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory) -> Path:
    from raytrain_lm.data import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "pydoc"
    prepare_dataset("pydoc", out)
    return out


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None):
    """Run `python cli.py ARGS` in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd or ROOT, capture_output=True,
        text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
