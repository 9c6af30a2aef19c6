"""Which matmul kernel can fp32 CPU training use? The paths torch offers, measured (issue 31).

Part `mm`: a 2048 x 2048 fp32 `torch.mm` on --threads threads through each path, each path in a
process of its own (the environment variables are read at start-up), alternated for --rounds
rounds: GFLOP/s of the median of --reps calls, and |result - MKL's| / max|MKL's|.

    mkl            torch.mm as shipped (MKL's sgemm)
    mkl-avx512     MKL_ENABLE_INSTRUCTIONS=AVX512
    mkl-cpu-type5  MKL_DEBUG_CPU_TYPE=5 (the old switch that made MKL take AVX2+ paths on AMD)
    mkldnn-ieee    torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    onednn         oneDNN's inner product, torch.ops.mkldnn._linear_pointwise (what inductor
                   calls for frozen linears), on plain tensors
    onednn-avx512  the same with ONEDNN_MAX_CPU_ISA=AVX512_CORE
    inductor       torch.compile of the mm (inductor's CPU backend, default settings)
    inductor-cpp   torch.compile with max_autotune and max_autotune_gemm_backends=CPP (inductor's
                   AVX-512 C++ GEMM template)

Part `model`: the project's training step (TrainStep: forward, backward, clip, AdamW) of the
tiny and small presets (byte vocabulary, fp32, one process) on each model path, alternated in
blocks of --steps steps for --rounds rounds: ms per step (median block), tokens/s, and the
largest difference of any step's loss from the MKL path's (every path starts from the same
weights and sees the same batches, so the losses are comparable step by step).

    mkl        today's step
    mkldnn-ieee  today's step with torch.backends.mkldnn.matmul.fp32_precision = "ieee" (set for
               its blocks only)
    onednn     every nn.Linear through oneDNN's inner product (forward, and the backward's
               dX = dY W and dW = dY^T X as inner products too), a torch.autograd.Function
    inductor   --compile (torch.compile, inductor's CPU backend)

    PYTHONPATH=. python bench/cpu_kernels.py --part mm --out bench/results/cpu_kernels_mm.json
    PYTHONPATH=. python bench/cpu_kernels.py --part model --out bench/results/cpu_kernels_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MM_PATHS = {
    "mkl": {}, "mkl-avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "mkl-cpu-type5": {"MKL_DEBUG_CPU_TYPE": "5"}, "mkldnn-ieee": {},
    "onednn": {}, "onednn-avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "inductor": {}, "inductor-cpp": {},
}
MODEL_PATHS = ("mkl", "mkldnn-ieee", "onednn", "inductor")
N = 2048


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------ oneDNN linear


def onednn_linear_function():
    """y = x W^T + b with oneDNN's inner product in forward and backward."""
    import torch

    ip = torch.ops.mkldnn._linear_pointwise

    class OneDNNLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            x2 = x.reshape(-1, x.shape[-1])
            ctx.save_for_backward(x2, weight)
            ctx.has_bias, ctx.in_shape = bias is not None, x.shape
            return ip(x2, weight, bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])

        @staticmethod
        def backward(ctx, gy):
            x2, weight = ctx.saved_tensors
            gy2 = gy.reshape(-1, gy.shape[-1])
            gx = ip(gy2, weight.t().contiguous(), None, "none", [], "").view(ctx.in_shape)
            gw = ip(gy2.t().contiguous(), x2.t().contiguous(), None, "none", [], "")
            return gx, gw, (gy2.sum(0) if ctx.has_bias else None)

    return OneDNNLinear


