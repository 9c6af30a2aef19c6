"""Throughput, MFU, memory and a loss gone non-finite: what a worker measures about its own
steps."""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Optional

import torch

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.parallel.fsdp import held_bytes, param_fraction, to_float
from raytrain_lm.parallel.mesh import all_gather_rows, all_reduce
from raytrain_lm.plan.fit import check_memory
from raytrain_lm.plan.gpus import kind_of_device, peak_tflops
from raytrain_lm.plan.noise_scale import NoiseScale, two_batch_estimates
from raytrain_lm.store.row import MetricsRow


def check_device_memory(cfg: TrainConfig, device: torch.device, force: bool) -> None:
    """On a GPU worker, before anything is built: plan.fit.check_memory against the memory the
    device reports (the driver knows only what Ray's label implies, often nothing), on the GPU
    kind its name is, unless --force."""
    if force or device.type != "cuda":
        return
    check_memory(cfg, torch.cuda.get_device_properties(device).total_memory / 2 ** 30,
                 kind_of_device(torch.cuda.get_device_name(device)))


def gpu_peak_tflops(device: torch.device, override: Optional[float] = None,
                    precision: str = "bf16") -> Optional[float]:
    """The peak used for MFU: `override`, else the dense peak of this GPU's kind (gpu_kinds.json) in
    the run's `precision` (fp32: TF32 where the GPU has it), else None (no MFU)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device), precision)


def mfu(tokens_per_second: float, flops_per_token: float, num_devices: int,
        peak_tflops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak."""
    if not peak_tflops:
        return None
    return tokens_per_second * flops_per_token / (num_devices * peak_tflops * 1e12)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory on CUDA; peak resident set size of this process on CPU. GB = 1e9
    bytes throughout, as in `plan`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


def reserved_memory_gb(device: torch.device) -> Optional[float]:
    """Peak memory PyTorch's CUDA caching allocator reserved (allocated plus its cached free
    blocks); None on CPU. nvidia-smi shows more still: the CUDA context, NCCL's buffers and
    libraries' workspaces sit outside the allocator."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 1e9
    return None


class StepTimer:
    """Accumulates wall time, steps and tokens between two log points."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self, excluded: float = 0.0) -> None:
        """Start a new interval at the last log point: the cost of logging and reporting (a
        barrier) counts against the next interval; `excluded` seconds (eval, checkpoint) do not."""
        self._sync()
        now = time.perf_counter()
        self.start = getattr(self, "mark", now) + excluded
        self.mark = now
        self.tokens = 0
        self.steps = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def elapsed(self) -> float:
        """Seconds since the interval started; marks now as the end of the interval."""
        self._sync()
        self.mark = time.perf_counter()
        return self.mark - self.start


