"""The local harness: `train --workers 0` as torchrun runs it, on N gloo ranks in processes of this
machine, without a Ray cluster. For the tests of training arithmetic (every layout against one
worker, accumulation, strategies, resumes across layouts), which are about torch, not Ray.

Each rank is what `torchrun --nproc_per_node N cli.py train --workers 0` starts: a process with
torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK, LOCAL_WORLD_SIZE) calling the
product's `run/in_process.run_local` (Ray Train's local mode, ray_compat/local_controller.py):
rank 0 checks and claims the run's folder and writes its files, every rank trains. Here rank 0's
progress lines and metrics rows come back to the test through a queue, with its summary or any
rank's traceback; `kill_after` ends every rank right after a report, as a lost job.

The ranks are forked from a fork server (a fresh Python process with the loop's modules imported
once): never from the test process itself, which may hold a Ray driver's threads and sockets.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

TESTS = str(Path(__file__).resolve().parent)
PROJECT_ENV = "RAYTRAIN_LM_"  # the drills' variables (raytrain_lm/env.py)
# What every rank imports, imported once in the fork server: the loop's modules, and what a run
# imports on its way (Ray Train's local mode imports ray.tune; the TensorBoard writer, the
# sharded checkpoints' DCP, boto3 behind the storage's checks), else paid again by every rank.
PRELOAD = ["raytrain_lm.worker.loop", "raytrain_lm.run.in_process",
           "raytrain_lm.ray_compat.local_controller", "raytrain_lm.ray_compat.trainer",
           "raytrain_lm.run.tensorboard", "local_mode", "ray.tune", "torch.utils.tensorboard",
           "torch.distributed.checkpoint.state_dict", "boto3", "ray.train.collective",
           "raytrain_lm.config.load", "raytrain_lm.models.gpt.gpt", "raytrain_lm.models.llama.hf_llama"]
_CTX = None
KILLED = 75  # the exit code of a rank that kill_after stopped


class Killed(RuntimeError):
    """run_local's ranks were killed as asked (kill_after)."""


def _context():
    """The fork server's multiprocessing context, started once per test session."""
    global _CTX
    if _CTX is None:
        import sys

        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
        # The server is a fresh interpreter: it finds this module through PYTHONPATH, and must
        # see no Ray address of this session (a rank never talks to a cluster).
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_ADDRESS")}
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [TESTS, *sys.path] if p)
        os.environ.pop("RAY_ADDRESS", None)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return _CTX


def _rank_main(rank: int, world: int, port: int, cfg, kwargs: dict, ours: dict, out,
               kill_after: Optional[int], default_dtype: Optional[str] = None) -> None:
    """One rank of a torchrun of `train --workers 0`: torchrun's variables and the test's own
    (`ours`: the RAYTRAIN_LM_* drills as the test process has them now; the fork server's
    environment is the one it started with), then the product. `default_dtype`: torch's default
    dtype in the rank ("float64": the model, its gradients and optimizer states in float64)."""
    import torch

    from raytrain_lm.errors import RunFailed, UserError
    from raytrain_lm.run.in_process import run_local

    if default_dtype:
        torch.set_default_dtype(getattr(torch, default_dtype))

    if kill_after is not None:
        _exit_after_report(kill_after, out)

    for key in [k for k in os.environ if k.startswith(PROJECT_ENV)]:
        del os.environ[key]
    os.environ.update(ours, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")  # N ranks on a few cores, as torchrun sets it
    code = 0
    try:
        summary = run_local(cfg, say=lambda m: out.put({"event": "say", "line": m}),
                            on_metrics=lambda row: out.put({"event": "row", "row": row}), **kwargs)
        out.put({"event": "done", "rank": rank, "summary": summary})
    except BaseException as e:  # the user's errors and a stopped run reach the test as they are
        out.put({"event": "error", "rank": rank, "error": traceback.format_exc(),
                 "raise": e if isinstance(e, (RunFailed, UserError)) else None})
        code = 1
    out.close()
    out.join_thread()  # what this rank put is in the pipe before it exits
    os._exit(code)  # no atexit handlers of the modules the fork server imported


def _exit_after_report(step: int, out) -> None:
    """Make this rank exit (KILLED) as soon as its `ray.train.report` of `step` or a later step
    has returned: the report's files are in and rank 0 has written its row (a report is a
    barrier), then the process ends with no cleanup, as a lost job's."""
    import ray.train

    report = ray.train.report

    def report_then_exit(metrics, *args, **kwargs):
        report(metrics, *args, **kwargs)
        if metrics.get("step", 0) >= step:
            out.close()
            out.join_thread()  # what this rank put is in the pipe
            os._exit(KILLED)

    ray.train.report = report_then_exit


def run_local(cfg, *, resume: bool = False, init_from: Optional[str] = None, force: bool = False,
              on_metrics: Optional[Callable[[dict], None]] = None,
              say: Callable[[str], None] = lambda m: None, timeout: float = 300,
              kill_after: Optional[int] = None, default_dtype: Optional[str] = None) -> dict:
    """`train --workers 0` of `cfg` under a torchrun of cfg.workers ranks. Returns rank 0's summary
    (also in summary.json); a rank's failure raises with its traceback. `kill_after`: every rank
    exits right after reporting that step (a lost job, its checkpoints as far as they got) and
    `Killed` is raised: resume the run's folder with resume=True. `default_dtype`: see _rank_main
    (a float64 run, for comparisons that must differ only by the order of float64 sums)."""
    from raytrain_lm.cluster.connect import free_port

    assert isinstance(cfg.workers, int), "an elastic run needs Ray"
    ctx, world, port = _context(), cfg.workers, free_port()
    out = ctx.Queue()
    kwargs = dict(resume=resume, init_from=init_from, force=force)
    ours = {k: v for k, v in os.environ.items() if k.startswith(PROJECT_ENV)}
    ranks = [ctx.Process(target=_rank_main, args=(r, world, port, cfg, kwargs, ours, out, kill_after,
                                                  default_dtype))
             for r in range(world)]
    for p in ranks:
        p.start()
    done, summary, error, deadline, raised = set(), None, None, time.time() + timeout, None
    try:
        while len(done) < world and error is None:
            try:
                got = out.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(ranks) if p.exitcode is not None and r not in done]
                killed = [r for r in dead if ranks[r].exitcode == KILLED]
                if killed and out.empty():  # as asked: once every rank is gone
                    error = "killed as asked" if len(dead) == world else None
                elif dead and out.empty():
                    error = f"rank {dead[0]} died (exit code {ranks[dead[0]].exitcode})"
                elif time.time() > deadline:
                    error = f"the ranks took over {timeout} s"
                continue
            if got["event"] == "row" and on_metrics:
                on_metrics(got["row"])
            elif got["event"] == "say":
                say(got["line"])
            elif got["event"] == "done":
                done.add(got["rank"])
                summary = got["summary"] if got["rank"] == 0 else summary
            elif got["event"] == "error":
                error, raised = f"rank {got['rank']} failed:\n{got['error']}", got["raise"]
    finally:
        for p in ranks:
            p.join(timeout=30 if error is None else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if raised is not None:
        raise raised
    if error is not None:
        raise (Killed if error == "killed as asked" else RuntimeError)(error)
    return summary
