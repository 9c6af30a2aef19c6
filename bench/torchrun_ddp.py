"""The baseline for `bench/overhead.py`: a plain `torchrun` DDP script, no Ray.

In the style of PyTorch's DDP tutorial (init_process_group, DistributedSampler, DDP(model)), but
with this project's pieces, so that the only difference from `python cli.py train` is Ray:
the same GPT (raytrain_lm/models/gpt/gpt.py), token shards (TokenWindows), optimizer and schedule
(raytrain_lm/worker/optim.py), DDP options (raytrain_lm/parallel.py), and per-step work and log cadence as
raytrain_lm/worker/loop.py: the same .item() and the same two small all-reduces every `log_every` steps,
validation at `eval_every`, a checkpoint written by rank 0 at `checkpoint_every` and at the end.
What it leaves out is what Ray adds: `ray.train.report` (a barrier) and the Ray processes.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/torchrun_ddp.py \
        --data data/pydoc --max-steps 200 --out /tmp/torchrun-run

Rank 0 writes OUT/metrics.jsonl with the same fields as a Ray run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from raytrain_lm.config.load import build_config
from raytrain_lm.data.manifest import load_manifest
from raytrain_lm.data.sampler import BatchPlan, BatchStream, eval_batches
from raytrain_lm.data.windows import TokenWindows, collate_windows
from raytrain_lm.models import flops_per_token
from raytrain_lm.models.gpt.gpt import GPT
from raytrain_lm.worker.metrics import StepTimer, gpu_peak_tflops, mfu, peak_memory_gb
from raytrain_lm.worker.optim import build_optimizer, lr_at


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--data", default="data/pydoc")
    p.add_argument("--out", required=True, help="folder for metrics.jsonl and the final checkpoint")
    p.add_argument("--max-steps", type=int, default=300)
    # A fixed count (the loop paces by time unless told a count): like for like in both sides.
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--grad-accum", type=int, default=None)
    p.add_argument("--use-gpu", action="store_true", help="one GPU per process, NCCL")
    # DDP knobs, to measure what they are worth (raytrain_lm/parallel.py's settings by default).
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size [torch: 25]")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--no-bucket-view", action="store_true", help="gradient_as_bucket_view=False")
    return p.parse_args(argv)


def train_batches(cfg, rank, world, device):
    """Endless batches in the project's global order (data/sampler.py, what the Ray loop reads)."""
    dataset = TokenWindows(cfg.data, "train", cfg.seq_len)
    stream = BatchStream(dataset.shard_windows, BatchPlan(cfg.batch_size, cfg.grad_accum, rank, world),
                         cfg.seed, lambda batches: DataLoader(
                             dataset, batch_sampler=batches, collate_fn=collate_windows,
                             pin_memory=cfg.use_gpu, generator=torch.Generator().manual_seed(cfg.seed)))
    while True:
        x, y = stream.next()
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@torch.no_grad()
def evaluate(model, cfg, ctx, device, rank, world) -> float:
    """The fixed validation windows, shared out as the Ray loop does (data/loaders.py)."""
    dataset = TokenWindows(cfg.data, "val", cfg.seq_len)
    n = min(len(dataset), cfg.eval_windows or len(dataset))
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for idx, weight in eval_batches(n, cfg.batch_size, rank, world):
        x, y = collate_windows(dataset.__getitems__(idx))
        with ctx:
            _, loss = model(x.to(device), y.to(device))
        total += torch.tensor([loss.item() * weight, weight], dtype=torch.float64, device=device)
    model.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def main(argv=None) -> None:
    args = parse_args(argv)
    flags = {k: v for k, v in dict(preset=args.preset, data=args.data, max_steps=args.max_steps,
                                   log_every=args.log_every, eval_every=args.eval_every,
                                   checkpoint_every=args.checkpoint_every,
                                   batch_size=args.batch_size, seq_len=args.seq_len,
                                   grad_accum=args.grad_accum, use_gpu=args.use_gpu).items()
             if v is not None}
    cfg = build_config(preset=args.preset, flags=flags)
    manifest = load_manifest(cfg.data)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = manifest["vocab_size"]

    dist.init_process_group("nccl" if cfg.use_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.use_gpu:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(device)
    raw_model = model
    n_params = raw_model.num_params()
    fpt = flops_per_token(cfg.model, cfg.seq_len)
    ddp_kwargs = dict(gradient_as_bucket_view=not args.no_bucket_view, broadcast_buffers=False,
                      static_graph=args.static_graph)
    if args.bucket_cap_mb is not None:
        ddp_kwargs["bucket_cap_mb"] = args.bucket_cap_mb
    model = DDP(model, device_ids=[device.index] if cfg.use_gpu else None, **ddp_kwargs)
    optimizer = build_optimizer(raw_model, cfg, device)

    stream = train_batches(cfg, rank, world, device)
    torch.manual_seed(cfg.seed + rank)

    amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[
        cfg.precision if cfg.precision != "auto" else ("bf16" if cfg.use_gpu else "fp32")]
    ctx = torch.autocast(device.type, dtype=amp) if amp else nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    peak = gpu_peak_tflops(device, cfg.peak_tflops)
    timer = StepTimer(device)
    data_wait = 0.0  # seconds in next(stream) since the last log point
    loss_sum = torch.zeros((), device=device)
    loss_count = 0
    log = open(out / "metrics.jsonl", "w") if rank == 0 else None
    step, tokens_seen = 0, 0
    train_start, train_start_unix = time.perf_counter(), time.time()
    model.train()

    while step < cfg.max_steps:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(cfg.grad_accum):
            t0 = time.perf_counter()
            x, y = next(stream)
            data_wait += time.perf_counter() - t0
            sync = micro == cfg.grad_accum - 1
            with (nullcontext() if sync else model.no_sync()), ctx:
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

        last = step == cfg.max_steps
        do_eval = step % cfg.eval_every == 0 or last
        do_ckpt = last or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        if not (step % cfg.log_every == 0 or do_eval or do_ckpt):
            continue

        elapsed = timer.elapsed()
        stats = torch.tensor([loss_sum.item(), loss_count, data_wait], dtype=torch.float64,
                             device=device)
        dist.all_reduce(stats)
        mem = torch.tensor([peak_memory_gb(device)], device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        tps = timer.tokens / elapsed
        metrics = {
            "step": step, "tokens": tokens_seen, "loss": stats[0].item() / stats[1].item(),
            "lr": lr, "grad_norm": float(grad_norm), "tokens_per_second": tps,
            "step_time": elapsed / timer.steps, "data_wait_frac": stats[2].item() / world / elapsed,
            "mfu": mfu(tps, fpt, world, peak), "peak_mem_gb": mem.item(),
            "elapsed": time.perf_counter() - train_start, "train_start_unix": train_start_unix,
            "num_parameters": n_params, "torch_threads": torch.get_num_threads(),
        }
        if do_eval:
            val = evaluate(model, cfg, ctx, device, rank, world)
            metrics.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)))
        if do_ckpt and rank == 0:
            ckpt = out / f"checkpoint_{step:08d}"
            ckpt.mkdir(exist_ok=True)
            torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step, "tokens": tokens_seen}, ckpt / "state.pt")
        if log:
            log.write(json.dumps(metrics) + "\n")
            log.flush()
        loss_sum.zero_()
        loss_count = 0
        timer.reset()
        data_wait = 0.0

    if log:
        log.close()
    dist.barrier()  # no rank tears gloo down while its peer still talks (SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
