"""The Ray Train controller a run uses: Ray's (the version pinned in pyproject.toml, whose private
methods this module overrides), with one gap in its failure handling closed
and without the helper processes a run does not need (the preemption watcher is a thread of the
controller); and the placement of a run's own helpers.

A worker group starts in steps: placement group, worker actors, train context, backend (the
process group), then each worker is told to run the training function. Ray turns a worker's
death in the middle steps into a `WorkerGroupStartupFailedError`, which it retries, but not a
death in the last one (`run_train_fn`, outside its try): that reaches the failure policy as a
`ControllerError`, which Ray never retries, and the started group (its placement group and
the live workers, already training) is left behind (tests/test_controller.py). Here such a
death shuts the group down and is reported as the failed start it is.

Its checkpoint manager also knows that a checkpoint can be made again at the same path: a run
resumed from an older checkpoint (its newest proved damaged) writes the newer steps' folders
anew, and Ray, which restored the damaged one's registration from its snapshot, would keep
both; evicting the old entry then deletes the new folder, and evicting the new one fails on the
missing path (tests/test_resume.py). Here the new registration replaces the old.
"""

from __future__ import annotations

import logging
import threading

import ray
from ray.exceptions import RayActorError
from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.constants import (
    HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    PREEMPTION_POLL_INTERVAL_S_ENV_VAR,
    get_env_vars_to_propagate,
)
from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.preemption import PreemptionWatcher
from ray.train.v2._internal.execution.worker_group import WorkerGroup

from raytrain_lm.ray_compat.callbacks import HeldRows
from raytrain_lm.ray_compat.polls import Polls

logger = logging.getLogger(__name__)


def on_this_node() -> dict:
    """Actor options that keep an actor on this process's node. A run's helpers (its controller,
    a sweep's queue) must live as long as their driver, not die with a worker node: Ray spreads
    zero-CPU actors over the whole cluster (on a 3-node cluster most of a sweep's queues landed
    on worker nodes), and a removed node once took a run's metrics queue with it, which ended the
    run whatever --max-failures allowed (CI: "the actor's node was terminated")."""
    return {"label_selector": {ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}}


def driver_queue():
    """A Ray queue on the driver's node (see on_this_node)."""
    from ray.util.queue import Queue

    return Queue(actor_options={"num_cpus": 0, **on_this_node()})


def helper_callbacks(callbacks: list, datasets: dict, pg_cleaner: bool) -> list:
    """Ray's default controller callbacks less two that each start a process per run, ~1.5-2 CPU
    seconds of start-up on the run's critical path (bench/helpers.py):
    - the dataset manager, started even when the trainer has no Ray Datasets (ours never has);
    - the placement-group cleaner (unless `pg_cleaner`): a detached actor that removes the run's
      placement groups if the controller dies while its driver lives on, as a Tune trial's
      does when ASHA stops it. A placement group lives as long as the driver's job, so for a
      driver that ends with its run (`train`) the cleaner has nothing to do."""
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    unneeded = (() if datasets else (DatasetsCallback,)) + \
        (() if pg_cleaner else (PlacementGroupCleanerCallback,))
    return [cb for cb in callbacks if not isinstance(cb, unneeded)]


class StartDeathsCaughtWorkerGroup(WorkerGroup):
    """Ray's worker group; a worker that dies at any step of the start fails the start, and the
    workers' runtime env leaves out the polls' variables (see run_controller)."""

    @staticmethod
    def _get_worker_runtime_env(custom_runtime_env):
        runtime_env = WorkerGroup._get_worker_runtime_env(custom_runtime_env)
        # Ray's merge, of our propagated variables: --worker-env's own still win
        runtime_env["env_vars"] = {**propagated_env_vars(), **(custom_runtime_env.get("env_vars") or {})}
        return runtime_env

    def _start(self):
        try:
            super()._start()
        except RayActorError as e:
            if self.has_started():  # Ray cleans up a group that failed earlier, not this one
                try:
                    self.shutdown()
                except Exception:
                    logger.exception("could not shut down the worker group that failed to start")
            raise WorkerGroupStartupFailedError(
                f"a worker died as its group started: {e}") from e


