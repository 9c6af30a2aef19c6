"""What does Ray Train cost per step? The same training run two ways, side by side, on CPU workers.

  (a) torchrun: `torchrun --standalone --nproc_per_node W bench/torchrun_ddp.py` (plain DDP over gloo)
  (b) ray:      `python cli.py train --workers W` (its own local Ray, DDP over gloo via Ray Train)

Same model, data, batch, seeds, step count, log cadence and one torch thread per worker
(Ray sets OMP_NUM_THREADS=1 for a 1-CPU worker; torchrun gets OMP_NUM_THREADS=1). Repetitions
alternate the order (a b, b a, ...) so drift on a shared machine hits both sides alike.

Figures per run, from the rank-0 metrics rows both sides write (metrics.jsonl):
  wall tok/s      tokens / wall time between the end of the warm-up and the last log row. The
                  honest one: it includes everything between steps (for Ray, every report).
  interval tok/s  median of the per-interval `tokens_per_second` (the loop's own figure; it stops
                  the clock before the metrics all-reduce and the report, so it hides their cost).
  data wait       share of step time spent waiting for batches (mean over steady intervals).
  first step      seconds from launching the command to the first training step.

Run it under the shared Ray lock on a shared machine:

    flock /tmp/raytrain-ray.lock python bench/overhead.py --reps 3 --steps 200
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="repetitions of the pair [3]")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run [200]")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="steps left out of the steady state (start-up, first batches) [20]")
    p.add_argument("--data", default=str(ROOT / "data" / "pydoc"),
                   help="prepared dataset; the built-in pydoc corpus is prepared if missing")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    p.add_argument("--only", choices=["torchrun", "ray"], default=None, help="run one side only")
    p.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the Ray side only (its local Ray inherits it), e.g. "
                        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=10; repeatable")
    p.add_argument("--torchrun-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for bench/torchrun_ddp.py (e.g. --torchrun-arg=--static-graph "
                        "to measure a DDP setting with --only torchrun); repeatable")
    p.add_argument("--keep", action="store_true", help="keep the runs' folders (printed)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before giving up")
    args = p.parse_args(argv)
    if args.reps < 1 or args.steps < 1 or args.workers < 1 or args.log_every < 1:
        p.error("--reps, --steps, --workers and --log-every must be positive")
    if any("=" not in kv for kv in args.ray_env):
        p.error("--ray-env takes KEY=VALUE")
    if args.warmup_steps + 2 * args.log_every > args.steps:
        p.error(f"--steps {args.steps} leaves fewer than two log intervals after "
                f"--warmup-steps {args.warmup_steps}; raise --steps")
    return args


def steady_stats(rows: list[dict], warmup_steps: int, t_launch: float) -> dict:
    """Steady-state figures of one run from its rank-0 metrics rows."""
    rows = sorted(rows, key=lambda r: r["step"])
    base = max((r for r in rows if r["step"] <= warmup_steps), key=lambda r: r["step"])
    steady = [r for r in rows if r["step"] > base["step"]]
    last = steady[-1]
    return {
        "wall_tokens_per_second": (last["tokens"] - base["tokens"]) / (last["elapsed"] - base["elapsed"]),
        "interval_tokens_per_second": statistics.median(r["tokens_per_second"] for r in steady),
        "data_wait_frac": statistics.fmean(r["data_wait_frac"] for r in steady),
        "time_to_first_step": rows[0]["train_start_unix"] - t_launch,
        "steady_steps": last["step"] - base["step"],
        "final_loss": last["loss"],
        "val_loss": last.get("val_loss"),
    }


def run_torchrun(args, workdir: Path, rep: int) -> dict:
    out = workdir / f"torchrun-{rep}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.workers}", str(ROOT / "bench" / "torchrun_ddp.py"),
           "--preset", args.preset, "--data", args.data, "--max-steps", str(args.steps),
           "--log-every", str(args.log_every), "--eval-every", str(args.steps),
           "--checkpoint-every", "0", "--out", str(out), *args.torchrun_arg]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # what Ray gives a 1-CPU worker
    return _run(cmd, env, out / "metrics.jsonl", args)


def run_ray(args, workdir: Path, rep: int) -> dict:
    name = f"ray-{rep}"
    cmd = [sys.executable, str(ROOT / "cli.py"), "train", "--workers", str(args.workers),
           "--preset", args.preset, "--data", args.data, "--max-steps", str(args.steps),
           "--log-every", str(args.log_every), "--eval-every", str(args.steps),
           "--checkpoint-every", "0", "--storage", str(workdir), "--name", name, "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    env.update(kv.split("=", 1) for kv in args.ray_env)
    return _run(cmd, env, workdir / name / "metrics.jsonl", args)


def other_raylets() -> int:
    """Raylets already running when a run starts: another Ray on this machine (noise)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                n += b"/raylet" in f.read().split(b"\0")[0]
        except OSError:
            pass
    return n


