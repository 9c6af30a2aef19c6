"""The local harness: a run's unmodified `train_loop_per_worker` on N gloo ranks in processes of
this machine, without a Ray cluster. For the tests of training arithmetic (every layout against
one worker, accumulation, strategies, resumes across layouts), which are about torch, not Ray.

It is Ray Train's own local mode (`ScalingConfig(num_workers=0)`): `LocalTorchController` starts
the gloo process group from torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
LOCAL_RANK, LOCAL_WORLD_SIZE) and gives `ray.train.get_context()` each rank's place. As shipped,
local mode has no storage (`get_storage()` raises), its `report` drops the checkpoint, and its
barrier and broadcast do nothing; here they are what Ray's workers do: a real `StorageContext`
for the run's folder, a `report` that uploads the checkpoint (through the loop's own
`checkpoint_upload_fn`) and sends rank 0's row to the driver side, and collectives over gloo.

The driver side is the driver's own: the run's folder claimed and checked as `train` does, rows
taken by `follower.Follower` (metrics.jsonl, summary.json, the caller's `on_metrics`), the best
checkpoint kept by `callbacks.KeepBest`, old checkpoints removed as Ray's `num_to_keep` does.

The ranks are forked from a fork server (a fresh Python process with the loop's modules imported
once): never from the test process itself, which may hold a Ray driver's threads and sockets.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import shutil
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

TESTS = str(Path(__file__).resolve().parent)
_CTX = None


def _context():
    """The fork server's multiprocessing context, started once per test session."""
    global _CTX
    if _CTX is None:
        import sys

        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["raytrain_lm.worker.loop", "local_mode"])
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


KILLED = 75  # the exit code of a rank that kill_after stopped


def _rank_main(rank: int, world: int, port: int, config: dict, storage, rows,
               kill_after: Optional[int] = None) -> None:
    """One rank: torchrun's variables, Ray Train's local controller, the loop."""
    import torch
    from ray.train.v2._internal.execution.local_mode.torch import LocalTorchController
    from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils, set_train_fn_utils

    from raytrain_lm.worker.loop import train_loop_per_worker

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks on a few cores

    class Controller(LocalTorchController):
        def _set_train_fn_utils(self) -> None:
            super()._set_train_fn_utils()  # the gloo group, from the variables above
            set_train_fn_utils(_fn_utils(get_train_fn_utils(), storage, rows, kill_after))

    code = 0
    try:
        Controller(experiment_name=config.run_name).run(lambda: train_loop_per_worker(config))
        rows.put({"event": "done", "rank": rank})
    except BaseException:
        rows.put({"event": "error", "rank": rank, "error": traceback.format_exc()})
        code = 1
    rows.close()
    rows.join_thread()  # what this rank put is in the pipe before it exits
    os._exit(code)  # no atexit handlers of the modules the fork server imported


def _fn_utils(local, storage, rows, kill_after: Optional[int] = None):
    """Ray's LocalTrainFnUtils with a storage, a report that uploads and collectives; with
    `kill_after`, every rank exits (KILLED) right after the report of that step."""
    import torch.distributed as dist
    from ray.train.v2._internal.execution.train_fn_utils import LocalTrainFnUtils
    from ray.train.v2.api.context import LocalTrainContext

    class Context(LocalTrainContext):
        def get_storage(self):
            return storage

    class FnUtils(LocalTrainFnUtils):
        def report(self, metrics, checkpoint=None, checkpoint_dir_name=None,
                   checkpoint_upload_mode=None, delete_local_checkpoint_after_upload=None,
                   checkpoint_upload_fn=None, validation=False) -> None:
            if checkpoint is not None:
                local_dir = checkpoint.path
                if checkpoint_upload_fn is not None:
                    checkpoint = checkpoint_upload_fn(checkpoint, checkpoint_dir_name)
                else:
                    checkpoint = storage.persist_current_checkpoint(checkpoint, checkpoint_dir_name)
                if delete_local_checkpoint_after_upload:
                    shutil.rmtree(local_dir, ignore_errors=True)
            dist.barrier()  # a report is a barrier; every rank's files are in before rank 0's row
            if self._context.get_world_rank() == 0:
                rows.put({"event": "report", "metrics": metrics,
                          "checkpoint": checkpoint.path if checkpoint is not None else None})
            self._last_metrics, self._last_checkpoint = metrics, checkpoint
            if kill_after is not None and metrics.get("step", 0) >= kill_after:
                rows.close()
                rows.join_thread()  # rank 0's row is in the pipe
                os._exit(KILLED)  # no cleanup, as a lost job

        def barrier(self) -> None:
            dist.barrier()

        def broadcast_from_rank_zero(self, data):
            box = [data]
            dist.broadcast_object_list(box, src=0)
            return box[0]

    c = local.get_context()
    utils = FnUtils(experiment_name=c.get_experiment_name(), world_size=c.get_world_size(),
                    world_rank=c.get_world_rank(), local_rank=c.get_local_rank(),
                    local_world_size=c.get_local_world_size(), node_rank=c.get_node_rank())
    utils._context = Context(experiment_name=c.get_experiment_name(), world_size=c.get_world_size(),
                             world_rank=c.get_world_rank(), local_rank=c.get_local_rank(),
                             local_world_size=c.get_local_world_size(), node_rank=c.get_node_rank())
    return utils


