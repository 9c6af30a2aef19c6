"""`train --workers 0`: the run in this process, on Ray Train's local mode
(ray_compat/local_controller.py), with no Ray cluster: for debugging, notebooks, profilers and a
quick first try. Under torchrun (`torchrun --nproc_per_node N cli.py train --workers 0`) this
process is one of N ranks over torch.distributed; rank 0 is the driver: it checks and claims the
run's folder, chooses its name, writes config.json, metrics.jsonl, the TensorBoard events and
summary.json, and prints. The other ranks write their checkpoint shards only, and train with rank
0's inputs.

The same loop, files and summary as a run on Ray: the rows reach the driver through the same
callbacks (ForwardMetrics, KeepBest), called by the local controller on rank 0 instead of Ray's
controller, and the driver's Follower writes them as it does for Ray. No restarts: a failure ends
the run (its summary says so), and --resume continues it."""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Callable, Optional

from raytrain_lm import env
from raytrain_lm.config.checks import MAX_COUNT, validate
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.config.sizes import is_elastic
from raytrain_lm.errors import RunFailed, UserError, last_line
from raytrain_lm.plan.fit import check_memory
from raytrain_lm.run.cpus import decide, machine_cores
from raytrain_lm.run.driver import build_trainer, previous_summary, run_folder
from raytrain_lm.run.follower import Follower, checkpoint_uri
from raytrain_lm.run.preflight import (
    check_init_from,
    configured_memory_gb,
    init_line,
    prepare_data,
    resume_step,
)
from raytrain_lm.run.tracked import Figure, close_tracking, open_tracking, trackers_of
from raytrain_lm.store import files
from raytrain_lm.store.claims import RunClaim
from raytrain_lm.store.runs import best_val_loss
from raytrain_lm.store.storage import RunFolder


def local_place() -> tuple[int, int, int]:
    """(rank, ranks, ranks on this node): torchrun's, checked, else (0, 1, 1). A rank outside the
    world, a port that is none or a value that is no number would hang in torch's rendezvous or
    end in its traceback: refused here, one line, before anything starts."""
    given = env.torchrun_vars()
    if given is None:
        return 0, 1, 1
    where = "torchrun's environment"
    numbers = {}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        text = given[name].strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 9:
            raise UserError(f"{where}: {name}={given[name]!r} is not a whole number >= 0 (torchrun "
                            f"sets it; a launcher that sets it by hand must too)")
        numbers[name] = int(text)
    rank, local, world, local_world, port = (numbers[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                  "LOCAL_WORLD_SIZE", "MASTER_PORT"))
    if not 1 <= world <= MAX_COUNT:
        raise UserError(f"{where}: WORLD_SIZE={world} must be between 1 and {MAX_COUNT:,}")
    if rank >= world:
        raise UserError(f"{where}: RANK={rank} with WORLD_SIZE={world}: the ranks are 0 to "
                        f"{world - 1}; the same WORLD_SIZE for every rank, each its own RANK")
    if not 1 <= local_world <= world or local >= local_world:
        raise UserError(f"{where}: LOCAL_RANK={local} and LOCAL_WORLD_SIZE={local_world} with "
                        f"WORLD_SIZE={world}: a node's ranks are 0 to LOCAL_WORLD_SIZE-1, and it "
                        f"holds at most WORLD_SIZE of them")
    if not 1 <= port <= 65535:
        raise UserError(f"{where}: MASTER_PORT={port} is not a port (1 to 65535)")
    addr = given["MASTER_ADDR"]
    if not addr or len(addr) > 253 or any(c.isspace() for c in addr):
        raise UserError(f"{where}: MASTER_ADDR={addr!r} is not a host name or address (rank 0's)")
    return rank, world, local_world


