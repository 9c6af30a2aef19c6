"""The squared norm of a gradient at a smaller batch than the step's, for the gradient noise
scale (plan/noise_scale.py): one scalar per rank per step, with no collective of its own.

- Data parallelism over DDP (nn.parallel.DistributedDataParallel, Ray's prepare_model): a comm
  hook sums the squares of each bucket before its all-reduce, so the scalar is this worker's own
  gradient (b = its batch, every micro-batch of the step), the global one (B) being the norm the
  step clips with. The hook then all-reduces as DDP's default does.
- One worker with accumulation: the gradient after the step's first micro-batch (b = a
  micro-batch, B = the step).
- ZeRO-1/2 and FSDP over dp alone (FSDP2): a custom reduce-scatter sums the squares of its input,
  the flat gradients of each parameter group as this rank computed them, then reduce-scatters.
Other layouts (FSDP2's replicate, tensor or pipeline parallelism, experts) report none: their
gradients are reduced elsewhere or split over ranks, where a local norm is not one worker's
gradient.

No `from __future__ import annotations` here: DDP checks the comm hook's annotations as objects."""

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel


class SmallBatchNorm:
    """This rank's squared gradient norm at the small batch, for one step. `batches`: (b, B) in
    sequences, or None where the layout gives no small batch (then `take` returns None)."""

    def __init__(self, built, micro_batch: int, accum: int, device: torch.device):
        """`built`: parallel.Built, the model as this rank holds it."""
        self.accum, self.device = accum, device
        self.sq: Optional[torch.Tensor] = None
        self.batches: Optional[tuple[int, int]] = None
        self.micro = False
        dp, ddp, shards = built.dp, _ddp_of(built.modules[0]), _fsdp_modules(built)
        if built.replicated and dp > 1 and ddp is not None:
            ddp.register_comm_hook(self, _squares_then_allreduce)
            self.batches = (micro_batch * accum, micro_batch * accum * dp)
        elif shards and dp > 1:
            for module in shards:
                module.set_custom_reduce_scatter(_SquaresThenReduceScatter(self))
            self.batches = (micro_batch * accum, micro_batch * accum * dp)
        elif built.replicated and dp == 1 and accum > 1:
            self.micro = True
            self.batches = (micro_batch, micro_batch * accum)

    def start(self) -> None:
        """Before a step's first backward."""
        if self.batches is not None:
            self.sq = torch.zeros((), dtype=torch.float32, device=self.device)

    def after_micro(self, micro: int, params) -> None:
        """After micro-batch `micro`'s backward: the first one's gradient (loss / accum), scaled
        back to that micro-batch's mean gradient."""
        if self.micro and micro == 0:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                norms = torch._foreach_norm(grads, 2, dtype=_at_least_fp32(grads[0]))
                self.sq = torch.stack(norms).square().sum() * float(self.accum ** 2)

    def take(self, scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The step's squared norm at batch b, unscaled by fp16's loss `scale` (None: none)."""
        if self.batches is None or self.sq is None:
            return None
        sq, self.sq = self.sq, None
        return sq / scale.float().square() if scale is not None else sq


def _at_least_fp32(t: torch.Tensor) -> torch.dtype:
    """The norm's dtype: fp32 for bf16/fp16/fp32 gradients, float64 for a float64 model (a
    reference run) -- a norm may not narrow its input."""
    return torch.promote_types(t.dtype, torch.float32)


def _ddp_of(module: torch.nn.Module) -> Optional[DistributedDataParallel]:
    """The DDP module under a compiled wrapper, or None."""
    module = getattr(module, "_orig_mod", module)
    return module if isinstance(module, DistributedDataParallel) else None


def _fsdp_modules(built) -> list:
    """The FSDP2 modules whose reduce-scatter input is this rank's whole gradient: zero1, zero2
    and fsdp over dp alone (with tp or pp a rank holds part of the model, with experts edp
    groups reduce them: none)."""
    from torch.distributed.fsdp import FSDPModule

    from raytrain_lm.models import family

    if not built.layout.by_fsdp or built.tp_on or built.pp_on or family(built.cfg.model).experts:
        return []
    return [m for part in built.parts for m in part.modules() if isinstance(m, FSDPModule)]


class _SquaresThenReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, after adding the squares of its input: the flat, padded gradients
    of one parameter group as this rank computed them (in the reduce dtype, fp32 here; FSDP
    divides before the reduce-scatter only for fp16 reductions, which our policy never uses)."""

    def __init__(self, state: "SmallBatchNorm"):
        self.state = state

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.state.sq is not None:
            self.state.sq += torch.linalg.vector_norm(input_tensor, 2, dtype=_at_least_fp32(input_tensor)).square()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _squares_then_allreduce(state: "SmallBatchNorm", bucket: dist.GradBucket
                            ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: add the bucket's local sum of squares (this worker's gradient), then the
    default all-reduce of the mean."""
    buffer = bucket.buffer()
    if state.sq is not None:
        state.sq += torch.linalg.vector_norm(buffer, 2, dtype=_at_least_fp32(buffer)).square()
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(None, bucket)
