"""Compute time of one pipeline rank's step, from the hardware's rates and the work counted per token.

    time = (matmul FLOPs / matmul rate + attention FLOPs / attention rate
            + bytes of the memory-bound kernels / HBM bandwidth + the optimizer's bytes / HBM) / ETA

- Matmuls run at peak x the kind's achievable fraction (MAMF / peak, measured: gpu_kinds.json) x
  the power cap's clock factor x F / (F + F_HALF), F the FLOPs of one h x h/tp matmul of a
  micro-batch: small matmuls lose a fixed cost per kernel (launch, wave quantization, epilogues).
- Attention (12 L h s per token over a step: QK^T and PV, forward and backward) runs, with fused
  flash attention, at the kind's published flash-attention fraction of the peak on half of the
  score matrix (causal blocks above the diagonal are skipped); unfused (Megatron-LM of 2021-22:
  the scores written to memory) at the matmul rate on all of it, plus the score tensor's traffic
  (SCORE_BYTES per score).
- Memory-bound kernels (norms, activations, residual adds, rotary embedding, the loss) move the
  bytes counted below, at the kind's HBM bandwidth; recomputation runs their forward again.
- AdamW reads the parameter, gradient and both moments and writes three back (fp32: 28 bytes per
  parameter the rank updates), plus 4 to read the gradient for its norm.
- ETA, fitted (calibration.json names its rows): the fraction of this ideal the frameworks reach
  (kernel gaps, launch latency, host work, data loading, what the counts leave out), one per
  software generation (Cluster.eta_key: "eta" for the stacks of 2021-23 and this project's eager
  trainer, "eta:2024" for 2024 stacks on H100), each fitted on its own in-sample rows.

Bytes per token per layer, counted from each implementation's kernels by the model's family
(Family.kernel_bytes, in elements of the activation dtype, forward and backward): "fused"
(Megatron-LM's fused LayerNorm, bias-GeLU and bias-dropout-add; torch.compile; a single
nn.LayerNorm or F.gelu kernel) or "eager" (the Llama of torchtitan and of this project without
compile: RMSNorm in fp32 as six kernels, rotary through fp32).
- the loss on the last stage per token (Cluster.loss): fused (in place, in bf16) 2V, fp32 (the
  logits upcast, log-softmax, its gradient, the cast back) 16V, divided by tp (vocabulary-parallel).
Without sequence parallelism the norms and residual adds run whole on every tp rank; the rest
divides by tp.
"""

from __future__ import annotations

from raytrain_lm.config.layout import Layout
from raytrain_lm.models import family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan import experts
from raytrain_lm.plan.hardware import Cluster
from raytrain_lm.plan.stages import StageShape

# A matmul of F FLOPs takes F / rate + TAU: a fixed time per kernel (launch, the last partial wave
# of tiles, the epilogue), so half of the achievable rate is reached at F_HALF = TAU x rate, the
# larger the faster the GPU. TAU is pinned by one small-model figure (calibration.json "f_half":
# nanoGPT's GPT-2 124M on an A100, F_HALF = 1e10 FLOPs there); the published rows' matmuls are large.
SCORE_BYTES = {"forward": 13.0, "backward": 17.0}  # bytes per score element, unfused attention
ADAM_BYTES = 32.0  # per parameter the rank updates: fp32 p, g, m, v read, p, m, v written, g read for its norm


def matmul_flops(m: ModelConfig, micro_batch: int, seq_len: int, tp: int) -> float:
    """F: one h x (h / tp) matmul over one micro-batch."""
    return 2.0 * micro_batch * seq_len * m.n_embd * m.n_embd / tp


def recomputed_matmul_weights(m: ModelConfig, ac: str, early_stop: bool) -> float:
    """Weight elements of a block's matmuls that run forward again: full, every one (but the last
    with `early_stop`: torch's checkpoint stops once backward has what it needs); op, the 2nd,
    4th, ... but the last (parallel/ac.py keeps attention's and every other matmul's output)."""
    mms = family(m).block_matmuls(m)
    if ac == "full":
        return sum(mms) - (mms[-1] if early_stop else 0)
    if ac == "op":
        return sum(w for i, w in enumerate(mms[:-1]) if i % 2 == 1)
    return 0.0


