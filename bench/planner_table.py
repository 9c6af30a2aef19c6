"""The tables of docs/planner.md: `plan`'s recommended layout for four GPT shapes (or, with
--llama, the six Llama presets) on 8, 64 and 512 H100 SXMs (`plan --gpu h100-sxm`: 80 GB, 8 per
node, NVLink 4, 8 x 400 Gb/s NICs per node), at a fixed global batch per model. Prints markdown;
an estimate, not a measurement (docs/planner.md's validation says how far to trust one).

    PYTHONPATH=. python bench/planner_table.py [--llama]
"""

from __future__ import annotations

import sys

from raytrain_lm.models import family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan.estimate import plan
from raytrain_lm.plan.hardware import GB, kind_cluster
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
            cl = kind_cluster("h100-sxm", gpus)
            ranked = plan(m, cl, batch, seq)
            best = recommendation(ranked)
            if best is None:
                print(f"| {name} | {gpus} | nothing fits | - | - | - | - |")
                continue
            tps = batch * seq / best.step_s / gpus
            print(f"| {name} | {gpus} | {layout_text(best.layout)} | {best.reserved / GB:.1f} | "
                  f"{best.step_s:.3g} | {tps:,.0f} | {best.mfu:.0%} |")
            reasons.append(f"- {name}, {gpus} GPUs: {reason(best, ranked, cl)}")
    print()
    print("\n".join(reasons))
    print()
    for name, (m, seq, batch) in SHAPES.items():
        print(f"- {name}: {family(m).counts(m).total / 1e9:.3f}B parameters, n_layer {m.n_layer}, "
              f"n_head {m.n_head}, n_embd {m.n_embd}, seq {seq}, global batch {batch} x {seq} = "
              f"{batch * seq / 1e6:.2f}M tokens")


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
            cl = kind_cluster("h100-sxm", gpus)
            ranked = plan(m, cl, batch, seq)
            best = recommendation(ranked)
            head = f"| {name} | {n / 1e9:.2f}B | {4 * n / GB:,.1f} GB | {gpus} |"
            if best is None:
                least = min(ranked, key=lambda e: e.reserved)
                print(f"{head} nothing fits (least: {least.reserved / GB:,.0f} GB/GPU) | - | - | - | - | - |")
                continue
            tps = batch * seq / best.step_s / gpus
            print(f"{head} {layout_text(best.layout)} | {best.memory.model_state / GB:.1f} | "
                  f"{best.reserved / GB:.1f} | {best.step_s:.3g} | {tps:,.0f} | {best.mfu:.0%} |")
            reasons.append(f"- {name}, {gpus} GPUs: {reason(best, ranked, cl)}")
    print()
    print("\n".join(reasons))


if __name__ == "__main__":
    llama() if sys.argv[1:] == ["--llama"] else main()
