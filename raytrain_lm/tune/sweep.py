"""`tune`: a Ray Tune sweep in which every trial is a full distributed training.

Each trial is a Tune *function* trainable that builds the same `TorchTrainer` as `train` (through
`run/driver.build_trainer`) and fits it: Ray's pattern (passing a trainer to `Tuner` is
deprecated). The trial reports rank 0's rows to Tune as they come (trial_rows.py), so ASHA sees
`step` and `val_loss` as training goes; when ASHA stops a trial, Tune ends the trial actor, and
the trainer's controller and workers, which it owns, end with it.

A sweep's folder `<storage>/<name>/` holds Tune's experiment state (what `--resume` restores), one
folder per trial (Tune's result.json, the trial's config, its Train run with checkpoints under
`train/`), and ours: sweep.json, results.json, best.yaml, val_curves.png.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

from raytrain_lm import env
from raytrain_lm.cluster.connect import connect_ray
from raytrain_lm.config.checks import validate
from raytrain_lm.config.settings import TrainConfig, apply_overrides
from raytrain_lm.errors import UserError
from raytrain_lm.ray_compat.callbacks import ForwardMetrics, HeldRows
from raytrain_lm.ray_compat.polls import report_poll_seconds
from raytrain_lm.run.driver import build_trainer, choose_worker_cpus, say_idle_cpus
from raytrain_lm.run.preflight import check_resources, default_run_name, prepare_data
from raytrain_lm.store.claims import RunClaim
from raytrain_lm.store.files import SWEEP, TRIAL_CONFIG
from raytrain_lm.store.storage import RunFolder
from raytrain_lm.track import check_trackers
from raytrain_lm.tune.space import SearchSpace, nest
from raytrain_lm.tune.sweep_config import SweepSettings
from raytrain_lm.tune.trial_rows import follow_trial

# What the trial function itself asks for. Its workers get their own placement group from Ray Train,
# so the trial needs next to nothing; Tune refuses a request of exactly zero.
TRIAL_CPUS = 0.01


# ---------------------------------------------------------------- what each trial runs


# Each trial's controller handle, sent by the trial (run_trial) to the driver, which aborts the run
# of a trial ASHA stops. Module-level, not held by the Tune callback, because Tune pickles its
# callbacks into the sweep's state and actor handles do not belong there.
_CONTROLLERS: dict[str, Any] = {"queue": None, "handles": {}}


def abort_train_run(trial_id: str) -> None:
    """End a stopped trial's Train run through its controller, before Tune ends the trial actor.

    Killing the trial actor kills the controller and workers it owns, but in the Ray pinned in
    pyproject.toml the workers' placement group outlives them (it is tied to the job; Ray's
    PlacementGroupCleaner removes it only through the state API, i.e. with a dashboard running).
    Its CPUs then stay reserved and the next trial waits forever. `abort()` shuts the worker group
    down and removes the group."""
    import ray

    queue, handles = _CONTROLLERS["queue"], _CONTROLLERS["handles"]
    if queue is None:
        return
    while not queue.empty():
        tid, handle = queue.get_nowait()
        handles[tid] = handle
    handle = handles.pop(trial_id, None)
    if handle is None:
        return
    try:
        ray.get(handle.abort.remote(), timeout=60)
    except Exception:  # already finished and gone (the usual case for completed trials), or exited
        pass


def _stop_callback():
    from ray import tune

    class AbortStoppedTrainRuns(tune.Callback):
        # Tune calls on_trial_complete before it ends the trial's actor.
        def on_trial_complete(self, iteration, trials, trial, **info):
            abort_train_run(trial.trial_id)

    return AbortStoppedTrainRuns()


def trial_config(base: dict, params: dict) -> TrainConfig:
    """The TrainConfig of one trial: the sweep's base config with the sampled point applied."""
    cfg = TrainConfig.from_dict(copy.deepcopy(base))
    apply_overrides(cfg, nest(params), source="trial")
    validate(cfg)
    cfg.ref_batch_tokens = cfg.tokens_per_step  # the batch this trial's lr was tried at
    cfg.ref_width = cfg.model.n_embd  # and the width
    return cfg


def run_trial(params: dict, base: dict, sweep_uri: str, controllers, poll_seconds: float,
              drills: Optional[dict[str, str]] = None) -> None:
    """The Tune function trainable: one full distributed training. `drills`: the sweep driver's
    drill variables (env.drills), set here, in the trial's own process, as a train's driver
    hands them to its workers."""
    from ray import tune

    env.set_drills(drills or {})
    cfg = trial_config(base, params)
    trial_dir = os.path.basename(tune.get_context().get_trial_dir().rstrip("/"))
    cfg.storage, cfg.name = f"{sweep_uri}/{trial_dir}", "train"
    RunFolder(sweep_uri, trial_dir).write_json(TRIAL_CONFIG, cfg.to_dict())
    # Same RunConfig(storage, name) as before a driver died: Ray Train resumes from its checkpoints.
    trainer = build_trainer(cfg, RunFolder(cfg.storage, cfg.name),
                            callbacks=[ForwardMetrics(HeldRows())], poll_seconds=poll_seconds)
    trial_id = tune.get_context().get_trial_id()
    follow_trial(trainer, tune.report, announce=lambda controller: controllers.put((trial_id, controller)))


