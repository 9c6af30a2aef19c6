"""The planner against published training runs (published_runs.json; docs/planner.md's tables).

For each row: the published layout's estimate (the fastest variant the planner finds with the
published tp, pp, strategy, checkpointing, sequence parallelism, micro-batch and schedule where
published: it picks the rest) against the published tokens/s and memory; and, for rows whose
source chose the layout for speed ("ranked"), its place among the (tp, pp) splits the planner
considers, each at its fastest fitting variant with the published data-parallel strategy (ties
within 0.1% count for it).

The rows are split before any result is looked at (published_runs.json's split_rule): constants
are fitted on the "fit" rows (bench/planner_validation.py --fit, plan/calibration.json) and the
targets are judged on the "held-out" ones. Rows the planner does not model say why and stay out of
both (docs/planner.md lists them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from raytrain_lm.config.layout import UNSHARDED
from raytrain_lm.config.presets import preset_config
from raytrain_lm.models import flops_per_token
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan import frameworks
from raytrain_lm.plan.estimate import (
    Estimate,
    _bucket,
    best_variant,
    divisors,
    estimate_layout,
    structures,
    tp_sizes,
    variants,
)
from raytrain_lm.plan.hardware import GIB, Cluster, kind_cluster
from raytrain_lm.plan.kinds import kind

RUNS = Path(__file__).with_name("published_runs.json")
LOW, HIGH = 0.8, 1.25  # the throughput target: planned / published within these


def load_runs(path: Path = RUNS) -> list[dict]:
    return json.loads(Path(path).read_text())["runs"]


def modelled(run: dict) -> bool:
    return "not_modelled" not in run


def fit_runs(runs: list[dict], name: str) -> list[dict]:
    """The rows the calibration constant `name` is fitted on: in-sample ("fit") modelled rows only,
    of its group: a kernel efficiency ("eta", "eta:2024"), the rows of the frameworks of that
    software generation (frameworks.Framework.efficiency) not on a kind whose clock is fitted
    (those fit the clock); a clock factor, the rows on its kind; the allocator, the rows that
    publish memory. Held-out rows never enter a fit."""
    from raytrain_lm.plan.calibration import clock_key, constants

    fit = [r for r in runs if r["split"] == "fit" and modelled(r)]
    if name == "allocator":
        return [r for r in fit if "memory_gib" in r["published"]]
    clocked = {k for k in constants() if k.startswith("clock_factor:")}
    if name in clocked:
        return [r for r in fit if clock_key(r["gpu"]) == name]
    return [r for r in fit if frameworks.FRAMEWORKS[r["framework"]].efficiency == name
            and clock_key(r["gpu"]) not in clocked]


def run_model(run: dict) -> ModelConfig:
    spec = dict(run["model"])
    m = preset_config(spec.pop("preset")).model if "preset" in spec else ModelConfig()
    for k, v in spec.items():
        setattr(m, k, v)
    return m


def run_cluster(run: dict) -> Cluster:
    """The run's cluster: its GPU kind's figures, the run's own node where it differs, and what
    its framework does."""
    k = kind(run["gpu"])
    per_node = run.get("gpus_per_node", k.gpus_per_node)
    inter = run["nics_per_node"] * run["nic_gbps"] / per_node if "nics_per_node" in run else None
    cl = kind_cluster(run["gpu"], run["gpus"], gpus_per_node=per_node, inter_gbps=inter,
                      precision=run.get("precision", "bf16"))
    cl = frameworks.apply(cl, run["framework"])
    return replace(cl, reduce_bytes=run["reduce_bytes"]) if "reduce_bytes" in run else cl


def megatron_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Megatron-LM's count (Narayanan et al. 2021, eq. 3) per token: 96 l h^2 (1 + s/6h +
    V/16lh), recomputation included; their TFLOP/s figures use it."""
    L, h, V = m.n_layer, m.n_embd, m.vocab_size
    return 96 * L * h * h * (1 + seq_len / (6 * h) + V / (16 * L * h))