def use_onednn_linears(model) -> int:
    """Route every nn.Linear of `model` through OneDNNLinear; returns how many."""
    import torch

    fn, count = onednn_linear_function(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = (lambda x, m=module: fn.apply(x, m.weight, m.bias))
            count += 1
    return count


# ------------------------------------------------------------------ part mm


def mm_child(path: str, reps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(N, N, generator=g), torch.randn(N, N, generator=g)
    ref = torch.mm(a, b)
    compile_s = None
    if path == "mkldnn-ieee":
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    if path.startswith("onednn"):
        bt = b.t().contiguous()
        f = lambda: torch.ops.mkldnn._linear_pointwise(a, bt, None, "none", [], "")  # noqa: E731
    elif path.startswith("inductor"):
        import torch._inductor.config as ic

        if path == "inductor-cpp":
            ic.max_autotune, ic.max_autotune_gemm_backends = True, "CPP"
        compiled = torch.compile(lambda x, y: x @ y)
        t0 = time.perf_counter()
        compiled(a, b)
        compile_s = time.perf_counter() - t0
        f = lambda: compiled(a, b)  # noqa: E731
    else:
        f = lambda: torch.mm(a, b)  # noqa: E731
    out = f()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return {"gflops": 2 * N ** 3 / statistics.median(times) / 1e9, "rel_err": err,
            "compile_s": compile_s, "threads": torch.get_num_threads()}


def part_mm(args) -> dict:
    rounds: dict[str, list[dict]] = {p: [] for p in args.paths}
    for r in range(args.rounds):
        order = args.paths if r % 2 == 0 else args.paths[::-1]
        for path in order:
            env = {**os.environ, **MM_PATHS[path]}
            out = subprocess.run([sys.executable, __file__, "--child-mm", path, "--reps",
                                  str(args.reps), "--threads", str(args.threads)],
                                 capture_output=True, text=True, env=env, timeout=900)
            if out.returncode != 0:
                rounds[path].append({"error": out.stderr.strip().splitlines()[-1][:200]})
            else:
                rounds[path].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(path, rounds[path][-1], flush=True)
    rows = {}
    for path, got in rounds.items():
        ok = [g for g in got if "gflops" in g]
        if not ok:
            rows[path] = {"error": got[0]["error"]}
            continue
        gf = sorted(g["gflops"] for g in ok)
        rows[path] = {"gflops_median": statistics.median(gf), "gflops_min": gf[0],
                      "gflops_max": gf[-1], "rel_err": max(g["rel_err"] for g in ok),
                      "compile_s": ok[0]["compile_s"], "rounds": got}
    base = rows["mkl"]["gflops_median"]
    for row in rows.values():
        if "gflops_median" in row:
            row["over_mkl"] = row["gflops_median"] / base
    return rows


# ------------------------------------------------------------------ part model


class Batches:
    """The same fixed batches, in the same order, for every path."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def next(self):
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b


def build_step(preset: str, path: str):
    """The project's TrainStep for `preset` on `path`, in this process (no Ray: world size 1,
    where Ray's prepare_model would only move the model to the device)."""
    import torch

    import raytrain_lm.parallel.ddp as ddp
    from raytrain_lm.config.presets import preset_config
    from raytrain_lm.worker.step import TrainStep

    ddp.replicate = lambda model, compile, wrap=None: torch.compile(model) if compile else model
    cfg = preset_config(preset)
    cfg.model.vocab_size, cfg.compile = 256, path == "inductor"
    step = TrainStep(cfg, torch.device("cpu"))
    if path == "onednn":
        use_onednn_linears(step.model.parts[0])
    return cfg, step


def part_model(args) -> dict:
    import torch

    from raytrain_lm.worker.optim import lr_at

    torch.set_num_threads(args.threads)
    out = {}
    for preset in args.presets:
        steps_per_block = args.steps if preset == "tiny" else max(1, args.steps // 2)
        built = {p: build_step(preset, p) for p in args.model_paths}
        cfg = built[args.model_paths[0]][0]
        g = torch.Generator().manual_seed(0)
        data = []
        for _ in range(8):
            w = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len + 1), generator=g)
            data.append((w[:, :-1], w[:, 1:]))
        streams = {p: Batches(data) for p in built}
        losses = {p: [] for p in built}
        seconds = {p: [] for p in built}
        warm = {}

        def run(path, n):
            _, step = built[path]
            precision = torch.backends.mkldnn.matmul.fp32_precision
            if path == "mkldnn-ieee":
                torch.backends.mkldnn.matmul.fp32_precision = "ieee"
            try:
                t0 = time.perf_counter()
                for _ in range(n):
                    loss, _ = step(streams[path], lr_at(step.steps, cfg))
                    losses[path].append(float(loss))
                return time.perf_counter() - t0
            finally:
                torch.backends.mkldnn.matmul.fp32_precision = precision

        for path in built:  # the first steps: allocator, AdamW state, compilation
            warm[path] = run(path, 2)
        for r in range(args.rounds):
            for path in (list(built) if r % 2 == 0 else list(built)[::-1]):
                seconds[path].append(run(path, steps_per_block) / steps_per_block)
            print(preset, {p: round(s[-1] * 1e3, 1) for p, s in seconds.items()}, flush=True)
        tokens = cfg.batch_size * cfg.seq_len
        base = statistics.median(seconds["mkl"])
        rows = {}
        for path in built:
            ms = sorted(s * 1e3 for s in seconds[path])
            n = min(len(losses[path]), len(losses["mkl"]))
            diff = max(abs(a - b) for a, b in zip(losses[path][:n], losses["mkl"][:n]))
            rows[path] = {"ms_per_step_median": statistics.median(ms), "ms_min": ms[0],
                          "ms_max": ms[-1], "tokens_per_s": tokens / statistics.median(seconds[path]),
                          "speedup_over_mkl": base / statistics.median(seconds[path]),
                          "max_loss_diff_vs_mkl": diff, "steps_compared": n,
                          "first_two_steps_s": warm[path], "losses": losses[path]}
        out[preset] = {"tokens_per_step": tokens, "steps_per_block": steps_per_block, "rows": rows}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("mm", "model"), default="mm")
    p.add_argument("--paths", nargs="+", default=list(MM_PATHS), choices=list(MM_PATHS))
    p.add_argument("--model-paths", nargs="+", default=list(MODEL_PATHS), choices=MODEL_PATHS)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5, help="mm: calls timed per round.")
    p.add_argument("--steps", type=int, default=4, help="model: steps per block (small: half).")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--child-mm", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_mm:
        print(json.dumps(mm_child(args.child_mm, args.reps, args.threads)))
        return
    import torch

    t0 = time.time()
    rows = part_mm(args) if args.part == "mm" else part_model(args)
    result = {"what": f"cpu_kernels --part {args.part}", "settings": vars(args),
              "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_at_start": os.getloadavg()[0], "wall_s": time.time() - t0, "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.part == "mm":
        for path, row in rows.items():
            print(f"{path:<15}" + (f"{row['gflops_median']:8.1f} GFLOP/s ({row['gflops_min']:.1f}-"
                                   f"{row['gflops_max']:.1f}) x{row['over_mkl']:.2f} err "
                                   f"{row['rel_err']:.1e}" if "gflops_median" in row else row["error"]))
    else:
        for preset, got in rows.items():
            for path, row in got["rows"].items():
                print(f"{preset:<6}{path:<10}{row['ms_per_step_median']:9.1f} ms ({row['ms_min']:.1f}-"
                      f"{row['ms_max']:.1f}) {row['tokens_per_s']:9.0f} tok/s x"
                      f"{row['speedup_over_mkl']:.2f} loss diff {row['max_loss_diff_vs_mkl']:.1e}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
