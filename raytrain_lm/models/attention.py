"""Which keys each query of a window sees, set from outside the model for a forward and its
backward: the tokens' places in the window, their positions, their documents and, under context
parallelism, how a rank's keys and values become the whole window's. Nothing here imports
torch.distributed: parallel/cp.py hands in the gathering function.

Without a `Span` installed (`using`) the models attend as they always did (causal SDPA, the
sliding window's mask past the window); with one, `attend` applies the span's mask:

    key j is visible to query i  iff  index[j] <= index[i]                  (causal in the window)
                                 and  index[i] - index[j] < window          (a sliding window)
                                 and  doc[j] == doc[i]                      (document masking)

`index` is a token's place in the window (0..T-1) and orders the keys; `positions` are what the
position embeddings read (rotary tables, the GPT's learned positions). Document masking restarts
positions at each document, so a packed document is computed exactly as the same document alone,
for every family (the GPT's learned positions are absolute; for rotary ones a shift cancels in
q.k anyway) and as Hugging Face's packed-sequence position_ids do.

Kernels: on a GPU, flex_attention with a block mask built from the same rule (compiled: a fused
kernel that skips the fully masked blocks); on the CPU, SDPA with the dense boolean mask. A
model's plain forward past its sliding window (no span, no KV cache: training and evaluation of
a Mistral-like model on windows longer than its window) attends by the same rule and kernels
(`sliding_window`): SDPA's fused kernels take no mask but the causal one, and a dense mask sends
a GPU's SDPA to the math kernel, which materialises every (query, key) score.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Span:
    """This rank's tokens of a batch of windows and the keys they attend to."""
    index: torch.Tensor  # (T_local,) long: each local token's place in the window
    positions: torch.Tensor  # (T_local,) or (B, T_local) long: what position embeddings read
    docs: Optional[torch.Tensor] = None  # (B, T_local) long: each local token's document
    key_index: Optional[torch.Tensor] = None  # (T_keys,) the keys' places (default: index)
    key_docs: Optional[torch.Tensor] = None  # (B, T_keys) the keys' documents (default: docs)
    # (B, heads, T_local, d) -> (B, heads, T_keys, d): a rank's keys (or values) -> every key the
    # window's queries may see, in key_index's order (context parallelism: an all-gather)
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    # (q, k, v, span, window, scale) -> the attention of this rank's queries over every key the
    # window's queries may see, computed by passing K/V around the cp ranks instead of gathering
    # them (parallel/ring.py: a ring, measured against the all-gather)
    ring: Optional[Callable] = None
    # what every layer of the step reads alike, built once: the dense mask (SDPA saves it for
    # backward: one copy, not one per layer) and the rotary rows of the positions
    masks: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def keys(self) -> torch.Tensor:
        return self.index if self.key_index is None else self.key_index

    @property
    def kdocs(self) -> Optional[torch.Tensor]:
        return self.docs if self.key_docs is None else self.key_docs

    def of_rows(self, rows: torch.Tensor) -> "Span":
        """The span of these rows of the batch (a pipeline's microbatch: its stages run a part of
        the batch the span was made for): the rows' documents and positions, masks of their own;
        the span itself where every row attends alike (no documents)."""
        if self.docs is None:
            return self
        rows = rows.to(self.docs.device)
        return dataclasses.replace(
            self, docs=self.docs[rows], key_docs=None if self.key_docs is None else self.key_docs[rows],
            positions=self.positions[rows] if self.positions.dim() == 2 else self.positions, masks={})


_SPAN: contextvars.ContextVar[Optional[Span]] = contextvars.ContextVar("raytrain_lm_span", default=None)


@contextlib.contextmanager
def using(span: Optional[Span]):
    """Attend by `span` in the forwards (and the recomputations of activation checkpointing in
    the backwards) run inside; None: as without."""
    token = _SPAN.set(span)
    try:
        yield
    finally:
        _SPAN.reset(token)


def current() -> Optional[Span]:
    return _SPAN.get()


def positions(start: int, T: int, device) -> torch.Tensor:
    """The positions of T tokens from `start` (a KV cache's length): the span's where one is
    installed, else start..start+T-1."""
    span = current()
    if span is not None:
        return span.positions.to(device)
    return torch.arange(start, start + T, device=device)


