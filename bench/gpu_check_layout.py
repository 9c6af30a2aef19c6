"""One row of bench/gpu_check.py: a layout built and run by the worker's own code on this one
process's device, as a Ray Train worker would run it, without Ray.

`step.TrainStep` builds the layout (`parallel.parallelize`, mesh dims of one rank applied all the
same: `force`) and steps it; the batches come from pinned host memory, copied with
non_blocking=True as the loader does on a GPU (so `take_data_wait` reads CUDA events); a
`metrics.Meter` makes the timed steps' metrics row as the loop does (step time with no sync per
step, tokens/s, MFU, data wait, the pipeline bubble through CUDA events, bytes per mesh dim,
max_memory_allocated); `TrainStep.evaluate` runs a validation with padding rows; sharded layouts
save a checkpoint (`store/checkpoint_format`: DCP) from the device, overwrite every weight and
AdamW state, load it back and compare. A row forced on "ep" (expert parallelism on one rank)
runs every MoE layer's all-to-all dispatch over the one-rank group. Every row starts after a
`gc.collect()` (FSDP and pipeline layouts leave reference cycles: without it their memory
stays allocated into the next rows' peaks) and records what was still allocated
(`held_at_start_gb`). Attention rows (`run_attention`) step the model's own attention module
alone, per attention path, and record which SDPA kernel ran and which fused kernels take the
path. Imports nothing outside torch, numpy and the project's
worker side (`MODULES`: a fast test imports them all with Ray, pyarrow, typer, yaml and
tokenizers unimportable)."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

# Every project module the check imports, here and in the modules these import (gpu_check's
# smoke test compares this with what its processes loaded).
MODULES = ("raytrain_lm.worker.step", "raytrain_lm.worker.metrics", "raytrain_lm.parallel.ddp",
           "raytrain_lm.parallel.fsdp", "raytrain_lm.store.checkpoint_format",
           "raytrain_lm.config.layout", "raytrain_lm.config.presets", "raytrain_lm.plan.estimate",
           "raytrain_lm.plan.hardware", "raytrain_lm.models", "raytrain_lm.models.gpt.gpt",
           "raytrain_lm.models.llama.llama", "raytrain_lm.models.moe.moe", "raytrain_lm.parallel.ep",
           "raytrain_lm.parallel.tp", "raytrain_lm.parallel.init", "raytrain_lm.parallel.cp")

# The model of every row but gpt2's: big enough on a GPU that a step is GPU work, not launches.
MODEL = {"gpu": dict(vocab_size=50304, block_size=512, n_layer=4, n_head=8, n_embd=512),
         "smoke": dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)}
BATCH = {"gpu": (8, 512), "smoke": (4, 32)}  # (sequences, tokens each)
# The attention rows' module: Mistral-like heads (GQA 4:1, head size 128) at a long context,
# the window shorter than it (the masked path); two sequences keep the math kernel's
# (sequences x heads x T x T) scores within a few GB.
ATTENTION = {"gpu": dict(model=dict(n_embd=2048, n_head=16, n_kv_head=4, block_size=4096),
                         batch=(2, 4096), window=1024, iters=10),
             "smoke": dict(model=dict(n_embd=32, n_head=4, n_kv_head=2, block_size=64),
                           batch=(2, 64), window=16, iters=2)}
GPT2_BATCH = {"gpu": (16, 1024), "smoke": (2, 64)}
WARMUP = 2  # untimed: compilation and allocation, then the step that counts bytes (CommCounter)


class PinnedBatches:
    """What the loop's loader hands a step: a batch of pinned host memory moved to the device
    with non_blocking=True at each next(), as Ray's loader does with pin_memory on a GPU."""

    def __init__(self, vocab: int, batch: int, seq: int, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        self.host = tokens.pin_memory() if device.type == "cuda" else tokens
        self.device, self.epoch = device, 0

    def next(self):
        t = self.host.to(self.device, non_blocking=True)
        return t[:, :-1], t[:, 1:]


class RandomValidation:
    """What step.evaluate reads of data/loaders.Validation: two batches, the second with two
    padding rows (ignored targets), and the bytes of text the real targets stand for."""

    IGNORE = -100

    def __init__(self, vocab: int, batch: int, seq: int, device: torch.device):
        g = torch.Generator().manual_seed(1)
        self.batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(2)]
        self.device = device
        self.text_bytes = (2 * batch - 2) * seq  # one byte per real target

    def __iter__(self):
        for i, t in enumerate(self.batches):
            x, y = t[:, :-1].to(self.device), t[:, 1:].clone()
            if i == 1:
                y[-2:] = self.IGNORE
            yield x, y.to(self.device)