def check_local(cfg: TrainConfig, saved_max_failures: int, worker_env: dict) -> None:
    """What `--workers 0` cannot do, refused before anything starts, one line each.
    `saved_max_failures`: a resumed run's own setting (not asked for now), else the default."""
    ranks = local_place()[1]
    if cfg.address:
        raise UserError("--workers 0 trains in this process, without Ray: drop --address (or "
                        "train on that cluster with --workers N)")
    if cfg.workers != ranks or is_elastic(cfg):
        raise UserError(f"--workers 0 trains a fixed group ({ranks} rank{'s' if ranks != 1 else ''}: "
                        f"this process, or torchrun's); elastic sizes need Ray's worker groups: "
                        f"use --workers MIN-MAX, or drop the workers settings")
    if cfg.max_failures != saved_max_failures:
        raise UserError("--max-failures restarts Ray's worker groups; --workers 0 has none to "
                        "restart (a failure ends the run, --resume continues it): drop it, or "
                        "train on Ray with --workers N")
    if worker_env:
        raise UserError("--worker-env sets the environment of Ray's worker processes; with "
                        "--workers 0 the training runs in this process: set the variables on "
                        "this command instead")
    if cfg.layout == "auto":
        raise UserError("--layout auto plans on the cluster Ray reports; with --workers 0 give "
                        "the layout yourself (--tp, --pp, --strategy)")


def use_gpus(use_gpu: bool, local_ranks: int) -> None:
    """The GPUs of a run in this process are what --use-gpu says, as on Ray (Ray Train's local
    mode would take any GPU torch sees): without it none are visible to this process (before
    torch looks); with it, every rank of this node needs one."""
    from raytrain_lm.ray_compat.local_controller import cuda_devices

    if not use_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run, as a Ray worker without a GPU
        return
    found = cuda_devices()
    if found < local_ranks:
        raise UserError(f"--use-gpu: torch sees {found} CUDA GPU{'s' if found != 1 else ''} here, "
                        f"and each of this node's {local_ranks} rank{'s' if local_ranks != 1 else ''} "
                        f"needs one; drop --use-gpu to train on the CPU")


def local_gpu_kind() -> Optional[str]:
    """The GPU kind (plan/gpus.py) of this node's GPUs, by the first one's name (use_gpus
    checked there is one per rank), for the memory check."""
    import torch  # torch: the loop runs in this process

    from raytrain_lm.plan.gpus import kind_of_device

    return kind_of_device(torch.cuda.get_device_name(0))


def quiet_worker_notes() -> None:
    """Ray Train's notes that go to a Ray worker's log, not to the terminal: that local mode is on,
    where the model moved, that it is wrapped in DDP, a deprecation inside Ray's prepare_model."""
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray\.train\.")


def launch_line(cfg: TrainConfig, ranks: int, local_ranks: int) -> str:
    """What `train --workers 0` says it runs, and on how many threads (set cfg.cpus_per_worker)."""
    chosen = decide(cfg.cpus_per_worker, local_ranks, True, machine_cores(), 1, env.omp_threads())
    cfg.cpus_per_worker = chosen.cpus
    threads = f"{chosen.threads} torch thread{'s' if chosen.threads != 1 else ''}"
    if env.omp_threads():
        why = f"{env.OMP_ENV}={env.omp_threads()}"
    elif chosen.line and "as set" in chosen.line:
        why = "cpus_per_worker as set"
    else:
        why = f"this machine's {machine_cores()} cores" + (" shared" if local_ranks > 1 else "")
    if ranks == 1:
        return (f"local mode: training in this process, no Ray cluster (Ray Train's local mode; "
                f"{threads}: {why})")
    return (f"torchrun: {ranks} ranks, Ray Train's local mode on torch.distributed, no Ray cluster "
            f"(rank 0 writes the run; {threads} each: {why})")


