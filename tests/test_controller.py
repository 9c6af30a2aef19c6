"""The controller a run uses (raytrain_lm/controller.py), on the session's real Ray cluster."""

from __future__ import annotations

import os
import sys

import ray.cloudpickle
from ray.train import RunConfig

from raytrain_lm.config import TrainConfig
from raytrain_lm.scaling import failure_config, scaling_config
from raytrain_lm.trainer import Trainer


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
        DiesWhenFirstLoaded(str(marker)), cfg=cfg, scaling_config=scaling_config(cfg),
        run_config=RunConfig(name="start-death", storage_path=str(tmp_path / "runs"),
                             failure_config=failure_config(cfg)))
    result = trainer.fit()
    assert marker.exists()  # a worker did die at the start
    assert result.error is None
