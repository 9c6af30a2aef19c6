"""When the loop makes a metrics row and when it sends rows (cadence.Cadence): rows by a fixed step
count when asked, sends paced by time, the rows between two sends carried by the next; the same
steps on every rank because the pace comes from the send's all-gather (Meter)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import MeteredStep
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.worker.cadence import Cadence
from raytrain_lm.worker.metrics import Meter


def cadence(**settings) -> Cadence:
    cfg = TrainConfig()
    for k, v in {**dict(max_steps=100_000, eval_every=100_000, checkpoint_every=0), **settings}.items():
        setattr(cfg, k, v)
    return Cadence(cfg)


def reported(c: Cadence, step_time: float, steps: int, rows: list | None = None) -> list[int]:
    """The steps that send (`rows`, if given: every step that makes a row)."""
    out = []
    for step in range(1, steps + 1):
        if c.rows(step):
            if rows is not None:
                rows.append(step)
            if c.sends(step):
                out.append(step)
                c.paced(step, step_time)
    return out


def test_fast_steps_report_about_once_per_log_seconds():
    # 2 ms steps, one report a second: every 500 steps, after the first step's own report.
    assert reported(cadence(log_seconds=1.0), 0.002, 2000) == [1, 501, 1001, 1501]


def test_slow_steps_report_every_step():
    assert reported(cadence(log_seconds=1.0), 3.0, 4) == [1, 2, 3, 4]


def test_the_pace_follows_the_measured_step_time():
    c = cadence(log_seconds=2.0)
    assert c.rows(1) and c.sends(1)
    assert c.paced(1, 0.5) == 5  # the warm-up step: 4 steps of 0.5 s
    assert c.paced(5, 0.01) == 205  # steps got fast: 200 more


def test_an_explicit_log_every_is_exact_whatever_the_step_time():
    """--log-every 10: a row every 10 steps, exactly, whatever the step time; slow steps send
    each one."""
    rows = []
    assert reported(cadence(log_every=10, log_seconds=1.0), 3.0, 40, rows) == [10, 20, 30, 40]
    assert rows == [10, 20, 30, 40]


def test_every_step_a_row_sent_about_once_per_log_seconds():
    """--log-every 1 with 2 ms steps: a row every step, and a report every 500 steps carrying the
    rows since the previous one (a report per row waited for Ray's poll: 0.5 s a step)."""
    rows = []
    assert reported(cadence(log_every=1, log_seconds=1.0), 0.002, 2000, rows) == [1, 501, 1001, 1501]
    assert rows == list(range(1, 2001))


def test_validation_and_the_last_step_still_report():
    c = cadence(log_seconds=1000.0, eval_every=7, max_steps=20)
    assert reported(c, 0.001, 20) == [1, 7, 14, 20]


def test_meter_gives_the_interval_step_time_for_the_pace():
    meter = Meter(torch.device("cpu"), 1, 1.0, None, 6, 0.0)
    for _ in range(4):
        meter.add_step(torch.tensor(1.0), 10)
    row = meter.row(4, 1e-3, 1.0, MeteredStep(data_wait=0.25))
    assert meter.slowest_step_time == row["step_time"] > 0
    assert row["step_losses"] == [1.0] * 4 and row["data_wait_frac"] > 0
    assert row["peak_mem_reserved_gb"] is None  # CPU: no caching allocator


def test_a_negative_count_or_a_pace_of_no_time_is_refused_in_one_line():
    import pytest

    from raytrain_lm.config.checks import validate
    from raytrain_lm.errors import UserError

    for settings in (dict(log_every=-1), dict(log_seconds=0.0)):
        cfg = TrainConfig()
        for k, v in settings.items():
            setattr(cfg, k, v)
        with pytest.raises(UserError, match="--log-every must be >= 0 .* --log-seconds positive"):
            validate(cfg)


def test_checkpoints_at_their_steps_and_the_end_or_never_at_minus_one():
    """--checkpoint-every 10: steps 10, 20 and the last; 0: the last only; -1: none, not even the
    last (a benchmark or smoke run that keeps no weights: the sharded-build test's 152M-parameter
    model wrote 1.8 GB it never read). Below -1 is refused."""
    import pytest

    from raytrain_lm.config.checks import validate
    from raytrain_lm.errors import UserError

    def saved(every):
        c = cadence(checkpoint_every=every, max_steps=25)
        return [s for s in range(1, 26) if c.checkpoints(s)]

    assert saved(10) == [10, 20, 25] and saved(0) == [25] and saved(-1) == []
    cfg = TrainConfig()
    cfg.checkpoint_every = -2
    with pytest.raises(UserError, match="--checkpoint-every must be a number of steps"):
        validate(cfg)


def _keeping_rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    meter = Meter(torch.device("cpu"), 2, 1.0, None, 6, 0.0)
    if rank == 1:
        dist.barrier()  # rank 0 keeps its rows first: a collective in keep() would never match
    for step in (1, 2, 3):
        meter.add_step(torch.tensor(float(step * (rank + 1))), 10, torch.tensor(1.0))
        meter.keep(step, 1e-3, torch.tensor(1.0), MeteredStep(data_wait=0.25), tokens=10 * step)
        meter.next_interval(exclude_since_row=False)
    if rank == 0:
        dist.barrier()
    torch.save(meter.rows(), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_rows_are_kept_on_their_rank_until_a_send_gathers_them_all(tmp_path):
    """A row every step without a collective every step (issue 42): two gloo ranks, rank 0 keeps
    three rows while rank 1 still waits in a barrier (a collective in keep() would hang or
    mismatch), then one call makes all three global: each step's loss the ranks' mean, the same
    on both ranks, the fields given to keep() kept."""
    mp.start_processes(_keeping_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="fork")
    rows = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["step_losses"] for r in rows[0]] == [r["step_losses"] for r in rows[1]]
    assert [r["step"] for r in rows[0]] == [1, 2, 3] and [r["tokens"] for r in rows[0]] == [10, 20, 30]
    assert [r["step_losses"] for r in rows[0]] == [[1.5], [3.0], [4.5]]  # (s + 2s) / 2
