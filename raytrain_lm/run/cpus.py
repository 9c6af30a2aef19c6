"""How many CPUs, and so torch threads, each worker gets (pure Python: no Ray, no torch).

Ray sets a worker's OMP_NUM_THREADS, which torch takes as its thread count, to the whole CPUs the
worker reserved (at least 1) unless the variable is already set. With Ray's default of one CPU
per worker, one worker on a laptop trains on one thread while the other cores idle. So:

- On a Ray that the command starts for itself (`local_share`), the workers share the machine's
  cores: `cpus_per_worker` = cores // (workers x trials at once), at least 1.
- On a cluster (`--address`, RAY_ADDRESS, a `cluster local-up` cluster) the user's setting, else
  Ray's 1, is kept: the cluster may be shared and its nodes are not this machine. `idle_line`
  says when the workers would leave a node's CPUs idle.

A `cpus_per_worker` the user set (file, flag, `--set`) always wins.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from raytrain_lm.env import OMP_ENV


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_share(cores: int, workers: int, trials: int = 1) -> int:
    """CPUs per worker when `workers` workers of each of `trials` concurrent trials share `cores`."""
    return max(1, cores // max(1, workers * trials))


def torch_threads(cpus: float, omp_env: Optional[str] = None) -> int:
    """The torch threads a Ray worker of `cpus` CPUs runs: OMP_NUM_THREADS where it is set for
    the worker, else what Ray sets it to."""
    if omp_env is not None and omp_env.strip().isdigit() and int(omp_env) > 0:
        return int(omp_env)
    return max(1, math.floor(cpus))


@dataclass
class WorkerCpus:
    """The decision for one launch: the CPUs each worker reserves and what the launch line says."""
    cpus: float
    threads: int
    line: Optional[str]


def decide(asked: Optional[float], workers: int, own_ray: bool, cores: int, trials: int = 1,
           omp_env: Optional[str] = None) -> WorkerCpus:
    """CPUs per worker for `workers` workers (of each of `trials` concurrent trials): `asked`
    (cpus_per_worker as the user set it, None if not) wins; else, on a Ray of our own, the
    machine's `cores` shared among them; else 1. `omp_env`: OMP_NUM_THREADS as the workers will
    see it (None: unset). The line says what was chosen, on a Ray of our own only (on a cluster
    see idle_line)."""
    cpus = asked if asked is not None else (float(local_share(cores, workers, trials)) if own_ray else 1.0)
    threads = torch_threads(cpus, omp_env)
    if not own_ray:
        return WorkerCpus(cpus, threads, None)
    count = f"{workers} worker{'s' if workers != 1 else ''}" + (f" per trial, {trials} trials at "
                                                                  f"once" if trials > 1 else "")
    why = ("as set" if asked is not None else
           f"this machine's {cores} cores shared among them; --set cpus_per_worker=N to choose")
    thread_text = f"{threads} torch thread{'s' if threads != 1 else ''} each"
    if threads != torch_threads(cpus):
        thread_text += f" ({OMP_ENV}={omp_env} is set)"
    return WorkerCpus(cpus, threads,
                      f"local Ray: {count} x {cpus:g} CPU{'s' if cpus != 1 else ''} "
                      f"({thread_text}; {why})")


def pack(nodes: list[dict[str, float]], workers: int, cpus: float, gpu: bool) -> list[tuple[dict, int]]:
    """Where Ray's PACK placement puts `workers` workers of `cpus` CPUs (and a GPU each with
    `gpu`) on nodes of these total resources: as few nodes as possible, the largest first.
    Returns (node, workers on it) for each node used."""
    def fits(node: dict[str, float]) -> int:
        n = math.floor(node.get("CPU", 0) / cpus + 1e-9) if cpus > 0 else workers
        return min(n, int(node.get("GPU", 0))) if gpu else n

    placed, left = [], workers
    for node in sorted(nodes, key=fits, reverse=True):
        if left <= 0:
            break
        n = min(fits(node), left)
        if n > 0:
            placed.append((node, n))
            left -= n
    return placed


def idle_line(nodes: list[dict[str, float]], workers: int, cpus: float, gpu: bool,
              omp_env: Optional[str] = None) -> Optional[str]:
    """One line when the workers, placed as Ray packs them, leave at least one CPU per worker
    idle on a node they use (the worst such node), else None. Threads count, not reservations:
    OMP_NUM_THREADS set for the workers (`omp_env`) may run more threads than CPUs reserved.
    `nodes`: each node's total resources (Ray's CPU, GPU)."""
    threads, worst = torch_threads(cpus, omp_env), None
    for node, n in pack(nodes, workers, cpus, gpu):
        total = node.get("CPU", 0)
        share = math.floor(total / n + 1e-9)
        if total - n * threads >= n and (worst is None or share < worst[2]):
            worst = (node, n, share)
    if worst is None:
        return None
    node, n, share = worst
    return (f"note: {n} worker{'s' if n != 1 else ''} x {cpus:g} CPU{'s' if cpus != 1 else ''} "
            f"({threads} torch thread{'s' if threads != 1 else ''} each) leave "
            f"{node.get('CPU', 0) - n * threads:g} of a node's {node.get('CPU', 0):g} CPUs idle; "
            f"--set cpus_per_worker={share} gives each worker {share} threads")
