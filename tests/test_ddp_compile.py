"""--compile with DDP compiles the DDP-wrapped module (no Ray, no GPU): Dynamo's DDPOptimizer
then splits the graph at DDP's buckets, so gradient all-reduces overlap the backward. A bare
model compiled and then wrapped is one graph whose gradients all arrive at its end."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.nn.parallel import DistributedDataParallel

from raytrain_lm.parallel.ddp import no_sync, replicate


def test_compile_wraps_the_ddp_module_and_accumulation_still_skips_the_all_reduce():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        module = replicate(nn.Linear(4, 4), compile=True, wrap=DistributedDataParallel)
        assert isinstance(module, OptimizedModule)  # compiled outermost (lazily: nothing traced)
        assert isinstance(module._orig_mod, DistributedDataParallel)
        with no_sync(module, sync=False):  # gradient accumulation reaches DDP's no_sync
            assert module._orig_mod.require_backward_grad_sync is False
        assert not isinstance(replicate(nn.Linear(4, 4), compile=False,
                                        wrap=DistributedDataParallel), OptimizedModule)
    finally:
        dist.destroy_process_group()
