"""The planner against published runs: docs/planner.md's validation table, from
raytrain_lm/plan/published_runs.json. `--fit` searches the efficiency formula's constants
(plan/efficiency.py: F_HALF and each GPU kind's peak fraction) that put the published layouts'
estimated tokens/s closest to the published ones (least squares of the log ratios), the
calibration the formula's defaults come from.

    PYTHONPATH=. python bench/planner_validation.py [--fit]
"""

from __future__ import annotations

import argparse
import math

from raytrain_lm.plan import efficiency
from raytrain_lm.plan.validation import (
    load_runs,
    markdown,
    published_estimate,
    published_tokens_per_s,
    run_cluster,
    run_model,
    summary,
    tokens_per_s,
    validate,
)


def fit() -> None:
    """F_HALF on a grid; for each, every GPU kind's ceiling on its own rows (they are
    independent given F_HALF)."""
    runs = load_runs()
    kinds = sorted({run["cluster"]["gpu"] for run in runs})
    results = []
    for f_half in (1e9, 3e9, 1e10, 2e10, 3e10):
        efficiency.F_HALF = f_half
        total, ceilings = 0.0, {}
        for kind in kinds:
            mine = [run for run in runs if run["cluster"]["gpu"] == kind]
            best = None
            for pf in [x / 100 for x in range(30, 96, 2)]:
                err = 0.0
                for run in mine:
                    m = run_model(run)
                    e = published_estimate(m, run_cluster(run, pf), run)
                    err += 100 if e is None else math.log(tokens_per_s(e) / published_tokens_per_s(run, m)) ** 2
                if best is None or err < best[0]:
                    best = (err, pf)
            total += best[0]
            ceilings[kind] = best[1]
        results.append((total, f_half, ceilings))
        print(f"F_HALF {f_half:g}: squared log error {total:.4f}, ceilings {ceilings}", flush=True)
    print("fit:", min(results, key=lambda r: r[0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", action="store_true")
    if ap.parse_args().fit:
        fit()
        return
    rows = validate()
    print(markdown(rows))
    print(summary(rows))


if __name__ == "__main__":
    main()
