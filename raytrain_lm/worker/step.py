"""One optimizer step of the model as this rank holds it, and a validation pass: what the loop
calls. The layout (ddp, fsdp, tp, pp) is the business of `parallel.Parallelized`; here: the
learning rate, mixed precision, the step.

Mixed precision, one mechanism per layout (as torchtitan's maybe_enable_amp): where FSDP shards
over dp, its MixedPrecisionPolicy alone (parameters gathered and computed in bf16/fp16,
gradients reduced in fp32) with no autocast around it; everywhere else (DDP, FSDP2's replicate,
tensor and pipeline parallelism without dp sharding, one worker) torch.autocast, which also runs
DTensor ops and pipeline stages (tested on CPU in bf16). fp16 adds a gradient scaler."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.parallel import Parallelized
from raytrain_lm.parallel.traffic import CommCounter
from raytrain_lm.tokenizer import bits_per_byte

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device_type: str, bf16_native: bool, pp: int = 1) -> str:
    """fp32, bf16 or fp16 for --precision. auto: fp32 on CPU; on a GPU bf16 where it has bf16
    units, else (T4, V100: bf16 only emulated, slower than fp32) fp16 with the gradient scaler,
    or fp32 with pipelining (which takes no scaler)."""
    if precision != "auto":
        return precision
    if device_type != "cuda":
        return "fp32"
    if bf16_native:
        return "bf16"
    return "fp32" if pp > 1 else "fp16"


def bf16_native(device: torch.device) -> bool:
    """Whether this GPU computes bf16 in hardware (Ampere and later), not by emulation."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """The mixed-precision dtype of this run on `device` (None: fp32)."""
    return DTYPES[resolve_precision(cfg.precision, device.type, bf16_native(device), cfg.pp)]


class TrainStep:
    def __init__(self, cfg: TrainConfig, device: torch.device, **layout):
        """`layout`: Parallelized's `force` and `ddp_wrap` (bench/gpu_check.py)."""
        self.cfg, self.device = cfg, device
        dtype = autocast_dtype(cfg, device)
        self.precision = {v: k for k, v in DTYPES.items()}[dtype]  # fp32, bf16 or fp16
        self.parallel = Parallelized(cfg, device, dtype, **layout)
        by_fsdp = self.parallel.mixed_by_fsdp
        self.autocast = torch.autocast(device.type, dtype=dtype) if dtype and not by_fsdp \
            else nullcontext()
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.steps = 0

    def __call__(self, batches, lr: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(the step's loss of this rank's data-parallel group, 0 on ranks that do not report it;
        the gradient norm before clipping; seconds spent waiting for batches)."""
        self.steps += 1
        with self._count_comm() as counter:
            # Gradients are freed here rather than after the step, so a report sees them as held.
            self.parallel.zero_grad()
            self.parallel.set_lr(lr)
            loss, waited = self.parallel.forward_backward(batches, self.autocast, self.scaler)
            grad_norm = self.parallel.clip_and_step(self.scaler)
        if counter is not None:
            self.parallel.comm_bytes = counter.bytes_per_dim()
        return loss, grad_norm, waited

    def _count_comm(self):
        """The bytes each mesh dimension moves, counted on this run's second step (the first
        one sets things up) of a sharded layout; every step moves the same."""
        if self.steps != 2 or self.parallel.mesh is None:
            return nullcontext()
        return CommCounter(self.parallel.mesh)

    def evaluate(self, validation) -> tuple[float, float]:
        """(mean loss over the validation windows' targets, all ranks together, in nats per
        token; the same loss in bits per byte of the text those targets stand for:
        tokenizer-independent)."""
        loss_sum, tokens, text_bytes = self.parallel.evaluate(validation, self.autocast)
        val_loss = loss_sum / tokens
        return val_loss, bits_per_byte(val_loss, tokens, text_bytes)