def run_local(cfg: TrainConfig, *, resume: bool = False, init_from: Optional[str] = None,
              force: bool = False, verbose: bool = False, say: Callable[[str], None] = print,
              on_metrics: Optional[Callable[[dict], None]] = None,
              track: Optional[list[str]] = None, figure: Optional[Figure] = None) -> Optional[dict]:
    """Train `cfg` in this process (and its torchrun peers). Returns the summary on rank 0 (also
    in summary.json), None on the other ranks. Without `verbose`, Ray Train's notes to its
    workers' logs (which a run on Ray shows only with --verbose) stay off the terminal. `track`,
    `figure`: rank 0's tracking runs, as in driver.run_training."""
    t_launch = time.time()
    if not verbose:
        quiet_worker_notes()
    rank, ranks, local_ranks = local_place()
    cfg.workers, cfg.min_workers = ranks, None
    validate(cfg)  # the layout at this size: --tp x --pp divides the ranks
    use_gpus(cfg.use_gpu, local_ranks)
    if ranks > 1:  # every rank here, or the ones that are not named, before anything is written
        from raytrain_lm.ray_compat.local_controller import join_torchrun

        join_torchrun(cfg.rendezvous_timeout)
    asked = cfg.cpus_per_worker  # None: this launch decides (launch_line); a resume decides again
    line = launch_line(cfg, ranks, local_ranks)
    if rank != 0:  # everything else is rank 0's (inputs, name, files)
        build_trainer(cfg, RunFolder(cfg.storage, cfg.name or "named-by-rank-0"), local=True).fit()
        return None
    run = run_folder(cfg, resume)
    trackers = trackers_of(run, track, resume)
    say(line)
    manifest = prepare_data(cfg, say)
    if resume and (step := resume_step(cfg, run, manifest)) is not None:
        say(f"resuming {cfg.name} from its newest checkpoint, step {step}")
    if init_from:
        init_from = check_init_from(init_from, cfg, manifest, say)
        say(init_line(init_from, cfg))
    previous = previous_summary(run) if resume else {}
    if not force:  # on the kind this process's GPU is, as a Ray run on its workers' label
        memory = configured_memory_gb(cfg)
        check_memory(cfg, memory, local_gpu_kind() if memory else None)
    with RunClaim(run):
        run.write_json(files.CONFIG, {**cfg.to_dict(), "cpus_per_worker": asked})  # for --resume
        return _train(cfg, run, t_launch, previous, resume=resume, init_from=init_from,
                      force=force, say=say, on_metrics=on_metrics, trackers=trackers, figure=figure)


class _Rows:
    """ForwardMetrics' queue in local mode: each row goes to the Follower as it comes."""

    def __init__(self, follower: Follower, tensorboard):
        self.follower, self.tensorboard = follower, tensorboard

    def put(self, row: dict) -> None:
        self.follower.take(row, self.tensorboard)


def _train(cfg: TrainConfig, run: RunFolder, t_launch: float, previous: dict, *, resume: bool,
           init_from: Optional[str], force: bool, say: Callable[[str], None],
           on_metrics: Optional[Callable[[dict], None]], trackers: list[str],
           figure: Optional[Figure]) -> dict:
    from raytrain_lm.ray_compat.callbacks import ForwardMetrics, KeepBest
    from raytrain_lm.run.tensorboard import TensorBoardLog

    follower = Follower(cfg, run, t_launch, previous, resume, say, on_metrics)
    follower.write_summary("running")
    follower.tracking = open_tracking(trackers, run, cfg.to_dict(), say, follower.log.rows)
    tensorboard = TensorBoardLog(run, say)
    callbacks = [ForwardMetrics(_Rows(follower, tensorboard)),
                 KeepBest(best_val_loss(run) if resume else None)]
    trainer = build_trainer(cfg, run, callbacks=callbacks, init_from=init_from,
                            fail_at=env.fail_at(), force=force, local=True)
    result, error = None, None
    try:
        result = trainer.fit()
    except KeyboardInterrupt:  # Ctrl-C: the tracking runs say so, then the CLI does
        close_tracking(follower.tracking, follower.write_summary("running"), follower.log.rows,
                       "killed", figure)
        raise
    except BaseException as e:  # the summary says it failed; the error itself goes on up
        error = e
    finally:
        tensorboard.close()
    checkpoint = checkpoint_uri(run, result.checkpoint.path) if result is not None and result.checkpoint else None
    if checkpoint is None:
        checkpoint = next((r["checkpoint"] for r in reversed(follower.log.rows) if r.get("checkpoint")), None)
    stopped = follower.stopped(checkpoint) if error is None else None  # a non-finite loss
    final = follower.write_summary("failed" if error or stopped else "completed", checkpoint,
                                   last_line(error) if error else stopped)
    close_tracking(follower.tracking, final, follower.log.rows, final["status"], figure)
    final["run_dir"] = run.display_path()
    if error is not None:  # a UserError stays the user's (exit 2); anything else, with its traceback
        raise error
    if stopped:
        raise RunFailed(stopped)
    return final
