"""What the gradient noise scale costs per step on data-parallel layouts, side by side: the same
step with the estimate (parallel/noise.py: DDP's comm hook, or FSDP2's post-backward squares) and
without it (nothing registered), on 2 gloo ranks of this machine, in one run.

Per layout (DDP through nn.parallel.DistributedDataParallel as Ray's prepare_model wraps it; ZeRO-1
and FSDP through FSDP2, their post-backward wrapped), two TrainSteps from the same config and
weights: one with the estimate, one built with SmallBatchNorm replaced by a class that registers
nothing. Their steps alternate in blocks of --block steps (ABBA: neither arm always first), after
--warm steps of each; both ranks start every block together (a barrier). Rank 0's seconds per
step of each block; per layout the median block of each arm, and the ratio of each with-block to
its neighbouring without-block (a pair of ABBA), whose median and range are the cost and its
spread. Beside it, the estimate's own arithmetic timed alone (the fused squared norms over a
rank's gradients after a step): the part of the cost that does not drown in the machine's noise.
Random tokens (the arithmetic, not the data, is timed). With --cp: on 4 ranks, DDP and FSDP over
dp 2 x cp 2 (the hook's reduce-scatter, all-reduce, all-gather; FSDP2's extra reduce-scatter
over cp), the squares alone without that reduce-scatter.

    nice -n 10 python bench/noise_cost.py [--blocks 8] [--block 10] [--cp] [--out bench/results/noise_cost.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ = 128
SETS = ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", f"model.block_size={SEQ}",
        "model.vocab_size=256", "model.dropout=0"]
MICRO = 8
LAYOUTS = {"ddp": {"strategy": "ddp"}, "zero1": {"strategy": "zero1"}, "fsdp": {"strategy": "fsdp"}}
CP_LAYOUTS = {"ddp-cp2": {"strategy": "ddp", "cp": 2}, "fsdp-cp2": {"strategy": "fsdp", "cp": 2}}


class Batches:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def next(self):
        x = torch.randint(0, 256, (MICRO, SEQ), generator=self.g)
        return x, x


class NoEstimate:
    """SmallBatchNorm as a run without the noise scale would have it: nothing registered."""

    def __init__(self, *args, **kwargs):
        self.batches = None

    def start(self) -> None:
        pass

    def after_micro(self, micro, params) -> None:
        pass

    def take(self, scale):
        return None


def build(flags: dict, world: int, estimate: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_lm.config.load import build_config
    from raytrain_lm.parallel.ddp import DDP_KWARGS
    from raytrain_lm.worker import step as step_module

    cfg = build_config(sets=SETS, flags={"workers": world, "lr": 1e-4, "seq_len": SEQ,
                                         "batch_size": MICRO, **flags})
    saved = step_module.SmallBatchNorm
    if not estimate:
        step_module.SmallBatchNorm = NoEstimate
    try:
        torch.manual_seed(0)
        return step_module.TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda m: DDP(m, **DDP_KWARGS))
    finally:
        step_module.SmallBatchNorm = saved


def rank_main(rank: int, store: str, out: str, blocks: int, block: int, warm: int, cp: bool) -> None:
    torch.set_num_threads(1)
    world = 4 if cp else 2
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = {}
    for strategy, flags in (CP_LAYOUTS if cp else LAYOUTS).items():
        arms = {"with": build(flags, world, True), "without": build(flags, world, False)}
        assert arms["with"].noise_batches is not None and arms["without"].noise_batches is None
        batches = Batches(10 + rank // flags.get("cp", 1))  # a cp group reads the same batches
        for s in arms.values():
            s.train()
            for _ in range(warm):
                s(batches, 1e-4)
        times: dict[str, list[float]] = {"with": [], "without": []}
        for i in range(2 * blocks):
            arm = ("with", "without", "without", "with")[i % 4]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                arms[arm](batches, 1e-4)
            times[arm].append((time.perf_counter() - t0) / block)
        result[strategy] = {**times, "squares_alone_s": squares_alone(arms["with"])}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def squares_alone(step, reps: int = 50) -> float:
    """Median seconds of the estimate's own arithmetic for one step, timed alone: the fused
    squared norms over this rank's gradients (the same elements the hook or the post-backward
    reads), without the machine's step-to-step noise."""
    from raytrain_lm.parallel.noise import _weighted_squares

    grads = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, 1)
             for part in step.parts for p in part.parameters() if p.grad is not None]
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _weighted_squares(grads, torch.device("cpu"))
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def summary(times: dict) -> dict:
    w, wo = times["with"], times["without"]
    # ABBA: blocks 0,3 with; 1,2 without -> pair each with-block with its neighbour
    ratios = [a / b for a, b in zip(w, wo)]
    return {"with_median_s": statistics.median(w), "without_median_s": statistics.median(wo),
            "with_range_s": [min(w), max(w)], "without_range_s": [min(wo), max(wo)],
            "pair_ratio_median": statistics.median(ratios), "pair_ratio_range": [min(ratios), max(ratios)],
            "blocks": len(w), "squares_alone_s": times["squares_alone_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8, help="blocks per arm")
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--warm", type=int, default=3, help="steps of each arm before timing")
    ap.add_argument("--cp", action="store_true", help="DDP and FSDP over dp 2 x cp 2, on 4 ranks")
    ap.add_argument("--out", default=None, help="[bench/results/noise_cost.json, --cp: noise_cost_cp.json]")
    a = ap.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "times.json")
        mp.start_processes(rank_main, args=(os.path.join(tmp, "store"), raw, a.blocks, a.block, a.warm,
                                            a.cp), nprocs=4 if a.cp else 2, start_method="spawn")
        times = json.loads(Path(raw).read_text())
    out = {"what": "gradient noise scale: seconds per step with and without it, "
                   + ("4 gloo ranks, dp 2 x cp 2" if a.cp else "2 gloo ranks"),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="minutes"),
           "model": SETS, "seq_len": SEQ, "micro_batch": MICRO, "block_steps": a.block,
           "load_avg_1min": [load_start, os.getloadavg()[0]],
           "layouts": {k: {**summary(v), "raw": v} for k, v in times.items()}}
    path = Path(a.out or ROOT / f"bench/results/noise_cost{'_cp' if a.cp else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "raw"} for k, v in out["layouts"].items()},
                     indent=2))


if __name__ == "__main__":
    main()
