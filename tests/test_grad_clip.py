"""The global gradient clip does its work on the gradients' device (no Ray, no GPU).

A CPU machine cannot run CUDA, but it can hold gradients on the meta device, which propagates
through every op and refuses a host read (`.item()`, `float()`, a Python branch on a value).
Torch's fake process group (its own testing backend) lets the collectives of an 8-rank
(pp, dp, tp) mesh run in one process on those tensors. A TorchDispatchMode then sees every op the
clip runs: a floating-point tensor on the host in any of them is device work mixed with a host
tensor, which on CUDA is an error (an in-place add into a CPU accumulator) or an NCCL all-reduce
of a CPU tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from raytrain_lm.parallel.grad import clip_grad_norm_


class HostTensors(TorchDispatchMode):
    """Records every op that touches a floating-point tensor on the CPU (integer CPU tensors are
    the mesh's rank grid: bookkeeping, not device work)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" and t.is_floating_point() for t in tensors):
            self.ops.append(str(func))
        return out


@pytest.fixture
def fake_world():
    """An 8-rank world in this process (rank 0 of pp 2 x dp 2 x tp 2), removed afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()


def _param(shape, device="meta", mesh=None, placements=None):
    data, grad = torch.empty(shape, device=device), torch.ones(shape, device=device)
    if mesh is not None:
        data = DTensor.from_local(data, mesh, placements, run_check=False)
        grad = DTensor.from_local(grad, mesh, placements, run_check=False)
    p = nn.Parameter(data)
    p.grad = grad
    return p


@pytest.mark.parametrize("layout", ["pp alone", "fsdp x tp x pp"])
def test_the_clip_runs_on_the_gradients_device_with_no_host_tensor(fake_world, layout):
    pp_group = fake_world["pp"].get_group()
    params = [_param((4, 3)), _param((3,))]  # plain tensors: a pipeline stage without dp/tp
    if layout != "pp alone":
        dp_tp = fake_world["dp", "tp"]
        params += [_param((2, 3), mesh=dp_tp, placements=[Shard(0), Shard(0)]),  # fsdp x tp
                   _param((3,), mesh=dp_tp, placements=[Shard(0), Replicate()]),  # fsdp, tp copy
                   _param((5, 3), mesh=fake_world["tp"], placements=[Shard(1)])]  # tp only
    duplicate = _param((2, 2))  # a pipeline's second copy of the tied embedding
    params.append(duplicate)
    with HostTensors() as seen:
        norm = clip_grad_norm_(params, 1.0, pp_group, exclude={id(duplicate)})
    assert seen.ops == []
    assert isinstance(norm, torch.Tensor) and norm.device.type == "meta" and norm.dim() == 0


def test_the_clip_equals_torchs_on_plain_gradients():
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(4))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a) * 3
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    small = [nn.Parameter(torch.zeros(3))]
    small[0].grad = torch.full((3,), 0.1)
    clip_grad_norm_(small, 1.0)  # under the limit: untouched
    assert torch.equal(small[0].grad, torch.full((3,), 0.1))
