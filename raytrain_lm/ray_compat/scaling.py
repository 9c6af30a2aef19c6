"""The Ray side of a run's size: Ray Train's ScalingConfig and FailureConfig for `cfg`, and the
scaling policy that keeps an elastic group at the sizes config/sizes.py allows.

Ray's elastic policy (`ScalingConfig(num_workers=(min, max))`) starts the group with as many
workers as the cluster's free resources hold, between min and max, and restarts it at a new size
when that number changes (checked every `elastic_resize_monitor_interval_s`) or after a failure.
It knows nothing of tensor/pipeline groups or of the global batch, so the run's trainer hands the
controller a policy that rounds each count down to the largest size of `config.sizes.worker_counts`
(trainer.py: Ray has no public hook for this; the policy is passed where TorchTrainer.fit passes
its own). The controller unpickles the policy: nothing here imports torch (see backend.py).

The policy also asks Ray's autoscaling coordinator to look at the cluster afresh each time it
counts (`recompute=True`), and never counts nodes being drained: they take no new workers, yet
Ray's coordinator counts them while their raylet lives, which is until the cloud takes the node
(with `ray drain-node` alone: for good). Seen with the pinned Ray: counted, a restart after a preemption
asked for the drained node's workers too; and once restarted at the size that was left, the
running group "grew" back onto the drained node, waited out Ray's 60 s worker-group start
timeout, fell back, and grew again, forever. By default the coordinator also answers from a view
refreshed every 20 s, so a new node went unnoticed for up to 20 s.

A running group never *shrinks* because of a drain, though: the preemption path (a checkpoint at
once, then Ray's restart at the deadline, counted against --max-preemptions) does that, and a
resize would instead restart at once from an older checkpoint.
"""

from __future__ import annotations

import logging

import ray
from ray.train import FailureConfig, ScalingConfig
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, FixedScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2._internal.execution.scaling_policy.scaling_policy import NoopDecision, ResizeDecision
from ray.train.v2._internal.util import time_monotonic

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.config.sizes import is_elastic, usable_workers

logger = logging.getLogger(__name__)


def scaling_config(cfg: TrainConfig) -> ScalingConfig:
    resources = {"CPU": cfg.worker_cpus, **({"GPU": 1} if cfg.use_gpu else {})}
    workers = (cfg.min_workers, cfg.workers) if is_elastic(cfg) else cfg.workers
    return ScalingConfig(num_workers=workers, use_gpu=cfg.use_gpu, resources_per_worker=resources,
                         elastic_resize_monitor_interval_s=cfg.resize_interval)


def failure_config(cfg: TrainConfig) -> FailureConfig:
    """Failures and preemptions are counted apart: a spot reclaim is not the run's fault."""
    return FailureConfig(max_failures=cfg.max_failures, max_preemption_failures=cfg.max_preemptions)


class SizedElasticPolicy(ElasticScalingPolicy):
    """Ray's elastic policy, at the run's allowed sizes only, counting on a fresh view of the
    cluster and never counting nodes being drained."""

    def __init__(self, scaling: ScalingConfig, counts: list[int]):
        super().__init__(scaling)
        self.counts = counts
        self._restarting = False
        self._draining: set[str] = set()  # nodes being drained at the last count

    def _count_possible_workers(self, reserved_resources) -> int:
        return usable_workers(self.counts, super()._count_possible_workers(reserved_resources))

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        self._restarting = False
        decision = super().make_decision_for_running_worker_group(worker_group_state,
                                                                  worker_group_status)
        if (isinstance(decision, ResizeDecision) and self._draining
                and decision.num_workers < worker_group_state.num_workers):
            return NoopDecision()  # a drain: the preemption path checkpoints, then restarts
        return decision

    def make_decision_for_non_running_worker_group(self):
        if not self._restarting:  # the group just stopped: do not size it on an older answer
            self._restarting = True
            self._latest_reserved_resources_query_time = float("-inf")
        return super().make_decision_for_non_running_worker_group()

    def _get_reserved_resources(self):
        """Ray's own, with the coordinator's view of the nodes refreshed first (at most once a
        second: the policy keeps an answer that long), less the nodes being drained."""
        now = time_monotonic()
        if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources  # the answer of less than a second ago
        try:
            reserved = ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id,
                                                                            recompute=True),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S)
            self._draining = set(ray._private.state.state.get_draining_nodes() or {})
            reserved = {node: r for node, r in reserved.items() if node not in self._draining}
        except Exception as e:  # as Ray's: keep the size until the coordinator answers again
            logger.warning(f"could not get the cluster's resources for {self._requester_id}: {e}")
            reserved = None
        self._latest_reserved_resources = reserved
        self._latest_reserved_resources_query_time = time_monotonic()
        return reserved


class FixedPolicyWithoutAutoscaler(FixedScalingPolicy):
    """Ray's fixed-size policy without its requests to an autoscaler, for a Ray that `train`
    started for itself: none runs there to read them. Ray's policy sends them through Ray Data's
    autoscaling coordinator, a detached actor it starts on first use: one more process to start
    beside the workers (2.3 CPU seconds here, while the workers import torch) that then polls
    until Ray stops."""

    def after_controller_start(self, train_run_context):
        self._requester_id = f"train-{train_run_context.run_id}"

    def _maybe_send_resource_request(self):
        pass

    def _send_resource_request(self):
        pass
