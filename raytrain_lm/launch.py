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

from raytrain_lm import checkpoint as ckpt_io
from raytrain_lm.config import TrainConfig
from raytrain_lm.data import load_manifest, prepare_dataset
from raytrain_lm.errors import UserError, last_line
from raytrain_lm.storage import MetricsLog, RunFolder
from raytrain_lm.tb import TensorBoardLog

DEFAULT_DATA = "data/pydoc"
FAULT_ENV = "RAYTRAIN_LM_FAIL_AT"  # fault drill: "RANK:STEP" makes that rank's process exit there


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


def prepare_data(cfg: TrainConfig, say: Callable[[str], None]) -> dict:
    """The dataset's manifest, with the model's vocabulary fitted to it and a local data path made
    absolute (workers do not share the driver's working directory)."""
    manifest = ensure_dataset(cfg, say)
    fit_model_to_data(cfg, manifest)
    if "://" not in cfg.data:
        cfg.data = os.path.abspath(cfg.data)
    return manifest


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


def worker_memory_gb(cfg: TrainConfig) -> Optional[float]:
    """Memory one worker may use: its GPU's (from --set gpu_memory_gb or Ray's accelerator
    label), or on CPU the cluster's memory resource split among the workers. None: unknown."""
    import ray

    from raytrain_lm.plan import GPU_MEMORY_GB

    if cfg.use_gpu:
        if cfg.gpu_memory_gb:
            return cfg.gpu_memory_gb
        labels = [k.split(":", 1)[1] for k in ray.cluster_resources() if k.startswith("accelerator_type:")]
        sizes = [GPU_MEMORY_GB[label] for label in labels if label in GPU_MEMORY_GB]
        return min(sizes) if sizes else None
    return ray.cluster_resources().get("memory", 0) / 1e9 / cfg.workers or None


def check_memory(cfg: TrainConfig, memory_gb: Optional[float]) -> None:
    """Refuse a configuration whose planned per-worker memory exceeds what a worker has."""
    from raytrain_lm.plan import GB, USABLE_FRACTION, estimate, recommend

    if memory_gb is None:
        return
    plan = estimate(cfg.model, cfg.workers, cfg.strategy, cfg.activation_checkpointing,
                    cfg.batch_size, cfg.seq_len, gpu=cfg.use_gpu)
    if plan.total <= memory_gb * GB * USABLE_FRACTION:
        return
    better = recommend(cfg.model, cfg.workers, cfg.batch_size, cfg.grad_accum, cfg.seq_len,
                       memory_gb, gpu=cfg.use_gpu)
    hint = ("nothing fits on this many workers: add workers or use a smaller model" if better is None
            else f"try --strategy {better[0].strategy} --activation-checkpointing "
                 f"{better[0].activation_checkpointing} --batch-size {better[0].micro_batch} "
                 f"--grad-accum {better[1]}")
    raise UserError(f"this run needs ~{plan.total / GB:.1f} GB per worker (model state "
                    f"{plan.model_state / GB:.1f}, activations {plan.activations / GB:.1f}, logits "
                    f"{plan.logits / GB:.1f}) but a worker has {memory_gb:.0f} GB; {hint}; "
                    f"see `python cli.py plan`, or pass --force")


