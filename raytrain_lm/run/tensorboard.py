"""TensorBoard event files for every run, so `tensorboard --logdir runs` shows every run's curves.

The driver feeds each metrics row (rank 0's, already global) to `TensorBoardLog.add`; its charted
metrics are tagged with their chart names (store/row.CHART_NAMES). Event files
go straight into the run's folder, so TensorBoard names each run after its folder. A row for a step
already written means the run restarted from a checkpoint: a new event file starts with a purge
marker at that step, and TensorBoard drops the abandoned points after it, like metrics.jsonl does.
Writing event files is a convenience: if it fails, training goes on and the user is told once.
The `tensorboard` package writes them, not torch's SummaryWriter: the driver does not import torch.
Its modules (protobuf's, ~0.1-0.4 CPU s) are imported with the first row, not before the first
step: with `--workers 0` the driver's imports are on the way to it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable, Optional

from raytrain_lm.store.row import MetricsRow, chart_values
from raytrain_lm.store.storage import RunFolder


class TensorBoardLog:
    def __init__(self, run: RunFolder, say: Callable[[str], None] = print):
        self.run, self.say = run, say
        # Object stores cannot take appends: write locally, copy into the run's folder at close.
        self.dir = run.path if run.local else tempfile.mkdtemp(prefix="raytrain-lm-tb-")
        self.writer = None
        self.last_step: Optional[int] = None
        self.failed = False

    def add(self, row: MetricsRow) -> None:
        if self.failed:
            return
        try:
            step = int(row["step"])
            if self.writer is None or (self.last_step is not None and step <= self.last_step):
                self._open(purge_step=step)
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            wall = (row["train_start_unix"] + row["elapsed"]
                    if row.get("train_start_unix") is not None and row.get("elapsed") is not None else None)
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in chart_values(row).items()]
            self.writer.add_event(Event(wall_time=time.time() if wall is None else wall, step=step,
                                        summary=Summary(value=values)))
            self.writer.flush()  # rows come every few seconds at most: keep the files current
            self.last_step = step
        except Exception as e:  # never let a chart break a training run
            self.failed = True
            self.say(f"warning: TensorBoard event files stopped ({type(e).__name__}: {e})")

    def _open(self, purge_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self.writer is not None:
            self.writer.close()
        os.makedirs(self.dir, exist_ok=True)
        self.writer = EventFileWriter(self.dir)
        # A session start at purge_step: TensorBoard discards points written earlier at steps
        # >= purge_step, so a resumed or restarted run shows the curve the model actually
        # followed (what torch's SummaryWriter(purge_step=...) writes).
        self.writer.add_event(Event(wall_time=time.time(), step=purge_step,
                                    session_log=SessionLog(status=SessionLog.START)))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if not self.run.local and not self.failed:
            import pyarrow.fs as pafs

            try:
                pafs.copy_files(self.dir, self.run.path, source_filesystem=pafs.LocalFileSystem(),
                                destination_filesystem=self.run.fs)
            except Exception as e:
                self.say(f"warning: could not copy TensorBoard event files to {self.run.display_path()}: {e}")
            shutil.rmtree(self.dir, ignore_errors=True)
