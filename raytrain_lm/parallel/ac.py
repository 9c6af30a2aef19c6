"""Activation checkpointing: recompute activations in the backward pass instead of keeping them."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from raytrain_lm.models import attention

_ATTENTION_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
# Selective activation checkpointing keeps the outputs of these ops (the expensive ones) and
# recomputes everything else (LayerNorm, GELU, adds, views) in the backward pass.
_SAVE_OPS = _MATMUL_OPS | {torch.ops.aten.bmm.default} | _ATTENTION_OPS
# "op" (torchtitan's per-op selective policy, its selective_ac_option "op"): attention's outputs,
# sequence parallelism's reduce-scatters and every other matmul of the block (the 1st, 3rd, ...
# in forward order: the Llama's q, v, gate and down projections; the GPT's qkv and fc), so the
# other matmuls run again in backward.
_OP_SAVE_OPS = _ATTENTION_OPS | {torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    """A fresh context per checkpointed call: the matmuls are counted separately in the forward
    and in its recomputation, so both save (and look up) the same ones."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in _MATMUL_OPS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in _OP_SAVE_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Recompute each transformer block's activations in backward ("full"), all but the
    matmul/attention outputs ("selective"), or all but attention's and every other matmul's
    ("op"). Replaces the blocks' forward on the instance, so parameter names (and checkpoints)
    are unchanged."""
    if mode == "none":
        return
    context_fn = {"selective": functools.partial(create_selective_checkpoint_contexts, _selective_policy),
                  "op": _op_context, "full": None}[mode]
    for block in (model.h.values() if isinstance(model.h, torch.nn.ModuleDict) else model.h):
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():  # eval and generation: nothing to save
                return _inner(*args, **kwargs)
            extra = {"context_fn": context_fn} if context_fn else {}
            # the recomputation in backward attends by the span this forward ran in, not by
            # whatever is installed when backward reaches it (a pipeline stage's microbatch
            # span is installed for its forward only: parallel/pp.py)
            span = attention.current()
            fn = _inner if span is None else functools.partial(_within, span, _inner)
            return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward


def _within(span, fn, *args, **kwargs):
    with attention.using(span):
        return fn(*args, **kwargs)
