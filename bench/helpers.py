"""What Ray Train's per-run helper processes, its TorchConfig and its runtime envs cost:
`python cli.py train` with Ray's default controller callbacks and Ray's TorchConfig, with Ray's
TorchConfig only, with the controller's polls set as Ray's environment variables and passed on
as Ray does (to the controller and every worker as a runtime env), and as shipped (controller.helper_callbacks:
no dataset manager, no placement-group cleaner; backend.TorchConfig: no torch in the controller;
controller.Polls: no runtime env, even when the polls' variables are set), alternated, on one already running local Ray.

Timed from outside: the command's wall time, its time to first step (summary.json), and the CPU
seconds of every process on the machine while it ran (sampled from /proc every 0.1 s; a process
that ends between two samples keeps its last reading, so the figure is a slight undercount).
The other arms run the same CLI patched: `trainer.helper_callbacks` replaced by one that keeps
all, Ray's own TorchConfig in place of ours, or `controller.POLL_VARS` emptied.

    flock /tmp/ray.lock python bench/helpers.py --reps 4 [--arms env-polls,ours]
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
TCK = os.sysconf("SC_CLK_TCK")
PATCHES = {"callbacks": "t.helper_callbacks = lambda callbacks, *_: callbacks; ",
           "torchconfig": "from ray.train.torch import TorchConfig; t.TorchConfig = TorchConfig; ",
           "polls-travel": "import raytrain_lm.ray_compat.controller as c; c.POLL_VARS.clear(); "}
# The polls `train` sets (driver.DEFAULT_POLL_S, preemption.DEFAULT_POLL_S) as Ray's variables,
# and let travel as Ray sends them: to the controller and every worker in a runtime env.
ENV_POLLS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1.0"}
ARMS = {"ray-defaults": (("callbacks", "torchconfig"), {}),  # name: (patches, environment)
        "ray-torchconfig": (("torchconfig",), {}),
        "env-polls": (("polls-travel",), ENV_POLLS),
        "ours": ((), {})}


def patched_cli(*patches: str) -> list[str]:
    """`python cli.py` with parts of raytrain_lm.ray_compat patched back to Ray's defaults."""
    if not patches:
        return [sys.executable, "cli.py"]
    code = ("import sys, runpy, raytrain_lm.ray_compat.trainer as t; " + "".join(PATCHES[p] for p in patches) +
            "sys.argv = ['cli.py'] + sys.argv[1:]; runpy.run_path('cli.py', run_name='__main__')")
    return [sys.executable, "-c", code]


def cpu_seconds() -> dict:
    """(pid, start time) -> CPU seconds so far, for every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[(pid, fields[19])] = (int(fields[11]) + int(fields[12])) / TCK
    return out


def timed_run(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds of all processes) of `cmd`."""
    base, last = cpu_seconds(), {}
    with tempfile.TemporaryFile("w+") as log:  # not a pipe: one read only at the end would fill it
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            last.update(cpu_seconds())
            time.sleep(0.1)
        wall = time.time() - t0
        log.seek(0)
        out = log.read()
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed\n{out[-3000:]}")
    return wall, sum(v - base.get(k, 0.0) for k, v in last.items())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--data", default=str(ROOT / "data" / "pydoc"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "helpers.json"))
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    args = p.parse_args(argv)
    if unknown := set(args.arms.split(",")) - set(ARMS):
        p.error(f"unknown arms: {', '.join(sorted(unknown))}")
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    time.sleep(5)  # let the fresh cluster settle
    arms = args.arms.split(",")
    results = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as storage:
        for rep in range(args.reps):
            for arm in arms:
                patches, env = ARMS[arm]
                prefix = patched_cli(*patches)
                name = f"{arm}-{rep}"
                cmd = prefix + ["train", "--preset", "tiny", "--max-steps", str(args.steps),
                                "--log-every", "1", "--eval-every", str(args.steps),
                                "--checkpoint-every", "0", "--data", args.data, "--storage", storage,
                                "--name", name, "--address", address]
                wall, cpu = timed_run(cmd, {**os.environ, **env})
                summary = json.loads(Path(storage, name, "summary.json").read_text())
                results[arm].append({"wall_s": wall, "cpu_s": cpu,
                                     "first_step_s": summary["time_to_first_step"]})
                print(f"rep {rep} {arm:15s} wall {wall:5.1f} s  CPU {cpu:5.1f} s  "
                      f"first step {summary['time_to_first_step']:5.1f} s", flush=True)
    ray.shutdown()
    medians = {arm: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
               for arm, rows in results.items()}
    for arm, m in medians.items():
        print(f"median {arm:15s} " + "  ".join(f"{k} {v:.2f}" for k, v in m.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "helpers", "date": _dt.date.today().isoformat(),
        "command": "python bench/helpers.py " + " ".join(argv or sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPUs", "runs": results, "medians": medians}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
