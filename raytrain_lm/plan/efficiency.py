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

from raytrain_lm.config import ModelConfig

F_HALF = 1.0e9  # FLOPs of one matmul at which half of peak_fraction is reached
# Ceiling by GPU kind: the fraction of the dense bf16 peak large matmuls sustain in training.
PEAK_FRACTION = {"h100": 0.60, "a100": 0.70}
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
