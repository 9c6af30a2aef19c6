"""The mixture of experts on the CPU: moe-tiny against a dense Llama of its active parameters
(tokens/s and the loss at equal tokens), and --ep 2 against --ep 1 on two gloo ranks (step time),
with the share of the step spent routing and moving tokens (the dispatch).

`dense`, one process, one torch thread (Ray adds orchestration, not compute): moe-tiny (4
experts of 256 units, 2 per token) and its dense twin, llama-tiny's attention with one SwiGLU of
512 units (the two active experts' units), train on the same byte windows of the built-in
corpus, alternating in blocks of --block steps so both see the same machine noise: tokens/s of
each block, the training loss of the last block, and the validation loss on 256 windows (a run's
default) after --steps steps (equal tokens).

`ep`, two processes over gloo (torch.multiprocessing; the worker's own TrainStep, built by
parallel/ as a Ray worker builds it, without Ray): moe-tiny at --strategy fsdp with --ep 1 (each
rank holds every expert, FSDP-sharded over the 2 ranks) and --ep 2 (each rank 2 experts, tokens
exchanged by all-to-all), alternating blocks: seconds per step, and the bytes each mesh dim moved.

Dispatch share (both parts): the ops of a few steps timed one by one (a TorchDispatchMode; CPU ops
are synchronous) and attributed to the module running them, forward and backward
(torch.distributed._tools.mod_tracker.ModTracker): the share of the op time spent in the MoE
layers outside the experts' and the shared expert's matmuls (the router, top-k, the sort,
gathers and scatters, the all-to-alls), per step, the median over --profile-steps steps. Op time
leaves out Python between ops.

    PYTHONPATH=. python bench/moe.py [--parts dense,ep] --out bench/results/moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def configs(data: str, seq: int, batch: int):
    """(moe-tiny, its dense twin) as TrainConfigs on `data`, fp32 on the CPU."""
    from raytrain_lm.config.load import build_config

    moe = build_config(preset="moe-tiny", flags=dict(data=data, seq_len=seq, batch_size=batch,
                                                     workers=1, max_steps=10 ** 6))
    moe.model.vocab_size = 256
    dense = build_config(preset="llama-tiny", flags=dict(data=data, seq_len=seq, batch_size=batch,
                                                         workers=1, max_steps=10 ** 6))
    dense.model.vocab_size = 256
    dense.model.ffn_dim = moe.model.top_k * moe.model.ffn_dim
    return moe, dense


def batch_stream(cfg, rank: int = 0, world: int = 1):
    """The windows a data-parallel rank reads, as the loop reads them (data/sampler.py)."""
    from torch.utils.data import DataLoader

    from raytrain_lm.data.sampler import BatchPlan, BatchStream
    from raytrain_lm.data.windows import TokenWindows, collate_windows

    windows = TokenWindows(cfg.data, "train", cfg.seq_len)
    return BatchStream(windows.shard_windows, BatchPlan(cfg.batch_size, 1, rank, world), cfg.seed,
                       lambda b: DataLoader(windows, batch_sampler=b, collate_fn=collate_windows))


def val_loss(model, cfg) -> float:
    """Mean loss per token over the first cfg.eval_windows windows of the validation split."""
    import torch

    from raytrain_lm.data.windows import TokenWindows, collate_windows

    windows = TokenWindows(cfg.data, "val", cfg.seq_len)
    n = min(len(windows), cfg.eval_windows)
    total = 0.0
    model.eval()
    with torch.no_grad():
        for start in range(0, n, cfg.batch_size):
            x, y = collate_windows([windows[i] for i in range(start, min(n, start + cfg.batch_size))])
            total += model(x, y)[1].item() * len(x)
    model.train()
    return total / n


class OpTimes:
    """Seconds of every op run inside it, by where it ran: "dispatch" (a MoE layer outside its
    experts and shared expert), "experts", "shared", "other"."""

    def __init__(self):
        import torch
        from torch.distributed._tools.mod_tracker import ModTracker
        from torch.utils._python_dispatch import TorchDispatchMode

        times = self.seconds = defaultdict(float)
        self.steps: list[dict] = []
        tracker = self.tracker = ModTracker()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                t0 = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                times[where(tracker.parents)] += time.perf_counter() - t0
                return out

        self.mode, self.torch = Mode(), torch

    def __enter__(self):
        self.tracker.__enter__()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.tracker.__exit__(*exc)

    def step(self) -> None:
        """The op time since the last call is one step's."""
        total = sum(self.seconds.values())
        self.steps.append({k: v / total for k, v in self.seconds.items()})
        self.seconds.clear()

    def share(self) -> dict:
        """The median over the steps of each place's share of the step's op time (a median: on a
        loaded machine an op the OS preempts takes the preemption's time)."""
        return {k: statistics.median(s.get(k, 0.0) for s in self.steps)
                for k in sorted({k for s in self.steps for k in s})}


def where(parents) -> str:
    names = [p.split(".") for p in parents]
    if any("experts" in n for n in names):
        return "experts"
    if any("shared" in n for n in names):
        return "shared"
    return "dispatch" if any(n[-1] == "mlp" or "mlp" in n for n in names) else "other"


