"""Who uses the CPUs while a training run is in its steady state? Per-process CPU time, grouped.

Runs a command, waits until its metrics file has `--skip-rows` rows (start-up over), then reads
every process's CPU time (/proc/PID/stat utime+stime) once a second until the run ends, and
reports the CPU-seconds each group of processes (the training workers, Ray's daemons, the driver,
everything else on the machine) used per second of that window. Linux only.

    flock /tmp/raytrain-ray.lock python bench/cpu_share.py --metrics /tmp/cs/r/metrics.jsonl -- \
        python cli.py train --max-steps 200 --eval-every 200 --checkpoint-every 0 \
        --storage /tmp/cs --name r --quiet
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (group name, CPU seconds used so far)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
        out[int(entry)] = (group(cmd), cpu)
    return out


def group(cmd: str) -> str:
    if not cmd:
        return "kernel threads"
    first = cmd.split()[0]
    if first.startswith("ray::"):
        return first.split(".")[0]  # ray::RayTrainWorker, ray::TrainController, ray::IDLE, ...
    for name in ("gcs_server", "raylet", "dashboard_agent", "runtime_env_agent", "log_monitor",
                 "monitor.py", "dashboard.py", "torchrun_ddp.py", "torch.distributed.run"):
        if name in cmd:
            return name
    if "cli.py" in cmd:
        return "cli.py (driver)"
    return "other: " + os.path.basename(first)[:30]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", required=True, help="the run's metrics.jsonl (rank-0 rows)")
    p.add_argument("--skip-rows", type=int, default=2, help="rows to wait for before measuring [2]")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the command to run after --")
    metrics = Path(args.metrics)
    log = tempfile.NamedTemporaryFile("w", prefix="cpu_share-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def rows() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    while proc.poll() is None and rows() < args.skip_rows:
        time.sleep(0.2)
    first, t_first = snapshot(), time.time()
    taken = []  # (time, rows logged by then, snapshot)
    while proc.poll() is None:
        time.sleep(1.0)
        taken.append((time.time(), rows(), snapshot()))
    # End the window at the last snapshot taken before the final row: the workers exit right after
    # it, and a process that is gone has no CPU time left to read.
    if proc.returncode != 0:
        raise SystemExit(f"error: the command failed (exit {proc.returncode}); its output: {log.name}")
    final_rows = rows()
    inside = [(t, snap) for t, n, snap in taken if n < final_rows]
    if not inside:
        raise SystemExit("error: the run ended before a steady window could be measured")
    t_last, last = inside[-1]
    window = t_last - t_first
    used: dict[str, float] = defaultdict(float)
    for pid, (name, cpu) in last.items():
        before = first.get(pid)
        used[name] += cpu - (before[1] if before and before[0] == name else 0.0)
    ranked = sorted(((v / window, k) for k, v in used.items() if v > 0), reverse=True)
    print(f"steady window: {window:.1f} s; CPU-seconds per second by process group "
          f"(machine has {os.cpu_count()} cores):")
    for share, name in ranked:
        if share >= 0.005:
            print(f"  {share:6.3f}  {name}")
    print(f"  {sum(s for s, _ in ranked):6.3f}  total")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": cmd, "window_s": window,
                                              "cpu_per_s": {k: s for s, k in ranked}}, indent=2))


if __name__ == "__main__":
    main()