# ---------------------------------------------------------------- following a run


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
                  init_from: Optional[str] = None, fail_at: Optional[str] = None):
    """The TorchTrainer for `cfg`, writing into `run`'s folder. Used by `train` and by each Tune trial."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_lm.loop import train_loop_per_worker

    # Ray Train's controller collects reports when it polls the workers (default every 2 s) and a
    # worker holds one report at a time, so reports more frequent than the poll stall training.
    # Ray passes this variable from the driver to the controller.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"train": cfg.to_dict(), "run_name": cfg.name, "init_from": init_from,
                           "fail_at": fail_at},
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


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint folder, or a run folder (its best, else its latest checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint not found: {path}")
    if (p / ckpt_io.META).exists() or (p / ckpt_io.STATE).exists():
        return p
    if (p / ckpt_io.BEST_DIR).is_dir():
        return p / ckpt_io.BEST_DIR
    found = sorted(c for c in p.glob("checkpoint_*") if c.is_dir())
    if not found:
        raise UserError(f"{path} holds no checkpoint (expected a checkpoint_* or run folder)")
    return found[-1]


def check_init_from(path: str, cfg: TrainConfig, manifest: dict) -> str:
    """Validate --init-from against the model and dataset before any worker starts."""
    folder = resolve_checkpoint(path)
    meta = ckpt_io.read_meta(folder)  # raises on a missing or corrupted state file
    theirs = TrainConfig.from_dict(meta["config"]).model
    if theirs != cfg.model:
        diff = ", ".join(f"{k}: {getattr(theirs, k)} vs {getattr(cfg.model, k)}"
                         for k in vars(theirs) if getattr(theirs, k) != getattr(cfg.model, k))
        raise UserError(f"checkpoint {folder} is for another model shape ({diff})")
    if meta["tokenizer"] != manifest["tokenizer"]:
        raise UserError(f"checkpoint {folder} used tokenizer {meta['tokenizer']} but dataset "
                        f"{cfg.data} uses {manifest['tokenizer']}")
    return str(folder.resolve())


def run_training(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    init_from: Optional[str] = None,
    verbose: bool = False,
    force: bool = False,
    say: Callable[[str], None] = print,
    on_metrics: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Train `cfg` on a Ray cluster; returns the summary (also written to summary.json).

    With `resume`, the run `cfg.name` continues from its latest valid checkpoint (the caller
    loads the run's saved config: see `saved_config`)."""
    t_launch = time.time()
    manifest = prepare_data(cfg, say)
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
    if init_from:
        init_from = check_init_from(init_from, cfg, manifest)
    previous = run.read_json("summary.json") if resume and run.exists("summary.json") else {}

    connect_ray(cfg.address, cfg.workers * cfg.cpus_per_worker, verbose)
    check_resources(cfg, say)
    if not force:
        check_memory(cfg, worker_memory_gb(cfg))

    from ray.util.queue import Queue

    from raytrain_lm.callbacks import ForwardMetrics, KeepBest

    metrics_q = Queue(actor_options={"num_cpus": 0})
    callbacks = [ForwardMetrics(metrics_q), KeepBest(previous.get("best_val_loss"))]
    trainer = build_trainer(cfg, run, callbacks=callbacks, init_from=init_from,
                            fail_at=os.environ.get(FAULT_ENV))
    if not resume:
        run.write_json("config.json", cfg.to_dict())
    log = MetricsLog(run)
    restarts = previous.get("restarts", 0) + (1 if resume else 0)
    failures_seen = 0

    def write_summary(status: str, checkpoint: Optional[str] = None, error: Optional[str] = None):
        summary = summarise(cfg, log.rows, status, time.time() - t_launch, checkpoint, t_launch,
                            error=error)
        summary["restarts"] = restarts
        summary["best_checkpoint"] = run.display_path(ckpt_io.BEST_DIR) if run.exists(ckpt_io.BEST_DIR) else None
        run.write_json("summary.json", summary)
        return summary

    # Written now and kept current: after a crash of this driver it still tells what happened.
    write_summary("running")
    tb = TensorBoardLog(run, say)  # event files beside metrics.jsonl: `tensorboard --logdir runs`
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
        if row.get("event") == "worker_failure":
            restarts, failures_seen = restarts + 1, failures_seen + 1
            say(f"worker failure: {row['error']}; restarting from the latest checkpoint")
            write_summary("running")
            continue
        for r in [*(row.pop("resumed_rows", None) or []), row]:  # rows Ray may have lost: see the loop
            if r.get("checkpoint"):
                r["checkpoint"] = checkpoint_uri(run, r["checkpoint"])
            log.add(r)
            tb.add(r)
        if row.get("checkpoint"):
            write_summary("running")
        if on_metrics:
            on_metrics(row)
    thread.join()
    tb.close()

    error = outcome.get("error")
    result = outcome.get("result")
    if error is not None and failures_seen:
        restarts -= 1  # the last failure ended the run: it was not followed by a restart
    checkpoint = checkpoint_uri(run, result.checkpoint.path) if result is not None and result.checkpoint else None
    if checkpoint is None:
        checkpoint = next((r["checkpoint"] for r in reversed(log.rows) if r.get("checkpoint")), None)
    summary = write_summary("failed" if error else "completed", checkpoint,
                            _describe(error) if error else None)
    summary["run_dir"] = run.display_path()
    if error is not None:
        user_error = _user_error_inside(error)
        raise user_error or UserError(f"training failed: {_describe(error)} "
                                      f"(summary in {run.display_path('summary.json')})")
    return summary


def checkpoint_uri(run: RunFolder, path: str) -> str:
    """Where a checkpoint of `run` is, as the user would name it, from its folder name or from
    Ray's path: a path inside Ray's filesystem, which on object stores lacks the scheme
    (`bucket/...`, not `s3://bucket/...`)."""
    return run.display_path(path.rstrip("/").rsplit("/", 1)[-1])


def saved_config(storage: str, name: str) -> dict:
    """The config a run was started with, for --resume."""
    run = RunFolder(storage, name)
    if not run.exists():
        raise UserError(f"cannot resume: no run named {name!r} in {storage}")
    if not run.exists("config.json"):
        raise UserError(f"cannot resume {name!r}: it has no config.json (not a raytrain-lm run?)")
    return run.read_json("config.json")


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
        from raytrain_lm.callbacks import describe_failures

        return describe_failures(failures)
    return last_line(error)
