"""The CPU training step against a peer written in nanoGPT's style, `train --workers 1`, and
`train` against nanoGPT's own train.py.

Part `step` (one process, no Ray, fp32, --threads threads): the project's GPT and its TrainStep
(forward, backward, global-norm clip, AdamW) against `RefGPT` + `ref_step` below, a plain PyTorch
GPT-2 written here in nanoGPT's manner: fused q/k/v in GPT-2's [q; k; v] order, SDPA causal
attention, exact GELU, pre-LayerNorm, tied embeddings, an AdamW loop of four lines. Same shapes
(the tiny and small presets, byte vocabulary), same batches. The two alternate in blocks of
--steps steps for --rounds rounds, the side that goes first swapping every round; a 2048^2
`torch.mm` on the same threads, measured between the rounds, is the matmul ceiling. Reported:
ms per step (median block, min-max), GFLOP/s by PaLM's 6N + 12·L·H·Q·T per token
(models.flops_per_token), and that as a share of the ceiling.

Part `threads` (no Ray): the project's tiny step in processes of 1 thread, 2 threads and 2
threads with OMP_WAIT_POLICY=PASSIVE, alternated, --rounds rounds of --steps steps: what two
threads cost when other processes want the cores too (OpenMP's waiting threads spin).

Part `train` (Ray): `python cli.py train --workers 1 --address local` of the tiny preset, timed
as whole processes at two step counts: per step = (time at --long-steps - time at --short-steps)
/ (difference of steps), so start-up, the final validation and checkpoint cancel out. With
--before DIR, the same commands from an older checkout (its PYTHONPATH) alternate with this one.

Part `nanogpt` (bench/peer_nanogpt.py): `train --workers 0`, `--workers 1` on Ray and a torchrun
of `--workers 0` against nanoGPT's unchanged train.py (alone and under torchrun), as whole
commands: ms per step in the steady state and time to the end of the first step.

    PYTHONPATH=. python bench/cpu_peer.py --part step --out bench/results/cpu_peer_step.json
    PYTHONPATH=. python bench/cpu_peer.py --part threads --rounds 4 --steps 10
    flock /tmp/ray.lock env PYTHONPATH=. python bench/cpu_peer.py --part train \\
        --before /work/wt-cpu-old --out bench/results/cpu_peer_train.json
    flock /tmp/ray.lock env PYTHONPATH=. python bench/cpu_peer.py --part nanogpt \\
        --nanogpt NANOGPT_CHECKOUT --rounds 3 --out bench/results/cpu_peer_nanogpt.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cpu_kernels import Batches, build_step, cpu_name  # noqa: E402 (bench/ is on sys.path)

# ------------------------------------------------------------------ the reference (nanoGPT's style)


class RefAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # q, k, v stacked: [q; k; v]
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class RefBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = RefAttention(n_embd, n_head)
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))  # exact GELU


class RefGPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(RefBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # GPT-2's init: N(0, 0.02), residual projections scaled down
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def ref_optimizer(model: nn.Module, lr: float, weight_decay: float, betas) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=lr, betas=betas)


def ref_step(model, optimizer, x, y) -> float:
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# ------------------------------------------------------------------ part step


def project_step(preset: str, gelu: str = "exact"):
    """The project's TrainStep in this process (cpu_kernels.build_step on MKL's path), with the
    GPT's MLP on `gelu`."""
    from raytrain_lm.config import presets

    saved = presets.PRESETS[preset]
    presets.PRESETS[preset] = {**saved, "model": {**saved["model"], "gelu": gelu}}
    try:
        return build_step(preset, "mkl")
    finally:
        presets.PRESETS[preset] = saved


