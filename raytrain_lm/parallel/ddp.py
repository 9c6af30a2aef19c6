"""Data parallelism with a full replica per worker: DDP, through Ray Train's `prepare_model`."""

from __future__ import annotations

import contextlib

import torch


def replicate(model: torch.nn.Module, compile: bool) -> torch.nn.Module:
    """The DDP-wrapped module to train (compiled first, if asked)."""
    import ray.train.torch

    if compile:
        # Compile the bare module, then wrap (as nanoGPT does): DDP's hooks stay outside the graph.
        model = torch.compile(model)
    # gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, saving one copy.
    return ray.train.torch.prepare_model(
        model, parallel_strategy="ddp",
        parallel_strategy_kwargs={"gradient_as_bucket_view": True, "broadcast_buffers": False},
    )


def no_sync(model: torch.nn.Module, sync: bool):
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) on the non-final micro-steps of
    gradient accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()
