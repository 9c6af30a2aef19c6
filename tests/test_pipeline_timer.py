"""The pipeline bubble is timed by device marks read after the step's sync (no Ray, no GPU): a
clock whose marks cannot be read before the sync stands in for CUDA events."""

from __future__ import annotations

import torch

from raytrain_lm.parallel.traffic import CudaClock, HostClock, PipelineTimer, clock_for


class DeviceLikeClock:
    """Marks are tick counts; reading one before `synced` fails, as an unfinished CUDA event
    would need a host sync to read."""

    def __init__(self):
        self.now, self.synced = 0, False

    def mark(self) -> int:
        return self.now

    def seconds(self, start: int, end: int) -> float:
        assert self.synced, "a mark read before the step's sync"
        return float(end - start)


class Stage:
    def __init__(self, clock: DeviceLikeClock):
        self.clock = clock

    def forward_one_chunk(self, ticks: int):  # the work of a chunk: `ticks` on the clock
        self.clock.now += ticks

    backward_one_chunk = backward_weight_one_chunk = forward_one_chunk


class Schedule:
    def __init__(self, clock: DeviceLikeClock):
        self._stage = Stage(clock)

    def step(self, idle: int, *chunks: int):
        for ticks in chunks:
            self._stage.clock.now += idle  # waiting for a neighbour
            self._stage.forward_one_chunk(ticks)


def test_the_bubble_comes_from_marks_read_only_after_the_sync():
    clock = DeviceLikeClock()
    schedule = Schedule(clock)
    timer = PipelineTimer(schedule, clock)
    timer.measure(lambda: schedule.step(1, 3, 3))  # 6 busy of 8
    timer.measure(lambda: schedule.step(2, 4))  # 4 busy of 6
    schedule._stage.forward_one_chunk(100)  # outside a step (validation): not counted
    clock.synced = True  # the report's sync
    assert timer.take() == 1 - 10 / 14
    assert timer.take() is None  # nothing measured since


def test_a_gpu_is_timed_by_cuda_events_and_a_cpu_by_the_host():
    assert isinstance(clock_for(torch.device("cuda", 0)), CudaClock)
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
