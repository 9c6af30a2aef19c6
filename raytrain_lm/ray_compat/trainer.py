"""The trainer every run uses (`train` and each Tune trial): Ray's TorchTrainer, as its parent
`DataParallelTrainer` with a torch-free backend config (backend.py), run by our controller
(controller.py) and, for `--workers MIN-MAX`, the scaling policy that keeps the group at the sizes
config/sizes.py allows (scaling.py); with `ScalingConfig(num_workers=0)` (`--workers 0`), Ray
Train's local mode as local_controller.py completes it.

Nothing here imports torch: Ray's `TorchTrainer` module does (~2 CPU seconds here), and the driver
only builds the trainer and follows the run; torch is the workers' business."""

from __future__ import annotations

from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from raytrain_lm.config.inputs import WorkerInputs
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.config.sizes import worker_counts
from raytrain_lm.ray_compat.backend import TorchConfig
from raytrain_lm.ray_compat.controller import helper_callbacks, run_controller
from raytrain_lm.ray_compat.polls import Polls
from raytrain_lm.ray_compat.scaling import FixedPolicyWithoutAutoscaler, SizedElasticPolicy


def train_loop(config: WorkerInputs) -> None:
    """The training function Ray sends to the workers, by reference: the loop's module (which
    imports torch) is imported there, not where the trainer is built."""
    from raytrain_lm.worker.loop import train_loop_per_worker  # torch: the function each worker runs

    train_loop_per_worker(config)


def local_train_loop(config: WorkerInputs) -> None:
    """The training function of Ray Train's local mode: under torchrun every rank trains with
    rank 0's inputs (the run's name, a resolved --init-from are rank 0's to choose)."""
    from ray.train.collective import broadcast_from_rank_zero

    from raytrain_lm.worker.loop import train_loop_per_worker  # torch: the function each worker runs

    train_loop_per_worker(broadcast_from_rank_zero(config))


class Trainer(DataParallelTrainer):
    """Ray's TorchTrainer (gloo on CPUs, nccl on GPUs), run by our controller; an elastic group
    takes only the sizes of `worker_counts(cfg)`."""

    def __init__(self, *args, cfg: TrainConfig, polls: Polls, pg_cleaner: bool = True,
                 autoscaler: bool = True, local_threads: int = 1, **kwargs):
        """`polls`: see controller.Polls; `pg_cleaner`: see controller.helper_callbacks;
        `autoscaler`: False on a Ray this process started, where no autoscaler can run;
        `local_threads`: the torch threads of local mode's training function."""
        super().__init__(*args, backend_config=TorchConfig(), **kwargs)
        self.counts = worker_counts(cfg)
        self.local_threads, self.rendezvous_timeout = local_threads, cfg.rendezvous_timeout
        self.polls, self.pg_cleaner, self.autoscaler = polls, pg_cleaner, autoscaler

    def _create_default_callbacks(self):
        return helper_callbacks(super()._create_default_callbacks(), self.datasets, self.pg_cleaner)

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if self.scaling_config.elasticity_enabled:
            controller_init_kwargs["scaling_policy"] = SizedElasticPolicy(self.scaling_config,
                                                                          self.counts)
        elif not self.autoscaler:
            controller_init_kwargs["scaling_policy"] = FixedPolicyWithoutAutoscaler(self.scaling_config)
        return run_controller(self, self.polls, **controller_init_kwargs)

    def _initialize_and_run_local_controller(self, train_func):
        from raytrain_lm.ray_compat.local_controller import local_controller

        return local_controller(self.run_config, self.local_threads, self.rendezvous_timeout).run(train_func)
