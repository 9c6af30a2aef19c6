"""Tokens/s and MFU of one worker's training step on one GPU, without Ray.

The step is the one `raytrain_lm/worker/loop.py` runs on each worker: this project's GPT, bf16 autocast,
AdamW from raytrain_lm/worker/optim.py (fused on CUDA), the warmup+cosine learning rate, gradient
clipping, zero_grad(set_to_none). Input batches are random tokens (no dataset needed), kept in
pinned host memory and copied with non_blocking=True each step, as the loader does on a GPU.
It imports nothing from Ray (GPU hosts need not have it).

  python bench/gpu_throughput.py --out gpu.json                   # gpt2 (124M), T=1024, bf16
  python bench/gpu_throughput.py --batch-sizes 16,32,64 --modes eager,compile --out gpu.json
  python bench/gpu_throughput.py --smoke --out smoke.json          # tiny model, runs on a CPU

MFU = tokens/s x FLOPs per token / peak FLOP/s, with FLOPs per token from PaLM (appendix B):
6N + 12·L·H·Q·T (N: parameters in matmuls, i.e. all but position embeddings; L layers, H heads,
Q head size, T sequence length). Peak: raytrain_lm/worker/metrics.py's table (dense bf16; H100 SXM and
H200 989 TFLOP/s), or --peak-tflops.

Timing: `--warmup` untimed steps (compilation happens there), then `--steps` timed steps, each
between two CUDA events; the figure is the median step. Memory: peak allocated by torch.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

# GPU hosts run this from a copy of the repository without installing it (the package would pull
# Ray, which they lack): the project's modules come from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from raytrain_lm.config.presets import preset_config  # noqa: E402
from raytrain_lm.errors import UserError  # noqa: E402
from raytrain_lm.models import family, flops_per_token  # noqa: E402
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.gpt.gpt import GPT  # noqa: E402
from raytrain_lm.worker.metrics import gpu_peak_tflops, mfu, peak_memory_gb  # noqa: E402
from raytrain_lm.worker.optim import build_optimizer, lr_at

SMOKE = dict(model=dict(vocab_size=50304, block_size=64, n_layer=2, n_head=2, n_embd=64, bias=False),
             seq_len=64, batch_sizes="2,4", modes="eager", steps=3, warmup=1)
FULL = dict(batch_sizes="8,16,32", modes="eager,compile", steps=30, warmup=10)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--preset", default="gpt2", help="model preset [gpt2]")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence [the preset's]")
    p.add_argument("--batch-sizes", default=None, help="micro-batch sizes to try [8,16,32]")
    p.add_argument("--modes", default=None, help="eager and/or compile [both]")
    p.add_argument("--compile-mode", default="default",
                   help="torch.compile mode: default, max-autotune-no-cudagraphs, max-autotune, ...")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration [30]")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first [10]")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 autocast on CUDA, fp32 on CPU")
    p.add_argument("--sdpa", choices=["auto", "flash", "efficient", "cudnn", "math"], default="auto",
                   help="force one scaled_dot_product_attention kernel [auto: torch picks]")
    p.add_argument("--no-tf32", action="store_true", help="keep fp32 matmuls in full fp32")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the GPU's peak")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, batch 2 and 4, 3 steps, eager: checks the script end to end "
                        "on any machine, CPU included")
    args = p.parse_args(argv)
    defaults = SMOKE if args.smoke else FULL
    for key in ("batch_sizes", "modes", "steps", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    try:
        args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    except ValueError:
        p.error(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}")
    args.modes = args.modes.split(",")
    if any(m not in ("eager", "compile") for m in args.modes):
        p.error(f"--modes takes eager and/or compile, got {','.join(args.modes)}")
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch-sizes and --steps must be positive, --warmup not negative")
    return args


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def setup_device(args) -> torch.device:
    if args.device:
        device = torch.device(args.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but torch sees no GPU")
    if device.type == "cpu" and not args.smoke:
        fail("no CUDA GPU here; pass --smoke for a small CPU check of the script")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # TF32 for whatever stays fp32 (bf16 autocast already covers the big matmuls).
        torch.backends.cuda.matmul.allow_tf32 = not args.no_tf32
        torch.backends.cudnn.allow_tf32 = not args.no_tf32
        torch.set_float32_matmul_precision("highest" if args.no_tf32 else "high")
    return device


def sdpa_context(name: str):
    if name == "auto":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name])


def sdpa_backends(device: torch.device, dtype, head_dim: int) -> dict:
    """Which fused attention kernels accept this shape and dtype here (causal, training)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = {}
    q = torch.randn(1, 2, 128, head_dim, device=device, dtype=dtype or torch.float32, requires_grad=True)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            found[name] = True
        except RuntimeError:
            found[name] = False
    return found


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


