"""Ray Train's local mode as a run uses it: `train --workers 0`, alone (one process) or as each rank
of `torchrun --nproc_per_node N cli.py train --workers 0`.

`ScalingConfig(num_workers=0)` makes the trainer's `fit()` run the training function in the calling
process, with no Ray cluster: Ray's `LocalTorchController` gives `ray.train.get_context()` this
process's place, and under torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK,
LOCAL_WORLD_SIZE) it starts the process group (gloo on CPUs, nccl on GPUs). As shipped (the Ray of
pyproject.toml) local mode has no storage (`get_storage()` raises), its `report` keeps the last
metrics and drops the checkpoint, its barrier and broadcast do nothing and it calls no callbacks.
Here they do what Ray's workers and controller do for a run:

- the storage is the run's (`RunConfig(storage_path, name)`, rank 0's on every rank: under
  torchrun the run's name is rank 0's to choose);
- `report` uploads a checkpoint through the loop's own `checkpoint_upload_fn`, before it returns
  (no background upload), then is a barrier across ranks, so every rank's files are in before
  rank 0 registers the checkpoint (the newest `num_to_keep` are kept, as by Ray's checkpoint
  manager; a checkpoint made again at a path replaces the old entry) and calls the RunConfig's
  callbacks' `after_report`, as Ray's controller does, with rank 0's metrics (every rank's
  metrics are global: the loop all-reduces them);
- barrier and broadcast go over torch.distributed.

Nothing here imports torch at import time: the driver imports this module's package.
"""

from __future__ import annotations

import shutil
from typing import Any, Optional

from raytrain_lm import env
from raytrain_lm.errors import UserError, last_line
from raytrain_lm.store.runs import checkpoint_folders


class Retention:
    """The checkpoints a run keeps: the newest `keep`, counting the ones already in its folder
    (a resumed run), as Ray's checkpoint manager does with its snapshot. Rank 0's."""

    def __init__(self, fs, run_path: str, keep: Optional[int]):
        self.fs, self.keep = fs, keep
        self.paths = [path for _, path in checkpoint_folders(fs, run_path)]

    def register(self, path: str) -> None:
        path = path.rstrip("/")
        self.paths = [p for p in self.paths if p.rstrip("/") != path] + [path]
        while self.keep is not None and len(self.paths) > self.keep:
            self.fs.delete_dir(self.paths.pop(0))


def cuda_devices() -> int:
    """The CUDA GPUs torch sees in this process (the GPUs local mode would train on)."""
    import torch  # torch: the ranks of a local run

    return torch.cuda.device_count()


def join_torchrun(timeout_s: float) -> None:
    """Start this torchrun rank's process group (gloo on CPUs, nccl on GPUs, as Ray's local mode
    chooses) once every rank has arrived at rank 0's MASTER_ADDR:MASTER_PORT, waiting at most
    `timeout_s` (torch's own rendezvous waits 30 minutes without a word); UserError naming the
    ranks that did not arrive. Nothing if the group is started already. (torchrun's variables:
    checked by run/in_process.local_place.)"""
    from datetime import timedelta

    import torch  # torch: the ranks of a local run
    import torch.distributed as dist  # torch: as above

    if dist.is_initialized():
        return
    given = env.torchrun_vars()
    rank, world = int(given["RANK"]), int(given["WORLD_SIZE"])
    addr, port = given["MASTER_ADDR"], int(given["MASTER_PORT"])
    timeout, setting = timedelta(seconds=timeout_s), f"{timeout_s:g} s (--set rendezvous_timeout=SECONDS)"
    try:  # rank 0 serves the store; the others connect to it, retrying until the timeout
        store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
    except RuntimeError as e:  # torch's DistStoreError / DistNetworkError
        if rank == 0:
            raise UserError(f"torchrun: rank 0 cannot serve the rendezvous at {addr}:{port}: "
                            f"{last_line(e)} (MASTER_PORT in use?)") from None
        raise UserError(f"torchrun: rank 0 did not answer at {addr}:{port} within {setting}; "
                        f"rank {rank} of {world} gives up (is rank 0 started, MASTER_ADDR and "
                        f"MASTER_PORT its?)") from None
    store.set(f"raytrain-lm/arrived/{rank}", "1")
    names = [f"raytrain-lm/arrived/{r}" for r in range(world)]
    try:
        store.wait(names, timeout)
    except RuntimeError:
        missing = [r for r, name in enumerate(names) if not store.check([name])]
        shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UserError(f"torchrun: rank{'s' if len(missing) > 1 else ''} {shown} of {world} did "
                        f"not arrive at {addr}:{port} within {setting}; rank {rank} gives up") from None
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store,
                            rank=rank, world_size=world)


