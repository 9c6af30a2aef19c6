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


# ---------------------------------------------------------------- the value, on two real ranks

# The whole model's gradients, the same on every rank (seeded): w (tp: rows, fsdp: rows), col
# (tp: columns), norm (replicated on tp, its gradient Partial as sequence parallelism leaves it),
# emb (the tied embedding: the pipeline's last stage holds a duplicate, left out of the norm).
SHAPES = {"w": (4, 6), "col": (6, 4), "norm": (6,), "emb": (8, 6)}  # even shards of 2


def _full_grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _params_of(layout: str, rank: int, full: dict):
    """(this rank's parameters with their gradients, the pp group, the excluded duplicates)."""
    from torch.distributed.device_mesh import init_device_mesh

    def build_mesh(device, tp=1, pp=1):  # the (pp, dp, tp) mesh over the two ranks
        return init_device_mesh(device.type, (pp, 2 // (tp * pp), tp), mesh_dim_names=("pp", "dp", "tp"))

    def dt(name, mesh, placements, grad_local, data_local=None):
        data = DTensor.from_local(torch.zeros_like(grad_local if data_local is None else data_local),
                                  mesh, placements, run_check=False)
        p = nn.Parameter(data)
        p.grad = DTensor.from_local(grad_local, mesh, grad_placements or placements, run_check=False)
        return p

    grad_placements = None
    if layout == "tp":
        tp = build_mesh(torch.device("cpu"), tp=2)["tp"]
        params = [dt("w", tp, [Shard(0)], full["w"].chunk(2, 0)[rank]),
                  dt("col", tp, [Shard(1)], full["col"].chunk(2, 1)[rank])]
        from torch.distributed.tensor import Partial

        grad_placements = [Partial()]  # each rank's part of the replicated norm weight's gradient
        params.append(dt("norm", tp, [Replicate()], full["norm"] * (0.25, 0.75)[rank], full["norm"]))
        grad_placements = None
        params.append(dt("emb", tp, [Replicate()], full["emb"]))
        return params, None, set()
    if layout == "fsdp":
        dp = build_mesh(torch.device("cpu"))["dp"]
        return [dt(n, dp, [Shard(0)], full[n].chunk(2, 0)[rank]) for n in ("w", "col", "norm", "emb")], None, set()
    pp_group = build_mesh(torch.device("cpu"), pp=2)["pp"].get_group()
    stage = [("w", "emb"), ("col", "norm", "emb")][rank]
    params = []
    for name in stage:
        p = nn.Parameter(torch.zeros(SHAPES[name]))
        p.grad = full[name].clone()
        params.append(p)
    return params, pp_group, {id(params[-1])} if rank == 1 else set()


def _clip_on_rank(rank: int, port: int, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        for layout in ("tp", "fsdp", "pp"):
            params, pp_group, exclude = _params_of(layout, rank, _full_grads())
            norm = clip_grad_norm_(params, 1.0, pp_group, exclude)
            grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
            out.put((layout, rank, norm.item(), [g.tolist() for g in grads]))  # not shared memory
    finally:
        dist.destroy_process_group()


def test_the_global_norm_and_the_clip_over_tp_fsdp_and_pp_ranks():
    """Two gloo ranks (forked, no Ray): the norm of the whole model's gradients whatever holds
    them (tp rows and columns, an FSDP shard each, a pipeline stage each with the duplicate tied
    embedding left out, a replicated norm weight whose gradient is Partial), each counted once;
    and every gradient scaled by max_norm / norm. Where the norm is computed is checked above;
    this is its value (a sum over a replicated dim, a missing pp reduction, a duplicate counted
    would each show)."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_clip_on_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in range(6)]
    for p in procs:
        p.join(timeout=60)
    full = _full_grads()
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full.values()])).item()
    assert norm > 1.0  # so the clip scales
    coef = 1.0 / (norm + 1e-6)
    for layout, rank, found, grads in got:
        # each side a float32 sum of 102 squares in its own order: each off by at most
        # 102 * 2**-24 of the sum, half that on its square root
        assert found == pytest.approx(norm, rel=102 * 2**-24), (layout, rank)
        names = {"pp": [("w", "emb"), ("col", "norm", "emb")][rank]}.get(layout, ("w", "col", "norm", "emb"))
        for name, g in zip(names, grads):
            where = (layout, rank, name)
            torch.testing.assert_close(torch.tensor(g), full[name] * coef, msg=lambda m, w=where: f"{w}: {m}")
