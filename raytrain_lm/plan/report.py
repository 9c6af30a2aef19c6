"""What `plan` prints: the table, the recommendation and its reason."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.plan.layout import Cluster, GB, Layout, param_counts
from raytrain_lm.plan.estimate import Estimate, plan


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
    if lay.pp > 1:
        parts.append(f"PP {lay.pp} {where('pp')} ({lay.schedule}, {lay.microbatches} microbatches, "
                     f"{best.bubble:.0%} bubble)")
    if lay.dp > 1:
        rest = "the remaining" if lay.tp * lay.pp > 1 else "all"
        parts.append(f"{lay.strategy.upper()} over {rest} {lay.dp} ({where('dp')})")
    if lay.ac != "none":
        parts.append(f"{lay.ac} activation checkpointing")
    fitting = [e for e in ranked if e.fits]
    return (f"{', '.join(parts) or 'one GPU'}: fastest of the {len(fitting)} layouts that fit"
            f"{_runner_up(best, fitting)}{_versus_plain(best, ranked)}")


def short(lay: Layout) -> str:
    """A layout in a few words."""
    out = f"tp {lay.tp}, pp {lay.pp}, {lay.strategy} {lay.dp}"
    if lay.pp > 1:
        out += f", {lay.schedule}"
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
    return f"; data parallelism alone would take {plain[0].step_s / best.step_s:.2g}x as long"


def _row(i: int, e: Estimate) -> str:
    lay, c = e.layout, e.comm
    pipeline = f"{lay.schedule} {e.bubble:.0%}" if lay.pp > 1 else "-"
    return (f"{i:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>4}  {lay.strategy:<6}{lay.ac:<10}"
            f"{'yes' if lay.sp else 'no':<4}{pipeline:<21}{f'{lay.micro_batch} x {lay.microbatches}':<10}"
            f"{e.memory.model_state / GB:>9.1f}{e.memory.total / GB:>7.1f}{e.step_s:>9.3g}{e.mfu:>6.0%}"
            f"{c.tp / GB:>8.2f}{c.pp / GB:>7.2f}{c.dp / GB:>7.2f}  {'yes' if e.fits else 'no'}")


def format_table(estimates: list[Estimate], start: int = 1) -> str:
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>4}  {'dp as':<6}{'ckpt':<10}{'sp':<4}"
            f"{'pipeline, bubble':<21}{'b x n':<10}{'state GB':>9}{'GB/GPU':>7}{'step s':>9}{'MFU':>6}"
            f"{'tp GB':>8}{'pp GB':>7}{'dp GB':>7}  fits")
    return "\n".join([head, "-" * len(head)] + [_row(start + i, e) for i, e in enumerate(estimates)])


def describe(name: str, n_params: int, global_batch: int, seq_len: int, cl: Cluster,
             ranked: list[Estimate], top: int, show_all: bool) -> str:
    """The text `plan` prints."""
    fitting = sum(e.fits for e in ranked)
    shown = ranked if show_all else ranked[:top]
    lines = [
        *model_memory(name, n_params),
        f"{cl.gpus} {'GPUs' if cl.gpu else 'workers'}, {cl.node} per node, {cl.memory_gb:g} GB each "
        f"({cl.budget / GB:.1f} usable); global batch {global_batch} x {seq_len} tokens; "
        f"{cl.tflops:g} TFLOP/s peak x {cl.efficiency:g} reached; links {cl.intra_gbps:g} Gb/s in a "
        f"node, {cl.inter_gbps:g} Gb/s between nodes (per GPU per direction)",
        f"{len(shown)} of {len(ranked)} layouts ({fitting} fit; --all or --json for all); b x n: "
        f"micro-batch x micro-batches per step (pipeline microbatches with pp, else accumulation); "
        f"GB sent per GPU per step:",
        format_table(shown),
    ]
    best = recommendation(ranked)
    if best is None:
        lines.append("recommendation: nothing fits; add GPUs, use GPUs with more memory, or lower "
                     "--batch-size / --seq-len")
    else:
        lines.append(f"recommendation: {best.layout.flags()} (~{best.memory.total / GB:.1f} GB per "
                     f"GPU, ~{best.step_s:.3g} s per step, ~{best.mfu:.0%} MFU)")
        lines.append(f"why: {reason(best, ranked, cl)}")
    lines.append("assumptions: raytrain_lm/plan/__init__.py; comparisons with published runs: docs/planner.md")
    return "\n".join(lines)


def model_memory(name: str, n_params: int) -> list[str]:
    """What the parameters alone take, before any layout divides them (the 'state GB' column:
    what a GPU of each layout holds of it)."""
    return [f"{name}: {n_params:,} parameters ({n_params / 1e9:.2f}B)",
            f"the model alone: fp32 weights {4 * n_params / GB:,.1f} GB ({n_params:,} x 4 bytes); "
            f"with gradients and AdamW's two moments x4 = {16 * n_params / GB:,.1f} GB (16 bytes "
            f"per parameter; mixed precision needs as much: bf16 weights and gradients, fp32 "
            f"master weights and moments, 2 + 2 + 12); 'state GB': what one GPU holds of it"]


def estimate_json(e: Estimate) -> dict:
    return {**asdict(e.layout), "flags": e.layout.flags(), "fits": e.fits,
            "memory_gb": {**{k: v / GB for k, v in asdict(e.memory).items()},
                          "total": e.memory.total / GB},
            "comm_gb": {"dp": e.comm.dp / GB, "dp_gather": e.comm.dp_gather / GB,
                        "dp_reduce": e.comm.dp_reduce / GB, "tp": e.comm.tp / GB,
                        "pp": e.comm.pp / GB},
            "seconds": {"compute": e.compute_s, "tp": e.tp_s, "pp": e.pp_s,
                        "dp_exposed": e.dp_exposed_s, "step": e.step_s},
            "bubble": e.bubble, "mfu": e.mfu}


def report_json(n_params: int, global_batch: int, seq_len: int, cl: Cluster,
                ranked: list[Estimate]) -> dict:
    best = recommendation(ranked)
    return {"parameters": n_params, "global_batch": global_batch, "seq_len": seq_len,
            "cluster": asdict(cl), "layouts": [estimate_json(e) for e in ranked],
            "recommendation": None if best is None else estimate_json(best),
            "reason": None if best is None else reason(best, ranked, cl)}


def plan_command(cfg, cl: Cluster, tp: Optional[int] = None, pp: Optional[int] = None,
                 strategy: Optional[str] = None, top: int = 10, show_all: bool = False,
                 as_json: bool = False) -> str:
    """`plan`: every layout of `cl` for cfg's model, sequence length and global batch
    (GPUs x --batch-size x --grad-accum: what plain data parallelism would train with), as text or
    JSON."""
    import json

    if top < 1:
        raise UserError(f"--top must be at least 1, got {top}")
    global_batch = cl.gpus * cfg.batch_size * cfg.grad_accum
    ranked = plan(cfg.model, cl, global_batch, cfg.seq_len, tp, pp, strategy)
    n_params = param_counts(cfg.model)["total"]
    if as_json:
        return json.dumps(report_json(n_params, global_batch, cfg.seq_len, cl, ranked), indent=2)
    return describe(cfg.preset, n_params, global_batch, cfg.seq_len, cl, ranked, top, show_all)
