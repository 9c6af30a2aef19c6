"""muTransfer on this machine's CPUs (the muP paper's Figure 1): learning-rate sweeps at several
widths at equal depth, sp against mup (base width: the narrowest), the final validation loss
against log2(lr), one curve per width; and ms/step of sp and mup side by side.

Each run: a byte-level GPT (--depth blocks, 4 heads) on the built-in corpus (the Python docs
topics; the last 10% of its bytes held out), the run's own AdamW (worker/optim.py: muP's
per-parameter groups) with warmup and a cosine decay (worker/optim.lr_at), global-norm clipping
at 1, the base width's init std --init-std (model.init_std), the same initial draws and batches
for every run of one --seed. One process, torch on --threads threads. At the base width mup is
sp, so with both params its runs there are run once and serve both curves. --params runs one
curve (sp and mup side by side in two processes), --merge sums up and plots their files.

The step times: at every width, sp and mup alternate in blocks of --time-steps steps, --time-reps
times (same machine noise); the median block of each, and the spread of the blocks.

    PYTHONPATH=. nice -n 10 python bench/mup_transfer.py --params sp --log2-lrs=-11,-10,-9,-8,-7 \
        --steps 300 --init-std 0.1 --no-times --out bench/results/mup_transfer_sp.json --plot ''
    (the same with --params mup --log2-lrs=-10,-9,-8,-7,-6 --out .../mup_transfer_mup.json)
    PYTHONPATH=. python bench/mup_transfer.py --merge bench/results/mup_transfer_sp.json \
        bench/results/mup_transfer_mup.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from mup_coord_check import batch_of, corpus_bytes, model_config, set_lr, train_config  # noqa: E402


def build(width: int, param: str, base: int, lr: float, steps: int, depth: int, seq: int,
          init_std: float = 0.02, seed: int = 0):
    import torch

    from raytrain_lm.models import build_model
    from raytrain_lm.worker.optim import build_optimizer

    m = model_config(width, param, base, depth=depth, seq=seq, init_std=init_std)
    cfg = train_config(m, lr, steps, warmup=max(1, steps // 10), weight_decay=0.1)
    model = build_model(m, seed=seed)
    return model, build_optimizer(model, cfg, torch.device("cpu")), cfg


def train_run(width: int, param: str, base: int, lr: float, steps: int, train, val, depth: int,
              batch: int, seq: int, init_std: float = 0.02, seed: int = 0) -> float:
    """The validation loss (nats/byte) after `steps` steps; `seed` draws the initial weights and
    the batches (seed 0: the batches of the one-seed runs before seeds were added)."""
    import torch

    from raytrain_lm.worker.optim import lr_at

    model, optimizer, cfg = build(width, param, base, lr, steps, depth, seq, init_std, seed)
    g = torch.Generator().manual_seed(1 + 1000 * seed)
    for step in range(steps):
        set_lr(optimizer, lr_at(step, cfg))
        _, loss = model(*batch_of(train, batch, seq, g))
        if not torch.isfinite(loss):
            return float("nan")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    gv = torch.Generator().manual_seed(2)
    with torch.no_grad():
        losses = [model(*batch_of(val, 32, seq, gv))[1].item() for _ in range(8)]
    return sum(losses) / len(losses)


def step_times(width: int, base: int, depth: int, batch: int, seq: int, steps: int, reps: int,
               data) -> dict:
    """ms/step of sp and mup at `width`, alternating blocks; median and spread per param."""
    import torch

    runs = {p: build(width, p, base, 1e-3, 10, depth, seq)[:2] for p in ("sp", "mup")}
    g = torch.Generator().manual_seed(3)
    batches = [batch_of(data, batch, seq, g) for _ in range(steps)]
    blocks = {p: [] for p in runs}
    for rep in range(reps + 1):  # the first block of each warms up, not counted
        for p, (model, optimizer) in runs.items():
            t0 = time.perf_counter()
            for x, y in batches:
                _, loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if rep:
                blocks[p].append(1000 * (time.perf_counter() - t0) / steps)
    return {p: {"median_ms": statistics.median(b), "min_ms": min(b), "max_ms": max(b)}
            for p, b in blocks.items()}


def best(curve: dict) -> tuple[float, float]:
    """(lr, loss) of the lowest finite loss of {lr: loss}."""
    finite = {lr: v for lr, v in curve.items() if math.isfinite(v)}
    lr = min(finite, key=finite.get)
    return lr, finite[lr]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, param in zip(axes, ("sp", "mup")):
        for w in result["widths"]:
            curve = result["loss"][param][str(w)]
            lrs = sorted(float(k) for k in curve)
            ax.plot([math.log2(lr) for lr in lrs], [curve[repr(lr)] for lr in lrs], marker="o",
                    ms=3, label=f"width {w}")
        ax.set_title(f"{param}" + (f" (base width {result['widths'][0]})" if param == "mup" else ""))
        ax.set_xlabel("log2(lr)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final validation loss (nats/byte)")
    axes[1].legend(fontsize=8)
    lo = min(v for p in result["loss"].values() for c in p.values() for v in c.values()
             if math.isfinite(v))
    axes[0].set_ylim(lo - 0.05, lo + 1.0)
    fig.suptitle(f"lr sweeps across widths: depth {result['depth']}, {result['steps']} steps, "
                 f"init std {result.get('init_std', 0.02)} at the base width")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def summarize(result: dict) -> dict:
    """Per param: the best log2(lr) and loss at each width, the shift of the best from the
    narrowest to the widest, and the widest at the narrowest's best lr against its own best."""
    widths, summary = result["widths"], {}
    for param, curves in result["loss"].items():
        if not all(str(w) in curves for w in widths):
            continue
        bests = {w: best({float(k): v for k, v in curves[str(w)].items()}) for w in widths}
        narrow_lr = bests[widths[0]][0]
        wide = curves[str(widths[-1])]
        at = wide.get(repr(narrow_lr), float("nan"))
        summary[param] = {
            "best_log2_lr": {str(w): math.log2(b[0]) for w, b in bests.items()},
            "best_loss": {str(w): b[1] for w, b in bests.items()},
            "shift_log2": math.log2(bests[widths[-1]][0]) - math.log2(narrow_lr),
            "widest_at_narrowest_best": at,
            "widest_gap_pct": 100 * (at / bests[widths[-1]][1] - 1),
        }
    return summary


