"""`train_loop_per_worker`: what every Ray Train worker runs, top to bottom.

restore (if a checkpoint exists) -> data -> model -> DDP -> optimizer -> steps, with a
`ray.train.report` every few steps (a report is a barrier across ranks, so all ranks follow the
same deterministic schedule of reports).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections import deque
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import ray.train
import ray.train.torch
import torch
from torch.utils.data import DataLoader

from raytrain_lm import checkpoint as ckpt_io
from raytrain_lm.config import TrainConfig
from raytrain_lm.data import (BatchStream, ResumableDistributedSampler, TokenWindows,
                              collate_windows, load_manifest, resolve_dataset)
from raytrain_lm.metrics import StepTimer, gpu_peak_tflops, mfu, peak_memory_gb
from raytrain_lm.model import GPT, flops_per_token
from raytrain_lm.optim import build_optimizer, lr_at
from raytrain_lm.parallel import (all_reduce, is_sharded, local_param_fraction, model_state_bytes,
                                  no_sync, to_local_float, wrap_model)

# Reported rows each checkpoint carries, to be re-sent after a resume: more than can be in flight
# in Ray (a worker holds one uncollected report) when the driver or a worker dies.
RECENT_ROWS = 8


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def build_loader(cfg: TrainConfig, split: str, rank: int, world: int, shuffle: bool):
    dataset = TokenWindows(cfg.data, split, cfg.seq_len)
    sampler = ResumableDistributedSampler(dataset, num_replicas=world, rank=rank, seed=cfg.seed,
                                          shuffle=shuffle)
    # Its own generator: creating a loader iterator must not draw from the global RNG, or a
    # resumed run's dropout masks would differ from an uninterrupted run's.
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=collate_windows, pin_memory=cfg.use_gpu,
                        generator=torch.Generator().manual_seed(cfg.seed))
    # The sampler is already a DistributedSampler, so Ray only adds the move to the device.
    return ray.train.torch.prepare_data_loader(loader), sampler


@torch.no_grad()
def evaluate(model, loader, cfg: TrainConfig, ctx, device) -> float:
    model.eval()
    total = torch.zeros(2, device=device)  # (sum of losses, number of batches)
    for i, (x, y) in enumerate(loader):
        if i >= cfg.eval_batches:
            break
        with ctx:
            _, loss = model(x, y)
        total += torch.stack([loss.detach().float(), torch.ones((), device=device)])
    model.train()
    all_reduce(total)
    return (total[0] / total[1]).item()


def _maybe_inject_fault(spec: Optional[str], step: int, rank: int, run_name: str) -> None:
    """Fault drill: with RAYTRAIN_LM_FAIL_AT=R:K in the driver's environment, rank R's process dies at
    step K, once per run. "Once" is remembered in the cluster's key-value store, so the restarted
    worker group gets past step K."""
    if not spec:
        return
    r, k = (int(v) for v in spec.split(":"))
    if r != rank or k != step:
        return
    from ray.experimental import internal_kv

    key = f"raytrain_lm:fault:{run_name}:{r}:{k}".encode()
    if internal_kv._internal_kv_get(key):
        return
    internal_kv._internal_kv_put(key, b"1")
    print(f"[fault drill] rank {rank} exiting at step {step}", flush=True)
    os._exit(1)  # the process dies: no exception, no cleanup, as on a lost node


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    cfg = TrainConfig.from_dict(loop_config["train"])
    cfg.data = resolve_dataset(cfg.data)  # s3://... -> verified local cache on this node
    run_name = loop_config["run_name"]
    tctx = ray.train.get_context()
    rank, world = tctx.get_world_rank(), tctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any matmul left in fp32
    manifest = load_manifest(cfg.data)

    # --- restore: the latest valid checkpoint of this run, else weights to start from, else fresh
    storage = tctx.get_storage()
    resume = ckpt_io.find_resume_state(storage.storage_filesystem, storage.experiment_fs_path, rank)
    torch.manual_seed(cfg.seed)  # identical init on every rank (DDP also broadcasts rank 0's)

    baseline_mem = peak_memory_gb(device)  # before the model exists: what the run adds is above it
    model = GPT(cfg.model)
    if resume is not None and resume.state["format"] == "full":
        model.load_state_dict(resume.state["model"])
    elif resume is None and loop_config.get("init_from"):  # weights only: fresh optimizer
        model.load_state_dict(ckpt_io.load_checkpoint(Path(loop_config["init_from"]))["model"])
    raw_model = model  # unwrapped: its state_dict has clean keys (FSDP shards it in place)
    n_params = raw_model.num_params()
    fpt = flops_per_token(cfg.model, raw_model.num_params(exclude_position=True), cfg.seq_len)
    model = wrap_model(model, cfg, device)
    optimizer = build_optimizer(raw_model, cfg, device)
    amp_dtype = autocast_dtype(cfg, device)
    ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    train_loader, train_sampler = build_loader(cfg, "train", rank, world, shuffle=True)
    val_loader, _ = build_loader(cfg, "val", rank, world, shuffle=False)
    stream = BatchStream(train_loader, train_sampler, cfg.batch_size)

    step, tokens_seen, resumed_from, resumed_rows = 0, 0, None, None
    recent: deque[dict] = deque(maxlen=RECENT_ROWS)  # the rows each checkpoint carries
    if resume is not None:
        state = resume.state
        if state["format"] == "dcp":
            ckpt_io.load_sharded(resume.folder, raw_model, optimizer)
        else:
            optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step, tokens_seen = state["step"], state["tokens"]
        stream.load_state_dict(state["data"])
        if resume.rng is not None:
            ckpt_io.set_rng_state(resume.rng)
        resumed_from = step
        # The last rows reported before this checkpoint, itself included: the driver may not have
        # received them (its own death or a worker's, while they were in flight in Ray), so they
        # go to it again with the first report.
        resumed_rows = state.get("recent_metrics") or None
        recent.extend(resumed_rows or [])
        resume.cleanup()
    else:
        torch.manual_seed(cfg.seed + rank)  # per-rank dropout streams

    peak = gpu_peak_tflops(device, cfg.peak_tflops)
    step_tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum * world
    timer = StepTimer(device)
    step_losses: list[torch.Tensor] = []  # this rank's loss of each step since the last report
    train_start, train_start_unix = time.perf_counter(), time.time()
    model.train()

    while step < cfg.max_steps:
        # Gradients are freed here rather than after the step, so a report sees them as held.
        optimizer.zero_grad(set_to_none=True)
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(cfg.grad_accum):
            t0 = time.perf_counter()
            x, y = stream.next()
            timer.data_wait += time.perf_counter() - t0
            with no_sync(model, sync=micro == cfg.grad_accum - 1), ctx:
                _, loss = model(x, y)
                scaler.scale(loss / cfg.grad_accum).backward()
            micro_loss = loss.detach() / cfg.grad_accum
            if micro == 0:
                step_losses.append(micro_loss)
            else:
                step_losses[-1] = step_losses[-1] + micro_loss
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        step += 1
        tokens_seen += step_tokens
        timer.steps += 1
        timer.tokens += step_tokens

        _maybe_inject_fault(loop_config.get("fail_at"), step, rank, run_name)

        last = step == cfg.max_steps
        do_ckpt = last or bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        do_eval = step % cfg.eval_every == 0 or do_ckpt  # every checkpoint knows its val loss
        if not (step % cfg.log_every == 0 or do_eval or do_ckpt):
            continue

        # --- metrics: one small all-reduce makes them global on every rank
        elapsed = timer.elapsed()
        losses = all_reduce(torch.stack(step_losses).double()) / world
        stats = all_reduce(torch.tensor([timer.data_wait], dtype=torch.float64, device=device))
        mem = all_reduce(torch.tensor([peak_memory_gb(device),
                                       model_state_bytes(raw_model, optimizer) / 1e9],
                                      dtype=torch.float64, device=device), op="max")
        tps = timer.tokens / elapsed
        metrics = {
            "step": step,
            "tokens": tokens_seen,
            "epoch": stream.epoch,
            "loss": losses.mean().item(),
            "step_losses": losses.tolist(),  # per-step global losses, for exact-resume checks
            "lr": lr,
            "grad_norm": to_local_float(grad_norm),
            "tokens_per_second": tps,
            "step_time": elapsed / timer.steps,
            "data_wait_frac": stats[0].item() / world / elapsed,
            "mfu": mfu(tps, fpt, world, peak),
            "peak_mem_gb": mem[0].item(),
            "model_state_gb": mem[1].item(),  # params + grads + optimizer states, max over ranks
            "mem_above_baseline_gb": mem[0].item() - baseline_mem,
            "param_fraction": local_param_fraction(raw_model),  # of all parameters, on rank 0
            "elapsed": time.perf_counter() - train_start,
            "train_start_unix": train_start_unix,
            "num_parameters": n_params,
            "resumed_from_step": resumed_from,
        }
        t_excluded = time.perf_counter()
        if do_eval:
            val = evaluate(model, val_loader, cfg, ctx, device)
            metrics.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)))
        recent.append({**metrics, "checkpoint": f"checkpoint_{step:08d}"} if do_ckpt else dict(metrics))
        if resumed_rows is not None:
            metrics["resumed_rows"], resumed_rows = resumed_rows, None
        if do_ckpt:
            state = None
            if rank == 0:
                state = {"scaler": scaler.state_dict(), "step": step, "tokens": tokens_seen,
                         "data": stream.state_dict(), "world_size": world,
                         "recent_metrics": list(recent),
                         "config": cfg.to_dict(), "tokenizer": manifest["tokenizer"]}
            with tempfile.TemporaryDirectory(prefix="raytrain-lm-ckpt-") as tmp:
                ckpt_io.save_checkpoint(Path(tmp), rank, raw_model, optimizer,
                                        sharded=is_sharded(raw_model), state=state)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                                 checkpoint_dir_name=f"checkpoint_{step:08d}")
        else:
            ray.train.report(metrics)
        step_losses = []
        if do_eval or do_ckpt:  # eval and checkpoint time stay out of the throughput
            timer.reset(excluded=time.perf_counter() - t_excluded)
        else:
            timer.reset()

    if resumed_rows is not None:
        # Resumed from the final checkpoint (the run stopped after writing it, before Ray took its
        # report): nothing is left to train, but the driver and Tune still need the final rows.
        ray.train.report({**resumed_rows[-1], "resumed_from_step": resumed_from,
                          "train_start_unix": train_start_unix, "resumed_rows": resumed_rows[:-1]})