def mm_gflops(reps: int = 5) -> float:
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def part_step(args) -> dict:
    from raytrain_lm.models import flops_per_token
    from raytrain_lm.worker.optim import lr_at

    torch.set_num_threads(args.threads)
    ceilings, out = [], {}
    for preset in args.presets:
        cfg, step = project_step(preset)
        m = cfg.model
        torch.manual_seed(cfg.seed)
        ref = RefGPT(256, m.block_size, m.n_layer, m.n_head, m.n_embd)
        opt = ref_optimizer(ref, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
        g = torch.Generator().manual_seed(0)
        data = []
        for _ in range(8):
            w = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len + 1), generator=g)
            data.append((w[:, :-1], w[:, 1:]))
        stream = Batches(data)
        n = args.steps if preset == "tiny" else max(1, args.steps // 2)

        def ours() -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                loss, _ = step(stream, lr_at(step.steps, cfg))
                loss.item()
            return (time.perf_counter() - t0) / n

        def theirs() -> float:
            t0 = time.perf_counter()
            for i in range(n):
                x, y = data[i % len(data)]
                ref_step(ref, opt, x, y)
            return (time.perf_counter() - t0) / n

        sides = {"project": ours, "nanogpt-style": theirs}
        for f in sides.values():  # warm-up: allocator, AdamW state
            f()
        seconds = {s: [] for s in sides}
        for r in range(args.rounds):
            for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                seconds[side].append(sides[side]())
            ceilings.append(mm_gflops())
            print(preset, {s: round(v[-1] * 1e3, 1) for s, v in seconds.items()},
                  f"mm {ceilings[-1]:.0f} GFLOP/s", flush=True)
        tokens = cfg.batch_size * cfg.seq_len
        fpt = flops_per_token(m, cfg.seq_len)
        rows = {}
        for side, secs in seconds.items():
            ms = sorted(s * 1e3 for s in secs)
            med = statistics.median(secs)
            rows[side] = {"ms_per_step_median": statistics.median(ms), "ms_min": ms[0],
                          "ms_max": ms[-1], "tokens_per_s": tokens / med,
                          "gflops": fpt * tokens / med / 1e9}
        out[preset] = {"tokens_per_step": tokens, "flops_per_token": fpt, "steps_per_block": n,
                       "rows": rows,
                       "project_over_reference": rows["project"]["ms_per_step_median"]
                       / rows["nanogpt-style"]["ms_per_step_median"]}
    ceiling = statistics.median(ceilings)
    for got in out.values():
        for row in got["rows"].values():
            row["share_of_mm_ceiling"] = row["gflops"] / ceiling
    return {"mm_ceiling_gflops_median": ceiling, "mm_ceiling_min": min(ceilings),
            "mm_ceiling_max": max(ceilings), "presets": out}


# ------------------------------------------------------------------ part threads

THREAD_SIDES = {"1 thread": {"OMP_NUM_THREADS": "1"}, "2 threads": {"OMP_NUM_THREADS": "2"},
                "2 threads, OMP_WAIT_POLICY=PASSIVE": {"OMP_NUM_THREADS": "2",
                                                       "OMP_WAIT_POLICY": "PASSIVE"}}


def threads_child(steps: int) -> float:
    """ms per step of the project's tiny TrainStep, on the threads the environment sets."""
    from raytrain_lm.worker.optim import lr_at

    cfg, step = project_step("tiny")
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        w = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len + 1), generator=g)
        data.append((w[:, :-1], w[:, 1:]))
    stream = Batches(data)
    for _ in range(2):
        step(stream, lr_at(step.steps, cfg))
    t0 = time.perf_counter()
    for _ in range(steps):
        step(stream, lr_at(step.steps, cfg))[0].item()
    return (time.perf_counter() - t0) / steps * 1e3


def part_threads(args) -> dict:
    """The tiny step in processes of 1 thread, 2 threads, 2 passive-waiting threads, alternated:
    what two threads cost when other processes want the cores."""
    got: dict[str, list[float]] = {k: [] for k in THREAD_SIDES}
    loads = []
    for r in range(args.rounds):
        for side in (list(THREAD_SIDES) if r % 2 == 0 else list(THREAD_SIDES)[::-1]):
            env = {**os.environ, **THREAD_SIDES[side], "PYTHONPATH": str(ROOT)}
            out = subprocess.run([sys.executable, __file__, "--child-threads", str(args.steps)],
                                 capture_output=True, text=True, env=env, timeout=900)
            got[side].append(float(out.stdout.strip().splitlines()[-1]))
        loads.append(os.getloadavg()[0])
        print(r, {k: round(v[-1]) for k, v in got.items()}, f"load {loads[-1]:.1f}", flush=True)
    return {"loads": loads, "rows": {k: {"ms_per_step_median": statistics.median(v), "ms_min": min(v),
                                         "ms_max": max(v), "ms_by_round": v}
                                     for k, v in got.items()}}


# ------------------------------------------------------------------ part gelu