def merge(paths: list[str]) -> dict:
    """One result of several runs' files (one param each, say, run side by side): their curves
    together, the first file's settings."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    out = dict(results[0])
    out["loss"] = {}
    for r in results:
        for param, curves in r["loss"].items():
            for w, curve in curves.items():
                out["loss"].setdefault(param, {}).setdefault(w, {}).update(curve)
    out["seconds"] = sum(r.get("seconds", 0.0) for r in results)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--log2-lrs", default="-10,-9,-8,-7,-6")
    p.add_argument("--params", default="sp,mup", help="Which curves to run (sp, mup or both).")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--init-std", type=float, default=0.02, help="model.init_std (the base width's).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-steps", type=int, default=5)
    p.add_argument("--time-reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-only", action="store_true", help="Only the step times (no sweeps).")
    p.add_argument("--no-times", action="store_true", help="Only the sweeps (no step times).")
    p.add_argument("--merge", nargs="+", help="Summarize and plot these result files together "
                   "(runs of one param each), nothing run.")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "mup_transfer.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "mup_transfer.png"))
    args = p.parse_args(argv)
    if args.merge:
        result = merge(args.merge)
        result["summary"] = summarize(result)
        Path(args.out).write_text(json.dumps(result, indent=1))
        if args.plot:
            plot(result, Path(args.plot))
        print(json.dumps(result["summary"], indent=1))
        return result
    import torch

    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    lrs = [2.0 ** float(k) for k in args.log2_lrs.split(",")]
    params = args.params.split(",")
    data = corpus_bytes()
    cut = int(0.9 * len(data))
    train, val = data[:cut], data[cut:]
    result = {"widths": widths, "lrs": lrs, "steps": args.steps, "depth": args.depth,
              "batch": args.batch, "seq": args.seq, "init_std": args.init_std, "seed": args.seed,
              "threads": args.threads, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "date": _dt.date.today().isoformat(),
              "loss": {p: {} for p in params}, "ms_per_step": {}}
    t0 = time.time()
    for w in widths:
        if not args.no_times:
            result["ms_per_step"][str(w)] = step_times(w, widths[0], args.depth, args.batch,
                                                       args.seq, args.time_steps, args.time_reps,
                                                       train)
        if args.time_only:
            print(w, result["ms_per_step"][str(w)], flush=True)
            continue
        for param in params:
            curve = {}
            for lr in lrs:
                if param == "mup" and w == widths[0] and "sp" in result["loss"] \
                        and str(w) in result["loss"]["sp"]:  # mup at its base width is sp
                    curve[repr(lr)] = result["loss"]["sp"][str(w)][repr(lr)]
                    continue
                curve[repr(lr)] = train_run(w, param, widths[0], lr, args.steps, train, val,
                                            args.depth, args.batch, args.seq, args.init_std,
                                            args.seed)
                print(f"{param} width {w} log2(lr) {math.log2(lr):+.1f}: {curve[repr(lr)]:.4f} "
                      f"({time.time() - t0:.0f} s)", flush=True)
            result["loss"][param][str(w)] = curve
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))  # each width as it completes
    result["seconds"] = time.time() - t0
    if args.time_only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({k: v for k, v in result.items() if k != "loss"},
                                             indent=1))
        return result
    result["summary"] = summarize(result)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot and len(result["summary"]) == 2:
        plot(result, Path(args.plot))
    print(json.dumps({"summary": result["summary"], "ms_per_step": result["ms_per_step"]}, indent=1))
    return result


if __name__ == "__main__":
    main()
