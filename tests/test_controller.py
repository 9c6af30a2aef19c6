"""The controller a run uses (raytrain_lm/controller.py), on the session's real Ray cluster."""

from __future__ import annotations

import json
import os
import sys

import ray.cloudpickle
from ray.train import RunConfig

from raytrain_lm.config import TrainConfig
from raytrain_lm.controller import Polls
from raytrain_lm.scaling import failure_config, scaling_config
from raytrain_lm.trainer import Trainer

POLLS = Polls(report_s=0.5, preemption_s=1.0)


def _train(config):
    pass


def _load_or_die_the_first_time(marker: str):
    """Unpickled by a worker as it starts to run the training function: the first worker to do
    so dies there, as a worker on a node being removed does."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return _train
    os._exit(1)


class DiesWhenFirstLoaded:
    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, config):  # the signature Ray checks; the workers get `_train`
        _train(config)

    def __reduce__(self):
        return _load_or_die_the_first_time, (self.marker,)


def test_a_worker_that_dies_as_its_group_starts_is_retried_not_the_end_of_the_run(ray_address,
                                                                                tmp_path):
    """Ray 2.60 ends the run (a ControllerError it never retries) when a worker dies in
    `run_train_fn`, the last step of a group's start; CI lost the grow/shrink run that way.
    With --max-failures 0: such a death is a failed start, not a failure of the training."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on workers' path
    marker = tmp_path / "died"
    cfg = TrainConfig(workers=1, max_failures=0)
    trainer = Trainer(
        DiesWhenFirstLoaded(str(marker)), cfg=cfg, polls=POLLS, scaling_config=scaling_config(cfg),
        run_config=RunConfig(name="start-death", storage_path=str(tmp_path / "runs"),
                             failure_config=failure_config(cfg)))
    result = trainer.fit()
    assert marker.exists()  # a worker did die at the start
    assert result.error is None


def _report_runtime_env(config):
    with open(config["out"], "w") as f:
        json.dump(ray.get_runtime_context().runtime_env, f)


def test_the_run_takes_ready_ray_processes_its_polls_are_arguments(ray_address, tmp_path):
    """Ray hands its Train settings to the controller and the workers as a runtime env, and an
    actor with a runtime env of its own cannot take one of the processes Ray keeps ready (it
    waits ~1.5-2 s more here for a new one). Ours take them: no runtime env, none set by the
    user; the controller's polls are its arguments."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg, out = TrainConfig(workers=1), tmp_path / "worker_env.json"
    polls = Polls(report_s=0.3, preemption_s=2.0)
    trainer = Trainer(_report_runtime_env, cfg=cfg, polls=polls,
                      train_loop_config={"out": str(out)}, scaling_config=scaling_config(cfg),
                      run_config=RunConfig(name="envs", storage_path=str(tmp_path / "runs")))
    assert trainer.fit().error is None
    settings = ray.get(trainer.controller.settings.remote())  # alive while its handle is
    assert settings["report_s"] == 0.3 and settings["preemption_s"] == [2.0]
    assert not settings["runtime_env"].get("env_vars")
    assert not json.loads(out.read_text()).get("env_vars")  # the worker's