def layer_bytes(m: ModelConfig, kernels: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """((forward, backward) elements per token that stay whole on every tp rank without sequence
    parallelism, (forward, backward) that divide by tp), memory-bound kernels of one layer
    (Family.kernel_bytes)."""
    return family(m).kernel_bytes(m, kernels)


def loss_bytes_per_token(m: ModelConfig, loss: str) -> float:
    return (16.0 if loss == "fp32" else 2.0) * (m.vocab_size or 256)


A100_RATE = 312e12 * 0.869  # the achievable rate at which F_HALF was pinned (gpu_kinds.json)


def f_half(cl: Cluster) -> float:
    """FLOPs at which a matmul reaches half the achievable rate on this GPU: TAU x its rate."""
    from raytrain_lm.plan.calibration import constant

    return constant("f_half") / A100_RATE * cl.tflops * 1e12 * cl.matmul_ceiling


def matmul_rate(cl: Cluster, f: float) -> float:
    """FLOP/s of a matmul of F FLOPs."""
    rate = cl.tflops * 1e12 * cl.matmul_ceiling
    return rate * f / (f + f_half(cl))


_PER_LAYER: dict[tuple, tuple] = {}


def _per_layer(m: ModelConfig, ac: str, early: bool, kernels: str) -> tuple:
    """(a block's matmul weights, those recomputed, layer_bytes), kept per model shape: a plan
    asks for them thousands of times."""
    key = (tuple(sorted(vars(m).items())), ac, early, kernels)
    if key not in _PER_LAYER:
        _PER_LAYER[key] = (sum(family(m).block_matmuls(m)), recomputed_matmul_weights(m, ac, early),
                           layer_bytes(m, kernels))
    return _PER_LAYER[key]


def rank_compute_seconds(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[StageShape],
                         params_held: float) -> dict[str, float]:
    """Seconds of one step's compute on a pp rank holding `stages` (all its microbatches, its
    recomputation and its optimizer step), by part: matmul, attention, memory (the memory-bound
    kernels and the optimizer) and total (their sum / ETA)."""
    from raytrain_lm.plan.calibration import constant

    # the pipeline replica's, each passing every stage; a cp rank's share of them (its chunks
    # balance the causal attention: the same attention work per token as the whole window's)
    tokens = lay.sequences * lay.seq_len / lay.cp
    t, a = lay.tp, cl.act_bytes
    layers = sum(st.layers for st in stages)
    last = any(st.last for st in stages)
    h, s = m.n_embd, lay.seq_len
    early = cl.recompute_early_stop
    # matmuls: 6 x weights per token (forward, two backward), one more forward of what is recomputed
    block, recomputed, ((wf, wb), (sf, sb)) = _per_layer(m, lay.ac, early, cl.kernels)
    # a mixture of experts' layer stays whole on every tp rank, its experts' matmuls small
    moe = experts.whole_weights(m)
    per_weight = layers * (6 + 2 * recomputed / block)
    mm = per_weight * (block - moe) / t
    if last:
        mm += 6 * (m.vocab_size or 256) * h / t
    f = matmul_flops(m, lay.micro_batch, s, t)
    t_mm = mm * tokens / matmul_rate(cl, f)
    if moe:
        f_expert = 2.0 * experts.expert_rows(m, lay) * h * m.hidden_dim
        t_mm += per_weight * moe * tokens / matmul_rate(cl, f_expert)
    # attention: 4 h s forward per token, twice that backward, and the forward again where recomputed
    unfused = cl.attention == "unfused"
    again = lay.ac == "full" or (unfused and lay.ac == "selective")
    attn = layers * 4 * h * s * (3 + again) / t
    if unfused:
        t_attn = attn * tokens / matmul_rate(cl, f)
        scores = m.n_head / t * s * (SCORE_BYTES["forward"] * (1 + again) + SCORE_BYTES["backward"])
    else:
        t_attn = 0.5 * attn * tokens / (cl.tflops * 1e12 * cl.attention_fraction)
        scores = 0.0
    # memory-bound kernels
    rerun = lay.ac == "full"  # selective and op rerun only part of the forward: counted as free
    whole = (wf * (1 + rerun) + wb) / (t if lay.sp else 1)
    split = (sf * (1 + rerun) + sb) / t
    byts = layers * ((whole + split) * a + scores)
    if last:
        byts += loss_bytes_per_token(m, cl.loss) * a / t
    hbm = cl.hbm_tbps * 1e12
    t_mem = byts * tokens / hbm + ADAM_BYTES * params_held / hbm
    total = (t_mm + t_attn + t_mem) / constant(cl.eta_key)
    return {"matmul": t_mm, "attention": t_attn, "memory": t_mem, "total": total}
