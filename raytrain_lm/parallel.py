"""Everything that makes the model distributed or memory-lean, applied from outside `model.py`:
activation checkpointing, torch.compile, then DDP (through Ray Train) or FSDP2."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from raytrain_lm.config import TrainConfig

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


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
    for block in model.h:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():  # eval and generation: nothing to save
                return _inner(*args, **kwargs)
            extra = {"context_fn": context_fn} if context_fn else {}
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward


def _fully_shard(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> None:
    """FSDP2: shard each block, then the root (embeddings, final norm, tied head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh}
    if device.type == "cuda" and cfg.precision in ("auto", "bf16"):
        # Gather parameters and compute in bf16; reduce gradients in fp32 for accuracy.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def wrap_model(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """Returns the module to call for training. `model` itself stays the unwrapped module whose
    state_dict has clean keys (with FSDP it is sharded in place)."""
    import ray.train.torch

    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.strategy == "fsdp" and is_distributed():
        model.to(device)
        if cfg.compile:
            for block in model.h:
                block.compile()  # per block, as torchtitan does: FSDP's hooks stay outside graphs
        _fully_shard(model, cfg, device)
        return model
    if cfg.compile:
        # Compile the bare module, then wrap (as nanoGPT does): DDP's hooks stay outside the graph.
        model = torch.compile(model)
    # gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, saving one copy.
    return ray.train.torch.prepare_model(
        model, parallel_strategy="ddp",
        parallel_strategy_kwargs={"gradient_as_bucket_view": True, "broadcast_buffers": False},
    )


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def no_sync(model: torch.nn.Module, sync: bool):
    """Skip the gradient all-reduce / reduce-scatter on non-final micro-steps of accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def to_local_float(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (FSDP's grad norm) as a Python float."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard of an FSDP DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def model_state_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes this rank holds for parameters, gradients and optimizer states (local shards)."""
    total = 0
    for p in model.parameters():
        total += _local(p).numel() * p.element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += _local(v).numel() * v.element_size()
    return total


def local_param_fraction(model: torch.nn.Module) -> float:
    """Share of the model's parameters stored on this rank: 1.0 with DDP, ~1/world with FSDP."""
    local = sum(_local(p).numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    return local / full


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t
