#!/usr/bin/env python
"""Context parallelism's two ways to attend across the cp ranks, measured on CPU gloo ranks:
the all-gather of K/V that training uses (parallel/cp.py, Llama 3) and the ring that passes K/V
blocks (parallel/ring.py). For one training forward and backward of a window on each rank:

  peak   the largest bytes of live tensors other than the model's parameters, buffers and
         gradients (torch.distributed._tools.mem_tracker.MemTracker: every tensor the step
         allocates, K/V in flight and temporaries included), max over the ranks
  saved  the bytes autograd saves for backward (bench/cp_memory.py's tracker), max over ranks;
         of them the all-gather's dense mask (the CPU path's; a GPU's flex block mask is small)
  sent   bytes a rank sends per step (parallel/traffic.CommCounter, ring algorithms' wire bytes)
  time   the median of the step's wall time over --reps steps, max over the ranks

cp 1 is the ordinary causal path (no span). The ring is a CPU reference in plain matmuls, the
all-gather runs SDPA with the dense mask (the CPU path; a GPU runs flex_attention), so their
times compare two CPU implementations, not two fused kernels; the bytes compare the methods.

    python bench/cp_ring.py                          # Llama 4 layers, width 256, GQA 8/2, 2048 tokens
    python bench/cp_ring.py --kv-heads 8             # no GQA: K/V as large as the queries
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_memory import saved_bytes


def model_config(args):
    from raytrain_lm.models.family import ModelConfig

    return ModelConfig(arch="llama", bias=False, vocab_size=256, block_size=args.seq, n_layer=args.layers,
                       n_head=8, n_kv_head=args.kv_heads, n_embd=args.width, multiple_of=32)


def peak_bytes(model, x, y, span) -> int:
    """The step's peak of live tensors beyond the model's parameters, buffers and gradients."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from raytrain_lm.models.attention import using

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, using(span):
        model(x, y)[1].backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return sum(v for k, v in peak.items() if str(k).split(".")[-1] not in ("PARAM", "BUFFER", "GRAD", "Total"))


def rank_main(rank: int, world: int, port: int, ring: bool, args, out) -> None:
    from raytrain_lm.models import build_model
    from raytrain_lm.models.attention import using
    from raytrain_lm.parallel.cp import ContextParallel
    from raytrain_lm.parallel.traffic import CommCounter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model(model_config(args), seed=1)
    window = torch.randint(0, 256, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    context = ContextParallel(world, rank, dist.group.WORLD, ring=ring) if world > 1 else None

    def batch():
        """This rank's tokens and a new span (its masks built in the step, as training's)."""
        x, y = window[:, :-1], window[:, 1:]
        return context.shard(x, y) if context is not None else (x, y, None)

    def step():
        x, y, span = batch()
        model.zero_grad(set_to_none=True)
        with using(span):
            model(x, y)[1].backward()

    times = []
    for _ in range(args.reps + 1):  # the first: warm-up
        dist.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    x, y, span = batch()
    model.zero_grad(set_to_none=True)
    with using(span):
        saved = saved_bytes(model, x, y)
    # the all-gather's CPU path holds its dense mask for the step (a GPU's block mask is small)
    mask = 0 if span is None else sum(m.untyped_storage().nbytes() for key, m in span.masks.items()
                                      if key[0] not in ("cos", "sin"))
    model.zero_grad(set_to_none=True)
    peak = peak_bytes(model, *batch())
    sent = 0
    if world > 1:
        with CommCounter() as counter:
            step()
        sent = sum(d["wire"] for d in counter.by_dim().values())
    out.put((rank, peak, saved, sent, statistics.median(times[1:]), mask))
    dist.destroy_process_group()


def measure(cp: int, ring: bool, args) -> dict:
    from raytrain_lm.cluster.connect import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, cp, port, ring, args, out)) for r in range(cp)]
    for p in procs:
        p.start()
    got = [out.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join()
    return {"peak_mib": max(g[1] for g in got) / 2**20, "saved_mib": max(g[2] for g in got) / 2**20,
            "dense_mask_mib": max(g[5] for g in got) / 2**20,
            "sent_mib": max(g[3] for g in got) / 2**20, "step_s": max(g[4] for g in got)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    report = {"cp1": measure(1, False, args)}
    for cp in args.cps:
        for ring in (False, True):
            report[f"cp{cp}-{'ring' if ring else 'gather'}"] = measure(cp, ring, args)
            print(json.dumps({k: {m: round(v, 4) for m, v in r.items()} for k, r in report.items()}), flush=True)
    kv_layer = 2 * args.seq * args.kv_heads * (args.width // 8) * 4  # one layer's window K/V, fp32
    print(json.dumps({"window_kv_per_layer_mib": kv_layer / 2**20,
                      "rows": {k: {m: round(v, 4) for m, v in r.items()} for k, r in report.items()}}, indent=2))


if __name__ == "__main__":
    main()
