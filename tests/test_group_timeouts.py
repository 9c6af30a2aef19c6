"""The mesh's sub-groups wait as long as the world group before timing out (no Ray, no GPU):
two gloo ranks in forked processes, the world given a timeout unlike the backend's default
(as Ray's 30 minutes is to NCCL's 10)."""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from raytrain_lm.config.layout import Layout
from raytrain_lm.parallel.mesh import build_mesh

WORLD = timedelta(minutes=45)


def _rank(rank: int, port: int, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=WORLD)
    try:
        layout = Layout(dp=1, tp=2, pp=1, strategy="ddp", ac="none", sp=False, schedule="-",
                        micro_batch=1, microbatches=1, seq_len=8)
        mesh = build_mesh(torch.device("cpu"), layout)  # pp and dp: groups of one rank each
        out.put({dim: mesh.get_group(dim)._get_backend(torch.device("cpu")).options._timeout
                 for dim in mesh.mesh_dim_names})
    finally:
        dist.destroy_process_group()


def test_every_mesh_dim_group_has_the_world_groups_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert got == [{dim: WORLD for dim in ("pp", "dp", "tp")}] * 2
