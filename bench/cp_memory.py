#!/usr/bin/env python
"""Per-worker activation memory under context parallelism, measured: the bytes of the tensors
autograd saves for backward in one training forward of a window (torch.autograd.graph.
saved_tensors_hooks, each storage counted once, the parameters left out), on each of cp gloo
ranks, at cp 1, 2 and 4, against 1/cp of cp 1's and against plan/memory.py's prediction.

    python bench/cp_memory.py                       # Llama, 4 layers, width 256, GQA 8/2, 2048 tokens
    python bench/cp_memory.py --seq 4096 --cps 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def model_config(args):
    from raytrain_lm.models.family import ModelConfig

    return ModelConfig(arch="llama", bias=False, vocab_size=256, block_size=args.seq, n_layer=args.layers,
                       n_head=8, n_kv_head=2, n_embd=args.width, multiple_of=32)


def saved_bytes(model, x, y) -> int:
    """Bytes of the distinct storages autograd saves in model(x, y)'s forward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)[1]
    loss.backward()
    return sum(seen.values())


def rank_main(rank: int, world: int, port: int, args, out) -> None:
    from raytrain_lm.models import build_model
    from raytrain_lm.models.attention import using
    from raytrain_lm.parallel.cp import ContextParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model(model_config(args), seed=1)
    g = torch.Generator().manual_seed(0)
    window = torch.randint(0, 256, (1, args.seq + 1), generator=g)
    x, y = window[:, :-1], window[:, 1:]
    mask = 0
    if world == 1:
        measured = saved_bytes(model, x, y)  # the ordinary path: causal SDPA, no span
    else:
        x, y, span = ContextParallel(world, rank, dist.group.WORLD).shard(x, y)
        with using(span):
            measured = saved_bytes(model, x, y)
        mask = sum(m.untyped_storage().nbytes() for key, m in span.masks.items()
                   if key[0] not in ("cos", "sin"))  # CPU's dense mask (not the rotary rows)
    out.put((rank, measured, mask))
    dist.destroy_process_group()


def measure(cp: int, args) -> int:
    """(the largest rank's saved bytes, of which its dense mask's) at context-parallel degree cp."""
    from raytrain_lm.cluster.connect import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, cp, port, args, out)) for r in range(cp)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return max((b, m) for _, b, m in got)


def planned(cp: int, args) -> float:
    from raytrain_lm.config.layout import Layout
    from raytrain_lm.plan.hardware import Cluster
    from raytrain_lm.plan.memory import rank_memory
    from raytrain_lm.plan.stages import rank_stages

    m = model_config(args)
    lay = Layout(dp=1, tp=1, pp=1, strategy="ddp", ac="none", sp=False, schedule="-", micro_batch=1,
                 microbatches=1, seq_len=args.seq, cp=cp)
    mem = rank_memory(m, lay, Cluster(gpus=cp, gpu=False, precision="fp32"), rank_stages(m, 1, 1)[0], 0)
    return mem.activations + mem.logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    rows = {cp: measure(cp, args) for cp in args.cps}
    base = rows[args.cps[0]] if args.cps[0] == 1 else None
    report = {}
    for cp, (b, mask) in rows.items():
        report[cp] = {"saved_mib": b / 2**20, "of_which_dense_mask_mib": mask / 2**20,
                      "planned_mib": planned(cp, args) / 2**20}
        if base:
            report[cp]["over_1_over_cp"] = b / (base[0] / cp) - 1
            report[cp]["over_1_over_cp_without_the_mask"] = (b - mask) / (base[0] / cp) - 1
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
