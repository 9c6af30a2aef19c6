"""What does reporting every step cost `lr-find`? The same LR range test, reports every step vs
every 10 steps (the default), alternating order each repetition.

Each run is `python cli.py lr-find` in a fresh process with its own local Ray; the only change is
`raytrain_lm.tune.lr_find.REPORT_EVERY`, set before the CLI runs. Both sides compute the same steps,
so their suggested lr must agree (checked). It starts its own local Ray, so run it alone:

    flock /tmp/raytrain-ray.lock python bench/lr_find_reports.py --reps 2 --steps 100
    flock /tmp/raytrain-ray.lock python bench/lr_find_reports.py --reps 2 --steps 100 \
        --set batch_size=8 --set seq_len=64 --out bench/results/lr_find_reports_small_batch.json

Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUN = """
import sys
import raytrain_lm.tune.lr_find
raytrain_lm.tune.lr_find.REPORT_EVERY = {every}
sys.argv = ["cli.py", "lr-find", *{args!r}]
from raytrain_lm.cli import main
main()
"""


def one_run(every: int, steps: int, storage: str, name: str, sets: list[str]) -> dict:
    args = ["--steps", str(steps), "--workers", "2", "--storage", storage, "--name", name,
            "--json", *[x for s in sets for x in ("--set", s)]]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", RUN.format(every=every, args=args)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    found = json.loads(out.stdout)
    saved = json.loads((Path(storage) / name / "lr_find.json").read_text())
    summary = json.loads((Path(storage) / name / "summary.json").read_text())
    return {"report_every": every, "wall_s": wall, "suggested_lr": found["suggested_lr"],
            "points": len(saved["lrs"]), "time_to_first_step_s": summary["time_to_first_step"],
            "train_s": summary["wall_seconds"] - summary["time_to_first_step"],
            "loadavg_1m_at_start": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--set", dest="sets", action="append", default=[],
                   help="passed to lr-find, e.g. batch_size=8 (smaller steps: reports cost more)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "lr_find_reports.json"))
    a = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="lrf-bench-") as storage:
        for rep in range(a.reps):
            order = (1, 10) if rep % 2 == 0 else (10, 1)
            for every in order:
                r = one_run(every, a.steps, storage, f"rep{rep}-every{every}", a.sets)
                runs.append(r)
                print(f"rep {rep} every {every:>2}: {r['wall_s']:6.1f} s wall, "
                      f"{r['train_s']:6.1f} s training, suggested {r['suggested_lr']:.3g}", flush=True)
    by = {e: [r for r in runs if r["report_every"] == e] for e in (1, 10)}
    assert len({r["suggested_lr"] for r in runs}) == 1, "the two cadences disagree"
    assert all(r["points"] == a.steps for r in runs)
    med = {e: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "train_s")}
           for e, rs in by.items()}
    print(f"median wall: every step {med[1]['wall_s']:.1f} s, every 10 {med[10]['wall_s']:.1f} s "
          f"({med[1]['wall_s'] / med[10]['wall_s']:.2f}x); training part "
          f"{med[1]['train_s']:.1f} s vs {med[10]['train_s']:.1f} s "
          f"({med[1]['train_s'] / med[10]['train_s']:.2f}x)")
    Path(a.out).write_text(json.dumps({"steps": a.steps, "reps": a.reps, "sets": a.sets, "runs": runs,
                                       "median": med}, indent=2) + "\n")


if __name__ == "__main__":
    main()
