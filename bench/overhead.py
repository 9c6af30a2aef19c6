"""What does Ray Train cost per step? Whole processes timed from outside, at two step counts.

Each arm is run as a user would run it, and only its whole-process wall time is taken:

  textbook  `torchrun ... bench/textbook_ddp.py`: a plain DDP loop of the tutorial kind (the
            project's GPT, random windows of the same shards, AdamW, clipping, a loss all-reduce
            every 10 steps, no reports)
  project   `torchrun ... bench/torchrun_ddp.py`: the project's own loop and data order, no Ray
  ray       `python cli.py train --workers W` on its own local Ray (the product)
  ray[K=V,...]  the product with extra environment (e.g. one of Ray Train's switches turned back
            on), to measure what a setting is worth beside the others in the same run

Per-step time = (T(long) - T(short)) / (long - short): start-up, the final validation and the
end of the run are in both and cancel. Repetitions alternate the order of arms and of step
counts, so drift on a shared machine hits every arm alike; the spread over repetitions is shown.
Nothing else should run on the machine (the load average at each start is recorded).

    flock /tmp/ray.lock python bench/overhead.py --reps 5 --arm textbook --arm project --arm ray
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


def parse_arm(spec: str) -> tuple[str, dict]:
    """'ray[K=V,K2=V2]' -> ('ray', {K: V, K2: V2}); the kind is one of textbook, project, ray."""
    kind, _, rest = spec.partition("[")
    env = {}
    if rest:
        if not rest.endswith("]"):
            raise ValueError(spec)
        for kv in filter(None, rest[:-1].split(",")):
            key, eq, value = kv.partition("=")
            if not eq:
                raise ValueError(spec)
            env[key] = value
    if kind not in ("textbook", "project", "ray") or (env and kind != "ray"):
        raise ValueError(spec)
    return kind, env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5, help="repetitions of every arm [5]")
    p.add_argument("--steps", default="60,300", help="the short and the long step count [60,300]")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--arm", action="append", default=None, metavar="ARM",
                   help="textbook, project, ray or ray[KEY=VALUE,...]; repeatable "
                        "[textbook, project, ray]")
    p.add_argument("--data", default=str(ROOT / "data" / "pydoc"),
                   help="prepared dataset; the built-in pydoc corpus is prepared if missing")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before giving up")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="keep every run's folder (metrics, checkpoint) in DIR [a temporary folder, removed]")
    args = p.parse_args(argv)
    try:
        args.short, args.long = (int(s) for s in args.steps.split(","))
    except ValueError:
        p.error("--steps takes SHORT,LONG, e.g. 60,300")
    if not 0 < args.short < args.long or args.reps < 1 or args.workers < 1:
        p.error("need 0 < SHORT < LONG, --reps >= 1 and --workers >= 1")
    args.arm = args.arm or ["textbook", "project", "ray"]
    for spec in args.arm:
        try:
            parse_arm(spec)
        except ValueError:
            p.error(f"--arm {spec!r}: use textbook, project, ray or ray[KEY=VALUE,...]")
    if len(set(args.arm)) != len(args.arm):
        p.error("each --arm once")
    return args


def command(spec: str, args, steps: int, workdir: Path, tag: str) -> tuple[list[str], dict]:
    kind, extra = parse_arm(spec)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # what Ray gives a 1-CPU worker
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={args.workers}"]
    if kind == "textbook":
        return torchrun + [str(ROOT / "bench" / "textbook_ddp.py"), "--preset", args.preset,
                           "--data", args.data, "--max-steps", str(steps)], env
    if kind == "project":
        return torchrun + [str(ROOT / "bench" / "torchrun_ddp.py"), "--preset", args.preset,
                           "--data", args.data, "--max-steps", str(steps), "--eval-every", str(steps),
                           "--checkpoint-every", "0", "--out", str(workdir / tag)], env
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    env.update(extra)
    return [sys.executable, str(ROOT / "cli.py"), "train", "--workers", str(args.workers),
            "--preset", args.preset, "--data", args.data, "--max-steps", str(steps),
            "--eval-every", str(steps), "--checkpoint-every", "0", "--storage", str(workdir),
            "--name", tag, "--quiet"], env


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


def timed(cmd: list[str], env: dict, timeout: float) -> dict:
    busy = {"raylets_at_start": other_raylets(), "load_avg_at_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:  # recorded; its repetition is left out, the others still count
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = "\n".join(lines[-15:])
        # torchrun's closing report names the failed rank, not its error: the rank's last
        # traceback goes first
        last = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=None)
        cause = "\n".join(lines[last:last + 40]) + "\n" if last is not None else ""
        print(f"run failed (exit {proc.returncode}): {' '.join(cmd)}\n{cause}{tail}", file=sys.stderr)
        return {"error": f"exit {proc.returncode}: {tail.splitlines()[-1] if tail else ''}", **busy}
    return {"wall_seconds": wall, **busy}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor()) \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    import torch
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def complete(per_rep: list[dict], arms: list[str], short: int, long: int) -> list[dict]:
    """The repetitions in which every arm ran both step counts to the end."""
    return [r for r in per_rep
            if all("wall_seconds" in r.get(a, {}).get(n, {}) for a in arms for n in (short, long))]


def summarise(per_rep: list[dict], arms: list[str], short: int, long: int) -> dict:
    """Per-step ms of every arm, and each arm's speed relative to the first arm, per repetition;
    a repetition with a failed run is left out (and counted)."""
    dropped = len(per_rep)
    per_rep = complete(per_rep, arms, short, long)
    if not per_rep:
        raise SystemExit("error: no repetition completed every run (see the failures above)")
    dropped -= len(per_rep)
    step_ms = {a: [1000 * (r[a][long]["wall_seconds"] - r[a][short]["wall_seconds"]) / (long - short)
                   for r in per_rep] for a in arms}
    base = arms[0]
    out = {"per_step_ms": {a: spread(v) for a, v in step_ms.items()},
           "wall_seconds_long": {a: spread([r[a][long]["wall_seconds"] for r in per_rep]) for a in arms},
           "wall_seconds_short": {a: spread([r[a][short]["wall_seconds"] for r in per_rep]) for a in arms},
           "speed_vs_" + base: {a: spread([b / x for b, x in zip(step_ms[base], step_ms[a])])
                                for a in arms[1:]},
           "repetitions": len(per_rep), "repetitions_left_out": dropped}
    return out


def table(summary: dict, arms: list[str]) -> str:
    base = arms[0]
    rel = summary["speed_vs_" + base]
    lines = [f"{'arm':44s}{'ms/step':>22s}{'speed vs ' + base:>30s}"]
    for a in arms:
        s = summary["per_step_ms"][a]
        cell = f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"
        r = rel.get(a)
        rcell = (f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]" if r else "1")
        lines.append(f"{a[:44]:44s}{cell:>22s}{rcell:>30s}")
    lines.append(f"{summary['repetitions']} repetitions"
                 + (f" ({summary['repetitions_left_out']} left out: a run failed)"
                    if summary["repetitions_left_out"] else ""))
    lines.append("cells: median [min-max] over repetitions; ms/step = (T_long - T_short) / "
                 "(long - short) of whole-process wall times")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.data = os.path.abspath(args.data)
    if not Path(args.data, "manifest.json").is_file():
        from raytrain_lm.data.prepare import prepare_dataset
        print(f"preparing the pydoc corpus into {args.data} ...", flush=True)
        prepare_dataset("pydoc", args.data)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    load_at_start = os.getloadavg()
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="raytrain-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    per_rep: list[dict] = []
    try:
        for rep in range(args.reps):
            arms = args.arm if rep % 2 == 0 else args.arm[::-1]  # a b c, c b a, ...: drift cancels
            counts = [args.short, args.long] if rep % 2 == 0 else [args.long, args.short]
            runs: dict = {}
            for i, arm in enumerate(arms):
                for steps in (counts if i % 2 == 0 else counts[::-1]):
                    cmd, env = command(arm, args, steps, workdir, f"r{rep}-{i}-{steps}")
                    r = timed(cmd, env, args.timeout)
                    runs.setdefault(arm, {})[steps] = r
                    took = f"{r['wall_seconds']:7.2f} s" if "wall_seconds" in r else "FAILED"
                    print(f"rep {rep + 1}/{args.reps} {arm:40s} {steps:4d} steps: "
                          f"{took} (load {r['load_avg_at_start']:.2f}"
                          + (f", {r['raylets_at_start']} other raylets" if r["raylets_at_start"] else "")
                          + ")", flush=True)
            per_rep.append(runs)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    summary = summarise(per_rep, args.arm, args.short, args.long)
    result = {
        "benchmark": "overhead", "started": started,
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {**machine(), "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "runs": [{arm: {str(k): v for k, v in r.items()} for arm, r in rep.items()} for rep in per_rep],
        "summary": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(summary, args.arm))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
