"""A sweep's trial reports its run's rows to Tune from its own thread (tune/trial_rows.py), the last
ones after fit has returned. The Ray tier runs it in real sweeps (test_tune.py); here the order and
the end, on a trainer stand-in whose controller is a plain object."""

import math
import threading
import time

import pytest

from raytrain_lm.tune.trial_rows import DIVERGED, follow_trial, tune_row


class Controller:
    def __init__(self):
        self.rows, self.lock = [], threading.Lock()

    def put(self, row):
        with self.lock:
            self.rows.append(row)

    def take(self):
        with self.lock:
            rows, self.rows = self.rows, []
            return rows


class Trainer:
    """fit() makes its controller, puts `steps` rows a little apart and returns right after the
    last (or raises `error` there), as a run that ends at its final report."""

    def __init__(self, steps, gap=0.002, error=None):
        self.steps, self.gap, self.error = steps, gap, error
        self.controller = None
        self.returned_at = None

    def fit(self):
        self.controller = Controller()
        for step in range(1, self.steps + 1):
            self.controller.put({"step": step, "loss": 3.0 / step})
            time.sleep(self.gap)
        self.returned_at = time.monotonic()
        if self.error:
            raise self.error


def follow(trainer, poll_s):
    reported, announced = [], []

    def report(row):
        reported.append((row["step"], time.monotonic()))

    follow_trial(trainer, report, announce=announced.append, take=Controller.take, poll_s=poll_s)
    return reported, announced


@pytest.mark.parametrize("poll_s", [0.001, 1e6])
def test_every_row_reaches_tune_in_order_the_last_after_fit_returned(poll_s):
    # poll_s 1e6: no poll falls within fit however slow the machine, so every row comes in the
    # one take after it returned (a follower that waited for its poll instead would hang here)
    trainer = Trainer(steps=40)
    reported, announced = follow(trainer, poll_s)
    assert [s for s, _ in reported] == list(range(1, 41))
    if poll_s > 1:
        assert reported[0][1] >= trainer.returned_at
    assert announced == [trainer.controller]


def test_a_failed_fit_is_raised_after_the_rows_it_reported():
    trainer = Trainer(steps=5, error=RuntimeError("worker died"))
    reported = []
    with pytest.raises(RuntimeError, match="worker died"):
        follow_trial(trainer, lambda row: reported.append(row["step"]), take=Controller.take,
                     poll_s=0.001)
    assert reported == [1, 2, 3, 4, 5]


def test_tune_gets_one_row_per_report_with_non_finite_values_as_diverged():
    row = {"step": 20, "loss": 2.5, "val_loss": math.nan, "val_bpb": math.inf,
           "earlier_rows": [{"step": 19}], "resumed_rows": [{"step": 10}]}
    out = tune_row(row)
    assert out == {"step": 20, "loss": 2.5, "val_loss": DIVERGED, "val_bpb": DIVERGED,
                   "diverged": True}
    assert "earlier_rows" in row and math.isnan(row["val_loss"])  # the caller's row is its own
    # the report with which a run whose loss became non-finite stops carries no loss of its own
    stop = tune_row({"step": 7, "event": "nonfinite", "error": "loss became nan at step 7"})
    assert stop["loss"] == stop["val_loss"] == stop["val_bpb"] == DIVERGED and stop["diverged"]
    assert tune_row({"event": "worker_failure", "error": "rank 1 died"}) is None
    assert tune_row({"step": 3, "loss": 2.0}) == {"step": 3, "loss": 2.0}
