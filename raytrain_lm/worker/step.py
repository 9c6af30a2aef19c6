"""The one owner of a run's step: the model as this rank holds it (built by
`parallel.parallelize`), its optimizers, the gradient scaler and the learning rate; the step
(accumulation, autocast, no_sync, the pipeline schedule), clipping, validation, the bytes each
mesh dimension moves and the pipeline's bubble. The loop, Meter and Checkpointer talk to it
through its methods and properties, never to the built layout directly.

Mixed precision, one mechanism per layout (as torchtitan's maybe_enable_amp): where FSDP shards
over dp, its MixedPrecisionPolicy alone (parameters gathered and computed in bf16/fp16,
gradients reduced in fp32) with no autocast around it; everywhere else (DDP, FSDP2's replicate,
tensor and pipeline parallelism without dp sharding, one worker) torch.autocast, which also runs
DTensor ops and pipeline stages (tested on CPU in bf16). fp16 adds a gradient scaler. Where
each rank holds other gradients (zero1, zero2, fsdp, tp) they are DTensors, whose overflow check
DTensor reduces over the mesh dims they are sharded on, so every rank skips the same steps and
keeps one scale (tests/test_zero.py)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn as nn

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.data.tokenizer import bits_per_byte
from raytrain_lm.models import family
from raytrain_lm.parallel import ddp, grad, parallelize, pp
from raytrain_lm.parallel.ep import moe_stats, moe_summary
from raytrain_lm.parallel.mesh import all_reduce
from raytrain_lm.parallel.noise import SmallBatchNorm
from raytrain_lm.parallel.traffic import CommCounter, PipelineTimer, clock_for
from raytrain_lm.worker.optim import build_optimizer

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
        """`layout`: parallelize's `force` and `ddp_wrap` (bench/gpu_check.py), and `init`
        (False where a checkpoint or --init-from fills the model next)."""
        self.cfg, self.device = cfg, device
        dtype = autocast_dtype(cfg, device)
        self.precision = {v: k for k, v in DTYPES.items()}[dtype]  # fp32, bf16 or fp16
        self.model = parallelize(cfg, device, dtype, **layout)  # layout: with `separator`
        self.optimizers = [build_optimizer(part, cfg, device) for part in self.model.parts]
        self.autocast = torch.autocast(device.type, dtype=dtype) \
            if dtype and not self.model.mixed_by_fsdp else nullcontext()
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.timer = PipelineTimer(self.model.schedule, clock_for(device)) \
            if self.model.schedule is not None else None
        self.data_clock = clock_for(device)
        self._data_marks: list[tuple] = []  # around each batches.next() since take_data_wait
        self.comm_bytes: dict[str, int] = {}  # per mesh dim, one step (see _count_comm)
        self.steps = 0
        # the gradient noise scale's small batch (parallel/noise.py); `small_sq`: the last step's
        self.small_batch = SmallBatchNorm(self.model, cfg.batch_size, cfg.grad_accum, device)
        self.small_sq: Optional[torch.Tensor] = None

    # ---------------------------------------------------------------- what others read

    @property
    def parts(self) -> list[nn.Module]:
        """The model's parts as this rank holds them (with `optimizers`: what a checkpoint saves)."""
        return self.model.parts

    @property
    def dp(self) -> int:
        """The data-parallel size: how many ranks read different data."""
        return self.model.dp

    @property
    def replicated(self) -> bool:
        """A whole replica of the model on every rank, trained by DDP (Layout.replicated)."""
        return self.model.replicated

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def take_bubble(self) -> Optional[float]:
        """The share of the pipeline steps since the last call this rank spent idle (None
        without a pipeline)."""
        return self.timer.take() if self.timer is not None else None

    def moe_stats(self) -> Optional[torch.Tensor]:
        """A mixture of experts' statistics since the last call, this rank's, for Meter to sum
        over the ranks in its one gather (parallel/ep.moe_stats; no collective); None for a
        dense model."""
        if family(self.cfg.model).experts is None:
            return None
        m = self.cfg.model
        return moe_stats(self.parts, m.n_layer, m.n_experts, counts_here=self.model.coords.tp == 0)

    def moe_summary(self, summed: torch.Tensor) -> Optional[dict]:
        """aux_loss, z_loss and expert_load from `moe_stats`' tables summed over every rank."""
        return moe_summary(summed, self.cfg.model.n_layer)

    def take_data_wait(self) -> float:
        """Seconds this rank waited for batches since the last call. On CPU, host time in
        `batches.next()`. On CUDA the host runs ahead of the GPU, so its time there overstates
        the wait: this is the GPU's time between events recorded just before and just after
        `batches.next()` (which copies the batch to the device): the time the GPU stood idle for
        the host to hand it a batch, plus the copy; none where the GPU still had queued work
        while the host waited. Read after the step's work is done (Meter.row syncs first)."""
        marks, self._data_marks = self._data_marks, []
        return sum(self.data_clock.seconds(a, b) for a, b in marks)

    def scaler_state(self) -> dict:
        return self.scaler.state_dict()

    def load_scaler_state(self, state: dict) -> None:
        """A saved fp16 scale; without one (or without fp16) the scaler starts fresh."""
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)

    # ---------------------------------------------------------------- a step

    def __call__(self, batches, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's loss of this rank's data-parallel group, 0 on ranks that do not report it;
        the gradient norm before clipping)."""
        self.steps += 1
        with self._count_comm() as counter:
            # Gradients are freed here rather than after the step, so a report sees them as held.
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
                for group, mult in zip(optimizer.param_groups, optimizer.lr_mults):  # muP's (optim.py)
                    group["lr"] = lr * mult
            loss = self._forward_backward(batches)
            grad_norm = self._clip_and_step()
        if counter is not None:
            self.comm_bytes = counter.bytes_per_dim()
        return loss, grad_norm

    @property
    def noise_batches(self) -> Optional[tuple]:
        """(b, B) in sequences of the squared norms `small_sq` and the gradient norm stand for,
        and with expert parallelism over edp > 1 the experts' own small batch (b, B, b_experts);
        None where this layout gives no smaller batch."""
        return self.small_batch.batches

    def _count_comm(self):
        """The bytes each mesh dimension moves, counted on this run's second step (the first
        one sets things up) of a sharded layout; every step moves the same."""
        if self.steps != 2 or self.model.mesh is None:
            return nullcontext()
        return CommCounter(self.model.mesh, self.model.layout.mesh_dims)

    def _forward_backward(self, batches) -> torch.Tensor:
        """Gradients of one step's mean loss over the whole global batch; returns the loss of
        this rank's dp group, or 0 on ranks that do not report it."""
        m = self.model
        accum, total = self.cfg.grad_accum, None
        self.small_batch.start()
        for micro in range(accum):
            start = self.data_clock.mark()
            x, y = batches.next()
            self._data_marks.append((start, self.data_clock.mark()))
            x, y, sequence = m.shard(x, y)  # context parallelism's part, a document mask
            if m.schedule is not None:
                with sequence:
                    loss = self._pipeline_step(x, y)
            else:
                with sequence, ddp.no_sync(m.modules[0], sync=micro == accum - 1,
                                           keep_gathered=m.layout.gathers_once), \
                        self.autocast, m.loss_ctx():
                    # the loss alone: holding the logits (batch x seq x vocab) through the
                    # backward would keep them alive when nothing needs them
                    loss = m.modules[0](x, y)[1]
                    self.scaler.scale(loss / accum).backward()
                loss = _local(loss.detach()) / accum
                self.small_batch.after_micro(micro, m.parts[0].parameters())
            total = loss if total is None else total + loss
        if m.cp_group is not None:  # each cp rank's is the mean of its equal share of tokens
            total = all_reduce(total.clone(), group=m.cp_group) / m.layout.cp
        return total if m.reports_loss else torch.zeros_like(total)

    def _pipeline_step(self, x, y) -> torch.Tensor:
        """One schedule step: the first stage takes the inputs, the last the targets; the
        microbatch losses come back on the last stage."""
        m = self.model
        losses: list[torch.Tensor] = []
        with self.autocast, m.loss_ctx():
            self.timer.measure(lambda: m.schedule.step(*((x,) if m.has_first else ()),
                                                       target=y if m.has_last else None,
                                                       losses=losses, **m.stage_kwargs(x)))
        if not m.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([_local(loss.detach()) for loss in losses]).mean()

    def _clip_and_step(self) -> torch.Tensor:
        """Global gradient-norm clipping, then every optimizer; returns the norm before clipping."""
        m = self.model
        if not m.replicated:
            grad.align_grads_(m.params())
            pp.sync_tied_grads(m.parts, m.tied_group)
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)
        self.small_sq = self.small_batch.take(self.scaler._scale if self.scaler.is_enabled() else None)
        if m.replicated:
            norm = torch.nn.utils.clip_grad_norm_(m.parts[0].parameters(), self.cfg.grad_clip)
        else:
            norm = grad.clip_grad_norm_(m.params(), self.cfg.grad_clip, m.pp_group, m.norm_exclude)
        for optimizer in self.optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()
        return norm

    # ---------------------------------------------------------------- validation

    def evaluate(self, validation) -> tuple[float, float]:
        """(mean loss over the validation windows' targets, all ranks together, in nats per
        token; the same loss in bits per byte of the text those targets stand for:
        tokenizer-independent)."""
        loss_sum, tokens, text_bytes = self._validation_sums(validation)
        val_loss = loss_sum / tokens
        return val_loss, bits_per_byte(val_loss, tokens, text_bytes)

    @torch.no_grad()
    def _validation_sums(self, validation) -> tuple[float, float, float]:
        """(summed token loss in nats, targets, bytes of text those targets stand for) over the
        validation windows, all ranks together. Padding windows (a rank with fewer windows runs
        full batches all the same) carry ignored targets and count for no bytes (Validation).
        Each data-parallel group counts once: its loss-reporting rank adds its sums."""
        m = self.model
        m.train(False)
        # (loss sum, tokens, text bytes)
        total = torch.zeros(3, dtype=torch.float64, device=self.device)
        if m.reports_loss:
            total[2] = float(validation.text_bytes)
        for x, y in validation:
            x, y, sequence = m.shard(x, y)  # a cp rank's tokens: its part of the sums
            tokens = int((y != validation.IGNORE).sum())
            if m.schedule is not None:
                with sequence:
                    loss_sum = self._pipeline_eval(x, y)
            else:
                with sequence, self.autocast, m.loss_ctx():
                    loss = m.modules[0](x, y)[1]
                loss_sum = _local(loss).double() * tokens if tokens else torch.zeros((), dtype=torch.float64)
            if m.sums_loss:
                total[0] += loss_sum.to(total)
                total[1] += tokens
        m.train(True)
        all_reduce(total)
        loss_sum, tokens, text_bytes = total.tolist()
        return loss_sum, tokens, text_bytes

    def _pipeline_eval(self, x, y) -> torch.Tensor:
        m = self.model
        losses: list[torch.Tensor] = []
        with self.autocast, m.loss_ctx(), m.loss_fn.summing():
            m.schedule.eval(*((x,) if m.has_first else ()),
                            target=y if m.has_last else None, losses=losses, **m.stage_kwargs(x))
        if not m.has_last:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([_local(loss).double() for loss in losses]).sum()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss that may be a DTensor (replicated over tp) as a plain tensor."""
    return t.to_local() if hasattr(t, "to_local") else t
