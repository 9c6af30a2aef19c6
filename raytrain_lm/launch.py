"""Driver side of `train`: validate, connect to Ray, build the TorchTrainer, follow it, summarise.

Everything that can be checked before a worker starts is checked here, so a bad input costs a
second and writes nothing.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import queue as _queue
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from raytrain_lm.config import TrainConfig
from raytrain_lm.data import load_manifest, prepare_dataset
from raytrain_lm.errors import UserError
from raytrain_lm.storage import MetricsLog, RunFolder

DEFAULT_DATA = "data/pydoc"


# ---------------------------------------------------------------- checks before any Ray


def ensure_dataset(cfg: TrainConfig, say: Callable[[str], None]) -> dict:
    """The dataset's manifest; the built-in default corpus is prepared on first use."""
    if cfg.data == DEFAULT_DATA and not Path(cfg.data).exists():
        say(f"preparing the built-in corpus (pydoc topics) into {cfg.data} ...")
        prepare_dataset("pydoc", cfg.data)
    return load_manifest(cfg.data)


def fit_model_to_data(cfg: TrainConfig, manifest: dict) -> None:
    vocab = manifest["vocab_size"]
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = vocab
    elif vocab > cfg.model.vocab_size:
        raise UserError(f"dataset {cfg.data} has a vocabulary of {vocab} tokens but the model's "
                        f"vocab_size is {cfg.model.vocab_size}; raise model.vocab_size")


def default_run_name(cfg: TrainConfig) -> str:
    return f"{cfg.preset}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


# ---------------------------------------------------------------- Ray connection


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail in seconds, not minutes, when nothing listens at a host:port address."""
    hostport = address.split("://", 1)[-1]
    if address == "auto" or ":" not in hostport:
        return
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError):
        raise UserError(f"no Ray cluster answers at {address}; start one with "
                        f"`python cli.py cluster local-up` or check the address") from None


def connect_ray(address: Optional[str], min_cpus: float, verbose: bool = False) -> bool:
    """Connect to `address` (or RAY_ADDRESS), else start a local Ray. Returns True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    quiet = dict(log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.WARNING)
    if address:
        from raytrain_lm.cluster import connect_error, match_cluster_auth

        _check_reachable(address)
        match_cluster_auth(address)  # Ray 2.60: a token when the cluster wants one, else none
        try:
            ray.init(address=address, **quiet)
        except Exception as e:  # ConnectionError, RuntimeError, AuthenticationError, ...
            raise connect_error(address, e) from None
        return False
    # Logical CPUs are bookkeeping: give the workers their share and keep one for Ray's own tasks,
    # so small machines don't deadlock (see docs: a 2-core laptop running 2 workers).
    num_cpus = max(os.cpu_count() or 1, math.ceil(min_cpus) + 1)
    ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
    return True


def check_resources(cfg: TrainConfig, say: Callable[[str], None] = print) -> None:
    import ray

    from raytrain_lm.autoscale import wait_for_resources

    per_worker = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})}
    total = ray.cluster_resources()
    if any(total.get(k, 0) < v * cfg.workers for k, v in per_worker.items()) and \
            wait_for_resources(per_worker, cfg.workers, cfg.scale_timeout, say):
        return  # an autoscaler brought the nodes up
    if cfg.use_gpu and total.get("GPU", 0) < cfg.workers:
        have = int(total.get("GPU", 0))
        raise UserError(f"--use-gpu with --workers {cfg.workers} needs {cfg.workers} GPUs but the "
                        f"cluster has {have}; drop --use-gpu or lower --workers")
    need = cfg.workers * cfg.cpus_per_worker
    if total.get("CPU", 0) < need:
        raise UserError(f"--workers {cfg.workers} needs {need:g} CPUs but the cluster has "
                        f"{total.get('CPU', 0):g}; lower --workers or cpus_per_worker")


# ---------------------------------------------------------------- following a run


def _progress_callback(q):
    """A Ray Train UserCallback (runs in the controller actor) that forwards rank 0's metrics."""
    from ray.train import UserCallback

    class ForwardMetrics(UserCallback):
        def __init__(self, queue):
            self.queue = queue

        def after_report(self, run_context, metrics, checkpoint):
            row = dict(metrics[0])
            if checkpoint is not None:
                row["checkpoint"] = checkpoint.path
            self.queue.put(row)

    return ForwardMetrics(q)