def dense_part(args, data: str) -> dict:
    import torch

    from raytrain_lm.models import family
    from raytrain_lm.worker.step import TrainStep

    torch.set_num_threads(1)
    moe, dense = configs(data, args.seq_len, args.batch_size)
    runs = {}
    for name, cfg in (("moe-tiny", moe), ("dense twin", dense)):
        torch.manual_seed(0)
        step = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda model: model)  # one process
        runs[name] = dict(cfg=cfg, step=step, batches=batch_stream(cfg), blocks=[], losses=[])
    tokens = args.block * args.batch_size * args.seq_len
    for _ in range(args.steps // args.block):
        for run in runs.values():
            t0 = time.perf_counter()
            losses = [run["step"](run["batches"], args.lr)[0] for _ in range(args.block)]
            run["blocks"].append(tokens / (time.perf_counter() - t0))
            run["losses"].append(float(torch.stack(losses).mean()))
    out = {}
    for name, run in runs.items():
        val = val_loss(run["step"].parts[0], run["cfg"])
        m = run["cfg"].model
        tps = sorted(run["blocks"][1:])  # the first block warms up
        out[name] = {"parameters": family(m).counts(m).total, "active": family(m).active_params(m),
                     "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": tps[0],
                     "tokens_per_s_max": tps[-1], "train_loss_last_block": run["losses"][-1],
                     "val_loss": val, "tokens": args.steps * args.batch_size * args.seq_len}
    with OpTimes() as times:
        for _ in range(args.profile_steps):
            runs["moe-tiny"]["step"](runs["moe-tiny"]["batches"], args.lr)
            times.step()
    out["moe-tiny"]["op_share"] = times.share()
    return out


def ep_rank(rank: int, args, data: str, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_lm.worker.step import TrainStep

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    arms = {}
    for ep in (1, 2):
        cfg, _ = configs(data, args.seq_len, args.batch_size // 2)
        cfg.workers, cfg.strategy, cfg.ep = 2, "fsdp", ep
        torch.manual_seed(0)
        arms[f"ep{ep}"] = dict(step=TrainStep(cfg, torch.device("cpu")), batches=batch_stream(cfg, rank, 2),
                               blocks=[], losses=[])
    for _ in range(args.ep_steps // args.block):
        for arm in arms.values():
            dist.barrier()
            t0 = time.perf_counter()
            losses = [arm["step"](arm["batches"], args.lr)[0] for _ in range(args.block)]
            dist.barrier()
            arm["blocks"].append((time.perf_counter() - t0) / args.block)
            arm["losses"].append(float(torch.stack(losses).mean()))
    out = {}
    for name, arm in arms.items():
        with OpTimes() as times:
            for _ in range(args.profile_steps):
                arm["step"](arm["batches"], args.lr)
                times.step()
        secs = sorted(arm["blocks"][1:])
        out[name] = {"step_s_median": statistics.median(secs), "step_s_min": secs[0],
                     "step_s_max": secs[-1], "comm_bytes": arm["step"].comm_bytes,
                     "op_share": times.share(), "train_loss_last_block": arm["losses"][-1]}
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def ep_part(args, data: str) -> dict:
    import torch.multiprocessing as mp

    from raytrain_lm.cluster.connect import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(ep_rank, args=(args, data, free_port(), results), nprocs=2, start_method="spawn")
    return results.get(timeout=10)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="dense,ep")
    p.add_argument("--steps", type=int, default=200, help="dense: steps per model (equal tokens).")
    p.add_argument("--ep-steps", type=int, default=60, help="ep: steps per arm.")
    p.add_argument("--block", type=int, default=10, help="Steps per timed block (alternating).")
    p.add_argument("--profile-steps", type=int, default=9, help="Steps whose ops are timed.")
    p.add_argument("--batch-size", type=int, default=16, help="Sequences per step (all ranks).")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data", default=None, help="A prepared dataset [default: the built-in corpus, "
                                                "prepared in a temporary folder].")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe.json"))
    args = p.parse_args(argv)

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            from raytrain_lm.data.prepare import prepare_dataset

            data = str(Path(tmp) / "pydoc")
            prepare_dataset("pydoc", data)
        result = {"what": __doc__.splitlines()[0], "settings": vars(args),
                  "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, "
                             f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}",
                  "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
        if "dense" in args.parts:
            result["dense"] = dense_part(args, data)
            for name, r in result["dense"].items():
                print(f"{name:<11} {r['parameters']:>10,} params ({r['active']:,} active): "
                      f"{r['tokens_per_s_median']:,.0f} tok/s ({r['tokens_per_s_min']:,.0f}-"
                      f"{r['tokens_per_s_max']:,.0f}), train {r['train_loss_last_block']:.4f}, "
                      f"val {r['val_loss']:.4f} after {r['tokens']:,} tokens")
            print(f"moe-tiny op share: {result['dense']['moe-tiny']['op_share']}")
        if "ep" in args.parts:
            result["ep"] = ep_part(args, data)
            for name, r in result["ep"].items():
                print(f"{name}: {r['step_s_median'] * 1e3:.1f} ms/step ({r['step_s_min'] * 1e3:.1f}-"
                      f"{r['step_s_max'] * 1e3:.1f}), bytes/step {r['comm_bytes']}, op share {r['op_share']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
