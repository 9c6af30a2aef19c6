"""The floor under the time to first step: what the imports alone cost in a fresh process.

Every Ray Train run starts new processes (the controller, each worker, the synchronization
actor) and each imports what it runs. Measured here in fresh `python -c` processes, one module
at a time on top of the previous ones, alone on the machine and then two at once (the two
workers of a run import side by side):

    python bench/import_floor.py --reps 3 --out bench/results/import_floor.json

- `ray`, `ray.train`: what Ray costs each process before it does anything (the controller, each
  worker); Ray Train imports pandas and Ray Data on the way (`ray.air`).
- `torch`, `torch._dynamo`: what a worker costs under torchrun as well; DDP's constructor and
  every optimizer's first step import `torch._dynamo` (torch/_compile.py, torch/optim/optimizer.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODULES = ["ray", "ray.train", "torch", "torch._dynamo"]

PROBE = """
import json, resource, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
out = {}
for name in %r:
    w, c = time.perf_counter(), cpu()
    __import__(name)
    out[name] = [time.perf_counter() - w, cpu() - c]
print(json.dumps(out))
"""


def probe(modules: list[str], at_once: int) -> list[dict]:
    """`at_once` fresh processes started together; each one's {module: [wall s, CPU s]}."""
    procs = [subprocess.Popen([sys.executable, "-c", PROBE % modules], stdout=subprocess.PIPE,
                              text=True) for _ in range(at_once)]
    return [json.loads(p.communicate()[0]) for p in procs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modules", default=",".join(MODULES), help="imported in this order")
    p.add_argument("--out", default=None, help="write the measurements as JSON here")
    args = p.parse_args()
    modules = args.modules.split(",")

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "modules": modules}
    for label, at_once in (("alone", 1), ("two at once", 2)):
        runs = [r for _ in range(args.reps) for r in probe(modules, at_once)]
        med = {m: [statistics.median(r[m][i] for r in runs) for i in (0, 1)] for m in modules}
        result[label] = {"median": med, "runs": runs}
        print(f"{label} (median of {len(runs)} processes):")
        for m in modules:
            print(f"  {m:14s} wall {med[m][0]:5.2f} s  CPU {med[m][1]:5.2f} s")
        print(f"  {'total':14s} wall {sum(v[0] for v in med.values()):5.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
