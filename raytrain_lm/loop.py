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
from raytrain_lm.parallel import all_reduce, no_sync, wrap_model

FAULT_ENV = "RAYTRAIN_LM_FAIL_AT"  # "RANK:STEP": that rank's process exits at that step, once per run


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def build_loader(cfg: TrainConfig, split: str, rank: int, world: int, shuffle: bool):
    dataset = TokenWindows(cfg.data, split, cfg.seq_len)
    sampler = ResumableDistributedSampler(dataset, num_replicas=world, rank=rank, seed=cfg.seed,
                                          shuffle=shuffle)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=collate_windows, pin_memory=cfg.use_gpu)
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


def _maybe_inject_fault(step: int, rank: int, run_name: str) -> None:
    """Fault drill: with RAYTRAIN_LM_FAIL_AT=R:K, rank R's process dies at step K, once per run.

    "Once" is remembered in the cluster's key-value store, so the restarted group gets past K."""
    spec = os.environ.get(FAULT_ENV)
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
    manifest = load_manifest(cfg.data)

    # --- restore: the latest valid checkpoint of this run, else weights to start from, else fresh
    restored = None
    ray_ckpt = ray.train.get_checkpoint()
    if ray_ckpt is not None:
        restored = ckpt_io.load_latest_valid(ray_ckpt, rank)
    torch.manual_seed(cfg.seed)  # identical init on every rank (DDP also broadcasts rank 0's)

    model = GPT(cfg.model)
    if restored is None and loop_config.get("init_from"):
        init = ckpt_io.load_checkpoint(Path(loop_config["init_from"]))
        model.load_state_dict(init["model"])
    raw_model = model  # unwrapped: its state_dict has clean keys
    n_params = raw_model.num_params()
    fpt = flops_per_token(cfg.model, raw_model.num_params(exclude_position=True), cfg.seq_len)
    model = wrap_model(model, cfg)
    optimizer = build_optimizer(raw_model, cfg, device)

    train_loader, train_sampler = build_loader(cfg, "train", rank, world, shuffle=True)
    val_loader, _ = build_loader(cfg, "val", rank, world, shuffle=False)
    stream = BatchStream(train_loader, train_sampler, cfg.batch_size)

    step, tokens_seen, restarts = 0, 0, 0
    if restored is not None:
        state, rng = restored
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen = state["step"], state["tokens"]
        stream.load_state_dict(state["data"])
        restarts = state.get("restarts", 0) + 1
        if rng is not None:
            ckpt_io.set_rng_state(rng)
    else:
        torch.manual_seed(cfg.seed + rank)  # per-rank dropout streams
    resumed_from = step if restored is not None else None

    amp_dtype = autocast_dtype(cfg, device)
    ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    peak = gpu_peak_tflops(device, cfg.peak_tflops)
    timer = StepTimer(device)
    loss_sum = torch.zeros((), device=device)
    loss_count = 0
    train_start, train_start_unix = time.perf_counter(), time.time()
    model.train()

    while step < cfg.max_steps:
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
            loss_sum += loss.detach()
            loss_count += 1
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += cfg.batch_size * cfg.seq_len * cfg.grad_accum * world
        timer.steps += 1
        timer.tokens += cfg.batch_size * cfg.seq_len * cfg.grad_accum * world

        _maybe_inject_fault(step, rank, run_name)

        last = step == cfg.max_steps
        do_eval = step % cfg.eval_every == 0 or last
        do_ckpt = last or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        if not (step % cfg.log_every == 0 or do_eval or do_ckpt):
            continue

        # --- metrics: one small all-reduce makes them global on every rank
        elapsed = timer.elapsed()
        stats = all_reduce(torch.tensor([loss_sum.item(), loss_count, timer.data_wait],
                                        dtype=torch.float64, device=device))
        mem = all_reduce(torch.tensor([peak_memory_gb(device)], device=device), op="max")
        tps = timer.tokens / elapsed
        metrics = {
            "step": step,
            "tokens": tokens_seen,
            "epoch": stream.epoch,
            "loss": stats[0].item() / stats[1].item(),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_second": tps,
            "step_time": elapsed / timer.steps,
            "data_wait_frac": stats[2].item() / world / elapsed,
            "mfu": mfu(tps, fpt, world, peak),
            "peak_mem_gb": mem.item(),
            "elapsed": time.perf_counter() - train_start,
            "train_start_unix": train_start_unix,
            "num_parameters": n_params,
            "restarts": restarts,
            "resumed_from_step": resumed_from,
        }
        if do_eval:
            val = evaluate(model, val_loader, cfg, ctx, device)
            metrics.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)))
        if do_ckpt:
            state = None
            if rank == 0:
                state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                         "step": step, "tokens": tokens_seen, "data": stream.state_dict(),
                         "restarts": restarts, "config": cfg.to_dict(),
                         "tokenizer": manifest["tokenizer"]}
            with tempfile.TemporaryDirectory(prefix="raytrain-lm-ckpt-") as tmp:
                ckpt_io.write_checkpoint(Path(tmp), rank, state)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                                 checkpoint_dir_name=f"checkpoint_{step:08d}")
        else:
            ray.train.report(metrics)
        loss_sum.zero_()
        loss_count = 0
        timer.reset()  # eval and checkpoint time stay out of the next interval's throughput
