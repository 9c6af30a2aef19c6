"""Time to the first training step of `python cli.py train`, timed from outside the process.

The clock starts when the command is launched and stops when its first metrics row (step 1,
`--log-every 1`) lands in the run's metrics.jsonl: everything a user waits for is inside. Also
read from that row: when step 1 began (the row's `train_start_unix`). Two situations, alternated:

  cold   no Ray running: `train` starts its own local Ray
  warm   a cluster from `python cli.py cluster local-up` is running: `train` joins it

The dataset is prepared beforehand (preparing the built-in corpus is a one-off, timed apart).

    flock /tmp/ray.lock python bench/first_step.py --reps 3
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 6399  # the warm cluster's port: not Ray's default, so no other local cluster is touched


def first_row(cmd: list[str], metrics: Path, env: dict, timeout: float) -> dict:
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    while not (metrics.is_file() and metrics.read_text().strip()):
        if proc.poll() is not None or time.time() - t0 > timeout:
            out = proc.communicate()[0] if proc.poll() is not None else "(timed out)"
            raise SystemExit(f"error: no metrics row from {' '.join(cmd)}\n{out[-3000:]}")
        time.sleep(0.05)
    t_row = time.time()
    row = json.loads(metrics.read_text().splitlines()[0])
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"error: run failed (exit {proc.returncode})\n{out[-3000:]}")
    return {"first_row_s": t_row - t0, "first_step_begins_s": row["train_start_unix"] - t0,
            "process_s": time.time() - t0, "load_avg_at_start": os.getloadavg()[0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data", default=str(ROOT / "data" / "pydoc"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "first_step.json"))
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    args.data = os.path.abspath(args.data)
    if not Path(args.data, "manifest.json").is_file():
        t0 = time.time()
        subprocess.run([sys.executable, str(ROOT / "cli.py"), "prepare", "--out", args.data], check=True)
        print(f"prepared the built-in corpus in {time.time() - t0:.1f} s (once)")
    storage = Path(tempfile.mkdtemp(prefix="raytrain-first-step-"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cli = [sys.executable, str(ROOT / "cli.py")]
    results: dict[str, list[dict]] = {"cold": [], "warm": []}

    def train(name: str) -> dict:
        cmd = cli + ["train", "--workers", str(args.workers), "--max-steps", "2", "--log-every", "1",
                     "--eval-every", "2", "--checkpoint-every", "0", "--data", args.data,
                     "--storage", str(storage), "--name", name, "--quiet"]
        return first_row(cmd, storage / name / "metrics.jsonl", env, args.timeout)

    for rep in range(args.reps):
        for situation in (("cold", "warm") if rep % 2 == 0 else ("warm", "cold")):
            if situation == "warm":
                # as many logical CPUs as the cold path's own local Ray: workers + 1
                cpus = max(os.cpu_count() or 1, args.workers + 1)
                subprocess.run(cli + ["cluster", "local-up", "--port", str(PORT), "--dashboard-port",
                                      "8299", "--num-cpus", str(cpus)], check=True, env=env,
                               capture_output=True)
                try:
                    r = train(f"warm-{rep}")
                finally:
                    subprocess.run(cli + ["cluster", "local-down", "--port", str(PORT)], env=env,
                                   capture_output=True)
            else:
                r = train(f"cold-{rep}")
            results[situation].append(r)
            print(f"rep {rep + 1}/{args.reps} {situation}: first row {r['first_row_s']:.2f} s, "
                  f"step 1 began {r['first_step_begins_s']:.2f} s, whole run {r['process_s']:.2f} s "
                  f"(load {r['load_avg_at_start']:.2f})", flush=True)

    summary = {s: {k: {"median": statistics.median(x[k] for x in rs), "min": min(x[k] for x in rs),
                       "max": max(x[k] for x in rs)}
                   for k in ("first_row_s", "first_step_begins_s", "process_s")}
               for s, rs in results.items()}
    for s, d in summary.items():
        print(f"{s}: first metrics row {d['first_row_s']['median']:.2f} s "
              f"[{d['first_row_s']['min']:.2f}-{d['first_row_s']['max']:.2f}], step 1 began "
              f"{d['first_step_begins_s']['median']:.2f} s (median of {args.reps})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "first_step", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/first_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cores": os.cpu_count(), "runs": results, "summary": summary}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