def published_tokens_per_s(run: dict, m: ModelConfig) -> float:
    pub = run["published"]
    if "tokens_per_s_per_gpu" in pub:
        return pub["tokens_per_s_per_gpu"]
    if "iteration_s" in pub:
        return run["global_batch"] * run["seq_len"] / pub["iteration_s"] / run["gpus"]
    per_token = (megatron_flops_per_token(m, run["seq_len"]) if pub["flops_formula"] == "megatron"
                 else flops_per_token(m, run["seq_len"]))
    return pub["tflops_per_gpu"] * 1e12 / per_token


def published_estimate(m: ModelConfig, cl: Cluster, run: dict) -> Optional[Estimate]:
    """The fastest fitting variant of the published layout (None: none fits)."""
    want = run["layout"]
    found = []
    for s in structures(m, cl, run["seq_len"], want["tp"], want["pp"], want["strategy"], want.get("v")):
        if s[4] != want.get("ac", s[4]) or s[5] != want.get("sp", s[5]) or \
                s[6] != want.get("schedule", s[6]):
            continue
        for lay in variants(s, run["global_batch"], run["seq_len"], want.get("b"), want.get("ep", 1)):
            found.append(estimate_layout(m, lay, cl))
    fitting = [e for e in found if e.fits]
    return best_variant(fitting) if fitting else None


def tokens_per_s(e: Estimate) -> float:
    lay = e.layout
    return lay.dp * lay.sequences * lay.seq_len / e.step_s / lay.gpus


@dataclass
class Row:
    run: dict
    mine: Optional[Estimate]  # the published layout as planned
    published_tps: float
    rank: Optional[int] = None  # ranked rows: the published split's place
    splits: int = 0  # (tp, pp) splits that fit with the published strategy
    behind: Optional[float] = None  # the published split's step time / the fastest split's
    pick: Optional[Estimate] = None  # the planner's fastest split

    @property
    def throughput_ratio(self) -> Optional[float]:
        return tokens_per_s(self.mine) / self.published_tps if self.mine else None

    @property
    def memory_ratio(self) -> Optional[float]:
        pub = self.run["published"].get("memory_gib")
        return self.mine.reserved / GIB / pub if self.mine and pub else None


