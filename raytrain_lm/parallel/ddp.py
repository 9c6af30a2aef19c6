"""Data parallelism with a full replica per worker: DDP, through Ray Train's `prepare_model`."""

from __future__ import annotations

import contextlib

import torch

# gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, saving one copy;
# broadcast_buffers off: the model's buffers (rotary tables, causal masks) never change.
DDP_KWARGS = {"gradient_as_bucket_view": True, "broadcast_buffers": False}


def replicate(model: torch.nn.Module, compile: bool, wrap=None) -> torch.nn.Module:
    """The DDP-wrapped module to train, compiled after wrapping if asked: compiling the DDP module
    lets Dynamo's DDPOptimizer split the graph at DDP's bucket boundaries, so each bucket's
    all-reduce starts while the backward of the layers before it still runs (a compiled bare
    model inside DDP is one graph whose gradients all arrive at its end: no overlap).
    `wrap`: the DDP wrapper [Ray Train's prepare_model]."""
    module = (wrap or _prepare_model)(model)
    return torch.compile(module) if compile else module


def _prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    import ray.train.torch

    return ray.train.torch.prepare_model(model, parallel_strategy="ddp",
                                         parallel_strategy_kwargs=DDP_KWARGS)


def no_sync(model: torch.nn.Module, sync: bool, keep_gathered: bool = False):
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) on the non-final micro-steps of
    gradient accumulation. `keep_gathered` (ZeRO-1): FSDP2 keeps the parameters gathered after
    those micro-steps' backward too, so a step gathers them once, whatever its micro-steps."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        if keep_gathered:
            model.set_reshard_after_backward(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()