def document_ids(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """(B, T) -> (B, T): each token's document in its window, counting from 0; a separator opens
    the document it precedes (the dataset writes one before every document but the stream's
    first), so it belongs to the document that follows."""
    return (tokens == separator).long().cumsum(dim=1)


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> each token's position within its document (0 at each start)."""
    T = docs.size(1)
    index = torch.arange(T, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def mask_rule(q_index, k_index, window: Optional[int], q_docs=None, k_docs=None):
    """The visibility rule of the module docstring on broadcastable index tensors."""
    ok = k_index <= q_index
    if window is not None:
        ok = ok & (q_index - k_index < window)
    if q_docs is not None:
        ok = ok & (k_docs == q_docs)
    return ok


_WINDOWS: dict = {}  # (T, device) -> the plain window's Span, whose masks hold its block masks


def window_span(T: int, device) -> Span:
    """A whole window of T tokens in order, no documents, no cp: the span a plain forward past its
    sliding window attends by on a GPU. One per (T, device), so its block mask is built once
    (the GPU path caches only block masks on it: a few bytes per 128 x 128 block)."""
    key = (T, str(device))
    if key not in _WINDOWS:
        index = torch.arange(T, device=device)
        _WINDOWS[key] = Span(index=index, positions=index)
    return _WINDOWS[key]


def sliding_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of a whole window's q (B, H, T, d) over its k, v (B, KV, T, d), each query
    seeing the `window` keys up to itself (`mask_rule`): on a GPU flex_attention with the rule's
    block mask (compiled: fused, the blocks outside every window skipped), on the CPU SDPA with
    the dense boolean mask, built per call as SDPA's masked path always was."""
    T, gqa = q.size(2), q.size(1) != k.size(1)
    if q.is_cuda:
        return _flex(q, k, v, window_span(T, q.device), window, gqa, scale)
    index = torch.arange(T, device=q.device)
    mask = mask_rule(index[:, None], index[None, :], window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


def dense_mask(span: Span, window: Optional[int], device, dtype) -> torch.Tensor:
    """(B or 1, 1, T_local, T_keys): the span's rule, materialised as SDPA's additive mask (0
    where visible, -inf where not; SDPA would turn booleans into this anyway, a copy per call),
    once per span for all its layers. Every query sees itself: no row is all -inf."""
    key = (window, str(device), dtype)
    if key not in span.masks:
        qi, ki = span.index.to(device)[:, None], span.keys.to(device)[None, :]
        if span.docs is None:
            ok = mask_rule(qi, ki, window)[None, None]
        else:
            qd, kd = span.docs.to(device)[:, :, None], span.kdocs.to(device)[:, None, :]
            ok = mask_rule(qi[None], ki[None], window, qd, kd)[:, None]
        span.masks[key] = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))
    return span.masks[key]


def rows(span: Span, table: torch.Tensor, name: str) -> torch.Tensor:
    """table[positions] (a rotary table's rows), once per span and table."""
    key = (name, table.data_ptr())
    if key not in span.masks:
        span.masks[key] = table[span.positions.to(table.device)]
    return span.masks[key]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int] = None,
           dropout: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
    """Attention of q (B, H, T_local, d) over k, v (B, KV, T_local, d) by the installed span
    (installed: `using`; the caller checked). Grouped-query attention where KV < H; `scale` of
    q.k as SDPA's (None: 1/sqrt(d); muP's 1/d-like one otherwise).

    Where the span gathers K/V (context parallelism), the attention's backward needs the whole
    window's K/V; it keeps only this rank's and gathers the rest again when backward reaches it
    (saved-tensor hooks): a rank's saved activations stay its share of the window's, at the
    price of one more gather per layer in backward (no recomputed FLOPs)."""
    span = current()
    if span.ring is not None:
        if dropout:
            raise ValueError("ring attention has no dropout")
        return span.ring(q, k, v, span, window, scale)
    if span.gather is None:
        return _attend(q, k, v, span, window, dropout, scale)
    k_all, v_all = span.gather(k), span.gather(v)
    local = {_key(k_all): k.detach(), _key(v_all): v.detach()}
    # hooks installed around this call (activation checkpointing's, a memory tracker's) still see
    # every saved tensor: ours wrap theirs (the innermost hooks are the only ones called)
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t):
        mine = local.get(_key(t))
        if mine is not None:
            return (_REGATHER, outer_pack(mine) if outer_pack else mine)
        return outer_pack(t) if outer_pack else t

    def unpack(saved):
        if isinstance(saved, tuple) and len(saved) == 2 and saved[0] is _REGATHER:
            mine = outer_unpack(saved[1]) if outer_unpack else saved[1]
            with torch.no_grad():
                return span.gather(mine)
        return outer_unpack(saved) if outer_unpack else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return _attend(q, k_all, v_all, span, window, dropout, scale)


_REGATHER = object()  # marks a saved K/V kept as this rank's part


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), tuple(t.shape), t.storage_offset())


def _attend(q, k, v, span: Span, window: Optional[int], dropout: float,
            scale: Optional[float] = None) -> torch.Tensor:
    gqa = q.size(1) != k.size(1)
    if q.is_cuda and dropout == 0.0:
        return _flex(q, k, v, span, window, gqa, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(span, window, q.device, q.dtype),
                                          dropout_p=dropout, enable_gqa=gqa, scale=scale)


_compiled_flex = None


def block_mask(span: Span, window: Optional[int], q_len: int, k_len: int, device):
    """flex_attention's BlockMask of the span's rule (the same `mask_rule` as the dense mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    qi, ki = span.index.to(device), span.keys.to(device)
    qd = span.docs.to(device) if span.docs is not None else None
    kd = span.kdocs.to(device) if span.docs is not None else None

    def mask_mod(b, h, i, j):
        return mask_rule(qi[i], ki[j], window, None if qd is None else qd[b, i],
                         None if kd is None else kd[b, j])

    B = qd.size(0) if qd is not None else None
    return create_block_mask(mask_mod, B, None, q_len, k_len, device=device)


def _flex(q, k, v, span: Span, window: Optional[int], gqa: bool, scale: Optional[float] = None) -> torch.Tensor:
    """flex_attention with a block mask of the span's rule: compiled, it is one fused kernel
    that skips every block the mask hides entirely (most of a causal or document mask)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    key = ("block", window, q.size(2), k.size(2), str(q.device))
    if key not in span.masks:  # once per step: every layer's is the same
        span.masks[key] = block_mask(span, window, q.size(2), k.size(2), q.device)
    return _compiled_flex(q, k, v, block_mask=span.masks[key], enable_gqa=gqa, scale=scale)
