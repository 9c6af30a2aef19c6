"""What metric reports cost a fast step: per-step wall time of `cli.py train` at several report
cadences, before and after the loop paced its reports by time (cadence.Cadence).

A report waits while the previous one is still in Ray's queue (one per worker), which the
controller empties when it polls the workers (every 0.5 s here), so reports by step count cap a
fast run at one report per poll. Per-step wall time comes from times at two step counts,
(t(hi) - t(lo)) / (hi - lo), so start-up, the final validation and checkpoint cancel: t is the
whole process's wall time, and also the run's training part (summary.json's wall_seconds less
its time_to_first_step), which leaves out the start-up's run-to-run spread (seconds on a loaded
machine).

Sides: `after`, this tree, and (with --before DIR) `before`, a checkout of the code before a
change (`git archive COMMIT | tar -x -C DIR`, run with PYTHONPATH=DIR). Cases (`--log-every`):
1, 10 and 1000 (1000: almost no report, the step's own cost), and `default` (paced by
--log-seconds). The sides alternate, case by case. Each run starts its own local Ray, so run it
alone:

    flock /tmp/ray.lock python bench/report_cadence.py --cases micro:1,micro:1000

Prints a table and, where micro:1 and micro:1000 both ran, the target of every step's row:
`--log-every 1` <= 1.25 x the no-report step time + 2 ms (this tree). Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODELS = {  # name: train flags
    "micro": ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--batch-size", "2",
              "--seq-len", "32"],
    "small": ["--set", "model.n_layer=2", "--set", "model.n_embd=64", "--batch-size", "4",
              "--seq-len", "64"],
}
# (model, cadence, low steps, high steps): enough steps between the two counts that the
# difference stands well above the run-to-run noise of start-up (a few tenths of a second).
CASES = [
    ("micro", "default", 100, 1100),
    ("small", "default", 100, 600),
    ("micro", "1000", 100, 1100),
    ("small", "1000", 100, 600),
    ("micro", "10", 100, 1100),
    ("micro", "1", 100, 1100),
]


def one_run(tree: Path, data: str, storage: str, model: str, cadence: str, steps: int,
            name: str) -> tuple[float, float]:
    """(whole-process wall seconds, seconds from the first step to the end of the run)."""
    cmd = [sys.executable, "cli.py", "train", "--workers", "2", "--data", data,
           "--max-steps", str(steps), "--eval-every", "100000", "--checkpoint-every", "0",
           "--set", "eval_windows=4", "--storage", storage, "--name", name, *MODELS[model]]
    if cadence != "default":
        cmd += ["--log-every", cadence]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = json.loads((Path(storage) / name / "summary.json").read_text())
    return wall, summary["wall_seconds"] - summary["time_to_first_step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="a checkout of the code before a change [none: "
                   "this tree only]")
    p.add_argument("--data", default=None, help="a prepared dataset [default: the built-in "
                   "corpus, prepared once into a temporary folder]")
    p.add_argument("--cases", default=None, help="comma-separated MODEL:CADENCE to run [all]")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "report_cadence.json"))
    a = p.parse_args()
    sides = {"after": ROOT, **({"before": Path(a.before).resolve()} if a.before else {})}
    wanted = set(a.cases.split(",")) if a.cases else None
    cases = [c for c in CASES if wanted is None or f"{c[0]}:{c[1]}" in wanted]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cadence-bench-") as tmp:
        data = a.data or str(Path(tmp) / "pydoc")
        if a.data is None:
            subprocess.run([sys.executable, "cli.py", "prepare", "--out", data], cwd=ROOT,
                           check=True, capture_output=True)
        for i, (model, cadence, lo, hi) in enumerate(cases):
            order = [s for s in (("before", "after") if i % 2 == 0 else ("after", "before"))
                     if s in sides]
            for side in order:
                times = {n: one_run(sides[side], data, tmp, model, cadence, n,
                                    f"{side}-{model}-{cadence}-{n}") for n in (lo, hi)}
                per_step = [(times[hi][k] - times[lo][k]) / (hi - lo) * 1e3 for k in (0, 1)]
                rows.append({"side": side, "model": model, "cadence": cadence, "steps": [lo, hi],
                             "wall_s": [times[lo][0], times[hi][0]],
                             "train_s": [times[lo][1], times[hi][1]],
                             "per_step_ms_wall": per_step[0], "per_step_ms_train": per_step[1],
                             "loadavg_1m": os.getloadavg()[0]})
                print(f"{model:5} log_every {cadence:>7} {side:6}: {per_step[1]:7.2f} ms/step "
                      f"training ({per_step[0]:7.2f} whole process; training "
                      f"{times[lo][1]:.1f} s at {lo}, {times[hi][1]:.1f} s at {hi})", flush=True)
    print("\nms per step (training part; whole process in brackets)")
    print("model  cadence          before            after")
    for model, cadence, _, _ in cases:
        got = {r["side"]: r for r in rows if r["model"] == model and r["cadence"] == cadence}
        cell = {k: f"{got[k]['per_step_ms_train']:7.2f} ({got[k]['per_step_ms_wall']:7.2f})"
                if k in got else "-" for k in ("before", "after")}
        print(f"{model:6} {cadence:>7}  {cell['before']:>17}  {cell['after']:>17}")
    out = {"machine": os.uname().nodename, "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    target = every_step_target(rows)
    if target:
        out["every_step_target"] = target
        print(f"\n--log-every 1: {target['every_step_ms']:.2f} ms/step against "
              f"{target['no_report_ms']:.2f} without reports; target <= "
              f"{target['limit_ms']:.2f} (1.25x + 2 ms): {'met' if target['met'] else 'NOT met'}")
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")


def every_step_target(rows: list[dict]) -> dict | None:
    """This tree's micro model: a row every step against almost no report (training part)."""
    got = {r["cadence"]: r["per_step_ms_train"] for r in rows
           if r["side"] == "after" and r["model"] == "micro"}
    if "1" not in got or "1000" not in got:
        return None
    limit = 1.25 * got["1000"] + 2.0
    return {"every_step_ms": got["1"], "no_report_ms": got["1000"], "limit_ms": limit,
            "met": got["1"] <= limit}


if __name__ == "__main__":
    main()