def local_controller(run_config, threads: int, rendezvous_timeout: float):
    """Ray's LocalTorchController for `run_config` (name, storage_path, callbacks, num_to_keep),
    completed as this module says; the training function runs on `threads` torch threads, its
    torchrun ranks joined within `rendezvous_timeout` seconds (join_torchrun)."""
    import torch  # torch: the ranks of a local run
    import torch.distributed as dist  # torch: as above
    from ray.train.v2._internal.execution.local_mode.torch import LocalTorchController  # torch: as above
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.train_fn_utils import (
        LocalTrainFnUtils,
        set_train_fn_utils,
    )
    from ray.train.v2.api.context import LocalTrainContext

    def collective() -> bool:
        return dist.is_available() and dist.is_initialized()

    class Context(LocalTrainContext):
        storage: Any = None

        def get_storage(self):
            return self.storage

    class FnUtils(LocalTrainFnUtils):
        retention: Optional[Retention] = None

        def report(self, metrics, checkpoint=None, checkpoint_dir_name=None,
                   checkpoint_upload_mode=None, delete_local_checkpoint_after_upload=None,
                   checkpoint_upload_fn=None, validation=False) -> None:
            storage = self._context.get_storage()
            if checkpoint is not None:
                local_dir = checkpoint.path
                if checkpoint_upload_fn is not None:
                    checkpoint = checkpoint_upload_fn(checkpoint, checkpoint_dir_name)
                else:
                    checkpoint = storage.persist_current_checkpoint(checkpoint, checkpoint_dir_name)
                if delete_local_checkpoint_after_upload:
                    shutil.rmtree(local_dir, ignore_errors=True)
            self.barrier()  # a report is a barrier; every rank's files are in before rank 0's row
            if self._context.get_world_rank() == 0:
                if checkpoint is not None:
                    self.retention.register(checkpoint.path)
                for callback in run_config.callbacks or []:
                    callback.after_report(None, [metrics], checkpoint)
            self._last_metrics = metrics
            self._last_checkpoint = checkpoint or self._last_checkpoint  # the Result's: the latest

        def barrier(self) -> None:
            if collective():
                dist.barrier()

        def broadcast_from_rank_zero(self, data):
            if not collective():
                return data
            box = [data]
            dist.broadcast_object_list(box, src=0)
            return box[0]

    class Controller(LocalTorchController):
        def _set_train_fn_utils(self) -> None:
            # Ray's own starts the process group under torchrun's variables with torch's
            # 30-minute rendezvous, silent while it waits: here the bounded one, and the place
            # computed as Ray's does.
            place = dict(experiment_name=self.experiment_name, world_size=1, world_rank=0,
                         local_rank=0, local_world_size=1, node_rank=0)
            given = env.torchrun_vars()  # all of them present: Ray's own test (has_torchrun_env)
            if given is not None:
                join_torchrun(rendezvous_timeout)
                rank, local, per_node = (dist.get_rank(), int(given["LOCAL_RANK"]),
                                         int(given["LOCAL_WORLD_SIZE"]))
                if torch.cuda.is_available():
                    torch.cuda.set_device(local)
                place.update(world_size=dist.get_world_size(), world_rank=rank, local_rank=local,
                             local_world_size=per_node, node_rank=rank // per_node)
            utils = FnUtils(**place)
            where = utils.broadcast_from_rank_zero((run_config.storage_path, run_config.name))
            utils._context = Context(**{**place, "experiment_name": where[1]})
            utils._context.storage = storage = StorageContext(*where)
            if place["world_rank"] == 0:
                utils.retention = Retention(storage.storage_filesystem, storage.experiment_fs_path,
                                            run_config.checkpoint_config.num_to_keep)
            set_train_fn_utils(utils)

        def run(self, train_func):
            torch.set_num_threads(threads)
            return super().run(train_func)

    return Controller(experiment_name=run_config.name)