class Killed(RuntimeError):
    """run_local's ranks were killed as asked (kill_after)."""


class _NoTensorBoard:
    def add(self, row) -> None:
        pass


def run_local(cfg, *, resume: bool = False, init_from: Optional[str] = None, force: bool = False,
              on_metrics: Optional[Callable[[dict], None]] = None,
              say: Callable[[str], None] = lambda m: None, timeout: float = 300,
              kill_after: Optional[int] = None) -> dict:
    """`driver.run_training(cfg, ...)` with the workers on this harness: cfg.workers gloo ranks.
    Returns the summary (also in summary.json); a rank's failure raises with its traceback.
    `kill_after`: every rank exits right after reporting that step (a lost job, its checkpoints
    as far as they got) and `Killed` is raised: resume the run's folder with resume=True."""
    import ray.train
    from ray.train.v2._internal.execution.storage import StorageContext

    from raytrain_lm.cluster.connect import free_port
    from raytrain_lm.errors import RunFailed
    from raytrain_lm.ray_compat.callbacks import KeepBest
    from raytrain_lm.run.driver import loop_config, previous_summary, run_folder
    from raytrain_lm.run.follower import Follower
    from raytrain_lm.run.preflight import check_init_from, prepare_data
    from raytrain_lm.store import files
    from raytrain_lm.store.claims import RunClaim
    from raytrain_lm.store.runs import best_val_loss

    assert isinstance(cfg.workers, int), "an elastic run needs Ray"
    t_launch = time.time()
    run = run_folder(cfg, resume)
    manifest = prepare_data(cfg, say)
    if init_from:
        init_from = check_init_from(init_from, cfg, manifest)
    previous = previous_summary(run) if resume else {}
    ctx = _context()
    with RunClaim(run):
        storage = StorageContext(run.storage_uri, cfg.name)
        run.write_json(files.CONFIG, cfg.to_dict())
        follower = Follower(cfg, run, t_launch, previous, resume, say, on_metrics)
        follower.write_summary("running")
        best = KeepBest(best_val_loss(run) if resume else None)
        kept: list[str] = []
        rows = ctx.Queue()
        port = free_port()
        config = loop_config(cfg, init_from, None, force)
        ranks = [ctx.Process(target=_rank_main, args=(r, cfg.workers, port, config, storage, rows,
                                                      kill_after))
                 for r in range(cfg.workers)]
        for p in ranks:
            p.start()
        done, error, deadline = set(), None, time.time() + timeout
        try:
            while len(done) < cfg.workers and error is None:
                try:
                    got = rows.get(timeout=1.0)
                except queue_mod.Empty:
                    dead = [p for p in ranks if p.exitcode is not None]
                    killed = [p for p in dead if p.exitcode == KILLED]
                    if killed and rows.empty():  # as asked: once every rank is gone
                        error = "killed as asked" if len(dead) == len(ranks) else None
                    elif dead and rows.empty() and ranks.index(dead[0]) not in done:
                        error = f"rank {ranks.index(dead[0])} died (exit code {dead[0].exitcode})"
                    elif time.time() > deadline:
                        error = f"the ranks took over {timeout} s"
                    continue
                if got["event"] == "done":
                    done.add(got["rank"])
                elif got["event"] == "error":
                    error = f"rank {got['rank']} failed:\n{got['error']}"
                else:
                    row = dict(got["metrics"])
                    if got["checkpoint"]:
                        row["checkpoint"] = got["checkpoint"]
                        checkpoint = ray.train.Checkpoint(got["checkpoint"],
                                                          filesystem=storage.storage_filesystem)
                        best.after_report(None, [got["metrics"]], checkpoint)
                        kept.append(got["checkpoint"])
                        while len(kept) > cfg.keep_checkpoints:  # Ray's num_to_keep
                            storage.storage_filesystem.delete_dir(kept.pop(0))
                    follower.take(row, _NoTensorBoard())
        finally:
            for p in ranks:
                p.join(timeout=30 if error is None else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
        checkpoint = next((r["checkpoint"] for r in reversed(follower.log.rows) if r.get("checkpoint")), None)
        stopped = follower.stopped(checkpoint) if error is None else None
        final = follower.write_summary("failed" if error or stopped else "completed", checkpoint,
                                       error or stopped)
        if stopped:
            raise RunFailed(stopped)
        if error is not None:
            raise (Killed if error == "killed as asked" else RuntimeError)(error)
        final["run_dir"] = run.display_path()
        return final