def config(kind: str, settings: dict):
    from raytrain_lm.config.presets import preset_config
    from raytrain_lm.config.settings import TrainConfig

    gpt2 = settings.get("model") == "gpt2"
    cfg = preset_config("gpt2") if gpt2 else TrainConfig()
    if not gpt2 or kind == "smoke":  # the smoke's gpt2 row: the small model at gpt2's settings
        for k, v in MODEL[kind].items():
            setattr(cfg.model, k, v)
    cfg.model.vocab_size = cfg.model.vocab_size or 50304
    cfg.batch_size, cfg.seq_len = (GPT2_BATCH if gpt2 else BATCH)[kind]
    cfg.seq_len = min(cfg.seq_len, cfg.model.block_size)
    cfg.lr, cfg.warmup_steps = 3e-4, 0
    for k, v in settings.items():
        if k.startswith("model."):
            setattr(cfg.model, k.split(".", 1)[1], v)
        elif k != "model":
            setattr(cfg, k, v)
    if cfg.model.arch in ("llama", "moe"):
        cfg.model.bias, cfg.model.multiple_of = False, 32
    return cfg


def weights_sums(parts) -> dict[str, float]:
    """Each parameter's sum by its name in the model (wrappers' name parts left out)."""
    from raytrain_lm.parallel.fsdp import local

    sums, seen = {}, set()
    for part in parts:
        for name, p in part.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                sums[name] = float(local(p.detach()).double().sum())
    return sums


def state_sums(step) -> list[float]:
    """Every weight's and AdamW moment's local sum, in a fixed order."""
    from raytrain_lm.parallel.fsdp import local

    out = [float(local(p.detach()).double().sum()) for p in step.model.params()]
    for opt in step.optimizers:
        for state in opt.state.values():
            out += [float(local(v).double().sum()) for k, v in sorted(state.items())
                    if torch.is_tensor(v) and v.dim() > 0]
    return out


def dcp_round_trip(step) -> dict:
    """Save this rank's shards (DCP, from the device), overwrite every weight and AdamW state,
    load them back: the same sums, or not."""
    from raytrain_lm.parallel.fsdp import local
    from raytrain_lm.store.checkpoint_format import load_state, save_checkpoint

    before = state_sums(step)
    with tempfile.TemporaryDirectory(prefix="gpu-check-dcp-") as tmp:
        t0 = time.perf_counter()
        save_checkpoint(Path(tmp), 0, step, {"step": step.steps}, commit=False)
        t1 = time.perf_counter()
        with torch.no_grad():
            for p in step.model.params():
                local(p).fill_(0.5)
            for opt in step.optimizers:
                for state in opt.state.values():
                    for v in state.values():
                        if torch.is_tensor(v) and v.dim() > 0:
                            local(v).fill_(0.5)
        load_state(Path(tmp), step)
        t2 = time.perf_counter()
    after = state_sums(step)
    same = len(before) == len(after) and all(a == b for a, b in zip(before, after))
    return {"dcp": "ok" if same else "differs", "dcp_save_s": t1 - t0, "dcp_load_s": t2 - t1}