def _run(cmd, env, metrics_path: Path, args) -> dict:
    busy = {"raylets_running_at_start": other_raylets(), "load_avg_at_start": os.getloadavg()[0]}
    t_launch = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t_launch
    if proc.returncode != 0 or not metrics_path.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"error: run failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return {**steady_stats(rows, args.warmup_steps, t_launch), "wall_seconds": wall, **busy}


def summarise(runs: list[dict]) -> dict:
    def spread(key):
        vals = [r[key] for r in runs]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
                "values": vals}
    keys = ["wall_tokens_per_second", "interval_tokens_per_second", "data_wait_frac",
            "time_to_first_step", "wall_seconds"]
    return {k: spread(k) for k in keys}


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor()) \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    import torch
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "load_avg_at_start": os.getloadavg()}


def table(result: dict) -> str:
    s = result["summary"]
    lines = [f"{'':22s}{'torchrun':>26s}{'ray train':>26s}"]

    def row(label, key, fmt):
        cells = []
        for side in ("torchrun", "ray"):
            if side not in s:
                cells.append(f"{'-':>26s}")
                continue
            d = s[side][key]
            cells.append(f"{fmt(d['median'])} [{fmt(d['min'])}-{fmt(d['max'])}]".rjust(26))
        lines.append(f"{label:22s}" + "".join(cells))

    row("wall tok/s", "wall_tokens_per_second", lambda v: f"{v:,.0f}")
    row("interval tok/s", "interval_tokens_per_second", lambda v: f"{v:,.0f}")
    row("data wait", "data_wait_frac", lambda v: f"{100 * v:.2f}%")
    row("time to first step s", "time_to_first_step", lambda v: f"{v:.1f}")
    row("run wall time s", "wall_seconds", lambda v: f"{v:.1f}")
    if "ratio" in result:
        r = result["ratio"]
        lines.append(f"ray/torchrun wall tok/s: median {r['median']:.3f} over paired reps "
                     f"[{r['min']:.3f}-{r['max']:.3f}]; interval tok/s: "
                     f"{r['interval_median']:.3f}")
    lines.append("cells: median [min-max] over repetitions")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.data = os.path.abspath(args.data)
    if not Path(args.data, "manifest.json").is_file():
        from raytrain_lm.data.prepare import prepare_dataset
        print(f"preparing the pydoc corpus into {args.data} ...", flush=True)
        prepare_dataset("pydoc", args.data)
    sides = [args.only] if args.only else ["torchrun", "ray"]
    runners = {"torchrun": run_torchrun, "ray": run_ray}
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    info = machine()
    workdir = Path(tempfile.mkdtemp(prefix="raytrain-overhead-"))
    per_rep: list[dict] = []
    try:
        for rep in range(args.reps):
            order = sides if rep % 2 == 0 else sides[::-1]  # a b, b a, ...: drift cancels
            runs = {}
            for side in order:
                runs[side] = runners[side](args, workdir, rep)
                r = runs[side]
                print(f"rep {rep + 1}/{args.reps} {side:8s}: wall {r['wall_tokens_per_second']:,.0f} tok/s, "
                      f"interval {r['interval_tokens_per_second']:,.0f} tok/s, data wait "
                      f"{100 * r['data_wait_frac']:.2f}%, first step {r['time_to_first_step']:.1f} s, "
                      f"loss {r['final_loss']:.4f}, load {r['load_avg_at_start']:.1f}"
                      + (f", {r['raylets_running_at_start']} other Ray running" if r['raylets_running_at_start'] else ""),
                      flush=True)
            per_rep.append(runs)
    finally:
        if args.keep:
            print(f"runs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "benchmark": "overhead", "started": started,
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "machine": {**info, "load_avg_at_end": os.getloadavg()},
        "runs": per_rep,
        "summary": {side: summarise([rep[side] for rep in per_rep]) for side in sides},
    }
    if len(sides) == 2:
        ratios = [rep["ray"]["wall_tokens_per_second"] / rep["torchrun"]["wall_tokens_per_second"]
                  for rep in per_rep]
        iratios = [rep["ray"]["interval_tokens_per_second"] / rep["torchrun"]["interval_tokens_per_second"]
                   for rep in per_rep]
        result["ratio"] = {"median": statistics.median(ratios), "min": min(ratios),
                           "max": max(ratios), "values": ratios,
                           "interval_median": statistics.median(iratios)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
