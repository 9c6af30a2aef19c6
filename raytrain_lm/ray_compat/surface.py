"""Ray's private surface: every name of Ray's private API this project touches (a private module's
names, a private method it overrides or calls, a private attribute it reads or sets), where, and
why, one line each. `problems()` checks each against the installed Ray, so that an upgrade fails
in one fast test (tests/test_ray_surface.py) naming the touch, not late in a run; the same test
checks that the code touches nothing this list does not name. Torch-free: each name is imported
only when checked (`ray.train.torch.config` imports torch).

Kinds of touch:
- "name": a class, function or constant that must exist;
- "call": a callable we call with these keyword or positional parameter names;
- "method": a method of a Ray class that we override or call through super(), with exactly these
  parameters (after self; "**name" for keyword arguments): an override with other parameters would
  silently stop being called;
- "attr": an attribute of a Ray object set in its class's source (`self.NAME`), which we read or
  replace.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Optional

V2 = "ray.train.v2._internal"


@dataclass(frozen=True)
class Touch:
    target: str  # "module:qualified.name"
    kind: str  # name, call, method, attr
    where: str  # our module that touches it
    why: str
    params: Optional[tuple[str, ...]] = None  # call: names used; method: the whole parameter list

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def name(self) -> str:
        return self.target.partition(":")[2]


CONTROLLER, SCALING, LOCAL = "ray_compat.controller", "ray_compat.scaling", "ray_compat.local_controller"
BACKEND, TRAINER = "ray_compat.backend", "ray_compat.trainer"

TOUCHES = (
    # the controller (ray_compat/controller.py)
    Touch(f"{V2}.execution.controller:TrainController", "name", CONTROLLER,
          "our controller subclasses Ray's: polls as arguments, checkpoints remade at one path"),
    Touch(f"{V2}.execution.controller:TrainController", "attr", CONTROLLER,
          "its checkpoint manager's class is swapped (RemadeCheckpointManager)", ("_checkpoint_manager",)),
    Touch(f"{V2}.execution.controller:TrainController", "attr", CONTROLLER,
          "the report poll is set from our Polls", ("_health_check_interval_s",)),
    Touch(f"{V2}.execution.controller:TrainController", "attr", CONTROLLER,
          "the preemption callback is replaced by a thread", ("_worker_group_callbacks_to_propagate",)),
    Touch(f"{V2}.execution.worker_group:WorkerGroup", "method", CONTROLLER,
          "a worker death in the group's last start step fails the start", ("_start",)),
    Touch(f"{V2}.execution.worker_group:WorkerGroup", "method", CONTROLLER,
          "the workers' runtime env leaves out the polls' variables",
          ("_get_worker_runtime_env", "custom_runtime_env")),
    Touch(f"{V2}.exceptions:WorkerGroupStartupFailedError", "name", CONTROLLER,
          "a death at start is reported as the retriable failed start it is"),
    Touch(f"{V2}.execution.checkpoint.checkpoint_manager:CheckpointManager", "method", CONTROLLER,
          "a checkpoint registered at a held path replaces that one", ("register_checkpoint", "training_report")),
    *(Touch(f"{V2}.execution.checkpoint.checkpoint_manager:CheckpointManager", "attr", CONTROLLER,
            "the replaced registration is removed from every list that holds it", (a,))
      for a in ("_checkpoint_results", "_checkpoint_to_report_index", "_validated_checkpoints",
                "_timed_out_validation_checkpoints", "_failed_validation_checkpoints")),
    Touch(f"{V2}.callbacks.preemption_callback:PreemptionCallback", "name", CONTROLLER,
          "its watcher runs as a thread of the controller, not an actor"),
    Touch(f"{V2}.callbacks.preemption_callback:PreemptionCallback", "attr", CONTROLLER,
          "the watcher it holds is stopped and replaced", ("_watcher",)),
    Touch(f"{V2}.callbacks.preemption_callback:PreemptionCallback", "attr", CONTROLLER,
          "the preemption poll is set from our Polls", ("_poll_interval_s",)),
    Touch(f"{V2}.execution.preemption:PreemptionWatcher", "call", CONTROLLER,
          "built in the controller's process (it starts its own thread)",
          ("node_to_ranks", "worker_actors_by_rank", "poll_interval_s")),
    Touch(f"{V2}.execution.preemption:PreemptionWatcher", "attr", CONTROLLER,
          "set to end the watcher's thread", ("_stop_event",)),
    Touch(f"{V2}.constants:HEALTH_CHECK_INTERVAL_S_ENV_VAR", "name", CONTROLLER,
          "the polls' variables are kept out of the workers' runtime env"),
    Touch(f"{V2}.constants:PREEMPTION_POLL_INTERVAL_S_ENV_VAR", "name", CONTROLLER, "as above"),
    Touch(f"{V2}.constants:get_env_vars_to_propagate", "call", CONTROLLER,
          "Ray's propagated Train variables, less the polls'", ()),
    Touch(f"{V2}.callbacks:DatasetsCallback", "name", CONTROLLER,
          "left out of a run without Ray Datasets (a process fewer)"),
    Touch(f"{V2}.callbacks.placement_group_callback:PlacementGroupCleanerCallback", "name", CONTROLLER,
          "left out where the driver ends with its run (a process fewer)"),
    Touch("ray._private.worker:blocking_get_inside_async_warned", "name", CONTROLLER,
          "the controller blocks in ray.get on purpose: its warning is off in its process only"),
    Touch("ray._raylet:RAY_NODE_ID_KEY", "name", CONTROLLER,
          "a run's helpers are placed on the driver's node by label"),
    Touch("ray.train.v2.api.data_parallel_trainer:DataParallelTrainer", "method", CONTROLLER,
          "the controller actor is started with our class (Ray names its own inside)",
          ("_initialize_and_run_controller", "**controller_init_kwargs")),
    Touch("ray.train.v2.api.data_parallel_trainer:DataParallelTrainer", "method", CONTROLLER,
          "Ctrl-C aborts our controller as Ray's", ("_register_sigint_handler", "controller")),
    # the trainer (ray_compat/trainer.py)
    Touch("ray.train.v2.api.data_parallel_trainer:DataParallelTrainer", "method", TRAINER,
          "the default callbacks less the helpers a run does not need", ("_create_default_callbacks",)),
    Touch("ray.train.v2.api.data_parallel_trainer:DataParallelTrainer", "method", TRAINER,
          "local mode (--workers 0) runs our completed local controller",
          ("_initialize_and_run_local_controller", "train_func")),
    # scaling policies (ray_compat/scaling.py)
    Touch(f"{V2}.execution.scaling_policy:ElasticScalingPolicy", "name", SCALING,
          "elastic groups take only the worker counts the layout allows"),
    Touch(f"{V2}.execution.scaling_policy:FixedScalingPolicy", "name", SCALING,
          "a fixed group on a Ray with no autoscaler sends it no requests"),
    Touch(f"{V2}.execution.scaling_policy:ElasticScalingPolicy", "method", SCALING,
          "worker counts rounded down to the layout's", ("_count_possible_workers", "reserved_resources")),
    Touch(f"{V2}.execution.scaling_policy:ElasticScalingPolicy", "method", SCALING,
          "the nodes being drained are left out of the count", ("_get_reserved_resources",)),
    *(Touch(f"{V2}.execution.scaling_policy:ElasticScalingPolicy", "attr", SCALING,
            "the reserved-resources cache is refreshed after a group stops", (a,))
      for a in ("_latest_reserved_resources", "_latest_reserved_resources_query_time",
                "_autoscaling_coordinator", "_requester_id")),
    Touch(f"{V2}.execution.scaling_policy:ElasticScalingPolicy", "name", SCALING,
          "its answer is kept this long", ("GET_RESERVED_RESOURCES_INTERVAL_S",)),
    Touch(f"{V2}.execution.scaling_policy.autoscaling_coordinator_client:AUTOSCALING_REQUESTS_GET_TIMEOUT_S",
          "name", SCALING, "the coordinator's answer is waited for as long as Ray waits"),
    Touch(f"{V2}.execution.scaling_policy.scaling_policy:NoopDecision", "name", SCALING,
          "a drain keeps the group's size (the preemption path restarts it)"),
    Touch(f"{V2}.execution.scaling_policy.scaling_policy:ResizeDecision", "name", SCALING, "as above"),
    Touch(f"{V2}.util:time_monotonic", "call", SCALING, "the cache's clock, as Ray's", ()),
    Touch("ray._private.state:state", "name", SCALING, "the nodes being drained (get_draining_nodes)",
          ("get_draining_nodes",)),
    # the backend without torch (ray_compat/backend.py)
    Touch("ray._private.ray_constants:env_integer", "call", BACKEND,
          "the process group's shutdown timeout, read as Ray reads it", ("key", "default")),
    Touch("ray.train._internal.utils:get_address_and_port", "call", BACKEND,
          "rank 0's address and a free port for the process group", ()),
    Touch(f"{V2}.util:TrainingFramework", "name", BACKEND, "our TorchConfig says it is torch's",
          ("TORCH",)),
    *(Touch(f"ray.train.torch.config:{f}", "call", BACKEND, "run on the workers as Ray's backend runs it", p)
      for f, p in (("_set_torch_distributed_env_vars", ()),
                   ("_setup_torch_process_group", ("backend", "world_rank", "world_size", "init_method",
                                                   "timeout_s")),
                   ("_shutdown_torch", ("destroy_process_group",)))),
    # local mode (ray_compat/local_controller.py)
    Touch(f"{V2}.execution.local_mode.torch:LocalTorchController", "method", LOCAL,
          "the process group, then our storage and report", ("_set_train_fn_utils",)),
    Touch(f"{V2}.execution.storage:StorageContext", "call", LOCAL,
          "the run's storage in local mode (Ray's raises)", ("storage_path", "experiment_dir_name")),
    Touch(f"{V2}.execution.train_fn_utils:LocalTrainFnUtils", "call", LOCAL,
          "a report that writes the checkpoint (Ray's drops it)",
          ("experiment_name", "world_size", "world_rank", "local_rank", "local_world_size", "node_rank")),
    Touch(f"{V2}.execution.train_fn_utils:LocalTrainFnUtils", "method", LOCAL,
          "overridden: writes the checkpoint and calls the run's callbacks",
          ("report", "metrics", "checkpoint", "checkpoint_dir_name", "checkpoint_upload_mode",
           "delete_local_checkpoint_after_upload", "checkpoint_upload_fn", "validation")),
    *(Touch(f"{V2}.execution.train_fn_utils:LocalTrainFnUtils", "attr", LOCAL,
            "the context, and the Result's last metrics and checkpoint", (a,))
      for a in ("_context", "_last_metrics", "_last_checkpoint")),
    Touch(f"{V2}.execution.train_fn_utils:get_train_fn_utils", "call", LOCAL, "the rank's place", ()),
    Touch(f"{V2}.execution.train_fn_utils:set_train_fn_utils", "call", LOCAL, "ours in its place",
          ("train_fn_utils",)),
    # clusters (cluster/)
    Touch("ray._private.state:state", "name", "cluster.autoscale",
          "an autoscaler v2's limits", ("get_max_resources_from_cluster_config",)),
    Touch("ray._private.ray_constants:DEBUG_AUTOSCALING_STATUS", "name", "cluster.autoscale",
          "the v1 autoscaler's status report key"),
    Touch("ray.experimental.internal_kv:_internal_kv_get", "call", "cluster.autoscale",
          "reads the v1 autoscaler's status report", ("key",)),
    Touch("ray.autoscaler._private.util:format_readonly_node_type", "call", "cluster.autoscale",
          "a cluster with no autoscaler names its nodes so", ("node_id",)),
    Touch("ray.autoscaler._private.util:prepare_config", "call", "cluster.launcher",
          "cluster.yaml checked as `ray up` checks it, before launching", ("config",)),
    Touch("ray.autoscaler._private.util:validate_config", "call", "cluster.launcher", "as above", ("config",)),
    Touch("ray._private.authentication.authentication_token_setup:generate_and_save_token", "call",
          "cluster.local", "a local cluster's auth token, as ray start makes it", ()),
    Touch("ray._private.authentication.authentication_token_setup:_get_default_token_path", "call",
          "cluster.local", "the token file, made private to its owner", ()),
    Touch("ray._private.services:get_node_ip_address", "call", "cluster.local",
          "the address other machines reach a public local head at", ()),
    Touch("ray._raylet:AuthenticationTokenLoader", "name", "cluster.connect",
          "whether a token is at hand before connecting", ("instance",)),
    Touch("ray._raylet:GcsClient", "name", "cluster.connect", "probes an address before ray.init"),
    Touch("ray._raylet:Config", "name", "cluster.connect", "the auth mode re-read after it is set",
          ("initialize",)),
    Touch("ray._private.ray_constants:ENABLE_RAY_CLUSTER", "name", "cluster.connect",
          "a loopback cluster's clients look up this node's address as it does"),
)


def resolve(target: str):
    module, _, name = target.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _parameters(fn) -> list[str]:
    """The parameter names after self, *args and **kwargs marked so."""
    star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [star.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values()
            if p.name not in ("self", "cls")]


def _accepts(fn, names: tuple[str, ...]) -> list[str]:
    sig = inspect.signature(fn)
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    return [n for n in names if n not in sig.parameters]


def problem(t: Touch) -> Optional[str]:
    """What no longer holds of touch `t` in the installed Ray (None: all holds)."""
    label = f"{t.where} -> {t.target}"
    try:
        obj = resolve(t.target)
    except (ImportError, AttributeError) as e:
        return f"{label}: gone ({e}) [{t.why}]"
    if t.kind == "name":
        missing = [n for n in t.params or () if not hasattr(obj, n)]
        return f"{label}: has no {', '.join(missing)} [{t.why}]" if missing else None
    if t.kind == "call":
        if not callable(obj):
            return f"{label}: not callable [{t.why}]"
        missing = _accepts(obj, t.params or ())
        return f"{label}: takes no {', '.join(missing)} [{t.why}]" if missing else None
    if t.kind == "method":
        name, *params = t.params
        fn = getattr(obj, name, None)
        if fn is None:
            return f"{label}.{name}: gone [{t.why}]"
        got = _parameters(fn)
        return None if got == params else f"{label}.{name}: parameters {got}, not {params} [{t.why}]"
    if t.kind == "attr":
        (attr,) = t.params
        sources = []
        for cls in inspect.getmro(obj):
            if cls.__module__.startswith("ray."):
                try:
                    sources.append(inspect.getsource(cls))
                except (OSError, TypeError):
                    pass
        if not any(f"self.{attr}" in s for s in sources):
            return f"{label}: no longer sets self.{attr} [{t.why}]"
        return None
    return f"{label}: unknown kind {t.kind!r}"


def problems(touches=TOUCHES) -> list[str]:
    return [p for t in touches if (p := problem(t)) is not None]
