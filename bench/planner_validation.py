"""The planner against published runs: docs/planner.md's validation tables, from
raytrain_lm/plan/published_runs.json, in-sample (the rows the constants were fitted on) and held
out, each with its summary. `--fit` refits the constants (plan/calibration.json: the kernel
efficiency of each software generation on its fit rows, the 500 W part's clock factor on its fit
rows, the allocator's reserved/allocated factor on the fit rows that publish memory) by least
squares of log ratios, on the fit rows only (validation.fit_runs), and writes them with the rows'
names. Then it prints the in-sample and held-out tables apart, and each generation's figures.

    PYTHONPATH=. python bench/planner_validation.py [--fit]
"""

from __future__ import annotations

import argparse
import math
import time

from raytrain_lm.plan import calibration
from raytrain_lm.plan.frameworks import FRAMEWORKS
from raytrain_lm.plan.hardware import GIB
from raytrain_lm.plan.validation import (
    fit_runs,
    load_runs,
    markdown,
    modelled,
    not_modelled_markdown,
    published_estimate,
    published_tokens_per_s,
    run_cluster,
    run_model,
    summary,
    summary_text,
    tokens_per_s,
    validate,
)

CLOCK = calibration.clock_key("h100-sxm-96gb-500w")


def generation(run: dict) -> str:
    """The kernel efficiency a row's framework is planned with (frameworks.Framework.efficiency)."""
    return FRAMEWORKS[run["framework"]].efficiency


def _log_error(runs: list[dict]) -> tuple[float, int]:
    err, n = 0.0, 0
    for run in runs:
        m = run_model(run)
        e = published_estimate(m, run_cluster(run), run)
        err += 1.0 if e is None else math.log(tokens_per_s(e) / published_tokens_per_s(run, m)) ** 2
        n += 1
    return err, n


def _set(name: str, value: float) -> None:
    calibration.constants()[name]["value"] = value


def _golden(f, lo: float, hi: float, steps: int = 18) -> float:
    """The argmin of a unimodal f on [lo, hi]."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(steps):
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def fit() -> None:
    """Each constant on its own in-sample rows (validation.fit_runs): the kernel efficiency of
    each software generation, then the 500 W clock, then the allocator."""
    runs = load_runs()
    _set("allocator", 1.0)  # throughput first, with memory not in the way
    fitted, said = {}, []
    etas = [k for k in calibration.constants() if k == "eta" or k.startswith("eta:")]
    for name in etas + [CLOCK]:
        rows = fit_runs(runs, name)

        def error(x: float, name=name, rows=rows) -> float:
            _set(name, x)
            return _log_error(rows)[0]

        value = _golden(error, *((0.3, 1.2) if name in etas else (0.5, 1.2)))
        _set(name, value)
        fitted[name] = (value, [r["name"] for r in rows])
        said.append(f"{name} {value:.4f} on {len(rows)} rows")
    mem_rows = fit_runs(runs, "allocator")
    logs = []
    for run in mem_rows:
        m = run_model(run)
        e = published_estimate(m, run_cluster(run), run)
        logs.append(math.log(run["published"]["memory_gib"] * GIB / e.memory.total))
    allocator = math.exp(sum(logs) / len(logs))
    fitted["allocator"] = (allocator, [r["name"] for r in mem_rows])
    calibration.write(fitted, "bench/planner_validation.py --fit")
    print("; ".join(said + [f"allocator {allocator:.4f} on {len(mem_rows)} rows"]))


def report(rows) -> str:
    out = []
    for split, title in (("fit", "In-sample (the rows the constants were fitted on)"),
                         ("held-out", "Held out (the targets)")):
        part = [r for r in rows if r.run["split"] == split]
        out += [f"## {title}", markdown(rows, split), "", summary_text(summary(part)), ""]
        for gen in sorted({generation(r.run) for r in part}):  # each software generation apart
            mine = [r for r in part if generation(r.run) == gen and modelled(r.run)]
            if any(r.throughput_ratio for r in mine):
                out += [f"{gen} ({len(mine)} rows): {summary_text(summary(mine))}", ""]
    out += ["## Not modelled", not_modelled_markdown(rows)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", action="store_true")
    if ap.parse_args().fit:
        fit()
    t0 = time.perf_counter()
    rows = validate()
    print(report(rows))
    print(f"\n({len(rows)} rows in {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
