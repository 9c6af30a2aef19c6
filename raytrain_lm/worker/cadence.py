"""When the loop makes a metrics row, sends rows, validates and checkpoints (`Cadence`): pure
functions of the step and of values every rank holds alike, so that every rank calls
`ray.train.report` (a barrier) at the same steps. No torch, no Ray: the loop (loop.py) asks it."""

from __future__ import annotations

import math

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.plan.goodput import DEFAULT_MTBF_GPU_HOURS, choice_line, choose_checkpoint_every


class Cadence:
    """When a step makes a metrics row, sends rows, validates and checkpoints. Every checkpoint is
    also a validation (so each checkpoint knows its validation loss), every validation sends.

    Rows: every `log_every` steps, or (log_every 0) one per send; and at every validation and the
    last step. Sends (`ray.train.report`), at rows: about once per `log_seconds`, at every
    validation and at the last step; `paced` sets the next
    send's step so that about `log_seconds` pass between two at the step time just measured. The
    rows made between two sends wait on the worker and travel together with the next
    (Checkpointer.report), so metrics.jsonl keeps every one of them while a fast run pays one
    report per `log_seconds`: a report is a barrier and waits for Ray's poll of the workers when
    the previous one is still queued (one report per poll), so one report per row would throttle
    fast steps to the poll. A row is kept on its rank until its send, when one all-gather makes
    every kept row global (Meter.rows): no collective per row. The decisions add none either: they
    are pure functions of the step and of the slowest rank's interval, which every rank receives
    from the send's all-gather, so all ranks call `ray.train.report` at the same steps.
    `--checkpoint-every auto` adds one all-reduce, once: its measured checkpoint stop (`decide`)."""

    FIRST_SEND = 1  # the first step's report (compilation, warm-up) gives the first step time
    # --checkpoint-every auto: the checkpoint this many steps after the group's start measures
    # what a checkpoint stops training; the row with it, the step time (its first step, with its
    # warm-up, has a row of its own: FIRST_SEND)
    AUTO_MEASURE_STEPS = 5

    def __init__(self, cfg: TrainConfig, start: int = 0):
        """`start`: the step this worker group starts at (0, or the checkpoint's it resumed)."""
        self.cfg = cfg
        self.next_send = self.FIRST_SEND
        self.auto = cfg.checkpoint_every == "auto"
        # auto: steps between checkpoints once decided (the same on every rank), from `measure_at`
        self.every: int | None = None if self.auto else cfg.checkpoint_every
        self.measure_at = min(start + self.AUTO_MEASURE_STEPS, cfg.max_steps)
        self.note: dict = {}  # the decision, for the next row

    def checkpoints(self, step: int) -> bool:
        if step == self.cfg.max_steps:
            return self.every != -1  # -1: never
        if self.auto:
            return step == self.measure_at if self.every is None else (
                step > self.measure_at and (step - self.measure_at) % self.every == 0)
        return self.every > 0 and step % self.every == 0

    def measures(self, step: int) -> bool:
        """Whether `step`'s checkpoint is --checkpoint-every auto's measurement (the one before
        the decision)."""
        return self.auto and self.every is None and step == self.measure_at < self.cfg.max_steps

    def decide(self, step: int, step_s: float, stop_s: float, workers: int, restart_s: float) -> str:
        """Choose auto's interval from the measured step, checkpoint stop and start-up (the same
        values on every rank) and --mtbf; returns the line that says why."""
        mtbf = self.cfg.mtbf if self.cfg.mtbf is not None else DEFAULT_MTBF_GPU_HOURS
        choice = choose_checkpoint_every(step_s, stop_s, workers, mtbf, restart_s)
        self.every = choice.every
        self.note = {"checkpoint_auto": {**choice.as_row(), "at": step}}
        return choice_line(self.note["checkpoint_auto"])

    def take_note(self) -> dict:
        """The decision's fields for the next row, once."""
        note, self.note = self.note, {}
        return note

    def validates(self, step: int) -> bool:
        return step % self.cfg.eval_every == 0 or self.checkpoints(step)

    def rows(self, step: int) -> bool:
        every = self.cfg.log_every
        due = step % every == 0 if every else step >= self.next_send
        return due or self.validates(step) or step == self.cfg.max_steps

    def sends(self, step: int) -> bool:
        """Whether the row of `step` (a step `rows` chose) goes now, with the rows before it."""
        return step >= self.next_send or self.validates(step) or step == self.cfg.max_steps

    def paced(self, step: int, seconds_per_step: float) -> int:
        """After the report of `step`: the step of the next send, from the step time of the
        interval just measured (the same value on every rank). Returns it."""
        steps = math.ceil(self.cfg.log_seconds / seconds_per_step) if seconds_per_step > 0 else 1
        self.next_send = step + max(1, steps)
        return self.next_send
