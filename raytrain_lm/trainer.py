"""The TorchTrainer every run uses (`train` and each Tune trial): Ray's, with our controller
(controller.py), a torch-free backend config (backend.py) and, for `--workers MIN-MAX`, the
scaling policy that keeps the group at the sizes elastic.py allows (scaling.py)."""

from __future__ import annotations

from ray.train.torch import TorchTrainer

from raytrain_lm.backend import TorchConfig
from raytrain_lm.config import TrainConfig
from raytrain_lm.controller import helper_callbacks, run_controller
from raytrain_lm.elastic import worker_counts
from raytrain_lm.scaling import SizedElasticPolicy


class Trainer(TorchTrainer):
    """Ray's TorchTrainer, run by our controller; an elastic group takes only the sizes of
    `worker_counts(cfg)`."""

    def __init__(self, *args, cfg: TrainConfig, pg_cleaner: bool = True, **kwargs):
        """`pg_cleaner`: see controller.helper_callbacks."""
        super().__init__(*args, torch_config=TorchConfig(), **kwargs)
        self.counts = worker_counts(cfg)
        self.pg_cleaner = pg_cleaner

    def _create_default_callbacks(self):
        return helper_callbacks(super()._create_default_callbacks(), self.datasets, self.pg_cleaner)

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if self.scaling_config.elasticity_enabled:
            controller_init_kwargs["scaling_policy"] = SizedElasticPolicy(self.scaling_config,
                                                                          self.counts)
        return run_controller(self, **controller_init_kwargs)
