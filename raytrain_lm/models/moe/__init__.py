"""The mixture-of-experts family (Mixtral, Qwen3-MoE): the Llama skeleton with every block's MLP a
set of routed SwiGLU experts (and optionally a shared one). What generic code asks of it; its
decoder is moe.py.

Counts: a block holds the skeleton's attention and norms (Qwen3-MoE's q/k norms and head size
included), a router (E x h), E experts of 3 h x f and a shared expert of 3 h x f_s; a token uses
the router, k of the experts and the shared one, so the FLOPs per token count the active
parameters (`matmul_params`), the memory all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.base import ParamCounts, TPPlan
from raytrain_lm.models.llama import LlamaFamily, LlamaSettings
from raytrain_lm.setting import setting


@dataclass
class MoESettings(LlamaSettings):
    """The mixture of experts' own `model.` settings: every block's MLP a set of routed SwiGLU
    experts (each of ffn_dim hidden units). Ignored by the others."""
    n_experts: int = setting(0, help="moe: routed experts per block (2 or more).")
    top_k: int = setting(2, help="moe: experts each token is sent to (Mixtral: 2 of 8).")
    shared_ffn_dim: int = setting(0, help="moe: hidden size of a shared expert every token also "
                                  "passes through (0: none).")
    norm_top_k: bool = setting(True, help="moe: rescale each token's top-k routing weights to sum "
                               "to 1 (Mixtral; Qwen3-MoE's norm_topk_prob).")
    aux_loss_coef: float = setting(0.01, help="moe: weight of the load-balancing loss (Switch / "
                                   "Mixtral form, 1.0 when balanced) added to the training loss; a "
                                   "Hugging Face folder's is its router_aux_loss_coef x top_k "
                                   "(transformers' loss is top_k when balanced).")
    z_loss_coef: float = setting(0.0, help="moe: weight of the router z-loss (ST-MoE: 0.001; 0: off).")


class MoEFamily(LlamaFamily):
    name = "moe"
    title = "mixture of experts"
    summary = "a mixture of experts in every block: model.n_experts, model.top_k"
    hf_releases = ("Mixtral", "Qwen3-MoE")
    decoder = "raytrain_lm.models.moe.moe:MoE"
    # tp splits the attention; the MoE layer is whole on every tp rank (its tokens replicated
    # there), its experts split by expert parallelism instead (parallel/ep.py).
    tp_plan = TPPlan(colwise=("attn.q_proj", "attn.k_proj", "attn.v_proj"), rowwise=("attn.o_proj",),
                     head_norms=("attn.q_norm", "attn.k_norm"), whole=("mlp",))
    experts = "mlp.experts"
    defaults = {"arch": "moe", "bias": False, "n_experts": 8, "top_k": 2}
    hf_adapter = "raytrain_lm.models.moe.hf_moe"  # MixtralForCausalLM, Qwen3MoeForCausalLM
    hf_model_types = ("mixtral", "qwen3_moe")
    export_format = "raytrain-lm/moe"

    def check(self, m: MoESettings) -> None:
        super().check(m)
        if m.n_experts < 2:
            raise UserError(f"model.arch moe needs model.n_experts of 2 or more, got {m.n_experts} "
                            f"(one expert is the llama: --arch llama)")
        if not 1 <= m.top_k <= m.n_experts:
            raise UserError(f"model.top_k ({m.top_k}) must be between 1 and model.n_experts "
                            f"({m.n_experts}): each token goes to top_k different experts")
        if m.shared_ffn_dim < 0:
            raise UserError(f"model.shared_ffn_dim must be >= 0 (0: no shared expert), got "
                            f"{m.shared_ffn_dim}")
        for key in ("aux_loss_coef", "z_loss_coef"):
            if getattr(m, key) < 0:
                raise UserError(f"model.{key} must be >= 0, got {getattr(m, key)}")

    def check_layout(self, m: MoESettings, tp: int, ep: int = 1) -> Optional[str]:
        problem = super().check_layout(m, tp)
        if problem is None and m.n_experts % ep:
            return (f"--ep {ep} must divide model.n_experts ({m.n_experts}): each expert-parallel "
                    f"rank holds the same number of whole experts")
        return problem

    def expert_params(self, m: MoESettings) -> int:
        """A block's routed experts (what expert parallelism splits)."""
        return m.n_experts * 3 * m.n_embd * self.hidden_dim(m)

    def _moe_extra(self, m: MoESettings) -> int:
        """What a block holds beyond the Llama skeleton's (whose one SwiGLU of ffn_dim units
        becomes E experts of ffn_dim units): E - 1 more experts, the router, the shared expert."""
        h = m.n_embd
        return (m.n_experts - 1) * 3 * h * self.hidden_dim(m) + m.n_experts * h + 3 * h * m.shared_ffn_dim

    def counts(self, m: MoESettings) -> ParamCounts:
        llama = super().counts(m)
        block = llama.block + self._moe_extra(m)
        return ParamCounts(block, llama.root, m.n_layer * block + llama.root)

    def active_block(self, m: MoESettings) -> int:
        return self.counts(m).block - (m.n_experts - m.top_k) * 3 * m.n_embd * self.hidden_dim(m)

    def active_params(self, m: MoESettings) -> int:
        counts = self.counts(m)
        return counts.total - m.n_layer * (counts.block - self.active_block(m))

    def matmul_params(self, m: MoESettings) -> int:
        """The active matrices: a token multiplies by k experts, not all of them."""
        return self.active_params(m) - self.lookup_params(m)

    def tp_counts(self, m: MoESettings, tp: int) -> dict[str, float]:
        """The Llama skeleton's with its SwiGLU whole on every tp rank, and the rest of the MoE
        layer too (it is not tensor-parallel)."""
        out = super().tp_counts(m, tp)
        swiglu = 3 * m.n_embd * self.hidden_dim(m)
        out["block"] += swiglu - swiglu / tp + self._moe_extra(m)
        return out

    def block_matmuls(self, m: MoESettings) -> list[int]:
        """By the FLOPs a token spends: the attention's, the router, then k experts' three
        matrices (and the shared expert's)."""
        h, f, k = m.n_embd, self.hidden_dim(m), m.top_k
        shared = [h * m.shared_ffn_dim] * 3 if m.shared_ffn_dim else []
        return [*super().block_matmuls(m)[:4], m.n_experts * h, k * h * f, k * h * f, k * h * f, *shared]

    def activation_split(self, m: MoESettings, ac: str) -> tuple[float, float]:
        """The attention's share as the Llama's (q, k, v and the attention output divide over
        tp); the MoE layer's stays whole on every tp rank: its input, the router's logits and
        probabilities (2E/h), and for each of the k copies of a token the dispatched input, the
        gate, up, silu and product (4f/h) and the output (none: recomputed from the input, as
        selective; op keeps the gate's output), with the shared expert's as a SwiGLU's."""
        q, kv = m.n_head * m.head_dim / m.n_embd, 2 * m.kv_heads * m.head_dim / m.n_embd
        f, k, E = self.hidden_dim(m) / m.n_embd, m.top_k, m.n_experts
        fs = m.shared_ffn_dim / m.n_embd
        moe = {"none": 1 + 2 * E / m.n_embd + k * (2 + 4 * f) + 4 * fs,
               "selective": 1 + k * (1 + 2 * f) + 2 * fs,
               "op": 1 + k * (1 + f) + fs}[ac]
        attention = {"none": (3, 2 * q + kv), "selective": (2, 2 * q + kv), "op": (1, 2 * q + kv / 2)}[ac]
        return attention[0] + moe, attention[1]

    def fused_mlp_unsaved(self, m: MoESettings) -> float:
        """None: the planner's fused-MLP saving is the Llama's dense SwiGLU's (its MoE layer
        runs its own kernels, models/moe/moe.py)."""
        return 0.0

    def kernel_bytes(self, m: MoESettings, kernels: str) -> tuple[tuple[float, float], tuple[float, float]]:
        """The Llama's attention, norms and residual adds; the MoE layer, whole on every tp rank:
        k SwiGLUs of f (the Llama's per SwiGLU) and the shared one, the dispatch's gather and the
        combine's scatter of k copies (2 k h each way) and the router's softmax (E)."""
        (wf, wb), (sf, sb) = super().kernel_bytes(m, kernels)
        f, fs, k, h = self.hidden_dim(m), m.shared_ffn_dim, m.top_k, m.n_embd
        glu = (5, 8) if kernels == "eager" else (3, 5)
        moe = [glu[i] * (k * f + fs) + 2 * k * h + 2 * m.n_experts for i in range(2)]
        return (wf + moe[0], wb + moe[1]), (sf - glu[0] * f, sb - glu[1] * f)
