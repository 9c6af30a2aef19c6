"""The planner against published training runs (published_runs.json; docs/planner.md's table).

For each run: the planner's own ranking of every layout of the run's cluster, model, sequence
length and global batch; the published layout's estimate (the fastest variant the planner finds
with the published tp, pp, data-parallel strategy and activation checkpointing, and micro-batch
where published: it picks the schedule and split itself); that layout's rank; its memory and
tokens/s per GPU against the published ones.

Rank: the published split's place among the distinct (tp, pp, strategy) splits the planner
considers, each at its fastest variant that fits, whatever its checkpointing, schedule or
micro-batch (one row per way of splitting the GPUs); ties (within 0.1%) count for it. The
throughput and memory compared are those of the published layout itself (its checkpointing too).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raytrain_lm.config import ModelConfig, preset_config
from raytrain_lm.plan.estimate import (Estimate, _bucket, best_variant, estimate_layout, plan,
                                       structures, variants)
from raytrain_lm.plan.layout import GIB, Cluster, param_counts

RUNS = Path(__file__).with_name("published_runs.json")


def load_runs(path: Path = RUNS) -> list[dict]:
    return json.loads(Path(path).read_text())["runs"]


def run_model(run: dict) -> ModelConfig:
    spec = dict(run["model"])
    if "preset" in spec:
        m = preset_config(spec.pop("preset")).model
    else:
        m = ModelConfig()
    for k, v in spec.items():
        setattr(m, k, v)
    return m


def run_cluster(run: dict, peak_fraction: Optional[float] = None) -> Cluster:
    from raytrain_lm.plan.efficiency import PEAK_FRACTION

    c = run["cluster"]
    return Cluster(gpus=c["gpus"], gpus_per_node=c["gpus_per_node"], memory_gb=c["memory_gib"],
                   intra_gbps=c["intra_gbps"], inter_gbps=c["inter_gbps"], tflops=c["tflops"],
                   precision=run.get("precision", "bf16"),
                   peak_fraction=peak_fraction if peak_fraction is not None else PEAK_FRACTION[c["gpu"]])


def megatron_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Megatron-LM's count (Narayanan et al. 2021, eq. 3) per token: 96 l h^2 (1 + s/6h +
    V/16lh), recomputation included; their TFLOP/s figures use it."""
    L, h, V = m.n_layer, m.n_embd, m.vocab_size
    return 96 * L * h * h * (1 + seq_len / (6 * h) + V / (16 * L * h))


def published_tokens_per_s(run: dict, m: ModelConfig) -> float:
    pub = run["published"]
    if "tokens_per_s_per_gpu" in pub:
        return pub["tokens_per_s_per_gpu"]
    assert pub["flops_formula"] == "megatron"
    return pub["tflops_per_gpu"] * 1e12 / megatron_flops_per_token(m, run["seq_len"])


def published_estimate(m: ModelConfig, cl: Cluster, run: dict) -> Optional[Estimate]:
    """The fastest fitting variant of the published layout (None: none fits)."""
    want = run["layout"]
    found = []
    for s in structures(m, cl, run["seq_len"], want["tp"], want["pp"], want["strategy"]):
        if s[4] != want.get("ac", s[4]) or s[5] != want.get("sp", s[5]):
            continue
        for lay in variants(s, run["global_batch"], run["seq_len"]):
            if lay.micro_batch == want.get("b", lay.micro_batch):
                found.append(estimate_layout(m, lay, cl))
    fitting = [e for e in found if e.fits]
    return best_variant(fitting) if fitting else None


def tokens_per_s(e: Estimate) -> float:
    lay = e.layout
    return lay.dp * lay.sequences * lay.seq_len / e.step_s / lay.gpus


@dataclass
class Row:
    run: dict
    pick: Estimate
    mine: Optional[Estimate]  # the published layout as planned
    rank: Optional[int]
    splits: int  # (tp, pp, strategy) layouts that fit
    published_tps: float

    @property
    def throughput_ratio(self) -> Optional[float]:
        return tokens_per_s(self.mine) / self.published_tps if self.mine else None

    @property
    def memory_ratio(self) -> Optional[float]:
        pub = self.run["published"].get("memory_gib")
        return self.mine.memory.total / GIB / pub if self.mine and pub else None


def validate_run(run: dict, peak_fraction: Optional[float] = None) -> Row:
    m, cl = run_model(run), run_cluster(run, peak_fraction)
    ranked = plan(m, cl, run["global_batch"], run["seq_len"])
    mine = published_estimate(m, cl, run)
    best: dict[tuple, Estimate] = {}
    for e in ranked:
        if e.fits:
            key = (e.layout.tp, e.layout.pp, e.layout.strategy)
            if key not in best or e.step_s < best[key].step_s:
                best[key] = e
    rank = None
    want = run["layout"]
    own = (want["tp"], want["pp"], want["strategy"])
    split = best.get(own, mine)
    if split is not None:
        rank = 1 + sum(1 for k, e in best.items()
                       if k != own and _bucket(e.step_s) < _bucket(split.step_s))
    return Row(run, ranked[0], mine, rank, len(best), published_tokens_per_s(run, m))


def validate(path: Path = RUNS) -> list[Row]:
    return [validate_run(run) for run in load_runs(path)]


def summary(rows: list[Row]) -> dict:
    ratios = [r.throughput_ratio for r in rows if r.throughput_ratio]
    mems = [r.memory_ratio for r in rows if r.memory_ratio]
    return {"rows": len(rows), "top3": sum(1 for r in rows if r.rank and r.rank <= 3),
            "fit": sum(1 for r in rows if r.mine is not None),
            "throughput_min": min(ratios), "throughput_max": max(ratios),
            "throughput_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
            "memory_ratios": mems}


def describe_layout(e: Estimate) -> str:
    lay = e.layout
    out = f"tp {lay.tp} pp {lay.pp} {lay.strategy} {lay.dp}"
    if lay.pp > 1:
        out += f" {lay.schedule}" + (f" x{lay.v}" if lay.v > 1 else "")
    return out + f", AC {lay.ac}" + (", SP" if lay.sp else "") + f", b {lay.micro_batch}"


def markdown(rows: list[Row]) -> str:
    head = ("| run | GPUs | published layout | planner's pick | rank of published | memory GiB "
            "plan / published | tokens/s/GPU plan / published (ratio) |\n|---|---:|---|---|---:|---:|---:|")
    out = [head]
    for r in rows:
        lay = r.run["layout"]
        pub = f"TP {lay['tp']} x PP {lay['pp']} x {lay['strategy']}, AC {lay['ac']}"
        mem_pub = r.run["published"].get("memory_gib")
        mem = (f"{r.mine.memory.total / GIB:.1f} / {mem_pub:g}" if mem_pub and r.mine else
               f"{r.mine.memory.total / GIB:.1f} / -" if r.mine else "does not fit")
        tps = (f"{tokens_per_s(r.mine):,.0f} / {r.published_tps:,.0f} ({r.throughput_ratio:.2f})"
               if r.mine else f"- / {r.published_tps:,.0f}")
        out.append(f"| {r.run['name']} | {r.run['cluster']['gpus']} | {pub} | "
                   f"{describe_layout(r.pick)} | {r.rank or '-'} of {r.splits} | {mem} | {tps} |")
    return "\n".join(out)