# ---------------------------------------------------------------- driver


# The files of a sweep that Ray Tune unpickles when it is resumed (Tuner.restore), and so could
# run code: the experiment's state, the searcher's, and each trial's pickled config and error.
TUNE_STATE = ("tuner.pkl", "experiment_state-*", "basic-variant-state-*", "search_gen_state-*",
              "searcher-state-*", "*/error.pkl", "*/params.pkl")


def check_sweep_state(folder: RunFolder, say: Callable[[str], None]) -> None:
    """`tune --resume` unpickles the sweep's Tune state (TUNE_STATE), which can run code: on a
    local disk every such file must be this user's and writable by no one else, else the resume
    is refused. On an object store the writer cannot be known here: a warning says who is
    trusted (cluster.yaml's worker role may not write these files: docs/aws/worker-policy.json)."""
    import stat

    if not folder.local:
        say(f"warning: resuming unpickles Tune's state in {folder.display_path()}: whoever can "
            f"write there can run code here")
        return
    for pattern in TUNE_STATE:
        for path in Path(folder.path).glob(pattern):
            st = path.lstat()
            if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or \
                    stat.S_ISLNK(st.st_mode):
                raise UserError(f"refusing to resume: {path} was written by another user or "
                                f"others may write it, and resuming unpickles it (it could run "
                                f"code as you); remove it, or start a new sweep")