def summarise(cfg: TrainConfig, rows: list[dict], status: str, wall: float,
              checkpoint: Optional[str], t_launch: float, error: Optional[str] = None) -> dict:
    last = rows[-1] if rows else {}
    evals = [r for r in rows if r.get("val_loss") is not None]
    # Steady state: drop the first interval (compilation, allocator and cache warm-up).
    steady = rows[1:] if len(rows) > 2 else rows
    tps = [r["tokens_per_second"] for r in steady]
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {
        "status": status,
        "name": cfg.name,
        "steps": last.get("step", 0),
        "max_steps": cfg.max_steps,
        "tokens": last.get("tokens", 0),
        "final_train_loss": last.get("loss"),
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "val_perplexity": evals[-1]["val_ppl"] if evals else None,
        "best_val_loss": min(r["val_loss"] for r in evals) if evals else None,
        "tokens_per_second": statistics.median(tps) if tps else None,
        "mfu": statistics.median(mfus) if mfus else None,
        "data_wait_frac": statistics.median([r["data_wait_frac"] for r in steady]) if steady else None,
        "peak_mem_gb": max((r["peak_mem_gb"] for r in rows), default=None),
        "time_to_first_step": (last["train_start_unix"] - t_launch) if last.get("train_start_unix") else None,
        "wall_seconds": wall,
        "workers": cfg.workers,
        "use_gpu": cfg.use_gpu,
        "preset": cfg.preset,
        "num_parameters": last.get("num_parameters"),
        "checkpoint": checkpoint,
        "restarts": last.get("restarts", 0),
        "resumed_from_step": last.get("resumed_from_step"),
        "error": error,
        "config": cfg.to_dict(),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def build_trainer(cfg: TrainConfig, run: RunFolder, callbacks: Optional[list] = None,
                  init_from: Optional[str] = None):
    """The TorchTrainer for `cfg`, writing into `run`'s folder. Used by `train` and by each Tune trial."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_lm.loop import train_loop_per_worker

    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"train": cfg.to_dict(), "run_name": cfg.name, "init_from": init_from},
        scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=run.storage_uri,
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            callbacks=callbacks or [],
        ),
    )


def run_training(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    init_from: Optional[str] = None,
    verbose: bool = False,
    say: Callable[[str], None] = print,
    on_metrics: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Train `cfg` on a Ray cluster; returns the summary (also written to summary.json)."""
    t_launch = time.time()
    manifest = ensure_dataset(cfg, say)
    fit_model_to_data(cfg, manifest)
    if "://" not in cfg.data:  # workers do not share the driver's working directory
        cfg.data = os.path.abspath(cfg.data)
    if cfg.name is None:
        if resume:
            raise UserError("--resume needs --name of the run to continue")
        cfg.name = default_run_name(cfg)
    run = RunFolder(cfg.storage, cfg.name)
    if resume and not run.exists():
        raise UserError(f"cannot resume: no run named {cfg.name!r} in {cfg.storage}")
    if not resume and run.exists():
        raise UserError(f"a run named {cfg.name!r} already exists in {cfg.storage}; "
                        f"pass --resume to continue it or choose another --name")

    connect_ray(cfg.address, cfg.workers * cfg.cpus_per_worker, verbose)
    check_resources(cfg, say)

    from ray.util.queue import Queue

    metrics_q = Queue(actor_options={"num_cpus": 0})
    trainer = build_trainer(cfg, run, callbacks=[_progress_callback(metrics_q)], init_from=init_from)

    log = MetricsLog(run)
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # reported below, on the main thread
            outcome["error"] = e

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive() or not metrics_q.empty():
        try:
            row = metrics_q.get(timeout=0.5)
        except _queue.Empty:
            continue
        except Exception:  # the queue actor is gone: nothing more will come
            break
        log.add(row)
        if on_metrics:
            on_metrics(row)
    thread.join()

    wall = time.time() - t_launch
    error = outcome.get("error")
    result = outcome.get("result")
    checkpoint = result.checkpoint.path if result is not None and result.checkpoint else None
    if checkpoint is None:
        checkpoint = next((r["checkpoint"] for r in reversed(log.rows) if r.get("checkpoint")), None)
    summary = summarise(cfg, log.rows, "failed" if error else "completed", wall, checkpoint,
                        t_launch, error=_describe(error) if error else None)
    run.write_json("summary.json", summary)
    summary["run_dir"] = run.display_path()
    if error is not None:
        user_error = _user_error_inside(error)
        raise user_error or UserError(f"training failed: {_describe(error)} "
                                      f"(summary in {run.display_path('summary.json')})")
    return summary


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
        rank, exc = sorted(failures.items())[0]
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        return f"rank {rank}: {lines[-1] if lines else type(exc).__name__}"
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
