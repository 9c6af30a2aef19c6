"""Ray's TorchConfig and its backend, without importing torch where Ray Train's controller
unpickles them, or in the driver.

The controller sets up the workers' process group through the trainer's backend config. Ray's
`TorchConfig` lives in a module that imports torch, so every run's controller imported torch
(all of torch, in memory and in CPU time, on the run's critical path before any worker starts)
to send three functions to the workers. Here the config and the backend do what the pinned Ray's do
for CPUs and GPUs (`ray.train.torch.config`; not TPUs, and only `init_method="env"`), and each
function that runs on a worker imports Ray's module there, where torch is imported anyway.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import ray
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)
from ray.train.v2._internal.util import TrainingFramework

logger = logging.getLogger(__name__)


@dataclass
class TorchConfig(BackendConfig):
    """Ray's `TorchConfig` (backend None: nccl with GPUs, else gloo)."""

    backend: Optional[str] = None
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return TorchBackend

    @property
    def train_func_context(self):  # read by the driver, which need not import torch
        return _WorkerContext

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class _WorkerContext:
    """Ray's `TorchConfigContextManager` (each GPU worker's default CUDA device), imported on the
    worker when its training function starts."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager  # torch: runs on the workers

        TorchConfigContextManager().__enter__()

    def __exit__(self, *exc) -> bool:
        return False


def _ray_torch(name: str, **kwargs):
    """Runs `ray.train.torch.config.<name>(**kwargs)` on a worker."""
    from ray.train.torch import config  # torch: runs on the workers

    return getattr(config, name)(**kwargs)


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


class TorchBackend(Backend):
    """Ray's `_TorchBackend.on_start/on_shutdown` for a v2 worker group."""

    share_cuda_visible_devices: bool = True  # each GPU worker sees its node's GPUs, as Ray's

    def on_start(self, worker_group, backend_config: TorchConfig):
        backend = backend_config.backend or (
            "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo")
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(_ray_torch, "_set_torch_distributed_env_vars")
        ray.get([worker_group.execute_single_async(
            i, _ray_torch, "_setup_torch_process_group", backend=backend, world_rank=i,
            world_size=len(worker_group), init_method="env://", timeout_s=backend_config.timeout_s)
            for i in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config):
        futures = worker_group.execute_async(_ray_torch, "_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = ray_constants.env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                              DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")
