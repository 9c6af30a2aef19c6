"""The tables of docs/planner.md: `plan`'s recommended layout for four GPT shapes (or, with
--llama, the six Llama presets) on 8, 64 and 512 H100s (80 GB, 8 per node, the plan's default
links and efficiency), at a fixed global batch per model. Prints markdown; an estimate, not a
measurement.

    PYTHONPATH=. python bench/planner_table.py [--llama]
"""

from __future__ import annotations

import sys

from raytrain_lm.config.layout import Layout
from raytrain_lm.models import family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan.estimate import estimate_layout, plan
from raytrain_lm.plan.hardware import GB, Cluster
from raytrain_lm.plan.printout import reason, recommendation

# name: (model shape, sequence length, global batch in sequences). Global batches as GPT-3's table
# (Brown et al. 2020: 0.5M tokens at 125M, 1M at 1.3B, 2M at 6.7B) and Llama 2 70B's 4M tokens.
SHAPES = {
    "GPT-2 124M": (ModelConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12,
                               n_embd=768, bias=False), 1024, 512),
    "GPT 1.3B": (ModelConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16,
                             n_embd=2048, bias=False), 2048, 512),
    "GPT 7B": (ModelConfig(vocab_size=50304, block_size=4096, n_layer=32, n_head=32,
                           n_embd=4096, bias=False), 4096, 512),
    "GPT 70B": (ModelConfig(vocab_size=50304, block_size=4096, n_layer=86, n_head=64,
                            n_embd=8192, bias=False), 4096, 1024),
}


# torchtitan's published H100 runs (benchmarks/llama3_h100_202412_torchtitan.md and
# benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: Grand Teton hosts, 8 x H100 96 GB per node,
# 400 Gb/s per GPU between hosts, 500 W power limit, bf16, seq 8192). Shapes here are this GPT's
# with Llama 3's depth, width, heads and vocabulary (the MLP is GPT's 4x GELU, not SwiGLU 3.5x,
# and attention is not grouped-query). Published MFU: tokens/s x torchtitan's FLOPs per token
# (6 x non-embedding parameters + 12 L h seq) over 989 TFLOP/s, with Llama 3's sizes (8.03B and
# 70.55B parameters, of which 128256 x width in the input embedding).
LLAMA8 = ModelConfig(vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_embd=4096, bias=False)
LLAMA70 = ModelConfig(vocab_size=128256, block_size=8192, n_layer=80, n_head=64, n_embd=8192, bias=False)


def llama_flops_per_token(params: float, m: ModelConfig, seq: int) -> float:
    return 6 * (params - 128256 * m.n_embd) + 12 * m.n_layer * m.n_embd * seq


PUBLISHED = [  # label, shape, layout, tokens/s/GPU, memory GiB (None: not published), Llama params
    ("Llama 3.1 8B, 8 GPUs, FSDP 8, selective AC, local batch 2 (Table 1, no compile)", LLAMA8,
     Layout(8, 1, 1, "fsdp", "selective", False, "-", 2, 1, 8192), 5762, 82.4, 8.03e9),
    ("Llama 3.1 8B, 128 GPUs, FSDP 128, selective AC, local batch 2 (Table 3, no compile)", LLAMA8,
     Layout(128, 1, 1, "fsdp", "selective", False, "-", 2, 1, 8192), 5605, 67.0, 8.03e9),
    ("Llama 3 8B, 64 GPUs, FSDP 8 x TP 8, per-op SAC, local batch 12, compile (async-TP page, "
     "bf16, vanilla TP)", LLAMA8, Layout(8, 8, 1, "fsdp", "selective", True, "-", 12, 1, 8192),
     4378, None, 8.03e9),
    ("Llama 3 70B, 256 GPUs, FSDP 32 x TP 8, full AC, local batch 16, compile (async-TP page, "
     "bf16, vanilla TP)", LLAMA70, Layout(32, 8, 1, "fsdp", "full", True, "-", 16, 1, 8192),
     597.3, None, 70.55e9),
]


