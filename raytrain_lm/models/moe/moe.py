"""The mixture of experts' decoder (after Mixtral and Qwen3-MoE, and torchtitan's MoE): the Llama
(models/llama/llama.py) with every block's MLP a `MoELayer`, routed SwiGLU experts with an
optional shared one. Nothing here imports torch.distributed: expert parallelism (parallel/ep.py)
swaps the layer's `dispatch` for one that sends tokens to the ranks holding their experts, and
hands `Experts` its weights sharded by expert.

A layer, for N tokens of width D, E experts, top k:

1. Router: logits = x W_r^T (E per token, in fp32 whatever the autocast: a rounding must not
   change which experts a token picks), softmax, the k largest probabilities and their experts;
   with `norm_top_k` the k weights rescaled to sum to 1 (Mixtral, Qwen3-MoE).
2. Dispatch, dropless: the N*k (token, expert) pairs sorted by expert (a stable sort: within an
   expert, in token order), every pair computed, none dropped for capacity.
3. Experts: each a SwiGLU on its contiguous rows, by a grouped matmul where torch has one for the
   compute dtype (bf16: CUDA's kernel, and a CPU one), else a loop over the experts
   (`expert_ffn`).
4. Combine: each pair's output back to its (token, slot) place, weighted and summed over the k
   slots in slot order (no atomics: the same sum on every layout and device).

Training adds two losses (`take_aux_loss`, which the decoder or a pipeline stage adds to the
loss, models/decoder.py) and keeps statistics (`stats`, read and reset by
parallel/ep.moe_stats):

* load balancing (Switch Transformer eq. 4, Mixtral's `load_balancing_loss_func`):
  E * sum_e f_e P_e, f_e the share of routed slots that chose expert e, P_e the mean router
  probability of e; 1.0 when perfectly balanced. Computed per sequence and averaged over the
  sequences (as DeepSeek-V3's sequence-wise balance loss), so the same tokens give the same loss
  whatever the layout splits the batch into (data-parallel ranks, micro-batches, pipeline
  microbatches): that is what lets every layout train exactly the one-worker model. Under
  context parallelism a rank holds 1/cp of each window's tokens: f_e is the whole window's
  (`window_sum`: the counts summed over its ranks, no gradient), P_e the mean over this rank's
  tokens, so the mean of the ranks' losses (what averaging their gradients trains) is the
  window's, and so is its gradient. Weighted by
  `aux_loss_coef / n_layer` per layer: the mean over layers, times the coefficient.
* router z-loss (ST-MoE eq. 5): the mean over tokens of logsumexp(logits)^2, weighted by
  `z_loss_coef / n_layer`.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.llama.llama import Llama, LlamaBlock, SwiGLU

# The grouped matmul's CUDA kernel wants rows aligned to 16 bytes: bf16 widths that divide by 8.
GROUPED_ALIGN = 8


def local(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight: under expert parallelism the experts' weights are
    distributed tensors sharded by expert (their local part: this rank's experts)."""
    return w.to_local() if hasattr(w, "to_local") else w


def grouped_mm_suits(x: torch.Tensor, hidden: int) -> bool:
    """Whether `expert_ffn` runs a grouped matmul: torch has one for bf16 (on CUDA where
    `grouped_mm_capable` says so, and on the CPU); fp32 and fp16 take the loop."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) \
        else x.dtype
    if dtype != torch.bfloat16 or not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cuda":
        return grouped_mm_capable(torch.cuda.get_device_capability(x.device)) and \
            x.shape[-1] % GROUPED_ALIGN == 0 and hidden % GROUPED_ALIGN == 0
    return x.device.type == "cpu"


def grouped_mm_capable(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability takes the grouped matmul: from sm80, except
    Blackwell's 10.x, where torch's grouped matmul gives non-zero gradients to experts that got
    no tokens (an open PyTorch issue; Hopper's are zero): those take the loop until it is fixed."""
    return tuple(capability) >= (8, 0) and capability[0] != 10


def expert_ffn(x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               down: torch.Tensor, host_counts: Optional[list[int]] = None) -> torch.Tensor:
    """SwiGLU expert i on rows counts[:i].sum() .. counts[:i+1].sum() of `x` (rows grouped by
    expert): down_i(silu(gate_i x) * up_i x). gate, up: (experts, hidden, D); down: (experts, D,
    hidden), as nn.Linear stores its weight. `host_counts`: `counts` as host ints where the
    caller has read them already (the loop needs them; the grouped matmul does not)."""
    if grouped_mm_suits(x, gate.shape[1]):
        offsets = counts.cumsum(0).to(torch.int32)
        a, g, u, d = (t.to(torch.bfloat16) for t in (x, gate, up, down))
        h = F.silu(F.grouped_mm(a, g.transpose(-2, -1), offs=offsets)) * \
            F.grouped_mm(a, u.transpose(-2, -1), offs=offsets)
        return F.grouped_mm(h, d.transpose(-2, -1), offs=offsets).to(x.dtype)
    # Every expert runs, even on no rows: each weight is then used in every step (DDP expects it).
    # (The split sizes are host ints: unless given, this path reads them, a sync per call.)
    outs = [F.linear(F.silu(F.linear(rows, gate[i])) * F.linear(rows, up[i]), down[i])
            for i, rows in enumerate(x.split(counts.tolist() if host_counts is None else host_counts))]
    return torch.cat(outs)


