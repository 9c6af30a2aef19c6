"""Everything that makes the model distributed, applied from outside `model.py`."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from raytrain_lm.config import TrainConfig


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def wrap_model(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """Move to the worker's device, optionally compile, then wrap in DDP via Ray Train."""
    import ray.train.torch

    if cfg.compile:
        # Compile the bare module, then wrap (as nanoGPT does): DDP's hooks stay outside the graph.
        model = torch.compile(model)
    # gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, saving one copy.
    return ray.train.torch.prepare_model(
        model, parallel_strategy="ddp",
        parallel_strategy_kwargs={"gradient_as_bucket_view": True, "broadcast_buffers": False},
    )


def no_sync(model: torch.nn.Module, sync: bool):
    """Skip DDP's gradient all-reduce on non-final micro-steps of gradient accumulation."""
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t