def split_estimates(m: ModelConfig, cl: Cluster, run: dict) -> dict[tuple, Estimate]:
    """(tp, pp) -> the fastest fitting variant of that split with the published strategy."""
    strategy = run["layout"]["strategy"]
    out: dict[tuple, Estimate] = {}
    for t in tp_sizes(m, cl):
        for p in (d for d in divisors(cl.gpus // t) if d <= m.n_layer):
            dp = cl.gpus // (t * p)
            for s in structures(m, cl, run["seq_len"], t, p, strategy if dp > 1 else UNSHARDED):
                if s[6] == "gpipe":  # as fast as 1f1b in the model and never smaller: no new split time
                    continue
                found = [e for e in (estimate_layout(m, lay, cl, time_unfit=False)
                                     for lay in variants(s, run["global_batch"], run["seq_len"])) if e.fits]
                if found:
                    best = best_variant(found)
                    if (t, p) not in out or best.step_s < out[(t, p)].step_s:
                        out[(t, p)] = best
    return out


def validate_run(run: dict) -> Row:
    m, cl = run_model(run), run_cluster(run)
    row = Row(run, published_estimate(m, cl, run), published_tokens_per_s(run, m))
    if run.get("ranked") and modelled(run):
        best = split_estimates(m, cl, run)
        own = (run["layout"]["tp"], run["layout"]["pp"])
        row.splits = len(best)
        if best:
            row.pick = min(best.values(), key=lambda e: e.step_s)
        if own in best:
            mine = best[own]
            row.rank = 1 + sum(1 for k, e in best.items() if k != own and _bucket(e.step_s) < _bucket(mine.step_s))
            row.behind = mine.step_s / row.pick.step_s
    return row


def validate(path: Path = RUNS) -> list[Row]:
    return [validate_run(run) for run in load_runs(path)]


def summary(rows: list[Row]) -> dict:
    """The targets' figures over modelled rows: throughput ratios, how many within LOW-HIGH,
    refused (no fitting variant of a layout that ran), published split in the top 3 among ranked
    rows, memory ratios where published."""
    rows = [r for r in rows if modelled(r.run)]
    ratios = [r.throughput_ratio for r in rows if r.throughput_ratio]
    ranked = [r for r in rows if r.run.get("ranked")]
    return {"rows": len(rows), "refused": [r.run["name"] for r in rows if r.mine is None],
            "within": sum(1 for x in ratios if LOW <= x <= HIGH), "ratios": len(ratios),
            "throughput_min": min(ratios, default=None), "throughput_max": max(ratios, default=None),
            "throughput_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
            "ranked": len(ranked), "top3": sum(1 for r in ranked if r.rank and r.rank <= 3),
            "memory_ratios": [round(r.memory_ratio, 3) for r in rows if r.memory_ratio]}


def summary_text(s: dict) -> str:
    """One line of the summary, as docs/planner.md quotes it."""
    out = (f"tokens/s within {LOW}-{HIGH} of published: {s['within']} of {s['ratios']} (from "
           f"{s['throughput_min']:.2f} to {s['throughput_max']:.2f}, geometric mean "
           f"{s['throughput_geomean']:.2f}); refused (does not fit): {len(s['refused'])}; published "
           f"split in the planner's top 3: {s['top3']} of {s['ranked']} ranked rows")
    if s["memory_ratios"]:
        out += "; reserved memory planned / published: " + ", ".join(f"{x:.2f}" for x in s["memory_ratios"])
    return out


def describe_layout(e: Estimate) -> str:
    lay = e.layout
    out = f"tp {lay.tp} pp {lay.pp} {lay.strategy} {lay.dp}" + (f" ep {lay.ep}" if lay.ep > 1 else "")
    if lay.pp > 1:
        out += f" {lay.schedule}" + (f" x{lay.v}" if lay.v > 1 else "")
    return out + f", AC {lay.ac}" + (", SP" if lay.sp else "") + f", b {lay.micro_batch}"


def _cells(r: Row) -> list[str]:
    lay = r.run["layout"]
    pub = f"TP {lay['tp']} x PP {lay['pp']} x {lay['strategy']}" + \
        (f" x EP {lay['ep']}" if lay.get("ep", 1) > 1 else "") + f", AC {lay.get('ac', 'unpublished')}"
    mem_pub = r.run["published"].get("memory_gib")
    mem = (f"{r.mine.reserved / GIB:.1f} / {mem_pub:g}" if mem_pub and r.mine else
           f"{r.mine.reserved / GIB:.1f} / -" if r.mine else "does not fit")
    tps = (f"{tokens_per_s(r.mine):,.0f} / {r.published_tps:,.0f} ({r.throughput_ratio:.2f})"
           if r.mine else f"- / {r.published_tps:,.0f}")
    rank = (f"{r.rank or '-'} of {r.splits}" + (f" ({r.behind:.3f})" if r.behind else "")
            if r.run.get("ranked") else "")
    return [r.run["name"], str(r.run["gpus"]), r.run["gpu"], pub, rank, mem, tps]


def markdown(rows: list[Row], split: str) -> str:
    """The modelled rows of one split, as docs/planner.md shows them."""
    held = split == "held-out"  # with the day each row was frozen as held out
    head = ("| run | GPUs | GPU | published layout | rank of published split (its step / the fastest "
            "split's) | GiB reserved plan / published | tokens/s/GPU plan / published (ratio) |"
            + (" held out since |" if held else "") + "\n|---|---:|---|---|---:|---:|---:|" + ("---|" if held else ""))
    lines = [head] + ["| " + " | ".join(_cells(r) + ([r.run["frozen"]] if held else [])) + " |"
                      for r in rows if r.run["split"] == split and modelled(r.run)]
    return "\n".join(lines)


def not_modelled_markdown(rows: list[Row]) -> str:
    head = ("| run | GPUs | why not modelled | tokens/s/GPU plan / published (for information) |\n"
            "|---|---:|---|---:|")
    lines = [head]
    for r in rows:
        if modelled(r.run):
            continue
        tps = (f"{tokens_per_s(r.mine):,.0f} / {r.published_tps:,.0f} ({r.throughput_ratio:.2f})"
               if r.mine else f"does not fit / {r.published_tps:,.0f}")
        lines.append(f"| {r.run['name']} | {r.run['gpus']} | {r.run['not_modelled']} | {tps} |")
    return "\n".join(lines)
