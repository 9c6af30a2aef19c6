"""The controller a run uses (raytrain_lm/ray_compat/controller.py), on the session's real Ray cluster."""

from __future__ import annotations

import json
import os
import sys

import ray.cloudpickle
from ray.train import RunConfig

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.ray_compat.polls import Polls
from raytrain_lm.ray_compat.scaling import failure_config, scaling_config
from raytrain_lm.ray_compat.trainer import Trainer


def _report_runtime_env(config):
    """The training function: writes the runtime env this worker process has."""
    with open(config["out"], "w") as f:
        json.dump(ray.get_runtime_context().runtime_env, f)


def _load_or_die_the_first_time(marker: str):
    """Unpickled by a worker as it starts to run the training function: the first worker to do
    so dies there, as a worker on a node being removed does."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return _report_runtime_env
    os._exit(1)


class DiesWhenFirstLoaded:
    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, config):  # the signature Ray checks; the workers get _report_runtime_env
        _report_runtime_env(config)

    def __reduce__(self):
        return _load_or_die_the_first_time, (self.marker,)


def test_a_start_death_is_retried_and_the_run_takes_ready_ray_processes(ray_address, tmp_path,
                                                                        monkeypatch):
    """One run, two claims about our controller on Ray 2.60.

    A worker that dies as its group starts is retried, not the end of the run: Ray ends the run
    (a ControllerError it never retries) when a worker dies in `run_train_fn`, the last step of a
    group's start; CI lost the grow/shrink run that way. With --max-failures 0 such a death is a
    failed start, not a failure of the training.

    The run takes ready Ray processes and its polls are arguments: Ray hands its Train settings
    to the controller and the workers as a runtime env, and an actor with a runtime env of its
    own cannot take one of the processes Ray keeps ready (it waits ~1.5-2 s more here for a new
    one). Ours take them: no runtime env, none set by the user, and none for the polls when the
    user sets their variables (they are the controller's arguments: carried as an env, they
    would cost every actor of every run a fresh process)."""
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")  # read by the driver alone
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "3")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on workers' path
    marker, out = tmp_path / "died", tmp_path / "worker_env.json"
    cfg = TrainConfig(workers=1, max_failures=0)
    polls = Polls(report_s=0.3, preemption_s=2.0)
    trainer = Trainer(
        DiesWhenFirstLoaded(str(marker)), cfg=cfg, polls=polls, train_loop_config={"out": str(out)},
        scaling_config=scaling_config(cfg),
        run_config=RunConfig(name="start-death", storage_path=str(tmp_path / "runs"),
                             failure_config=failure_config(cfg)))
    result = trainer.fit()
    assert marker.exists()  # a worker did die at the start
    assert result.error is None and out.exists()  # the next group ran the training function
    settings = ray.get(trainer.controller.settings.remote())  # alive while its handle is
    assert settings["report_s"] == 0.3 and settings["preemption_s"] == [2.0]
    assert not settings["runtime_env"].get("env_vars")
    assert not json.loads(out.read_text()).get("env_vars")  # the worker's
