"""Context parallelism: each window's sequence split over the cp ranks of a data-parallel rank
(which read the same batch), exact attention across them by an all-gather of keys and values
(Llama 3, arXiv:2407.21783 section 3.3.2), and the window's loss from the ranks' parts.

The split balances the causal work: the window is cut into 2 x cp equal chunks and rank i takes
chunks i and 2cp-1-i, one early (few keys before it) and one late (many):

    window of T tokens, cp = 2:   | c0 | c1 | c2 | c3 |
    rank 0 holds c0 + c3, rank 1 holds c1 + c2   (each: T/2 queries, (T/4)(T/4 + T) key pairs)

Every layer's attention all-gathers the ranks' keys and values (autograd: the backward
reduce-scatters their gradients) and masks by each token's place in the window
(models/attention.py). The gathered keys sit in rank order (c0 c3 c1 c2), which the mask reads
from their places, so nothing is reordered. All-gather rather than a ring: one collective per
layer instead of cp - 1 steps, any mask (documents, sliding windows) without a per-step schedule,
and on gloo an overlapped ring buys nothing; the whole window's K/V are in flight for one layer
at a time (with GQA 2 x kv_heads/heads of the queries' size), since the attention keeps only
its rank's part for backward and gathers the rest again there (models/attention.py).

The loss: each rank's cross-entropy is its own tokens' mean. With equal chunks and every target
counted (training windows have no ignored targets) the mean over the cp ranks is the window's
mean; the gradients are averaged over dp x cp by DDP or FSDP (the cp ranks are in the
parameters' reduction group, parallel/__init__.py), so they are the whole batch's gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from raytrain_lm.models.attention import Span, document_ids, document_positions
from raytrain_lm.parallel.mesh import ALL_GATHER


def chunk_index(T: int, cp: int, rank: int) -> torch.Tensor:
    """The places in a window of T tokens that cp rank `rank` holds: chunks rank and
    2cp-1-rank of 2cp (T divisible by 2cp: Layout.problems)."""
    c = T // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


class _GatherSeq(torch.autograd.Function):
    """(B, H, T_local, d) on each rank -> (B, H, cp x T_local, d), rank r's at [r T_local, ...);
    backward: each rank's slice of the summed gradient (every rank's queries read every key)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group, n = group, dist.get_world_size(group)
        t = t.contiguous()
        out = torch.empty((n * t.numel(),), dtype=t.dtype, device=t.device)
        ALL_GATHER(out, t.reshape(-1), group=group)
        ctx.shape = t.shape
        parts = out.view(n, *t.shape)  # (cp, B, H, Tl, d)
        return torch.cat(parts.unbind(0), dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, shape = ctx.group, ctx.shape
        Tl = shape[2]
        stacked = torch.stack(grad.split(Tl, dim=2)).contiguous()  # (cp, B, H, Tl, d)
        if dist.get_backend(group) == "nccl":
            out = torch.empty(shape, dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, stacked.reshape(-1), group=group)
            return out, None
        dist.all_reduce(stacked, group=group)  # gloo has no reduce-scatter of tensors
        return stacked[dist.get_rank(group)].clone(), None


class ContextParallel:
    """A cp group's split of the windows: `shard` takes a batch every cp rank read alike and
    returns this rank's tokens and the Span its attention runs by. At cp 1 (one rank, the whole
    window) it is document masking alone."""

    def __init__(self, cp: int, rank: int, group, separator: Optional[int] = None, ring: bool = False):
        """`separator`: the token that opens a document, for document masking (None: none);
        `ring`: attend by passing K/V blocks around the cp ranks (parallel/ring.py) instead of
        all-gathering them."""
        self.cp, self.rank, self.group, self.separator, self.ring = cp, rank, group, separator, ring

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Span]:
        T = x.size(1)
        index = chunk_index(T, self.cp, self.rank).to(x.device)
        keys = torch.cat([chunk_index(T, self.cp, r) for r in range(self.cp)]).to(x.device)
        docs = document_ids(x, self.separator) if self.separator is not None else None
        span = Span(index=index, positions=index if docs is None else document_positions(docs)[:, index],
                    docs=None if docs is None else docs[:, index], key_index=keys,
                    key_docs=None if docs is None else docs[:, keys],
                    gather=self._gather if self.cp > 1 and not self.ring else None,
                    ring=self._ring if self.cp > 1 and self.ring else None)
        return x[:, index], y[:, index], span

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return _GatherSeq.apply(t, self.group)

    def _ring(self, q, k, v, span, window, scale) -> torch.Tensor:
        from raytrain_lm.parallel.ring import ring_attention

        return ring_attention(q, k, v, span, window, scale, self.group)

    def window_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a statistic of this rank's tokens of each window, no gradient) summed over the
        cp group: the whole windows' (a mixture of experts' expert shares, models/moe/moe.py)."""
        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t

