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


def test_under_torchrun_a_process_is_its_global_rank_not_its_local_one(monkeypatch):
    """The second process of the second node of a 2 x 2 torchrun (RANK 3, LOCAL_RANK 1) is rank 3
    of 4, with 2 ranks on its node; the first process of that node (LOCAL_RANK 0) is rank 2, not
    a second rank 0 (which would write the run's files and wait for peers that never come)."""
    from raytrain_lm.run.in_process import local_place

    for name, value in dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    for rank, local_rank in ((3, 1), (2, 0)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        assert local_place() == (rank, 4, 2)