class Timer:
    """Per-step timing: CUDA events on a GPU (no host sync inside the loop), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def run_config(cfg, model_cfg: ModelConfig, device, mode: str, batch: int, args) -> dict:
    seq = cfg.seq_len
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    raw = model
    if mode == "compile":
        torch._dynamo.reset()
        model = torch.compile(model, mode=None if args.compile_mode == "default" else args.compile_mode)
    optimizer = build_optimizer(raw, cfg, device)
    amp = {"bf16": torch.bfloat16, "fp32": None}[
        args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")]
    ctx = torch.autocast(device.type, dtype=amp) if amp else nullcontext()
    pin = device.type == "cuda"
    # A few batches of random tokens, cycled: host (pinned) -> device each step, like the loader.
    host = [torch.randint(0, model_cfg.vocab_size, (batch, seq + 1), dtype=torch.int64)
            for _ in range(4)]
    host = [h.pin_memory() if pin else h for h in host]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    timer = Timer(device)
    losses = []
    t_start = time.perf_counter()
    first_step_s = None
    with sdpa_context(args.sdpa):
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                timer.mark()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(i + cfg.warmup_steps, cfg)  # past warmup: a full-size lr
            tokens = host[i % len(host)].to(device, non_blocking=True)
            x, y = tokens[:, :-1], tokens[:, 1:]
            with ctx:
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if i >= args.warmup:
                timer.mark()
            if i == 0:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first_step_s = time.perf_counter() - t_start
    steps = timer.step_seconds()
    med = statistics.median(steps)
    loss_values = [float(v) for v in losses]
    return {
        "mode": mode, "batch_size": batch, "seq_len": seq, "status": "ok",
        "step_seconds_median": med, "step_seconds_min": min(steps), "step_seconds_max": max(steps),
        "tokens_per_second": batch * seq / med,
        "first_step_seconds": first_step_s,
        "peak_mem_gb": peak_memory_gb(device),
        "loss_first": loss_values[0], "loss_last": loss_values[-1],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    device = setup_device(args)
    try:
        cfg = preset_config(args.preset)
    except UserError as e:
        fail(str(e))
    if args.smoke:
        cfg.model = ModelConfig(**SMOKE["model"])
        cfg.seq_len = SMOKE["seq_len"]
    if args.seq_len:
        cfg.seq_len = args.seq_len
    model_cfg = cfg.model
    if model_cfg.vocab_size is None:
        model_cfg.vocab_size = 50304
    if cfg.seq_len > model_cfg.block_size:
        fail(f"--seq-len {cfg.seq_len} exceeds the model's block_size {model_cfg.block_size}")
    probe = GPT(model_cfg)
    n_params, n_matmul = probe.num_params(), family(model_cfg).matmul_params(model_cfg)
    del probe
    fpt = flops_per_token(model_cfg, cfg.seq_len)
    amp_dtype = torch.bfloat16 if device.type == "cuda" and args.precision != "fp32" else None
    peak = gpu_peak_tflops(device, args.peak_tflops, "bf16" if amp_dtype else "fp32")

    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gb=props.total_memory / 2**30, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(),
                    sdpa_kernels_available=sdpa_backends(device, amp_dtype,
                                                         model_cfg.n_embd // model_cfg.n_head))
    else:
        info["cpu"] = cpu_model()
    L, H = model_cfg.n_layer, model_cfg.n_head
    Q, T = model_cfg.n_embd // H, cfg.seq_len
    header = (f"{args.preset if not args.smoke else 'smoke'}: {n_params / 1e6:.1f}M parameters "
              f"({n_matmul / 1e6:.1f}M in matmuls), T={T}, {info.get('gpu', info['device'])}, "
              f"peak {peak or '-'} TFLOP/s; FLOPs/token = 6N + 12·L·H·Q·T = "
              f"6·{n_matmul:,} + 12·{L}·{H}·{Q}·{T} = {fpt / 1e6:.1f} MFLOP")
    print(header, flush=True)
    results = []
    for mode in args.modes:
        for batch in args.batch_sizes:
            try:
                r = run_config(cfg, model_cfg, device, mode, batch, args)
                r["mfu"] = mfu(r["tokens_per_second"], fpt, 1, peak)
            except torch.OutOfMemoryError:
                r = {"mode": mode, "batch_size": batch, "seq_len": cfg.seq_len, "status": "oom"}
            results.append(r)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(row(r), flush=True)

    out = {
        "benchmark": "gpu_throughput", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/gpu_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": info, "preset": "smoke" if args.smoke else args.preset,
        "model": {"num_parameters": n_params, "num_parameters_matmul": n_matmul, "n_layer": L,
                  "n_head": H, "head_dim": Q, "n_embd": model_cfg.n_embd,
                  "vocab_size": model_cfg.vocab_size, "seq_len": T},
        "flops_per_token": fpt,
        "flops_formula": "PaLM appendix B: 6N + 12*L*H*Q*T, N = parameters in matmuls "
                         "(all but position embeddings; tied embedding once)",
        "peak_tflops": peak,
        "settings": {"precision": args.precision, "tf32": not args.no_tf32, "sdpa": args.sdpa,
                     "compile_mode": args.compile_mode, "steps": args.steps, "warmup": args.warmup,
                     "fused_adamw": device.type == "cuda"},
        "results": results,
        "ray_imported": "ray" in sys.modules,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    ok = [r for r in results if r["status"] == "ok"]
    if ok:
        best = max(ok, key=lambda r: r["tokens_per_second"])
        mfu_text = f", MFU {100 * best['mfu']:.1f}%" if best.get("mfu") else ""
        print(f"best: {best['mode']} batch {best['batch_size']}: {best['tokens_per_second']:,.0f} tok/s{mfu_text}")
    print(f"written: {args.out}")


def row(r: dict) -> str:
    if r["status"] != "ok":
        return f"  {r['mode']:8s} batch {r['batch_size']:4d}: {r['status']}"
    mfu_text = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "    -"
    return (f"  {r['mode']:8s} batch {r['batch_size']:4d}: {r['tokens_per_second']:>12,.0f} tok/s  "
            f"step {1e3 * r['step_seconds_median']:8.1f} ms  MFU {mfu_text}  peak mem "
            f"{r['peak_mem_gb']:6.2f} GB  first step {r['first_step_seconds']:.1f} s  "
            f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")


if __name__ == "__main__":
    main()