class PreemptionThread(PreemptionCallback):
    """Ray's preemption callback, its watcher (which polls the cluster for nodes being drained
    and tells the workers) a thread of the controller instead of an actor: one process fewer per
    worker group (~2.5 CPU seconds of start-up here, beside the group's own), and a watcher that
    lives with the controller on the driver's node, not on any node Ray picks for a zero-CPU
    actor."""

    def __init__(self, poll_interval_s: float):
        super().__init__()
        self._poll_interval_s = poll_interval_s

    def after_worker_group_start(self, worker_group) -> None:
        self._stop_watcher()
        node_to_ranks: dict[str, list[int]] = {}
        actors = {}
        for w in worker_group.get_workers():
            rank = w.distributed_context.world_rank
            node_to_ranks.setdefault(w.metadata.node_id, []).append(rank)
            actors[rank] = w.actor
        self._watcher = PreemptionWatcher(node_to_ranks=node_to_ranks, worker_actors_by_rank=actors,
                                          poll_interval_s=self._poll_interval_s)  # starts its thread

    def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher._stop_event.set()  # its thread ends at its next wake-up


POLL_VARS = {HEALTH_CHECK_INTERVAL_S_ENV_VAR, PREEMPTION_POLL_INTERVAL_S_ENV_VAR}  # Polls' variables


def propagated_env_vars() -> dict[str, str]:
    """The Ray Train variables set here that Ray hands the controller and the workers, less the
    polls' own: only the controller reads those, and it has them as arguments (run_controller)."""
    return {k: v for k, v in get_env_vars_to_propagate().items() if k not in POLL_VARS}


class RemadeCheckpointManager(CheckpointManager):
    """Ray's checkpoint manager, where a checkpoint registered at the path of one it already
    holds replaces that one (same folder, newer files) instead of standing beside it."""

    def register_checkpoint(self, training_report):
        path = training_report.checkpoint.path
        for old in [r for r in self._checkpoint_results if r.checkpoint.path == path]:
            self._checkpoint_results.remove(old)
            self._checkpoint_to_report_index.pop(old.checkpoint, None)
            for held in (self._validated_checkpoints, self._timed_out_validation_checkpoints,
                         self._failed_validation_checkpoints):
                held.discard(old.checkpoint)
        super().register_checkpoint(training_report)


class Controller(TrainController):
    worker_group_cls = StartDeathsCaughtWorkerGroup

    def __init__(self, *args, polls: Polls, **kwargs):
        # It blocks in ray.get on purpose: Ray's controller turns the warning off through its
        # runtime env, which would also pass it on to every worker; as if already given:
        ray._private.worker.blocking_get_inside_async_warned = True
        super().__init__(*args, **kwargs)
        self._checkpoint_manager.__class__ = RemadeCheckpointManager  # (other parts hold it)
        self._health_check_interval_s = polls.report_s
        callbacks = self._worker_group_callbacks_to_propagate  # used when a group starts
        callbacks[:] = [PreemptionThread(polls.preemption_s) if type(cb) is PreemptionCallback
                        else cb for cb in callbacks]

    def settings(self) -> dict:
        """What this controller runs with: its polls (one preemption watcher per group) and the
        runtime env Ray gave its process."""
        return {"report_s": self._health_check_interval_s,
                "preemption_s": [cb._poll_interval_s for cb in self._worker_group_callbacks_to_propagate
                                 if isinstance(cb, PreemptionCallback)],
                "runtime_env": ray.get_runtime_context().runtime_env}

    def take_rows(self) -> list[dict]:
        """The metrics rows reported since the last call (callbacks.HeldRows)."""
        return HeldRows.take()


def run_controller(trainer, polls: Polls, **controller_init_kwargs):
    """Ray's `DataParallelTrainer._initialize_and_run_controller` with our controller
    class (Ray names its own inside that method, so it is repeated here), which takes its polls
    as arguments (Polls). Ray's other Train variables that the user set still travel as Ray sends
    them; the polls' own would change nothing there (only the controller reads them, and it has
    them as arguments), yet alone they would give every actor of the run a runtime env."""
    env_vars = propagated_env_vars()
    runtime_env = {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
    controller_cls = ray.remote(  # on the driver's node, as Ray's
        num_cpus=0, **runtime_env, **on_this_node())(Controller)
    controller = controller_cls.remote(polls=polls, **controller_init_kwargs)
    trainer.controller = controller  # for the driver, which takes the rows from it
    if threading.current_thread() is threading.main_thread():  # not in a Tune trial's thread
        trainer._register_sigint_handler(controller)
    ray.get(controller.run.remote())
    return ray.get(controller.get_result.remote())
