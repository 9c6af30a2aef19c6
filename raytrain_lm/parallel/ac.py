"""Activation checkpointing: recompute activations in the backward pass instead of keeping them."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Selective activation checkpointing keeps the outputs of these ops (the expensive ones) and
# recomputes everything else (LayerNorm, GELU, adds, views) in the backward pass.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Recompute each transformer block's activations in backward ("full"), or all but the
    matmul/attention outputs ("selective"). Replaces the blocks' forward on the instance, so
    parameter names (and checkpoints) are unchanged."""
    if mode == "none":
        return
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                  if mode == "selective" else None)
    for block in (model.h.values() if isinstance(model.h, torch.nn.ModuleDict) else model.h):
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():  # eval and generation: nothing to save
                return _inner(*args, **kwargs)
            extra = {"context_fn": context_fn} if context_fn else {}
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward
