"""The fraction of a GPU's peak that its matmuls reach, as a function of their size.

    efficiency = peak_fraction x F / (F + F_HALF),   F = 2 x (b x seq) x h x (h / tp)

F is the FLOPs of one of the block's h x (h / tp) matmuls on one micro-batch on one GPU (b x seq
tokens: the micro-batch as the GPU computes it; h: the width; h / tp: its share of the output
columns). Large matmuls approach `peak_fraction` of the peak (what cuBLAS sustains on big bf16
GEMMs with the kernels around them: norms, attention, elementwise ops); small ones lose a fixed
cost per kernel (launch, wave quantization, memory-bound epilogues), which F_HALF, the size at
which half of that is reached, stands for. Attention's own FLOPs run at the same efficiency.

Calibration: the published runs of docs/planner.md (raytrain_lm/plan/published_runs.json: Megatron-LM's
weak-scaling table, MT-NLG, BLOOM, torchtitan on A100 and H100), fitted once for all of them by
bench/planner_validation.py --fit: one F_HALF, and one peak_fraction per GPU kind (the GPU's
table below). `--compute-efficiency` replaces the whole formula with a constant, and
`--peak-fraction` the ceiling (the figure to change for another GPU or a power limit).
"""

from __future__ import annotations

from raytrain_lm.models.family import ModelConfig

# FLOPs of one matmul at which half of the ceiling is reached. The published runs below hardly
# constrain it (their matmuls are large: the fit's root-mean-square log error is 8.3% at 1e9,
# 7.9% here, 7.7% at 2e10), so it
# is pinned by one small-model figure: nanoGPT's GPT-2 124M at micro-batch 12 x 1024 tokens on
# an A100, 37% MFU (design notes), where F = 1.45e10 and this formula gives 0.59 x 0.58 = 34%.
F_HALF = 1.0e10
# Ceiling by GPU kind, fitted at that F_HALF (bench/planner_validation.py --fit, least squares
# of the log ratios of tokens/s): a100 on Megatron-LM's, MT-NLG's, BLOOM's and torchtitan's A100
# runs; h100 on torchtitan's H100 runs, whose hosts run their H100s at 500 W (below the 989
# TFLOP/s of a 700 W SXM part, which reaches more: pass --peak-fraction).
PEAK_FRACTION = {"h100": 0.38, "a100": 0.58}
DEFAULT_GPU = "h100"


def matmul_flops(m: ModelConfig, micro_batch: int, seq_len: int, tp: int) -> float:
    """F: one h x (h / tp) matmul over one micro-batch."""
    return 2.0 * micro_batch * seq_len * m.n_embd * m.n_embd / tp


def compute_efficiency(m: ModelConfig, micro_batch: int, seq_len: int, tp: int,
                       peak_fraction: float | None = None, constant: float | None = None) -> float:
    """The fraction of the peak the step's matmuls reach (the formula above), or `constant`."""
    if constant is not None:
        return constant
    f = matmul_flops(m, micro_batch, seq_len, tp)
    ceiling = PEAK_FRACTION[DEFAULT_GPU] if peak_fraction is None else peak_fraction
    return ceiling * f / (f + F_HALF)
