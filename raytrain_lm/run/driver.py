"""Driver side of `train`: connect to Ray, build the TorchTrainer, follow the run (progress lines,
metrics.jsonl, TensorBoard, summary.json) and return its summary. What is checked before any of
this happens is in preflight.py."""

from __future__ import annotations

import time
from typing import Callable, Optional

from raytrain_lm import env
from raytrain_lm.cluster.connect import check_reachable, connect_ray, starts_own_ray
from raytrain_lm.config.checks import validate
from raytrain_lm.config.inputs import WorkerInputs
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.config.sizes import is_elastic, sizes_line
from raytrain_lm.errors import RunFailed, UserError, last_line
from raytrain_lm.plan.auto import auto_cluster, choose_layout, cluster_kind, cluster_shape, kind_text
from raytrain_lm.plan.fit import check_memory
from raytrain_lm.ray_compat.polls import Polls
from raytrain_lm.run.cpus import OMP_ENV, decide, idle_line, machine_cores, torch_threads
from raytrain_lm.run.follower import Follower, checkpoint_uri
from raytrain_lm.run.preflight import (
    check_init_from,
    check_resources,
    configured_memory_gb,
    default_run_name,
    init_line,
    prepare_data,
    resume_step,
    worker_memory_gb,
    workers_kind,
)
from raytrain_lm.run.tracked import Figure, close_tracking, open_tracking, trackers_of
from raytrain_lm.store import files
from raytrain_lm.store.claims import RunClaim, live_claims
from raytrain_lm.store.runs import best_val_loss
from raytrain_lm.store.storage import RunFolder


def loop_config(cfg: TrainConfig, init_from: Optional[str] = None, fail_at: Optional[str] = None,
                force: bool = False) -> WorkerInputs:
    """What every worker's `train_loop_per_worker` is given (see build_trainer)."""
    return WorkerInputs(train=cfg.to_dict(), run_name=cfg.name, init_from=init_from,
                        fail_at=fail_at, force=force, log_windows=env.log_windows(),
                        nan_at=env.nan_at(), hold_at=env.hold_at())