def release(device: torch.device) -> None:
    """Free what earlier rows left: their reference cycles first (FSDP's and the pipeline's
    modules hold themselves through hooks and schedules), then the allocator's cache."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated_bytes(device: torch.device) -> int:
    """Bytes of tensors now allocated on `device`: the CUDA allocator's count; on the CPU (which
    keeps no such count) the storages of every live tensor the garbage collector tracks."""
    import gc

    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    seen, total = set(), 0
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device == device and not obj.is_meta:
            t = obj._local_tensor if hasattr(obj, "_local_tensor") else obj
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a wrapper without storage (a fake tensor
                continue  # left alive by a compiled or flex_attention trace holds no memory)
            if ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def run_layout(name: str, settings: dict, force: tuple, kind: str, device: torch.device,
               steps: int) -> dict:
    """The layout's row: what was built, the timed steps' metrics row, validation, DCP (or an
    attention row: `run_attention`)."""
    from torch.nn.parallel import DistributedDataParallel

    from raytrain_lm.models import family, flops_per_token
    from raytrain_lm.parallel.ddp import DDP_KWARGS
    from raytrain_lm.parallel.fsdp import to_float
    from raytrain_lm.worker.metrics import Meter, gpu_peak_tflops, peak_memory_gb
    from raytrain_lm.worker.step import TrainStep

    torch._dynamo.reset()
    release(device)
    if "attention" in settings:
        return run_attention(name, settings, kind, device)
    cfg = config(kind, settings)
    ep = "ep" in force  # the MoE layers' all-to-all over this one rank (no mesh: DDP)
    force = tuple(d for d in force if d != "ep")
    row = {"layout": name, "settings": settings, "force": list(force), "all_to_all": ep,
           "status": "ok", "batch": [cfg.batch_size, cfg.seq_len],
           "held_at_start_gb": allocated_bytes(device) / 1e9}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(cfg.seed)
    cuda = device.type == "cuda"
    # DDP as Ray's prepare_model wraps it (parallel/ddp.py's kwargs), without Ray
    wrap = None if force else (lambda m: DistributedDataParallel(
        m, device_ids=[device] if cuda else None, **DDP_KWARGS))
    baseline = peak_memory_gb(device)
    step = TrainStep(cfg, device, force=frozenset(force), ddp_wrap=wrap)
    if ep:
        import torch.distributed as dist

        from raytrain_lm.parallel.ep import AllToAllDispatch, moe_layers

        for part in step.parts:
            for _, layer in moe_layers(part):
                layer.dispatch = AllToAllDispatch(dist.group.WORLD)
    row.update(precision=step.precision, fsdp_mixed=step.model.mixed_by_fsdp, arch=cfg.model.arch,
               parameters=family(cfg.model).counts(cfg.model).total,
               init_sums=weights_sums(step.parts))
    batches = PinnedBatches(cfg.model.vocab_size, cfg.batch_size, cfg.seq_len, device)
    step.train()
    losses = []
    t0 = time.perf_counter()
    for _ in range(WARMUP):
        loss, norm = step(batches, cfg.lr)
        losses.append(float(loss))
    step.take_data_wait(), step.take_bubble()
    row["first_steps_s"] = time.perf_counter() - t0
    fpt = flops_per_token(cfg.model, cfg.seq_len)
    meter = Meter(device, 1, fpt, gpu_peak_tflops(device, None, step.precision),
                  row["parameters"], baseline)
    for _ in range(steps):
        loss, norm = step(batches, cfg.lr)
        meter.add_step(loss, cfg.batch_size * cfg.seq_len * cfg.grad_accum)
    metrics = meter.row(WARMUP + steps, cfg.lr, to_float(norm), step)
    losses += metrics["step_losses"]
    row.update({k: metrics[k] for k in ("step_time", "tokens_per_second", "mfu", "data_wait_frac",
                                        "bubble", "comm_bytes", "peak_mem_gb", "grad_norm")})
    row.update(loss_first=losses[0], loss_last=losses[-1],
               scale=step.scaler.get_scale() if step.scaler.is_enabled() else None)
    if "pp" in force and cfg.pp == 1 and cfg.pp_schedule == "interleaved-1f1b":
        # Both stages on this one rank hand activations over locally, and torch's eval runs the
        # schedule's backward hand-offs too (an AssertionError); a real run puts neighbouring
        # stages on different ranks (tests/test_virtual_stages.py validates there).
        row["val_loss"] = row["val_bpb"] = None
    else:
        row["val_loss"], row["val_bpb"] = step.evaluate(
            RandomValidation(cfg.model.vocab_size, cfg.batch_size, cfg.seq_len, device))
    if step.model.mesh is not None:  # a sharded layout: its checkpoint's round trip
        row.update(dcp_round_trip(step))
    row["status"] = verdict(row, losses)
    return row


# SDPA's kernels by the op each dispatches to (the math kernel is none of these: plain ops)
KERNEL_OPS = (("flash", "flash"), ("efficient", "efficient"), ("cudnn", "cudnn"), ("flex", "flex"))


def run_attention(name: str, settings: dict, kind: str, device: torch.device) -> dict:
    """An attention row: the model's own attention module (a one-block Llama's, the path of
    settings["attention"]: causal, a sliding window shorter than the sequence, documents: a
    packed window of two documents under --doc-mask's span, or cp-chunks: the window in --cp 2's
    gathered chunk order masked by place; a span's path and the sliding window's (no span: the
    plain forward past the window) take flex_attention's block mask on a GPU,
    models/attention.py, and are compared with the dense mask's: `against_dense`), forward
    and backward on random activations in bf16 on a GPU (fp32 on the CPU): which SDPA
    kernel ran (the op it dispatched to), which fused kernels take this path (each tried alone
    under sdpa_kernel), the milliseconds of one forward and backward, the peak memory."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    from raytrain_lm.models import attention as spans
    from raytrain_lm.models import build_model
    from raytrain_lm.models.family import ModelConfig

    spec, path = ATTENTION[kind], settings["attention"]
    B, T = spec["batch"]
    m = ModelConfig(arch="llama", bias=False, vocab_size=256, n_layer=1, multiple_of=32,
                    sliding_window=spec["window"] if path == "sliding-window" else None, **spec["model"])
    row = {"layout": name, "settings": settings, "force": [], "attention": path, "batch": [B, T],
           "held_at_start_gb": allocated_bytes(device) / 1e9}
    with torch.device(device):
        attention = next(mod for mod in build_model(m, seed=0).modules()
                         if type(mod).__name__ == "Attention")
    span = None
    if path == "documents":  # two documents a row, as --doc-mask installs them
        docs = (torch.arange(T, device=device) >= T // 2).long().expand(B, T)
        span = spans.Span(index=torch.arange(T, device=device), positions=spans.document_positions(docs),
                          docs=docs)
    elif path == "cp-chunks":  # the window in --cp 2's gathered order (chunks 0 3 1 2), masked by place
        from raytrain_lm.parallel.cp import chunk_index

        order = torch.cat([chunk_index(T, 2, r) for r in range(2)]).to(device)
        span = spans.Span(index=order, positions=order)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(B, T, m.n_embd, device=device, dtype=dtype, requires_grad=True)
    attention.to(dtype)

    def step():
        x.grad = None  # (a refused kernel may have stopped the step before this)
        attention.zero_grad(set_to_none=True)
        with spans.using(span):
            out = attention(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        return out.detach()

    ops = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.__name__ or "flex" in func.__name__:
                ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Seen():
        step()
    row["sdpa_ops"] = sorted(set(ops))
    row["kernel"] = next((k for k, word in KERNEL_OPS if any(word in op for op in ops)), "math")
    row["fused_kernels"] = []
    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                           ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                step()
            row["fused_kernels"].append(label)
        except RuntimeError:  # "No available kernel": this backend refuses the path
            pass
    release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(WARMUP):
        step()
    times = timed(step, spec["iters"], device)
    row.update(step_time=times[len(times) // 2], step_time_min=times[0], step_time_max=times[-1],
               peak_mem_gb=torch.cuda.max_memory_allocated(device) / 1e9
               if device.type == "cuda" else None, precision=str(dtype).replace("torch.", ""),
               status="ok")
    if span is not None or path == "sliding-window":  # flex_attention's paths on a GPU
        row.update(against_dense(step, spans, spec["iters"], device))
    return row


def timed(step, iters: int, device: torch.device) -> list[float]:
    """Seconds of each of `iters` calls of `step` (the GPU synchronized around each), sorted."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)


def against_dense(step, spans, iters: int, device: torch.device) -> dict:
    """A masked path (a span's, or the plain sliding window's, whose span is
    attention.window_span) against the same mask materialised for SDPA, what the CPU runs
    (models/attention.dense_mask; on a GPU the masked path is flex_attention's block mask): the
    largest difference of the outputs, and the dense path's kernel, time and peak memory: what
    the fused path saves."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    masked = step()
    fused = spans._flex

    def dense(q, k, v, span, window, gqa, scale=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=spans.dense_mask(span, window, q.device, q.dtype),
                                              enable_gqa=gqa, scale=scale)

    ops = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.__name__:
                ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    spans._flex = dense
    try:
        with Seen():
            reference = step()
        release(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = timed(step, iters, device)
    finally:
        spans._flex = fused
    return {"dense_max_diff": (masked.float() - reference.float()).abs().max().item(),
            "dense_kernel": next((k for k, word in KERNEL_OPS if any(word in op for op in ops)), "math"),
            "dense_step_time": times[len(times) // 2],
            "dense_peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None}


def verdict(row: dict, losses: list[float]) -> str:
    if not all(math.isfinite(x) for x in losses):
        return "non-finite loss"
    if not losses[-1] < losses[0]:  # (fp16: the scaler may skip a first step)
        return "loss did not fall"
    if row["val_loss"] is not None and not math.isfinite(row["val_loss"]):
        return "non-finite validation loss"
    if row.get("dcp", "ok") != "ok":
        return "checkpoint round trip differs"
    return "ok"