class Experts(nn.Module):
    """E SwiGLU experts' weights as three (E, ., .) tensors (expert parallelism shards dim 0)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                host_counts: Optional[list[int]] = None) -> torch.Tensor:
        """x: rows grouped by this rank's experts, counts[i] of them for its i-th (`host_counts`:
        the same as host ints, where already read)."""
        return expert_ffn(x, counts, local(self.gate_proj), local(self.up_proj), local(self.down_proj),
                          host_counts)


def local_dispatch(routed: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert is here: compute the rows grouped by expert where they are."""
    return experts(routed, counts)


def expert_counts(pairs: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of `pairs` (expert indices) chose each expert, counted on the device: CUDA's
    bincount reads the smallest and the largest index on the host (two syncs) even with
    minlength; scatter_add_ reads nothing."""
    return torch.zeros(n_experts, dtype=torch.long, device=pairs.device).scatter_add_(
        0, pairs, torch.ones_like(pairs))


class MoELayer(nn.Module):
    """Router, dispatch, experts, combine (the module docstring), plus a shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.norm_top_k = cfg.n_experts, cfg.top_k, cfg.norm_top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.n_embd, cfg.hidden_dim)
        self.shared = SwiGLU(cfg, cfg.shared_ffn_dim) if cfg.shared_ffn_dim else None
        self.dispatch = local_dispatch  # (routed, counts, experts) -> outputs in the same order
        # context parallelism (parallel/cp.py) sets it: a statistic of this rank's tokens of each
        # window -> the whole window's (summed over the ranks holding its chunks); None: whole here
        self.window_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.aux_weight, self.z_weight = cfg.aux_loss_coef / cfg.n_layer, cfg.z_loss_coef / cfg.n_layer
        # Training statistics since the last read (parallel/ep.moe_stats): tokens per expert,
        # then the sums over forwards of the balance loss and the z-loss, and the forwards. A
        # plain attribute, not a buffer: DDP would broadcast rank 0's over every rank's.
        self.stats: Optional[torch.Tensor] = None
        self.keeps_stats = True  # off where a forward is not a training step's (pipelining's probe)
        self.aux_loss: Optional[torch.Tensor] = None

    def take_aux_loss(self) -> Optional[torch.Tensor]:
        aux, self.aux_loss = self.aux_loss, None
        return aux

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, weights, experts): the router's logits (N, E; at least fp32), each token's top-k
        weights and experts (N, k)."""
        dtype = torch.promote_types(flat.dtype, torch.float32)  # a float64 model stays float64
        with torch.autocast(flat.device.type, enabled=False):
            logits = F.linear(flat.to(dtype), local(self.router.weight).to(dtype))
        weights, chosen = logits.softmax(-1).topk(self.top_k, dim=-1)
        if self.norm_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        logits, weights, chosen = self.route(flat)
        pairs = chosen.reshape(-1)  # (N*k,): token t's slot j at t*k + j
        counts = expert_counts(pairs, self.n_experts)
        order = pairs.argsort(stable=True)
        out = self.dispatch(flat[order // self.top_k], counts, self.experts)
        out = torch.zeros_like(out).index_copy(0, order, out)  # back to (token, slot) order
        y = (out.view(-1, self.top_k, D).to(weights.dtype) * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        y = y.view(B, T, D)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.training:
            self._losses(logits, chosen, counts, B)
        return y

    def _losses(self, logits: torch.Tensor, chosen: torch.Tensor, counts: torch.Tensor,
                sequences: int) -> None:
        """The auxiliary losses of this forward (module docstring), kept for the decoder, and
        their values in `stats`."""
        E = self.n_experts
        probs = logits.softmax(-1).view(sequences, -1, E)
        picks = chosen.view(sequences, -1)
        chose = torch.zeros(sequences, E, dtype=torch.float32, device=logits.device).scatter_add_(
            1, picks, torch.ones_like(picks, dtype=torch.float32))
        if self.window_sum is not None:  # f_e of the whole window, P_e of this rank's share
            chose = self.window_sum(chose)
        share = chose / chose.sum(-1, keepdim=True)
        balance = E * (share * probs.mean(1)).sum(-1).mean()
        z = torch.logsumexp(logits, -1).square().mean()
        self.aux_loss = self.aux_weight * balance + (self.z_weight * z if self.z_weight else 0.0)
        if not self.keeps_stats:
            return
        with torch.no_grad():
            if self.stats is None or self.stats.device != logits.device:
                self.stats = torch.zeros(E + 3, dtype=torch.float64, device=logits.device)
            self.stats += torch.cat([counts, torch.stack([balance, z, torch.ones_like(z)])]).to(self.stats)


class MoEBlock(LlamaBlock):
    MLP = MoELayer


class MoE(Llama):
    """The Llama whose blocks' MLPs are mixtures of experts."""

    Block = MoEBlock

    @staticmethod
    def init_spec(cfg: ModelConfig, module: nn.Module, fqn: str) -> tuple[str, float]:
        """The Llama's scheme; the experts' matrices as its MLPs' (down projections scaled by
        1/sqrt(2 n_layer)), the router's N(0, 0.02)."""
        if isinstance(module, Experts):
            return ("normal", cfg.init_std / math.sqrt(2 * cfg.n_layer) if fqn.endswith("down_proj")
                    else cfg.init_std)
        return Llama.init_spec(cfg, module, fqn)

