"""The planner against published training runs (published_runs.json; docs/planner.md's table).

For each run: the planner's own ranking of every layout of the run's cluster, model, sequence
length and global batch; the published layout's estimate (the fastest variant the planner finds
with the published tp, pp, data-parallel strategy and activation checkpointing, and micro-batch
where published: it picks the schedule and split itself); that layout's rank; its memory and
tokens/s per GPU against the published ones.

Rank: the published split's place among the (tp, pp) splits the planner considers, each at its
fastest variant that fits with the published data-parallel strategy (what the run's framework
offered: Megatron-LM of 2021 had no sharded data parallelism to choose), whatever its
checkpointing, schedule or micro-batch; ties (within 0.1%) count for it. The throughput and
memory compared are those of the published layout itself (its checkpointing too).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raytrain_lm.config.presets import preset_config
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan.estimate import Estimate, _bucket, best_variant, estimate_layout, structures, variants
from raytrain_lm.plan.hardware import GIB, Cluster

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
                   overlap_reduce=run.get("overlap_reduce", True),
                   reduce_bytes=run.get("reduce_bytes", 4),
                   recompute_early_stop=run.get("recompute_early_stop", True),
                   overlap_pp=run.get("overlap_pp", True),
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
    splits: int  # (tp, pp) splits that fit with the published strategy
    published_tps: float
    behind: Optional[float] = None  # the published split's step time / the fastest split's

    @property
    def throughput_ratio(self) -> Optional[float]:
        return tokens_per_s(self.mine) / self.published_tps if self.mine else None

    @property
    def memory_ratio(self) -> Optional[float]:
        pub = self.run["published"].get("memory_gib")
        return self.mine.memory.total / GIB / pub if self.mine and pub else None


def split_estimates(m: ModelConfig, cl: Cluster, run: dict) -> tuple[dict[tuple, Estimate], list[Estimate]]:
    """((tp, pp) -> the fastest fitting variant of that split with the published strategy,
    every layout the planner considers at its best variant, ranked as `plan` ranks them)."""
    from raytrain_lm.config.layout import Layout
    from raytrain_lm.plan.estimate import divisors, rank_key, tp_sizes

    strategy = run["layout"]["strategy"]
    out: dict[tuple, Estimate] = {}
    ranked: list[Estimate] = []
    for t in tp_sizes(m, cl):
        for p in (d for d in divisors(cl.gpus // t) if d <= m.n_layer):
            dp = cl.gpus // (t * p)
            kinds = Layout.strategies(dp, t, p)
            for kind in kinds + ([strategy] if strategy not in kinds and dp > 1 else []):
                for s in structures(m, cl, run["seq_len"], t, p, kind):
                    found = [estimate_layout(m, lay, cl)
                             for lay in variants(s, run["global_batch"], run["seq_len"])]
                    if not found:
                        continue
                    best = best_variant(found)
                    if kind in kinds:
                        ranked.append(best)
                    if kind == strategy and best.fits and \
                            ((t, p) not in out or best.step_s < out[(t, p)].step_s):
                        out[(t, p)] = best
    return out, sorted(ranked, key=rank_key)


def validate_run(run: dict, peak_fraction: Optional[float] = None) -> Row:
    m, cl = run_model(run), run_cluster(run, peak_fraction)
    mine = published_estimate(m, cl, run)
    best, ranked = split_estimates(m, cl, run)
    want = run["layout"]
    own = (want["tp"], want["pp"])
    split = best.get(own)
    rank = behind = None
    if split is not None:
        rank = 1 + sum(1 for k, e in best.items()
                       if k != own and _bucket(e.step_s) < _bucket(split.step_s))
        behind = split.step_s / min(e.step_s for e in best.values())
    return Row(run, ranked[0], mine, rank, len(best), published_tokens_per_s(run, m), behind)


def validate(path: Path = RUNS) -> list[Row]:
    return [validate_run(run) for run in load_runs(path)]


def summary(rows: list[Row]) -> dict:
    ratios = [r.throughput_ratio for r in rows if r.throughput_ratio]
    mems = [r.memory_ratio for r in rows if r.memory_ratio]
    return {"rows": len(rows), "top3": sum(1 for r in rows if r.rank and r.rank <= 3),
            "within_5_percent": sum(1 for r in rows if r.behind is not None and r.behind <= 1.05),
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
    head = ("| run | GPUs | published layout | planner's pick | rank of published split (its "
            "step / the fastest split's) | memory GiB plan / published | tokens/s/GPU plan / "
            "published (ratio) |\n|---|---:|---|---|---:|---:|---:|")
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
                   f"{describe_layout(r.pick)} | {r.rank or '-'} of {r.splits}"
                   f"{f' ({r.behind:.3f})' if r.behind else ''} | {mem} | {tps} |")
    return "\n".join(out)
