"""Ring attention (Liu et al. 2023; torch's `context_parallel`): context parallelism's other
way to attend across the cp ranks, kept to measure against the all-gather that training uses
(parallel/cp.py, docs/parallelism.md: bench/cp_ring.py measures both).

Each rank keeps its queries and passes its keys and values around the ring: at step s it
attends to the block of rank (me - s) mod cp while sending the block it holds to rank me + 1
and receiving the next from me - 1, and merges the block's result into its output by the
blocks' log-sum-exps (the online softmax of flash attention). A block holds 1/cp of the window's
K/V, so two are in flight at a time instead of the whole window, at the price of cp - 1 sends
per layer in forward (and in backward cp - 1 of K/V and cp of their gradients, which travel
with their block back to its owner). The backward recomputes each block's probabilities from
the saved log-sum-exp (flash attention's backward): nothing of another rank is saved.

The masks are the span's rule (models/attention.py) on each block's places in the window, so
documents, sliding windows and the balanced chunk split are exact as they are for the
all-gather. Each block runs the CPU's fused flash-attention kernel (the one SDPA runs there,
called for its log-sum-exp), so the ring and the all-gather compare on the same kernel; it is a
CPU reference: a GPU ring would call the CUDA kernels' equivalents.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from raytrain_lm.models.attention import Span, mask_rule

KV_TAG, GRAD_TAG = 1, 2


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: Span,
                   window: Optional[int], scale: Optional[float], group) -> torch.Tensor:
    """Attention of q (B, H, T_local, d) over the whole window's K/V, of which this rank holds
    k, v (B, KV, T_local, d), by passing K/V blocks around `group` (module docstring)."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    return _Ring.apply(q, k, v, span, window, scale, group)


def block_visible(span: Span, src: int, n_local: int, window: Optional[int]) -> torch.Tensor:
    """(B or 1, 1, T_local, T_local) bool: which keys of rank `src`'s block each local query sees."""
    keys = slice(src * n_local, (src + 1) * n_local)
    qi, ki = span.index[:, None], span.keys[keys][None, :]
    if span.docs is None:
        return mask_rule(qi, ki, window)[None, None]
    return mask_rule(qi[None], ki[None], window, span.docs[:, :, None],
                     span.kdocs[:, keys][:, None, :])[:, None]


def _pass_on(t: torch.Tensor, group, tag: int) -> tuple[torch.Tensor, list]:
    """Send `t` to the next rank of the ring, receive the previous rank's into a new tensor;
    returns it and the requests to wait on (`tag`: K/V and their gradients apart)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    got = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, (me + 1) % n), group, tag),
           dist.P2POp(dist.irecv, got, dist.get_global_rank(group, (me - 1) % n), group, tag)]
    return got, dist.batch_isend_irecv(ops)


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads -> query heads (query head h reads kv head h // groups, as SDPA's enable_gqa)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _finite(t: torch.Tensor) -> torch.Tensor:
    """-inf (a row that sees no key yet) as 0, so exp(x - it) stays 0, not nan."""
    return t.masked_fill(t.isneginf(), 0.0)


def _additive(ok: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))


# The CPU's fused flash-attention kernel with its log-sum-exp (what SDPA runs on the CPU, here
# called directly for the log-sum-exp that merging blocks needs), forward and backward.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _Ring(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, span, window, scale, group):
        if q.device.type != "cpu":
            raise ValueError("ring attention is a CPU reference (parallel/ring.py)")
        n, me, Tl = dist.get_world_size(group), dist.get_rank(group), q.size(2)
        groups = q.size(1) // k.size(1)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(n):
            src = (me - step) % n
            nxt, reqs = _pass_on(kv, group, KV_TAG) if step + 1 < n else (None, [])
            ok = block_visible(span, src, Tl, window).to(q.device)
            if bool(ok.any()):  # a causal window's later blocks are hidden from early queries
                o, block_lse = _FLASH(q, _expand(kv[0], groups), _expand(kv[1], groups), 0.0, False,
                                      attn_mask=_additive(ok, q.dtype), scale=scale)[:2]
                # a row that sees none of the block: the kernel's 0 means "nothing" here
                block_lse = block_lse.masked_fill(~ok.any(-1), float("-inf"))
                new = torch.logaddexp(lse, block_lse)
                out = out * (lse - _finite(new)).exp()[..., None] + \
                    o * (block_lse - _finite(new)).exp()[..., None]
                lse = new
            for r in reqs:
                r.wait()
            kv = nxt if nxt is not None else kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.span, ctx.window, ctx.scale, ctx.group = span, window, scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        """Each block's share of the gradients from the whole row's output and log-sum-exp
        (flash attention's backward of one block of keys), K/V's travelling back to their owner."""
        q, k, v, out, lse = ctx.saved_tensors
        span, window, scale, group = ctx.span, ctx.window, ctx.scale, ctx.group
        n, me, Tl = dist.get_world_size(group), dist.get_rank(group), q.size(2)
        B, KV, groups = k.size(0), k.size(1), q.size(1) // k.size(1)
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)
        for step in range(n):
            src = (me - step) % n
            nxt, reqs = _pass_on(kv, group, KV_TAG) if step + 1 < n else (None, [])
            ok = block_visible(span, src, Tl, window).to(q.device)
            if bool(ok.any()):
                dq_b, dk_b, dv_b = _FLASH_BACKWARD(dout, q, _expand(kv[0], groups), _expand(kv[1], groups),
                                                   out, lse, 0.0, False, attn_mask=_additive(ok, q.dtype),
                                                   scale=scale)
                dq += dq_b
                dkv[0] += dk_b.view(B, KV, groups, Tl, -1).sum(2)
                dkv[1] += dv_b.view(B, KV, groups, Tl, -1).sum(2)
            sent = dkv
            dkv, dreqs = _pass_on(sent, group, GRAD_TAG)
            for r in reqs + dreqs:
                r.wait()
            kv = nxt if nxt is not None else kv
            del sent
        return dq, dkv[0], dkv[1], None, None, None, None