def part_gelu(args) -> dict:
    """The project's step with the exact GELU and with GPT-2's tanh form, same weights and
    batches, alternated in blocks of --steps steps on --threads threads: wall and CPU ms per
    step (CPU time is what a busy machine changes least)."""
    from raytrain_lm.worker.optim import lr_at

    torch.set_num_threads(args.threads)
    out = {}
    for preset in args.presets:
        steps = {g: project_step(preset, g) for g in ("exact", "tanh")}
        cfg = steps["exact"][0]
        g = torch.Generator().manual_seed(0)
        data = []
        for _ in range(8):
            w = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len + 1), generator=g)
            data.append((w[:, :-1], w[:, 1:]))
        n = args.steps if preset == "tiny" else max(1, args.steps // 2)

        def block(gelu: str) -> tuple[float, float]:
            _, step = steps[gelu]
            stream = Batches(data)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                step(stream, lr_at(step.steps, cfg))[0].item()
            return (time.perf_counter() - t0) / n * 1e3, (time.process_time() - c0) / n * 1e3

        for gelu in steps:  # warm-up
            block(gelu)
        got = {gelu: [] for gelu in steps}
        for r in range(args.rounds):
            for gelu in (("exact", "tanh") if r % 2 == 0 else ("tanh", "exact")):
                got[gelu].append(block(gelu))
            print(preset, {k: [round(x, 1) for x in v[-1]] for k, v in got.items()}, flush=True)
        rows = {k: {"wall_ms_median": statistics.median(w for w, _ in v),
                    "cpu_ms_median": statistics.median(c for _, c in v),
                    "wall_ms_by_round": [w for w, _ in v], "cpu_ms_by_round": [c for _, c in v]}
                for k, v in got.items()}
        out[preset] = {"steps_per_block": n, "rows": rows,
                       "tanh_minus_exact_cpu_ms_by_round": [t[1] - e[1] for e, t in
                                                            zip(got["exact"], got["tanh"])]}
    return out


# ------------------------------------------------------------------ part train


def train_seconds(pythonpath: str, steps: int, workdir: Path, name: str) -> float:
    cmd = [sys.executable, str(Path(pythonpath) / "cli.py"), "train", "--workers", "1",
           "--address", "local", "--preset", "tiny", "--max-steps", str(steps),
           "--eval-every", str(steps), "--checkpoint-every", "0", "--log-every", str(steps),
           "--set", "eval_windows=16", "--data", str(workdir / "data"),
           "--storage", str(workdir / "runs"), "--name", name, "--quiet"]
    env = {**os.environ, "PYTHONPATH": pythonpath}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    return wall


def part_train(args) -> dict:
    from raytrain_lm.data.prepare import prepare_dataset

    workdir = Path(tempfile.mkdtemp(prefix="cpu-peer-"))
    prepare_dataset("pydoc", workdir / "data")
    sides = {"after": str(ROOT)}
    if args.before:
        sides = {"before": args.before, **sides}
    walls: dict[str, dict[int, list[float]]] = {s: {args.short_steps: [], args.long_steps: []}
                                                for s in sides}
    k = 0
    for r in range(args.rounds):
        for steps in (args.short_steps, args.long_steps):
            for side in (list(sides) if (r + (steps == args.long_steps)) % 2 == 0 else list(sides)[::-1]):
                k += 1
                walls[side][steps].append(train_seconds(sides[side], steps, workdir, f"r{k}"))
                print(side, steps, f"{walls[side][steps][-1]:.1f} s", flush=True)
    rows = {}
    d = args.long_steps - args.short_steps
    for side, got in walls.items():
        per_round = [(lng - sht) / d * 1e3 for sht, lng in zip(got[args.short_steps], got[args.long_steps])]
        med = statistics.median(got[args.long_steps]) - statistics.median(got[args.short_steps])
        rows[side] = {"ms_per_step": med / d * 1e3, "ms_per_step_by_round": per_round,
                      "wall_s": got, "tokens_per_s": 16 * 128 / (med / d)}
    return {"steps": [args.short_steps, args.long_steps], "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("step", "threads", "train", "gelu", "nanogpt"), default="step")
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="step: steps per block (small: half).")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--short-steps", type=int, default=10)
    p.add_argument("--long-steps", type=int, default=70)
    p.add_argument("--before", default=None, help="train: an older checkout to compare with.")
    p.add_argument("--nanogpt", default=None, help="nanogpt: a checkout of karpathy/nanoGPT (its "
                   "train.py, model.py, configurator.py are used as they are).")
    p.add_argument("--rows", nargs="+", default=["tiny-1", "small-1", "tiny-ddp2"],
                   help="nanogpt: rows of peer_nanogpt.ROWS.")
    p.add_argument("--extra", nargs="*", default=[], help="nanogpt: extra sides of the one-process "
                   "rows (peer_nanogpt.EXTRA): one suspect of the per-step gap each.")
    p.add_argument("--data", default=str(ROOT / "data" / "pydoc"), help="nanogpt: the prepared dataset.")
    p.add_argument("--out", default=None)
    p.add_argument("--child-threads", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_threads:
        print(threads_child(args.child_threads))
        return
    t0 = time.time()
    load = os.getloadavg()[0]
    from peer_nanogpt import part_nanogpt

    parts = {"step": part_step, "threads": part_threads, "train": part_train, "gelu": part_gelu,
             "nanogpt": part_nanogpt}
    rows = parts[args.part](args)
    result = {"what": f"cpu_peer --part {args.part}", "settings": vars(args),
              "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_at_start": load, "wall_s": time.time() - t0, "result": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
