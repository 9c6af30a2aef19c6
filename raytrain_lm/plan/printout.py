"""What `plan` prints: the table, the recommendation and its reason."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from raytrain_lm.config.layout import STRATEGIES, Layout
from raytrain_lm.errors import UserError
from raytrain_lm.models import family
from raytrain_lm.plan import network
from raytrain_lm.plan.estimate import Estimate, estimate_layout, plan
from raytrain_lm.plan.goodput import RunRisk, goodput_lines
from raytrain_lm.plan.hardware import GB, GIB, Cluster


def recommendation(ranked: list[Estimate]) -> Optional[Estimate]:
    return ranked[0] if ranked and ranked[0].fits else None


def reason(best: Estimate, ranked: list[Estimate], cl: Cluster) -> str:
    """Why `best`, in one line: where each dimension runs, and what it beats."""
    lay = best.layout

    def where(dim: str) -> str:
        return "inside a node" if cl.inside(lay.blocks[dim]) else "across nodes"

    parts = []
    if lay.tp > 1:
        parts.append(f"TP {lay.tp} {where('tp')}" + (" with sequence parallelism" if lay.sp else ""))
    if lay.ep > 1:
        parts.append(f"EP {lay.ep} {where('ep')} (the experts over {lay.ep} of the {lay.dp} "
                     f"data-parallel GPUs)")
    if lay.cp > 1:
        parts.append(f"CP {lay.cp} {where('cp')} (each window over {lay.cp} GPUs, K/V all-gathered)")
    if lay.pp > 1:
        stages = f" x {lay.v} stages" if lay.v > 1 else ""
        parts.append(f"PP {lay.pp} {where('pp')} ({lay.schedule}{stages}, {lay.microbatches} "
                     f"microbatches, {best.bubble:.0%} bubble)")
    if lay.dp_cp > 1:
        rest = "the remaining" if lay.tp * lay.pp > 1 else "all"
        group = f"{lay.dp_cp} (dp {lay.dp} x cp {lay.cp})" if lay.cp > 1 else f"{lay.dp}"
        parts.append(f"{STRATEGIES[lay.strategy].title} over {rest} {group} ({where('dp')})")
    if lay.ac != "none":
        parts.append(f"{lay.ac} activation checkpointing")
    fitting = [e for e in ranked if e.fits]
    return (f"{', '.join(parts) or 'one GPU'}: fastest of the {len(fitting)} layouts that fit"
            f"{_runner_up(best, fitting)}{_versus_plain(best, ranked)}")


def short(lay: Layout) -> str:
    """A layout in a few words."""
    out = f"tp {lay.tp}, pp {lay.pp}, {lay.strategy} {lay.dp}" + (f", ep {lay.ep}" if lay.ep > 1 else "") + \
        (f", cp {lay.cp}" if lay.cp > 1 else "")
    if lay.pp > 1:
        out += f", {lay.schedule}" + (f" x{lay.v}" if lay.v > 1 else "")
    ckpt = "no checkpointing" if lay.ac == "none" else f"{lay.ac} checkpointing"
    return f"{out}, {ckpt}" + (", SP" if lay.sp else "")


def _runner_up(best: Estimate, fitting: list[Estimate]) -> str:
    if len(fitting) < 2:
        return ""
    nxt = fitting[1]
    slower = nxt.step_s / best.step_s - 1  # within 0.1% the simpler layout ranks first
    return f"; next: {short(nxt.layout)}, " + ("as fast" if abs(slower) < 0.005 else f"{slower:+.0%}")


def _versus_plain(best: Estimate, ranked: list[Estimate]) -> str:
    """How plain data parallelism (no tp, no pp) compares, when it was planned at all."""
    plain = [e for e in ranked if e.layout.tp == e.layout.pp == 1]
    if not plain or any(e is best for e in plain):
        return ""
    if not plain[0].fits:
        return "; data parallelism alone does not fit"
    return f"; data parallelism alone would take {plain[0].step_s / best.step_s:.1f}x as long"


def _row(i: int, e: Estimate, experts: bool, contexts: bool = False) -> str:
    lay, c = e.layout, e.comm
    pipeline = "-"
    if lay.pp > 1:
        pipeline = f"{lay.schedule}{f' x{lay.v}' if lay.v > 1 else ''} {e.bubble:.0%}"
    return (f"{i:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>4}" + (f" {lay.ep:>3}" if experts else "") +
            (f" {lay.cp:>3}" if contexts else "") +
            f"  {lay.strategy:<6}{lay.ac:<10}"
            f"{'yes' if lay.sp else 'no':<4}{pipeline:<24}{f'{lay.micro_batch} x {lay.microbatches}':<10}"
            f"{e.memory.model_state / GIB:>10.1f}{e.reserved / GIB:>8.1f}{e.step_s:>9.3g}{e.mfu:>6.0%}"
            f"{c.tp / GB:>8.2f}{c.pp / GB:>7.2f}{c.dp / GB:>7.2f}" + (f"{c.ep / GB:>7.2f}" if experts else "")
            + (f"{c.cp / GB:>7.2f}" if contexts else "") + f"  {'yes' if e.fits else 'no'}")


def format_table(estimates: list[Estimate], start: int = 1, experts: bool = False) -> str:
    """`experts`: a mixture of experts' columns too (ep, and the all-to-alls' GB); context
    parallelism's (cp, the K/V gathers' GB) where a layout has it."""
    contexts = any(e.layout.cp > 1 for e in estimates)
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>4}" + (f" {'ep':>3}" if experts else "") +
            (f" {'cp':>3}" if contexts else "") +
            f"  {'dp as':<6}{'ckpt':<10}{'sp':<4}"
            f"{'pipeline, bubble':<24}{'b x n':<10}{'state GiB':>10}{'GiB/GPU':>8}{'step s':>9}{'MFU':>6}"
            f"{'tp GB':>8}{'pp GB':>7}{'dp GB':>7}" + (f"{'ep GB':>7}" if experts else "") +
            (f"{'cp GB':>7}" if contexts else "") + "  fits")
    return "\n".join([head, "-" * len(head)] + [_row(start + i, e, experts, contexts)
                                                for i, e in enumerate(estimates)])


def describe(name: str, n_params: int, global_batch: int, seq_len: int, cl: Cluster,
             ranked: list[Estimate], top: int, show_all: bool, active: Optional[int] = None,
             risk: Optional[RunRisk] = None) -> str:
    """The text `plan` prints (`active`: a mixture of experts' parameters per token; `risk`:
    the failures the recommended layout's goodput is planned for)."""
    fitting = sum(e.fits for e in ranked)
    shown = ranked if show_all else ranked[:top]
    experts = active is not None and active < n_params
    lines = [
        *model_memory(name, n_params, active if experts else None),
        f"{cl.gpus} {cl.kind + ' ' if cl.gpu else ''}{'GPUs' if cl.gpu else 'workers'}, {cl.node} per "
        f"node, {cl.memory_gb:g} GiB each ({cl.budget / GIB:.1f} usable); global batch {global_batch} x "
        f"{seq_len} tokens; {cl.tflops:g} TFLOP/s peak, {_efficiency_text(cl)}; links "
        f"{cl.intra_gbps:g} Gb/s per GPU in a node, the node's NICs {cl.inter_gbps * cl.gpus_per_node:g} "
        f"Gb/s between nodes (per direction)",
        f"{len(shown)} of {len(ranked)} layouts ({fitting} fit; --all or --json for all); b x n: "
        f"micro-batch x micro-batches per step (pipeline microbatches with pp, else accumulation); "
        f"GB sent per GPU per step:",
        format_table(shown, experts=experts),
    ]
    best = recommendation(ranked)
    if best is None:
        lines.append("recommendation: nothing fits; add GPUs, use GPUs with more memory, or lower "
                     "--batch-size / --seq-len")
    else:
        lines.append(f"recommendation: {best.layout.flags()} (~{best.reserved / GIB:.1f} GiB per "
                     f"GPU, ~{best.step_s:.3g} s per step, ~{best.mfu:.0%} MFU)")
        lines.append(f"why: {reason(best, ranked, cl)}")
        if cl.gpu:
            risk = risk or RunRisk()
            gp = risk.plan(cl.gpus, n_params, best.step_s, global_batch * seq_len)
            lines += goodput_lines(gp, risk, n_params)
    lines.append(fitted_text(cl))
    lines.append("assumptions and comparisons with published runs: docs/planner.md")
    return "\n".join(lines)


def model_memory(name: str, n_params: int, active: Optional[int] = None) -> list[str]:
    """What the parameters alone take, before any layout divides them (the 'state GiB' column:
    what a GPU of each layout holds of it); a mixture of experts' active parameters."""
    moe = (f", {active:,} active per token ({active / 1e9:.2f}B: FLOPs count these; expert "
           f"parallelism splits the experts, ep GB: its all-to-alls)") if active else ""
    return [f"{name}: {n_params:,} parameters ({n_params / 1e9:.2f}B){moe}",
            f"the model alone: fp32 weights {4 * n_params / GIB:,.1f} GiB ({n_params:,} x 4 bytes); "
            f"with gradients and AdamW's two moments x4 = {16 * n_params / GIB:,.1f} GiB (16 bytes "
            f"per parameter; mixed precision needs as much: bf16 weights and gradients, fp32 "
            f"master weights and moments, 2 + 2 + 12); 'state GiB': what one GPU holds of it"]


def _efficiency_text(cl: Cluster) -> str:
    if cl.efficiency is not None:
        return f"{cl.efficiency:g} (--compute-efficiency)"
    return (f"matmuls up to {cl.matmul_ceiling:.3g} (by size), flash attention "
            f"{cl.attention_fraction:g}, memory-bound kernels at {cl.hbm_tbps:g} TB/s (plan/kernels.py)")


def estimate_json(e: Estimate) -> dict:
    return {**e.layout.choices(), "flags": e.layout.flags(), "fits": e.fits,
            "memory_gib": {**{k: v / GIB for k, v in asdict(e.memory).items()},
                           "total": e.memory.total / GIB},
            "comm_gb": {"dp": e.comm.dp / GB, "dp_gather": e.comm.dp_gather / GB,
                        "dp_reduce": e.comm.dp_reduce / GB, "tp": e.comm.tp / GB,
                        "pp": e.comm.pp / GB, "ep": e.comm.ep / GB, "cp": e.comm.cp / GB},
            "seconds": {"compute": e.compute_s, "tp": e.tp_s, "ep": e.ep_s, "pp": e.pp_s, "cp": e.cp_s,
                        "dp_exposed": e.dp_exposed_s, "bubble": e.bubble_s, "step": e.step_s},
            "compute_parts": e.compute_parts, "reserved_gib": e.reserved / GIB,
            "bubble": e.bubble, "mfu": e.mfu}


def report_json(n_params: int, global_batch: int, seq_len: int, cl: Cluster,
                ranked: list[Estimate], active: Optional[int] = None,
                risk: Optional[RunRisk] = None) -> dict:
    best = recommendation(ranked)
    gp = None
    if best is not None and cl.gpu:
        gp = (risk or RunRisk()).plan(cl.gpus, n_params, best.step_s, global_batch * seq_len)
    return {"parameters": n_params, "active_parameters": active or n_params,
            "global_batch": global_batch, "seq_len": seq_len,
            "cluster": asdict(cl), "fitted_constants": fitted_json(cl),
            "layouts": [estimate_json(e) for e in ranked],
            "recommendation": None if best is None else estimate_json(best),
            "reason": None if best is None else reason(best, ranked, cl),
            "goodput": None if gp is None else {**asdict(gp.failures),
                                                **{k: v for k, v in asdict(gp).items() if k != "failures"}}}


def fitted_json(cl: Cluster) -> list[dict]:
    """The fitted constants behind this cluster's estimates, each with its value and rows."""
    from raytrain_lm.plan.calibration import constants, used_by

    return [{"name": name, "value": constants()[name]["value"], "rows": constants()[name]["rows"]}
            for name in used_by(cl.kind, memory=cl.gpu, eta=cl.eta_key)
            if cl.efficiency is None or name == "allocator"]


def fitted_text(cl: Cluster) -> str:
    """What `plan` says beside its estimates about the constants they rest on."""
    from raytrain_lm.plan.calibration import describe

    text = describe(cl.kind, memory=cl.gpu, eta=cl.eta_key)
    if cl.efficiency is not None:
        text = "compute at --compute-efficiency (no fitted rate); " + text
    return (f"fitted: {text}; the rest is counted or from datasheets and measurements "
            f"(docs/planner.md); {PROFILE_CLAUSE}")


# `plan` plans this project's trainer (frameworks.DEFAULT), not a 2024 Megatron-Core stack
PROFILE_CLAUSE = ("profile: this project's trainer (raytrain-lm: torch eager FSDP2/DDP, SDPA flash "
                  "attention), with the 2021-23 stacks' kernel efficiency, not megatron-core-2024's")


def plan_command(cfg, cl: Cluster, tp: Optional[int] = None, pp: Optional[int] = None,
                 strategy: Optional[str] = None, top: int = 10, show_all: bool = False,
                 as_json: bool = False, global_batch: Optional[int] = None,
                 virtual_stages: Optional[int] = None, explain: Optional[str] = None,
                 ep: Optional[int] = None, name: Optional[str] = None,
                 risk: Optional[RunRisk] = None) -> str:
    """`plan`: every layout of `cl` for cfg's model, sequence length and global batch
    (--global-batch, else GPUs x --batch-size x --grad-accum: what plain data parallelism would
    train with), as text or JSON; with `explain`, one layout's step time and memory, by part.
    `name`: what the model is called [default: its preset]; `risk`: the failures the goodput of
    the recommended layout is planned for [default: RunRisk()'s]."""
    import json

    if top < 1:
        raise UserError(f"--top must be at least 1, got {top}")
    if global_batch is None:
        global_batch = cl.gpus * cfg.batch_size * cfg.grad_accum
    ranked = plan(cfg.model, cl, global_batch, cfg.seq_len, tp, pp, strategy, virtual_stages, ep)
    n_params = family(cfg.model).counts(cfg.model).total
    active = family(cfg.model).active_params(cfg.model)
    if explain is not None:
        e, rank = explained(cfg.model, cl, ranked, explain, global_batch, cfg.seq_len)
        if as_json:
            return json.dumps({"rank": rank, "layouts": len(ranked), **estimate_json(e)}, indent=2)
        return explain_text(e, rank, ranked, cl)
    if as_json:
        return json.dumps(report_json(n_params, global_batch, cfg.seq_len, cl, ranked, active, risk), indent=2)
    return describe(name or cfg.preset, n_params, global_batch, cfg.seq_len, cl, ranked, top, show_all, active,
                    risk)


# ---------------------------------------------------------------- plan --explain

LAYOUT_KEYS = {"tp": int, "pp": int, "dp": int, "ep": int, "strategy": str, "ac": str, "sp": bool,
               "schedule": str, "v": int, "b": int}
LAYOUT_HELP = ("a row number of the table, or key=value pairs separated by commas: tp, pp, dp, "
               "ep, strategy, ac, sp (yes/no), schedule, v (stages per GPU), b (micro-batch); "
               "e.g. tp=8,pp=4,strategy=ddp,ac=full")


def parse_layout(text: str) -> dict:
    """--explain's LAYOUT as {key: value}; a row number as {"row": n}."""
    text = text.strip()
    if text.isdigit():
        return {"row": int(text)}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in LAYOUT_KEYS or (not sep and key != "sp"):
            raise UserError(f"--explain {text!r}: expected {LAYOUT_HELP}")
        kind = LAYOUT_KEYS[key]
        if kind is bool:
            out[key] = value.strip().lower() in ("", "yes", "true", "1", "on")
        elif kind is int:
            if not value.strip().isdigit() or int(value) < 1:
                raise UserError(f"--explain: {key} must be a positive whole number, got {value!r}")
            out[key] = int(value)
        else:
            out[key] = value.strip()
    return out


def explained(m, cl: Cluster, ranked: list[Estimate], text: str, global_batch: int,
              seq_len: int) -> tuple[Estimate, int]:
    """The estimate --explain describes and its 1-based rank: the row asked for, or the best
    layout matching the keys given (with b: that micro-batch, estimated as asked)."""
    want = parse_layout(text)
    if "row" in want:
        if not 1 <= want["row"] <= len(ranked):
            raise UserError(f"--explain {want['row']}: the plan has rows 1 to {len(ranked)}")
        return ranked[want["row"] - 1], want["row"]

    def matches(lay: Layout) -> bool:
        return all(getattr(lay, field) == want[key] for key, field in
                   (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("ep", "ep"), ("strategy", "strategy"),
                    ("ac", "ac"), ("sp", "sp"), ("schedule", "schedule"), ("v", "v"))
                   if key in want)

    for i, e in enumerate(ranked):
        if matches(e.layout):
            if "b" in want and e.layout.micro_batch != want["b"]:
                lay = e.layout
                if lay.sequences % want["b"]:
                    raise UserError(f"--explain: b={want['b']} does not divide the "
                                    f"{lay.sequences} sequences per data-parallel rank")
                from dataclasses import replace

                lay = replace(lay, micro_batch=want["b"], microbatches=lay.sequences // want["b"])
                e = estimate_layout(m, lay, cl)
                fitting = [x for x in ranked if x.fits]
                if not e.fits:  # after every layout that fits
                    return e, len(fitting) + 1
                return e, sum(1 for x in fitting if x.step_s < e.step_s) + 1
            return e, i + 1
    raise UserError(f"--explain {text!r}: no layout of the plan matches (see the table, or "
                    f"relax --tp/--pp/--strategy)")


def explain_text(e: Estimate, rank: int, ranked: list[Estimate], cl: Cluster) -> str:
    """One layout's step time and memory, by part, and where it ranks."""
    lay, c, mem = e.layout, e.comm, e.memory

    def bw(dim: str) -> str:
        where = "inside a node" if network.inside(cl, lay, dim) else "across nodes"
        return f"{network.bandwidth(cl, lay, dim) / 1e9:.3g} GB/s, {where}"

    def line(name: str, seconds: float, note: str) -> str:
        share = seconds / e.step_s if e.step_s else 0.0
        return f"  {name:<16}{seconds:>10.4g} s {share:>5.0%}  {note}"

    fitting = sum(x.fits for x in ranked)
    lines = [f"layout: {short(lay)}, micro-batch {lay.micro_batch} x {lay.microbatches}"
             f" ({lay.flags()})",
             f"rank {rank} of {len(ranked)} ({fitting} fit); "
             + ("fits" if e.fits else "does NOT fit")
             + f"; ~{e.mfu:.0%} MFU",
             f"step time {e.step_s:.4g} s:",
             line("compute", e.compute_s, ("the slowest pp rank's" if lay.pp > 1 else "the step's")
                  + " work: " + _parts_text(e)),
             line("exposed tp", e.tp_s, f"{c.tp / GB:.3g} GB sent per GPU at {bw('tp')}"
                  if lay.tp > 1 else "no tensor parallelism"),
             *([line("exposed ep", e.ep_s, f"{c.ep / GB:.3g} GB of all-to-alls sent per GPU at "
                     f"{bw('ep')}")] if lay.ep > 1 else []),
             line("bubble", e.bubble_s, f"{e.bubble:.1%} of a pipelined step idle" if lay.pp > 1
                  else "no pipeline"),
             line("exposed pp", e.pp_s, f"{c.pp / GB:.3g} GB sent per GPU at {bw('pp')}; the "
                  f"fill and drain sends exposed" if lay.pp > 1 else "no pipeline"),
             line("exposed dp", e.dp_exposed_s, f"gathers {c.dp_gather / GB:.3g} GB + "
                  f"reductions {c.dp_reduce / GB:.3g} GB per GPU at {bw('dp')}"
                  if lay.dp > 1 else "no data parallelism"),
             f"memory per GPU {e.reserved / GIB:.2f} GiB reserved ({mem.total / GIB:.2f} GiB "
             f"allocated) of {cl.budget / GIB:.1f} GiB usable (the pipeline rank that needs the most):"]
    for name, value, note in (
            ("parameters", mem.params, "fp32" + (", sharded over dp" if lay.sharded else "")),
            ("gradients", mem.grads, "fp32" + (", sharded over dp" if lay.sharded else "")),
            ("optimizer", mem.optimizer, "AdamW's two fp32 moments" +
             (", sharded over dp" if lay.optimizer_shards > 1 else "")),
            ("FSDP working set", mem.gathered, "gathered parameters and unsharded gradients"
             if lay.sharded else "none (not sharded)"),
            ("activations", mem.activations, f"{lay.ac} checkpointing, {cl.act_bytes} bytes a "
             f"value"),
            ("logits", mem.logits, "last stage")):
        lines.append(f"  {name:<16}{value / GIB:>10.2f} GiB  {note}")
    lines.append(fitted_text(cl))
    return "\n".join(lines)


def _parts_text(e: Estimate) -> str:
    p = e.compute_parts or {}
    if "matmul" not in p:
        return "the FLOPs at --compute-efficiency"
    return (f"matmuls {p['matmul']:.3g} s, attention {p['attention']:.3g} s, memory-bound kernels "
            f"and optimizer {p['memory']:.3g} s, over the fitted kernel efficiency")
