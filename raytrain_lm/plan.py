"""Per-worker memory plan for a model shape, worker count, strategy and activation checkpointing.

Assumptions (stated so a user can check them):
- Parameters, gradients and AdamW's two moments are fp32: 4 + 4 + 8 = 16 bytes per parameter.
  DDP keeps all of it on every worker; FSDP keeps 1/W of it, plus the parameters of the layers
  being gathered (two blocks in flight, and the root: embeddings stay gathered during a step)
  and one block's unsharded fp32 gradient before its reduce-scatter.
- Activations saved for backward, per layer, per token, in elements of the activation dtype
  (2 bytes on GPU with bf16, 4 on CPU): 17 x width without recomputation (inputs of the two
  LayerNorms and four matmuls, q/k/v and attention output, the 4x-wide MLP pre- and post-GELU;
  fused attention stores no T x T scores); 11 x width with selective checkpointing (only matmul
  and attention outputs and the block input); with full checkpointing only each block's input
  (fp32 residual stream) plus one block's activations while it is recomputed.
- Logits: batch x seq x vocab in the activation dtype, plus an fp32 copy and its gradient for the
  cross-entropy.
- Usable device memory: 90% of the total (allocator fragmentation, CUDA context, NCCL buffers).
Estimates, not measurements: bench/memory.py compares them with measured memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_lm.config import ModelConfig

GB = 1e9
USABLE_FRACTION = 0.9
AC_ELEMENTS = {"none": 17, "selective": 11}


def param_counts(m: ModelConfig) -> dict[str, int]:
    h, V, L = m.n_embd, m.vocab_size or 256, m.n_layer
    bias = 1 if m.bias else 0
    block = 12 * h * h + bias * (3 * h + h + 4 * h + h) + (2 + 2 * bias) * h
    root = V * h + m.block_size * h + (1 + bias) * h  # tied embedding, positions, final norm
    return {"block": block, "root": root, "total": L * block + root}


@dataclass
class MemoryPlan:
    strategy: str
    activation_checkpointing: str
    workers: int
    micro_batch: int
    params: float
    grads: float
    optimizer: float
    gathered: float  # FSDP's unsharded working set
    activations: float
    logits: float

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_state + self.gathered + self.activations + self.logits


def estimate(m: ModelConfig, workers: int, strategy: str, ac: str, micro_batch: int, seq_len: int,
             gpu: bool = True) -> MemoryPlan:
    n = param_counts(m)
    shard = workers if strategy == "fsdp" else 1
    act_bytes = 2 if gpu else 4
    tokens = micro_batch * seq_len
    h, V = m.n_embd, m.vocab_size or 256
    gathered = 0.0
    if strategy == "fsdp" and workers > 1:
        gathered = (2 * n["block"] + n["root"]) * act_bytes + max(n["block"], n["root"]) * 4
    if ac == "full":
        activations = m.n_layer * tokens * h * 4 + AC_ELEMENTS["none"] * tokens * h * act_bytes
    else:
        activations = m.n_layer * AC_ELEMENTS[ac] * tokens * h * act_bytes
    activations += tokens * h * 4  # embedding output (residual stream, fp32)
    return MemoryPlan(
        strategy=strategy, activation_checkpointing=ac, workers=workers, micro_batch=micro_batch,
        params=4 * n["total"] / shard, grads=4 * n["total"] / shard,
        optimizer=8 * n["total"] / shard, gathered=gathered, activations=activations,
        logits=tokens * V * (act_bytes + 4 + 4),
    )


def all_plans(m: ModelConfig, workers: int, micro_batch: int, seq_len: int, gpu: bool = True):
    return [estimate(m, workers, s, ac, micro_batch, seq_len, gpu)
            for s in ("ddp", "fsdp") for ac in ("none", "selective", "full")]


def recommend(m: ModelConfig, workers: int, micro_batch: int, grad_accum: int, seq_len: int,
              memory_gb: float, gpu: bool = True) -> tuple[MemoryPlan, int] | None:
    """The cheapest plan that fits: DDP before FSDP, less recomputation before more, the
    largest micro-batch (keeping micro_batch x grad_accum) before smaller ones.
    Returns (plan, grad_accum) or None if nothing fits."""
    budget = memory_gb * GB * USABLE_FRACTION
    global_micro = micro_batch * grad_accum
    mb = micro_batch
    while mb >= 1:
        for plan in all_plans(m, workers, mb, seq_len, gpu):
            if plan.total <= budget:
                return plan, max(1, global_micro // mb)
        mb //= 2
    return None


def format_plans(plans: list[MemoryPlan], memory_gb: float | None) -> str:
    head = (f"{'strategy':<9}{'act. ckpt':<11}{'params':>9}{'grads':>9}{'optim':>9}"
            f"{'gathered':>10}{'activ.':>9}{'logits':>9}{'total':>9}  fits")
    lines = [head, "-" * len(head)]
    for p in plans:
        fits = "-" if memory_gb is None else ("yes" if p.total <= memory_gb * GB * USABLE_FRACTION
                                              else "no")
        lines.append(f"{p.strategy:<9}{p.activation_checkpointing:<11}"
                     + "".join(f"{v / GB:>9.2f}" for v in (p.params, p.grads, p.optimizer))
                     + f"{p.gathered / GB:>10.2f}"
                     + "".join(f"{v / GB:>9.2f}" for v in (p.activations, p.logits, p.total))
                     + f"  {fits}")
    return "\n".join(lines)


def plan_report(cfg, memory_gb: float, gpu: bool = True) -> dict:
    """`plan`: the parameter count, every plan, and the recommendation for `cfg`'s model,
    workers and batch."""
    from raytrain_lm.errors import UserError

    if memory_gb <= 0:
        raise UserError("--gpu-memory-gb must be positive")
    return {"parameters": param_counts(cfg.model)["total"],
            "plans": all_plans(cfg.model, cfg.workers, cfg.batch_size, cfg.seq_len, gpu=gpu),
            "recommendation": recommend(cfg.model, cfg.workers, cfg.batch_size, cfg.grad_accum,
                                        cfg.seq_len, memory_gb, gpu=gpu)}


def describe_plans(cfg, report: dict, memory_gb: float, gpu: bool = True) -> str:
    """The text `plan` prints for a plan_report."""
    n = report["parameters"]
    lines = [f"{cfg.preset}: {n / 1e9:.3f}B parameters; fp32 parameters alone {4 * n / GB:.1f} GB, "
             f"with gradients and AdamW states {16 * n / GB:.1f} GB",
             f"per worker, GB, {cfg.workers} workers, micro-batch {cfg.batch_size} x {cfg.seq_len} "
             f"tokens, {'bf16' if gpu else 'fp32'} activations, {memory_gb:g} GB per "
             f"{'GPU' if gpu else 'worker'} (90% usable):",
             format_plans(report["plans"], memory_gb)]
    best = report["recommendation"]
    if best is None:
        lines.append("recommendation: does not fit at any micro-batch; add workers or shrink the model")
    else:
        p, accum = best
        lines.append(f"recommendation: --strategy {p.strategy} --activation-checkpointing "
                     f"{p.activation_checkpointing} --batch-size {p.micro_batch} --grad-accum {accum} "
                     f"(~{p.total / GB:.1f} GB per worker)")
    lines.append("assumptions: see raytrain_lm/plan.py (fp32 master weights and AdamW states, "
                 "bf16 activations on GPU, fused attention)")
    return "\n".join(lines)