class Meter:
    """What a rank measures between two rows (losses, tokens, time; the step's wait for data),
    turned into metrics rows: kept as this rank measured them, then made global on every rank
    by one small all-gather for all the rows of a report."""

    def __init__(self, device: torch.device, world: int, flops_per_token: float,
                 peak_tflops: Optional[float], num_parameters: int, baseline_mem: float,
                 build_mem: float = 0.0, loss_ranks: Optional[int] = None,
                 scaler_skips: bool = False, noise_batches: Optional[tuple] = None):
        """`loss_ranks`: how many ranks report a loss (one per data-parallel group; the others
        add 0), so the sum over all ranks divided by it is the global mean. `scaler_skips`: fp16's
        gradient scaler skips a step whose gradients overflow, so a non-finite gradient norm is
        its business, not an error (a non-finite loss still is). `noise_batches`: (b, B), the
        batch sizes of each step's small-batch squared norm (`add_step`'s `small_sq`) and of its
        gradient norm, for the gradient noise scale, and the experts' small batch where they
        have their own (b, B, b_experts); None: no noise scale. `small_sq`: (this rank's part
        of the squared norm at b, its part of the excluded parameters' squared norm in the
        step's gradient, its part of the experts' squared norm at b_experts and in the step's
        gradient), parallel/noise.SmallBatchNorm.take."""
        self.device, self.world, self.loss_ranks = device, world, loss_ranks or world
        self.fpt, self.peak, self.num_parameters = flops_per_token, peak_tflops, num_parameters
        self.baseline_mem = baseline_mem  # peak memory before the model existed
        self.build_mem = build_mem  # what building the model added (before any step)
        self.timer = StepTimer(device)
        self.losses: list[torch.Tensor] = []  # this rank's loss of each step since the last report
        self.norms: list[torch.Tensor] = []  # the global gradient norm of each step, the same
        self.scaler_skips = scaler_skips
        # "loss became nan at step N": the first step since the last report whose loss or gradient
        # norm is not finite (the same on every rank: read off the report's all-reduce), else None
        self.nonfinite: Optional[str] = None
        self.start, self.start_unix = time.perf_counter(), time.time()
        self.first_step_unix: Optional[float] = None  # when this worker group's first step ended
        self._row_done = 0.0
        self.slowest_step_time = 0.0  # seconds per step of the last reported interval, max over ranks
        self.kept: list = []  # this rank's rows since the last `rows` (keep)
        # each kept row's mixture-of-experts statistics (None: dense) and what reads them summed
        self.kept_moe: list = []
        self.first_bad: Optional[int] = None  # the index in `rows`' answer of nonfinite's row
        self.noise_batches, self.noise = noise_batches, NoiseScale()
        self.small: list[torch.Tensor] = []  # each step's small-batch squared norm (noise scale)

    def add_step(self, loss: torch.Tensor, tokens: int,
                 grad_norm: Optional[torch.Tensor] = None,
                 small_sq: Optional[torch.Tensor] = None) -> None:
        """Keeps the step's loss and gradient norm as device tensors: nothing is read on the host
        until the row (no per-step synchronisation)."""
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
        self.losses.append(loss)
        self.norms.append(grad_norm if grad_norm is not None else torch.zeros((), device=loss.device))
        if self.noise_batches is not None:
            self.small.append(small_sq if small_sq is not None else torch.zeros(4, device=loss.device))
        self.timer.steps += 1
        self.timer.tokens += tokens

    def keep(self, step: int, lr: float, grad_norm, step_fn, **fields) -> None:
        """The interval's row as this rank measured it, kept until `rows` makes the kept rows
        global together: no collective here, so a row every step does not stop every rank at
        every step. `grad_norm`: the last step's (a tensor, read in `rows`); `fields`: added to
        the row as they are. `step_fn`: the step (step.TrainStep): its parts and optimizers
        (memory held), the time it waited for data, the pipeline's bubble and the bytes each
        mesh dimension moved."""
        elapsed = self.timer.elapsed()  # (a sync on CUDA: the events below are complete)
        norms = torch.stack([_plain(g) for g in self.norms]).to(torch.float64)
        mine = torch.cat([torch.stack(self.losses).double().reshape(-1),
                          (~torch.isfinite(norms)).double().reshape(-1), torch.tensor(
            [step_fn.take_data_wait(), peak_memory_gb(self.device),
             held_bytes(step_fn.parts, step_fn.optimizers) / 1e9,
             peak_memory_gb(self.device) - self.baseline_mem, self.build_mem,
             elapsed / self.timer.steps, reserved_memory_gb(self.device) or 0.0],
            dtype=torch.float64, device=self.device),
            # the noise scale's small-batch squared norms, one per step (none without it)
            torch.stack(self.small).double().reshape(-1) if self.small else norms[:0]])
        tps = self.timer.tokens / elapsed
        row: MetricsRow = {
            "step": step,
            "lr": lr,
            "tokens_per_second": tps,
            "step_time": elapsed / self.timer.steps,
            "mfu": mfu(tps, self.fpt, self.world, self.peak),
            "param_fraction": param_fraction(step_fn.parts, self.num_parameters),  # on rank 0
            "bubble": step_fn.take_bubble(),  # pipeline idle share (rank 0's), None without pp
            "comm_bytes": dict(step_fn.comm_bytes),  # rank 0's bytes sent per step, per mesh dim
            "elapsed": time.perf_counter() - self.start,
            "train_start_unix": self.start_unix,
            "first_step_unix": self.first_step_unix,
            "num_parameters": self.num_parameters,
            **fields,
        }
        self.kept.append((row, mine, norms, grad_norm, elapsed))
        self.kept_moe.append((step_fn.moe_stats(), step_fn.moe_summary))
        self._row_done = time.perf_counter()

    def rows(self) -> list[MetricsRow]:
        """The kept rows, global on every rank, in order; one all-gather for all of them. Summed
        over the ranks: each step's loss (the loss-reporting ranks'), whether any rank saw its
        gradient norm non-finite (so every rank decides the same), the data waits; the memory
        and the step time: their maximum. Sets `nonfinite` (None when every step is finite) and
        `first_bad` (the index of the first row with such a step), and `slowest_step_time` (the
        last row's)."""
        kept, self.kept = self.kept, []
        moe, self.kept_moe = self.kept_moe, []
        self.nonfinite, self.first_bad = None, None
        # a mixture of experts' statistics ride in the same gather, after every row's own part
        every = all_gather_rows(torch.cat([mine for _, mine, *_ in kept] +
                                          [stats for stats, _ in moe if stats is not None]))
        out, at = [], 0
        moe_at = sum(mine.numel() for _, mine, *_ in kept)
        for i, (row, mine, norms, grad_norm, elapsed) in enumerate(kept):
            stats, summary = moe[i]
            if stats is not None:  # aux_loss, z_loss, expert_load: summed over every rank
                row.update(summary(every[:, moe_at:moe_at + stats.numel()].sum(0)) or {})
                moe_at += stats.numel()
            part, at = every[:, at:at + mine.numel()], at + mine.numel()
            n = len(norms)
            sums = part[:, :2 * n + 1].sum(0)
            losses, bad, wait = sums[:n] / self.loss_ranks, sums[n:2 * n], sums[2 * n]
            mem = part[:, 2 * n + 1:2 * n + 7].max(0).values
            self._noise_fields(row, part[:, 2 * n + 7:].sum(0).reshape(-1, 4), norms)
            why = first_nonfinite(row["step"] - n + 1, losses.tolist(),
                                  [] if self.scaler_skips else norms.tolist(),
                                  [] if self.scaler_skips else (bad > 0).tolist())
            if why and not self.nonfinite:
                self.nonfinite, self.first_bad = why, i
            # The slowest rank's step time: identical on every rank after the all-gather, so
            # the loop's time-paced cadence (cadence.Cadence) agrees everywhere.
            self.slowest_step_time = mem[4].item()
            row.update({
                "loss": losses.mean().item(),
                "step_losses": losses.tolist(),  # per-step global losses, for exact-resume checks
                "grad_norm": to_float(grad_norm),
                "data_wait_frac": wait.item() / self.world / elapsed,
                "peak_mem_gb": mem[0].item(),
                # what the allocator holds (allocated + cached); None on CPU
                "peak_mem_reserved_gb": mem[5].item() if self.device.type == "cuda" else None,
                "model_state_gb": mem[1].item(),  # params + grads + optimizer states, max over ranks
                "mem_above_baseline_gb": mem[2].item(),  # max over ranks of what the run added
                "build_mem_gb": mem[3].item(),  # max over ranks of what building the model added
            })
            out.append(row)
        return out

    def row(self, step: int, lr: float, grad_norm, step_fn, **fields) -> MetricsRow:
        """`keep` then `rows`: the interval's global row at once (with any rows kept before it
        made global too, and dropped)."""
        self.keep(step, lr, grad_norm, step_fn, **fields)
        return self.rows()[-1]

    def _noise_fields(self, row: MetricsRow, sums: torch.Tensor, norms: torch.Tensor) -> None:
        """The gradient noise scale after the row's steps (plan/noise_scale.py). `sums`: per
        step, summed over every rank, the small-batch squared norms (parallel/noise.py: each rank
        its weighted part, so the sum is over the dp ranks' whole gradients), the excluded
        parameters' part of the squared global norm, and the experts' small-batch squared norms
        (over the ep groups' gradients) and their part of the squared global norm. Each step's
        mean over the dp ranks against the squared global norm less the excluded and the
        experts' parts, and where the experts have their own small batch the estimates of their
        mean over the ep groups against their part added (the estimators are linear in the
        squared norms: a sum over parameter sets of each set's); steps whose norm is not finite
        (fp16's skipped steps) left out."""
        if self.noise_batches is None or not sums.numel():
            return
        b, big_b = self.noise_batches[:2]
        for (small, excluded, small_e, big_e), norm in zip(sums.tolist(), norms.tolist()):
            if not (math.isfinite(small) and math.isfinite(small_e) and math.isfinite(norm)):
                continue
            g2, trace = two_batch_estimates(small / self.loss_ranks, norm * norm - excluded - big_e,
                                            b, big_b)
            if len(self.noise_batches) > 2:
                b_e = self.noise_batches[2]  # ep x b: the mean over edp = dp x b / b_e groups
                more = two_batch_estimates(small_e * b_e / (self.loss_ranks * b), big_e, b_e, big_b)
                g2, trace = g2 + more[0], trace + more[1]
            self.noise.add(g2, trace)
        row.update(noise_scale=self.noise.b_simple, noise_grad_sq=self.noise.grad_sq,
                   noise_trace=self.noise.trace_sigma)

    def replica_spread(self, model: torch.nn.Module) -> float:
        """Max minus min over ranks of a float64 checksum of this rank's parameters: 0.0 exactly
        when every data-parallel replica holds the same weights (DDP's promise)."""
        total = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
        hi_lo = all_reduce(torch.stack([total, -total]), op="max")
        return (hi_lo[0] + hi_lo[1]).item()

    def next_interval(self, exclude_since_row: bool) -> None:
        """Start the next interval. The cost of reporting (a barrier) counts against it; with
        `exclude_since_row`, validation and checkpoint time since the row was built does not."""
        self.losses, self.norms, self.small = [], [], []
        self.timer.reset(excluded=time.perf_counter() - self._row_done if exclude_since_row else 0.0)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim norm that may be a replicated DTensor as a plain tensor (no communication)."""
    return t.to_local() if hasattr(t, "to_local") else t


def first_nonfinite(first_step: int, losses: list[float], norms: list[float],
                    norm_flags: list[bool]) -> Optional[str]:
    """"loss became nan at step N" (or "the gradient norm became inf ...") for the first of the
    steps `first_step`, `first_step` + 1, ... whose global loss, or gradient norm on any rank
    (`norm_flags`; `norms`: this rank's values, for the word), is not finite; None when all are.
    The loss is named first where both are."""
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return f"loss became {loss} at step {first_step + i}"
        if i < len(norm_flags) and norm_flags[i]:
            word = norms[i] if not math.isfinite(norms[i]) else "non-finite"
            return f"the gradient norm became {word} at step {first_step + i}"
    return None
