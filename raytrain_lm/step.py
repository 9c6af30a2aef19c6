"""One optimizer step of the parallelized model, and a validation pass: what the loop calls.

The step accumulates gradients over `grad_accum` micro-batches (without the all-reduce on all
but the last), runs under autocast (bf16 on GPU; fp16 with a gradient scaler), clips the global
gradient norm, and applies AdamW at the learning rate the schedule gives it.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Optional

import torch

from raytrain_lm.config import TrainConfig
from raytrain_lm.model import GPT
from raytrain_lm.optim import build_optimizer
from raytrain_lm.parallel import parallelize
from raytrain_lm.parallel.ddp import no_sync
from raytrain_lm.parallel.fsdp import is_sharded
from raytrain_lm.parallel.mesh import all_reduce
from raytrain_lm.tokenizer import bits_per_byte


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class TrainStep:
    def __init__(self, model: GPT, cfg: TrainConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.raw = model  # unwrapped: its state_dict has clean keys (FSDP shards it in place)
        self.model = parallelize(model, cfg, device)
        self.optimizer = build_optimizer(model, cfg, device)
        dtype = autocast_dtype(cfg, device)
        self.autocast = torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    @property
    def sharded(self) -> bool:
        return is_sharded(self.raw)

    def __call__(self, batches, lr: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(this rank's loss of the step, the gradient norm before clipping, seconds spent
        waiting for batches)."""
        # Gradients are freed here rather than after the step, so a report sees them as held.
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum, waited, step_loss = self.cfg.grad_accum, 0.0, None
        for micro in range(accum):
            t0 = time.perf_counter()
            x, y = batches.next()
            waited += time.perf_counter() - t0
            with no_sync(self.model, sync=micro == accum - 1), self.autocast:
                _, loss = self.model(x, y)
                self.scaler.scale(loss / accum).backward()
            micro_loss = loss.detach() / accum
            step_loss = micro_loss if step_loss is None else step_loss + micro_loss
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return step_loss, grad_norm, waited

    @torch.no_grad()
    def evaluate(self, validation) -> tuple[float, float]:
        """(mean loss over the validation windows, all ranks together, in nats per token; the
        same loss in bits per byte of the text those targets stand for: tokenizer-independent)."""
        self.model.eval()
        # (loss x windows, windows, targets, text bytes), summed over batches and ranks
        total = torch.tensor([0.0, 0.0, validation.targets, validation.text_bytes],
                             dtype=torch.float64, device=self.device)
        for (x, y), windows in validation:
            with self.autocast:
                _, loss = self.model(x, y)
            total[0] += loss.detach().double() * windows
            total[1] += windows
        self.model.train()
        all_reduce(total)
        val_loss = (total[0] / total[1]).item()
        return val_loss, bits_per_byte(val_loss, total[2].item(), total[3].item())
