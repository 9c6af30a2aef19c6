"""The drills a test switches on from the driver's environment (worker/drills.py), in this
process: the hold drill, and how drill variables reach a process that does not inherit them."""

from __future__ import annotations

import json
import os
import threading
import time

import pyarrow.fs as pafs
import pytest

from raytrain_lm import env
from raytrain_lm.worker.drills import UploadHold, hold_drill


def test_the_hold_drill_holds_its_steps_until_released(tmp_path):
    """RAYTRAIN_LM_HOLD_AT=3,7: the ranks pass every other step at once; before step 3 rank 0
    says where the group stands (hold-3.waiting: step, world) and every rank waits until the
    test writes hold-3.release; a later group there is not held again."""
    fs = pafs.LocalFileSystem()
    for step in (1, 2, 4, 8):
        hold_drill("3,7", step, 0, 2, fs, str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    ranks = [threading.Thread(target=hold_drill, args=("3,7", 3, rank, 2, fs, str(tmp_path)))
             for rank in (0, 1)]
    for t in ranks:
        t.start()
    waiting = tmp_path / "hold-3.waiting"
    while not waiting.exists():  # rank 0 writes it before it waits (atomically: whole or absent)
        assert ranks[0].is_alive()
        time.sleep(0.01)
    assert json.loads(waiting.read_text()) == {"step": 3, "world": 2}
    assert all(t.is_alive() for t in ranks)  # held: nothing has released them
    (tmp_path / "hold-3.release").touch()
    for t in ranks:
        t.join()
    hold_drill("3,7", 3, 0, 1, fs, str(tmp_path))  # released once, released for every group
    assert json.loads(waiting.read_text()) == {"step": 3, "world": 1}


def test_an_upload_hold_holds_a_checkpoints_upload_until_training_reports_on(tmp_path):
    """RAYTRAIN_LM_HOLD_AT=3,15:upload: the loop's hold_drill passes step 15 (no file, any
    storage); the upload of checkpoint 15 on another thread than training's waits until training
    reports a later step (reporting 15 does not release it), and an upload on training's own
    thread (sync: inside the report) raises instead of waiting for itself; other checkpoints pass."""
    hold_drill("3,15:upload", 15, 0, 1, pafs.S3FileSystem(anonymous=True, region="us-east-1"), str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    hold = UploadHold("3,15:upload")
    hold.reporting(15)  # on this thread: training's
    hold.before_upload(10, 0)  # not held
    with pytest.raises(RuntimeError, match="training's thread"):
        hold.before_upload(15, 0)
    uploaded = []
    upload = threading.Thread(target=lambda: (hold.before_upload(15, 0), uploaded.append(hold.reported)))
    upload.start()
    while hold.waiting != 15:  # set under the hold's lock before it waits
        assert upload.is_alive()
        time.sleep(0.01)
    hold.reporting(15)  # not a later report: still held
    assert hold.waiting == 15 and uploaded == []
    hold.reporting(20)
    upload.join()
    assert uploaded == [20] and hold.waiting is None


def test_drill_variables_travel_to_a_process_that_does_not_inherit_them(monkeypatch):
    """A Tune trial runs in a process of the cluster: the sweep's driver hands its drill
    variables (env.drills) to each trial, which sets them (env.set_drills) before it builds its
    workers' inputs; nothing else in the hand-over is set."""
    for name in (env.FAULT_ENV, env.WINDOWS_ENV, env.NAN_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env.HOLD_ENV, "21")
    handed = env.drills()
    assert handed == {env.HOLD_ENV: "21"}
    monkeypatch.setenv(env.HOLD_ENV, "")  # the trial's process: unset (restored after the test)
    monkeypatch.setenv("NOT_A_DRILL", "")
    env.set_drills({**handed, "NOT_A_DRILL": "x"})
    assert env.hold_at() == "21" and os.environ["NOT_A_DRILL"] == ""
