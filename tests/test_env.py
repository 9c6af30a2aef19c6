"""raytrain_lm/env.py is the one reader of the environment, and reads at call time."""

from __future__ import annotations

import re
from pathlib import Path

import raytrain_lm
from raytrain_lm.ray_compat.polls import report_poll_seconds

PACKAGE = Path(raytrain_lm.__file__).parent
# a read: os.environ.get / os.environ[...] not assigned to / os.getenv / "in os.environ"
READ = re.compile(r"os\.getenv|os\.environ\.get|os\.environ\[[^\]]+\](?!\s*(=[^=]|,))|in os\.environ")


def test_only_env_py_reads_the_environment():
    readers = [f"{path.relative_to(PACKAGE)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "env.py" or path.parent != PACKAGE
               for n, line in enumerate(path.read_text().splitlines(), 1) if READ.search(line)]
    assert readers == []


def test_the_report_poll_is_read_when_asked_not_at_import(monkeypatch):
    """It was read once when run/driver.py was imported: a value set later was ignored."""
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "7")
    assert report_poll_seconds() == 7.0
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    assert report_poll_seconds(0.5) == 0.5
