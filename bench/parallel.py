"""Layouts side by side on this machine: each (dp, tp, pp) layout trains the same model at the same
global batch through `python cli.py train`, as a user would run it, one after another.

For each layout: tokens/s (the run's median over its steady intervals) against dp=2; the bytes
each mesh dimension sent per step (measured on rank 0 by parallel/traffic.py's counter) against
the planner's estimate for rank 0 (plan.rank_comm: CPU, fp32 activations); the pipeline's
measured bubble against (p-1)/(v m + p-1). CPU workers over gloo: the ratios of compute to
communication are nothing like a GPU node's, so tokens/s here says what the layouts cost in
overhead on 2 cores, not how they scale on a cluster (docs/planner.md does that on paper).

    python bench/parallel.py                 # every layout, ~8 minutes on 2 cores
    python bench/parallel.py --only tp2 pp2-1f1b --steps 20
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=128",
         "model.dropout=0"]
GLOBAL_BATCH = 16
LAYOUTS = {  # name: (workers, flags)
    "dp2": (2, {}),
    "fsdp2": (2, {"strategy": "fsdp"}),
    "tp2": (2, {"tp": 2}),
    "pp2-gpipe": (2, {"pp": 2, "pp-schedule": "gpipe", "microbatches": 4}),
    "pp2-1f1b": (2, {"pp": 2, "pp-schedule": "1f1b", "microbatches": 4}),
    "pp2-1f1b-m8": (2, {"pp": 2, "pp-schedule": "1f1b", "microbatches": 8}),
    "pp2-interleaved": (2, {"pp": 2, "pp-schedule": "interleaved-1f1b", "microbatches": 4}),
    "dp2xtp2": (4, {"tp": 2}),
    "dp2xpp2": (4, {"pp": 2, "microbatches": 4}),
    "fsdp2xtp2": (4, {"tp": 2, "strategy": "fsdp"}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2, "microbatches": 4}),
}


def run_layout(name: str, workers: int, flags: dict, args, storage: str) -> dict:
    tp, pp = int(flags.get("tp", 1)), int(flags.get("pp", 1))
    dp = workers // (tp * pp)
    cmd = [sys.executable, str(ROOT / "cli.py"), "train", "--workers", str(workers),
           "--batch-size", str(GLOBAL_BATCH // dp), "--seq-len", "128", "--max-steps", str(args.steps),
           "--log-every", "5", "--eval-every", str(args.steps), "--checkpoint-every", "0",
           "--storage", storage, "--name", name, "--data", args.data, "--json"]
    if workers > 2:
        cmd += ["--set", "cpus_per_worker=0.5"]
    for key, value in flags.items():
        cmd += [f"--{key}", str(value)]
    for s in MODEL:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip().splitlines()[-1:]}
    summary = json.loads((Path(storage) / name / "summary.json").read_text())  # --json leaves out config
    rows = [json.loads(line) for line in open(Path(storage) / name / "metrics.jsonl")]
    return {"name": name, "workers": workers, "dp": dp, "tp": tp, "pp": pp, "flags": flags,
            "tokens_per_second": summary["tokens_per_second"],
            "final_loss": summary["final_train_loss"],
            "comm_bytes": rows[-1].get("comm_bytes") or {},
            "bubble": [r["bubble"] for r in rows[1:] if r.get("bubble") is not None],
            "config": summary["config"]}


def planned(result: dict) -> dict:
    """The planner's bytes per dimension and bubble for rank 0 of this layout."""
    from raytrain_lm.config.layout import Layout
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.plan.comm import rank_comm
    from raytrain_lm.plan.estimate import bubble
    from raytrain_lm.plan.hardware import Cluster
    from raytrain_lm.plan.stages import rank_stages

    cfg = TrainConfig.from_dict(result["config"])
    lay = Layout.of(cfg)
    cluster = Cluster(gpus=cfg.workers, gpus_per_node=cfg.workers, gpu=False)
    comm = rank_comm(cfg.model, lay, cluster, rank_stages(cfg.model, lay.pp, lay.v)[0])
    out = {"comm_bytes": {"dp": comm.dp, "tp": comm.tp, "pp": comm.pp}}
    if lay.pp > 1:
        out["bubble"] = bubble(lay.pp, lay.microbatches, lay.v)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--only", nargs="*", choices=list(LAYOUTS))
    p.add_argument("--data", default=str(ROOT / "data" / "pydoc"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "parallel.json"))
    args = p.parse_args(argv)
    if not Path(args.data, "manifest.json").is_file():
        from raytrain_lm.data.prepare import prepare_dataset

        prepare_dataset("pydoc", args.data)
    storage = tempfile.mkdtemp(prefix="raytrain-parallel-")
    results = []
    for name in args.only or LAYOUTS:
        workers, flags = LAYOUTS[name]
        print(f"{name}: {workers} workers {flags} ...", flush=True)
        r = run_layout(name, workers, flags, args, storage)
        if "error" not in r:
            r["plan"] = planned(r)
        results.append(r)
    base = next((r["tokens_per_second"] for r in results if r["name"] == "dp2" and "error" not in r), None)
    print(f"\n{'layout':<17}{'tok/s':>9}{'vs dp2':>8}  {'dim':<4}{'measured B':>13}{'planned B':>13}"
          f"{'ratio':>7}  bubble (measured / theory)")
    for r in results:
        if "error" in r:
            print(f"{r['name']:<17} error: {r['error']}")
            continue
        rel = f"{r['tokens_per_second'] / base:.2f}" if base else "-"
        dims = [d for d in ("dp", "tp", "pp") if r["comm_bytes"].get(d) or r["plan"]["comm_bytes"][d]]
        bub = ""
        if r["bubble"]:
            measured = sorted(r["bubble"])[len(r["bubble"]) // 2]
            r["bubble_median"] = measured
            bub = f"{measured:.2f} / {r['plan']['bubble']:.2f}"
        for i, d in enumerate(dims or [""]):
            m = r["comm_bytes"].get(d, 0)
            e = r["plan"]["comm_bytes"].get(d, 0)
            head = (f"{r['name']:<17}{r['tokens_per_second']:>9,.0f}{rel:>8}" if i == 0 else " " * 34)
            print(f"{head}  {d:<4}{m:>13,.0f}{e:>13,.0f}{(m / e if e else float('nan')):>7.2f}  "
                  f"{bub if i == 0 else ''}")
    info = {"date": _dt.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs", "command": "python bench/parallel.py " + " ".join(argv or sys.argv[1:]),
            "steps": args.steps, "global_batch": GLOBAL_BATCH, "model": MODEL, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=2))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