def published() -> None:
    print("| torchtitan run | published tokens/s/GPU | published MFU | plan's tokens/s/GPU | "
          "plan's MFU | published memory | plan's memory |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, m, lay, tps, gib, params in PUBLISHED:
        e = estimate_layout(m, lay, Cluster(gpus=lay.gpus, memory_gb=96))
        est_tps = lay.dp * lay.sequences * lay.seq_len / e.step_s / lay.gpus
        mfu = tps * llama_flops_per_token(params, m, lay.seq_len) / 989e12
        mem = f"{gib:g} GiB = {gib * 2**30 / GB:.1f} GB" if gib else "-"
        print(f"| {label} | {tps:,.0f} | {mfu:.1%} | {est_tps:,.0f} | {e.mfu:.1%} | {mem} | "
              f"{e.memory.total / GB:.1f} GB |")


def layout_text(lay) -> str:
    parts = [f"tp {lay.tp}", f"pp {lay.pp}", f"{lay.strategy} {lay.dp}"]
    if lay.sp:
        parts.append("SP")
    if lay.pp > 1:
        parts.append(f"{lay.schedule} m={lay.microbatches}")
    parts.append(f"AC {lay.ac}")
    parts.append(f"b={lay.micro_batch}" + (f" x{lay.microbatches} accum" if lay.pp == 1 and
                                           lay.microbatches > 1 else ""))
    return ", ".join(parts)


def main() -> None:
    print("| model | GPUs | recommended layout | GB/GPU | step s | tokens/s/GPU | MFU |")
    print("|---|---:|---|---:|---:|---:|---:|")
    reasons = []
    for name, (m, seq, batch) in SHAPES.items():
        for gpus in (8, 64, 512):
            cl = Cluster(gpus=gpus)
            ranked = plan(m, cl, batch, seq)
            best = recommendation(ranked)
            if best is None:
                print(f"| {name} | {gpus} | nothing fits | - | - | - | - |")
                continue
            tps = batch * seq / best.step_s / gpus
            print(f"| {name} | {gpus} | {layout_text(best.layout)} | {best.memory.total / GB:.1f} | "
                  f"{best.step_s:.3g} | {tps:,.0f} | {best.mfu:.0%} |")
            reasons.append(f"- {name}, {gpus} GPUs: {reason(best, ranked, cl)}")
    print()
    print("\n".join(reasons))
    print()
    for name, (m, seq, batch) in SHAPES.items():
        print(f"- {name}: {family(m).counts(m).total / 1e9:.3f}B parameters, n_layer {m.n_layer}, "
              f"n_head {m.n_head}, n_embd {m.n_embd}, seq {seq}, global batch {batch} x {seq} = "
              f"{batch * seq / 1e6:.2f}M tokens")
    print()
    published()


# The Llama presets (config/presets.py: the released shapes) at Llama 2's and Llama 3's 4M tokens per step
# (Touvron et al. 2023: 4M-token batches; Llama 3 405B started at 4M tokens of 4096 and grew to
# 16M), at the preset's context: 1024 x 4096 and 512 x 8192.
LLAMA_PRESETS = ("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b")


def llama() -> None:
    from raytrain_lm.config.presets import preset_config

    print("| preset | parameters | fp32 weights | GPUs | recommended layout | state GB/GPU | GB/GPU | "
          "step s | tokens/s/GPU | MFU |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    reasons = []
    for name in LLAMA_PRESETS:
        m = preset_config(name).model
        seq = m.block_size
        batch = 4 * 2**20 // seq
        n = family(m).counts(m).total
        for gpus in (8, 64, 512):
            cl = Cluster(gpus=gpus)
            ranked = plan(m, cl, batch, seq)
            best = recommendation(ranked)
            head = f"| {name} | {n / 1e9:.2f}B | {4 * n / GB:,.1f} GB | {gpus} |"
            if best is None:
                least = min(ranked, key=lambda e: e.memory.total)
                print(f"{head} nothing fits (least: {least.memory.total / GB:,.0f} GB/GPU) | - | - | - | - | - |")
                continue
            tps = batch * seq / best.step_s / gpus
            print(f"{head} {layout_text(best.layout)} | {best.memory.model_state / GB:.1f} | "
                  f"{best.memory.total / GB:.1f} | {best.step_s:.3g} | {tps:,.0f} | {best.mfu:.0%} |")
            reasons.append(f"- {name}, {gpus} GPUs: {reason(best, ranked, cl)}")
    print()
    print("\n".join(reasons))


if __name__ == "__main__":
    llama() if sys.argv[1:] == ["--llama"] else main()