def build_trainer(cfg: TrainConfig, run: RunFolder, callbacks: Optional[list] = None,
                  init_from: Optional[str] = None, fail_at: Optional[str] = None,
                  poll_seconds: Optional[float] = None, force: bool = False,
                  worker_env: Optional[dict[str, str]] = None, pg_cleaner: bool = True,
                  autoscaler: bool = True, local: bool = False):
    """The TorchTrainer for `cfg`, writing into `run`'s folder. Used by `train` and by each Tune
    trial. `poll_seconds`: the report poll (ray_compat/polls.py). `force`: workers skip their memory check.
    `worker_env`: environment variables of the worker processes (--worker-env). `pg_cleaner`:
    see controller.helper_callbacks. `autoscaler`: see trainer.Trainer. `local`: Ray Train's
    local mode (ray_compat/local_controller.py), in this process: `ScalingConfig(num_workers=0)`."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig

    from raytrain_lm.ray_compat.scaling import failure_config, scaling_config
    from raytrain_lm.ray_compat.trainer import Trainer, local_train_loop, train_loop

    return Trainer(
        local_train_loop if local else train_loop,
        cfg=cfg,
        local_threads=torch_threads(cfg.worker_cpus, env.omp_threads()),
        polls=Polls.for_run(poll_seconds),
        pg_cleaner=pg_cleaner,
        autoscaler=autoscaler,
        train_loop_config=loop_config(cfg, init_from, fail_at, force),
        scaling_config=ScalingConfig(num_workers=0) if local else scaling_config(cfg),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=run.storage_uri,
            failure_config=failure_config(cfg),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            callbacks=callbacks or [],
            worker_runtime_env={"env_vars": dict(worker_env)} if worker_env else None,
        ),
    )


def run_training(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    init_from: Optional[str] = None,
    verbose: bool = False,
    force: bool = False,
    say: Callable[[str], None] = print,
    on_metrics: Optional[Callable[[dict], None]] = None,
    poll_seconds: Optional[float] = None,
    worker_env: Optional[dict[str, str]] = None,
    track: Optional[list[str]] = None,
    figure: Optional[Figure] = None,
) -> dict:
    """Train `cfg` on a Ray cluster; returns the summary (also written to summary.json).

    With `resume`, the run `cfg.name` continues from its latest valid checkpoint (the caller
    loads the run's saved config: see `saved_config`), and its tracking runs too. `track`:
    trackers to send the run to (run/tracked.py), `figure` drawing the curves they keep."""
    t_launch = time.time()
    run = run_folder(cfg, resume)
    trackers = trackers_of(run, track, resume)
    manifest = prepare_data(cfg, say)
    if resume and (step := resume_step(cfg, run, manifest)) is not None:
        say(f"resuming {cfg.name} from its newest checkpoint, step {step}")
    if init_from:
        init_from = check_init_from(init_from, cfg, manifest, say)
        say(init_line(init_from, cfg))
    previous = previous_summary(run) if resume else {}
    known = configured_memory_gb(cfg)
    if not force and cfg.layout != "auto":  # before Ray starts when --gpu-memory-gb tells it
        check_memory(cfg, known)
    # The folder is this driver's from here on, before Ray is reached (another `train --name`
    # of the same run is refused), until it returns.
    with RunClaim(run):
        return _launch(cfg, run, t_launch, previous, known, resume=resume,
                       init_from=init_from, verbose=verbose, force=force, say=say,
                       on_metrics=on_metrics, poll_seconds=poll_seconds, worker_env=worker_env,
                       trackers=trackers, figure=figure)


def _launch(cfg: TrainConfig, run: RunFolder, t_launch: float, previous: dict,
            known: Optional[float], *, resume: bool, init_from: Optional[str], verbose: bool,
            force: bool, say: Callable[[str], None], on_metrics: Optional[Callable[[dict], None]],
            poll_seconds: Optional[float], worker_env: Optional[dict[str, str]],
            trackers: list[str], figure: Optional[Figure]) -> dict:
    """run_training from connecting to Ray on, with the run's folder claimed."""
    # Ray Train and the Ray connection are imported only now: a bad input above fails in a
    # second, not after ~2 s of imports; nor does an address where nothing answers
    check_reachable(cfg.address or env.ray_address() or "local")
    from raytrain_lm.ray_compat.callbacks import ForwardMetrics, HeldRows, KeepBest

    asked = cfg.cpus_per_worker  # None: the launch decides (run/cpus.py); a resume decides again
    own_ray = choose_worker_cpus(cfg, worker_env, say)
    started_ray = connect_ray(cfg.address, cfg.workers * cfg.worker_cpus, verbose, say)
    check_resources(cfg, say)
    if not own_ray:
        say_idle_cpus(cfg, worker_env, say)
    if cfg.layout == "auto":
        auto_layout(cfg, say)
    if not force and known is None:  # else from Ray's accelerator labels or memory resource
        memory = worker_memory_gb(cfg)
        check_memory(cfg, memory, workers_kind(cfg, memory))

    callbacks = [ForwardMetrics(HeldRows()), KeepBest(best_val_loss(run) if resume else None)]
    trainer = build_trainer(cfg, run, callbacks=callbacks, init_from=init_from,
                            fail_at=env.fail_at(), poll_seconds=poll_seconds,
                            force=force, worker_env=worker_env,
                            pg_cleaner=False,  # this driver's job ends with the run
                            autoscaler=not started_ray)
    run.write_json(files.CONFIG, {**cfg.to_dict(), "cpus_per_worker": asked})  # for --resume
    if is_elastic(cfg):
        say(sizes_line(cfg))
    follower = Follower(cfg, run, t_launch, previous, resume, say, on_metrics)
    follower.write_summary("running")  # kept current: after a crash of this driver it still tells
    follower.tracking = open_tracking(trackers, run, cfg.to_dict(), say, follower.log.rows)
    try:
        result, error = follower.follow(trainer)
    except KeyboardInterrupt:  # Ctrl-C: the tracking runs say so, then the CLI does
        close_tracking(follower.tracking, follower.write_summary("running"), follower.log.rows,
                       "killed", figure)
        raise

    checkpoint = checkpoint_uri(run, result.checkpoint.path) if result is not None and result.checkpoint else None
    if checkpoint is None:
        checkpoint = next((r["checkpoint"] for r in reversed(follower.log.rows) if r.get("checkpoint")), None)
    stopped = follower.stopped(checkpoint) if error is None else None
    final = follower.write_summary("failed" if error or stopped else "completed", checkpoint,
                                   _describe(error) if error else stopped)
    close_tracking(follower.tracking, final, follower.log.rows, final["status"], figure)
    final["run_dir"] = run.display_path()
    if stopped:
        raise RunFailed(stopped)
    if error is not None:
        raise _user_error_inside(error) or UserError(
            f"training failed: {_describe(error)} (summary in {run.display_path(files.SUMMARY)})")
    return final


def choose_worker_cpus(cfg: TrainConfig, worker_env: Optional[dict[str, str]],
                       say: Callable[[str], None], trials: int = 1) -> bool:
    """Set cfg.cpus_per_worker for this launch (cpus.decide: on a Ray this process is about to
    start, the machine's cores shared among the workers of `trials` concurrent trials) and say
    it in the launch line. Returns whether this process will start its own Ray."""
    own_ray = starts_own_ray(cfg.address)
    omp = (worker_env or {}).get(OMP_ENV) or (env.omp_threads() if own_ray else None)
    chosen = decide(cfg.cpus_per_worker, cfg.workers, own_ray, machine_cores(), trials, omp)
    cfg.cpus_per_worker = chosen.cpus
    if chosen.line:
        say(chosen.line)
    return own_ray


def say_idle_cpus(cfg: TrainConfig, worker_env: Optional[dict[str, str]],
                  say: Callable[[str], None], workers: Optional[int] = None) -> None:
    """On a cluster: one line when the workers (`workers`, default the run's), as Ray would
    pack them on its nodes, leave a node's CPUs idle (cpus.idle_line)."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    line = idle_line(nodes, workers or cfg.workers, cfg.worker_cpus, cfg.use_gpu,
                     (worker_env or {}).get(OMP_ENV))
    if line:
        say(line)


def auto_layout(cfg: TrainConfig, say: Callable[[str], None]) -> None:
    """--layout auto: ask Ray for the cluster's shape, let the planner choose, say what and why,
    and train with it (cfg changed in place; the run's saved config records the choice)."""
    import ray

    nodes = ray.nodes()
    per_node, memory = cluster_shape(cfg, nodes, worker_memory_gb(cfg))
    kind = cluster_kind(nodes, memory) if cfg.use_gpu else None
    best, why = choose_layout(cfg, auto_cluster(cfg, per_node, memory, kind))
    best.layout.apply(cfg)
    validate(cfg)
    say(f"layout auto: {best.layout.flags()} (~{best.reserved / 2**30:.1f} GiB per worker of "
        f"{memory:g}, {kind_text(kind, cfg.use_gpu)}); {why}")


def run_folder(cfg: TrainConfig, resume: bool) -> RunFolder:
    """The run's folder: an existing one to resume, else a new name."""
    if cfg.name is None:
        if resume:
            raise UserError("--resume needs --name of the run to continue")
        cfg.name = default_run_name(cfg)
    run = RunFolder(cfg.storage, cfg.name)
    if run.exists() and (others := live_claims(run)):
        raise UserError(f"run {cfg.name!r} in {cfg.storage} is in use by another driver (pid "
                        f"{others[0]['pid']} on {others[0]['host']}); wait until it ends, or "
                        f"choose another --name")
    if resume and not run.exists():
        raise UserError(f"cannot resume: no run named {cfg.name!r} in {cfg.storage}")
    if not resume and run.exists():
        raise UserError(f"a run named {cfg.name!r} already exists in {cfg.storage}; "
                        f"pass --resume to continue it or choose another --name")
    if not resume:
        run.check_can_create()
    return run


def saved_config(storage: str, name: Optional[str]) -> dict:
    """The config a run was started with, for --resume."""
    if not name:
        raise UserError("--resume needs --name of the run to continue")
    run = RunFolder(storage, name)
    if not run.exists():
        raise UserError(f"cannot resume: no run named {name!r} in {storage}")
    if not run.exists(files.CONFIG):
        raise UserError(f"cannot resume {name!r}: it has no {files.CONFIG} (not a raytrain-lm run?)")
    try:
        config = run.read_json(files.CONFIG)
    except UserError as e:
        raise UserError(f"cannot resume {name!r}: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"cannot resume {name!r}: {run.display_path(files.CONFIG)} is damaged: "
                        f"not a JSON object")
    return config


def previous_summary(run: RunFolder) -> dict:
    """A resumed run's summary.json so far; {} when it has none or it is damaged (it only counts
    the restarts and resizes so far, which a damaged one cannot tell)."""
    try:
        found = run.read_json(files.SUMMARY) if run.exists(files.SUMMARY) else {}
    except UserError:
        return {}
    return found if isinstance(found, dict) else {}


def _user_error_inside(error: BaseException) -> Optional[UserError]:
    """A UserError raised on a worker (e.g. no valid checkpoint) is still the user's to fix."""
    failures = getattr(error, "worker_failures", None) or {}
    for exc in failures.values():
        inner = exc
        while inner is not None:
            if isinstance(inner, UserError):
                return UserError(str(inner))
            inner = getattr(inner, "cause", None) or inner.__cause__
    return None


def _describe(error: BaseException) -> str:
    failures = getattr(error, "worker_failures", None)
    if failures:
        from raytrain_lm.ray_compat.callbacks import describe_failures

        return describe_failures(failures)
    return last_line(error)