def trial_capacity(cfg: TrainConfig) -> tuple[int, str]:
    """How many trials the cluster holds at once, and why."""
    import ray

    total = ray.cluster_resources()
    per = cfg.workers * cfg.worker_cpus + TRIAL_CPUS
    n = int(total.get("CPU", 0) // per)
    why = f"{total.get('CPU', 0):g} CPUs, {per:g} per trial"
    if cfg.use_gpu:
        n = min(n, int(total.get("GPU", 0) // cfg.workers))
        why += f", {total.get('GPU', 0):g} GPUs, {cfg.workers} per trial"
    return n, why


def _trainable(cfg: TrainConfig, sweep_uri: str):
    from ray import tune

    from raytrain_lm.ray_compat.controller import driver_queue

    _CONTROLLERS["queue"], _CONTROLLERS["handles"] = driver_queue(), {}
    # The trial runs in its own process: the driver's poll setting travels with it.
    fn = tune.with_parameters(run_trial, base=cfg.to_dict(), sweep_uri=sweep_uri,
                              controllers=_CONTROLLERS["queue"],
                              poll_seconds=report_poll_seconds(), drills=env.drills())
    return tune.with_resources(fn, {"cpu": TRIAL_CPUS})


def _trial_name(trial) -> str:
    return f"trial_{trial.trial_id}"


def default_sweep_name(cfg: TrainConfig) -> str:
    return f"tune-{default_run_name(cfg)}"


def run_sweep(
    cfg: TrainConfig,
    space: Optional[SearchSpace],
    settings: Optional[SweepSettings],
    *,
    resume: bool = False,
    verbose: bool = False,
    say: Callable[[str], None] = print,
    live: Optional[Callable[[str], None]] = None,
    live_interval: float = 10.0,
    track: Optional[list[str]] = None,
) -> dict:
    """Run (or, with resume, continue) the sweep `cfg.name` in `cfg.storage`; returns the summary.
    `track`: trackers that get a run per trial, grouped by the sweep (tune/trial_tracking.py).

    For a resume, only cfg.name, cfg.storage and cfg.address are used: the rest comes from the
    sweep's own sweep.json, its trackers included."""
    if resume:
        if not cfg.name:
            raise UserError("--resume needs --name of the sweep to continue")
        folder = RunFolder(cfg.storage, cfg.name)
        if not folder.exists(SWEEP):
            raise UserError(f"cannot resume: no sweep named {cfg.name!r} in {cfg.storage}")
        check_sweep_state(folder, say)  # before anything of it is unpickled
        saved = folder.read_json(SWEEP)
        address = cfg.address
        cfg = TrainConfig.from_dict(saved["base"])
        cfg.address = address
        space = SearchSpace.from_json(saved["space"])
        settings = SweepSettings(**saved["settings"])
        track = check_trackers(saved.get("track"))
    else:
        cfg.name = cfg.name or default_sweep_name(cfg)
        folder = RunFolder(cfg.storage, cfg.name)
        if folder.exists():
            raise UserError(f"a sweep or run named {cfg.name!r} already exists in {cfg.storage}; "
                            f"pass --resume to continue it or choose another --name")
        folder.check_can_create()
        track = check_trackers(track)
        prepare_data(cfg, say)
    assert space is not None and settings is not None
    with RunClaim(folder):  # one driver per sweep folder, from before Ray is reached
        return _run(cfg, space, settings, folder, resume, verbose, say, live, live_interval, track)


def _run(cfg: TrainConfig, space: SearchSpace, settings: SweepSettings, folder: RunFolder,
         resume: bool, verbose: bool, say: Callable[[str], None],
         live: Optional[Callable[[str], None]], live_interval: float, track: list[str]) -> dict:
    """run_sweep from connecting to Ray on, with the sweep's folder claimed."""
    own_ray = choose_worker_cpus(cfg, None, say, trials=settings.concurrent)
    connect_ray(cfg.address, cfg.workers * cfg.worker_cpus + TRIAL_CPUS, verbose, say)
    check_resources(cfg)
    capacity, why = trial_capacity(cfg)
    if capacity < 1:
        raise UserError(f"one trial of {cfg.workers} workers does not fit the cluster ({why})")
    concurrent = settings.concurrent
    if concurrent > capacity:
        say(f"warning: --concurrent {concurrent} but the cluster holds {capacity} trial"
            f"{'s' if capacity > 1 else ''} of {cfg.workers} workers at a time ({why}); "
            f"running {capacity} at once, the others wait in the queue")
        concurrent = capacity
    if not own_ray:
        say_idle_cpus(cfg, None, say, workers=cfg.workers * concurrent)

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # Validation runs every eval_every steps; other reports (loss, lr, throughput) carry no
    # val_loss. ASHA skips those, but Tune's strict check would fail the trial on them.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    # Tune's own console output (a banner and paths, even at verbose=0) stays off: the live table
    # is ours, and --json must leave nothing else on stdout.
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    from raytrain_lm.tune.report import LiveTable, collect_trials, watch, write_outputs
    from raytrain_lm.tune.trial_tracking import SINK, TrackTrials

    SINK["say"] = say

    watch(live, live_interval)
    trainable = _trainable(cfg, folder.display_path())
    if resume:
        from ray.tune import Tuner

        if not Tuner.can_restore(folder.display_path()):
            raise UserError(f"cannot resume: {folder.display_path()} holds no Tune experiment state")
        say(f"resuming sweep {cfg.name}: finished trials are kept, unfinished ones continue "
            f"from their latest checkpoint")
        # The saved RunConfig comes back with it, LiveTable included (its output goes to SINK).
        tuner = Tuner.restore(folder.display_path(), trainable=trainable, resume_unfinished=True,
                              resume_errored=True)
    else:
        say(f"search space: {space.describe()}")
        folder.write_json(SWEEP, {"base": cfg.to_dict(), "space": space.to_json(),
                                  "settings": asdict(settings), "track": track})
        tracking = [TrackTrials(track, cfg.storage, cfg.name, cfg.to_dict(), space.describe())] if track else []
        tuner = tune.Tuner(
            trainable,
            param_space=space.param_space(settings.search),
            tune_config=tune.TuneConfig(
                metric=settings.metric, mode="min",
                # stop_last_trials=False: a trial that reaches max_steps ends on its own, cleanly.
                scheduler=ASHAScheduler(time_attr="step", max_t=cfg.max_steps,
                                        grace_period=settings.grace_steps,
                                        reduction_factor=settings.reduction_factor,
                                        stop_last_trials=False),
                search_alg=BasicVariantGenerator(random_state=settings.seed,
                                                 max_concurrent=concurrent),
                num_samples=settings.trials if settings.search == "random" else 1,
                trial_name_creator=_trial_name, trial_dirname_creator=_trial_name,
                reuse_actors=False,
            ),
            run_config=tune.RunConfig(
                name=cfg.name, storage_path=folder.storage_uri, verbose=0,
                callbacks=[_stop_callback(), LiveTable(cfg.max_steps, space.keys, settings.trials),
                           *tracking],
                failure_config=tune.FailureConfig(max_failures=0)),
        )
    t0 = time.time()
    try:
        grid = tuner.fit()
    finally:
        watch(None, live_interval)
        _CONTROLLERS["queue"], _CONTROLLERS["handles"] = None, {}
    trials = collect_trials(grid, cfg.max_steps, space.keys, settings.metric)
    return write_outputs(folder, cfg, space, settings, trials, wall=time.time() - t0)
