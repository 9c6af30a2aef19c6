"""A trial's rows into Tune. The trial's function runs its Train run in a thread, takes the run's
rows from the controller as `train`'s driver does (run/follower.py), and reports each one to Tune
with `tune.report` from its own thread: one producer, so Tune gets every row, in order.

Ray's `TuneReportCallback` instead puts each row into a queue that the trial's Tune session
drains from another thread, while the function's end is announced through a second queue. When
a run ends within one fetch of its last report, the session can take the end first: Tune never
gets the trial's last row, and a trial that trained to the end looks stopped early; or the
session blocks and the trial hangs (docs/benchmarks.md, bench/tune_last_row.py)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from raytrain_lm.run.follower import fit_following
from raytrain_lm.tune.sweep_config import SWEEP_METRICS

# Stands in for a NaN/inf loss: ASHA's cutoffs ignore NaN, so a NaN trial would never stop.
DIVERGED = 1e4


def tune_row(row: dict) -> Optional[dict]:
    """What Tune gets for one report of the run (rank 0's row, callbacks.ForwardMetrics); None
    for an event that is no report (a worker failure, after which the run restarts).

    Rows sent with it (`earlier_rows`, `resumed_rows`) stay out: they are for `train`'s
    metrics.jsonl, and Tune keeps its own log of the reported rows. Non-finite values become
    DIVERGED, as does the report with which a run whose loss became non-finite stops (loop.py:
    it has no loss of its own)."""
    if row.get("event") == "worker_failure":
        return None
    row = {k: v for k, v in row.items() if k not in ("earlier_rows", "resumed_rows")}
    if row.get("event") == "nonfinite":
        row.update(dict.fromkeys(("loss", *SWEEP_METRICS), DIVERGED), diverged=True)
    for key in ("loss", *SWEEP_METRICS):
        if row.get(key) is not None and not math.isfinite(row[key]):
            row[key], row["diverged"] = DIVERGED, True
    return row


def follow_trial(trainer, report: Callable[[dict], None],
                 announce: Callable[[Any], None] = lambda controller: None, **follow) -> None:
    """`trainer.fit()`, its rows `report`ed (tune.report) from this thread as they come, the
    last ones after fit has returned (run/follower.fit_following, with `follow`); fit's error
    raised here. `announce` gets the run's controller handle as soon as fit has made it."""

    def report_rows(rows: list[dict]) -> None:
        for row in rows:
            if (out := tune_row(row)) is not None:
                report(out)

    _, error = fit_following(trainer, report_rows, on_controller=announce, **follow)
    if error is not None:
        raise error
