"""Measuring a parallel step: bytes moved per mesh dim, and the pipeline bubble.

CommCounter is a TorchDispatchMode. Every collective in torch 2.13 reaches the dispatcher as an
op: DTensor (TP/SP, loss parallel) issues functional collectives (`_c10d_functional.*`, the
group given by name); FSDP2, replicate, pipelining's send/recv and plain `dist.all_reduce` go
through the `c10d.*` ops (the ProcessGroup passed as an argument). One mode therefore sees all of
them, in forward and backward (CPU autograd runs on the calling thread; on CUDA the backward
thread inherits the mode too). Collectives issued inside another collective are not re-counted
(the mode is off while it handles an op). CommDebugMode (torch.distributed.tensor.debug) only
counts DTensor's collectives, and only by count.

Bytes are counted per rank: `payload` is the size of the tensor the rank contributes (the input
of all-reduce / all-gather / reduce-scatter, the tensor of a send), `wire` the bytes a rank
sends under ring algorithms (all-reduce 2(n-1)/n S, all-gather (n-1) S_in, reduce-scatter
(n-1)/n S_in, send S). Receives are counted as `recv`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from raytrain_lm.parallel.mesh import dim_mesh

_FUNCOL = ("_c10d_functional", "_c10d_functional_autograd")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _as_pg(a):
    """c10d ops receive the ProcessGroup boxed as a TorchScript object."""
    if isinstance(a, dist.ProcessGroup):
        return a
    if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
        return dist.ProcessGroup.unbox(a)
    return None


class CommCounter(TorchDispatchMode):
    def __init__(self, mesh: DeviceMesh | None = None, dims: tuple[str, ...] = ()):
        """`dims`: the mesh's dims to name (default: its own; a flattened one, as "dp" under
        expert parallelism, is named here too)."""
        super().__init__()
        # Groups are identified by their ranks, not their names: DTensor may run a mesh's
        # collectives on the groups of an earlier, equal mesh (DeviceMesh equality is by rank
        # layout and dim names, and sharding decisions are cached by it). Under --ep equal to
        # dp, ep and dp are the same ranks: the all-to-alls are named ep, the rest dp.
        self.names = {}  # ranks of a group -> mesh dim name
        self.a2a_names = {}  # ... for all-to-alls
        self.dims = (dims or tuple(mesh.mesh_dim_names)) if mesh is not None else ()
        for dim in self.dims:
            if dim_mesh(mesh, dim).size() > 1:
                ranks = tuple(dist.get_process_group_ranks(dim_mesh(mesh, dim).get_group()))
                if dim in ("dp_cp", "edp_cp") and ranks in self.names:  # dp (edp) 1: the cp
                    continue  # ranks, named so
                (self.a2a_names if dim == "ep" else self.names)[ranks] = dim
        # (dim, op) -> {"calls", "payload", "wire", "recv", "max" (largest payload of one call)}
        self.stats = defaultdict(lambda: defaultdict(int))

    def _record(self, group, op: str, payload: int = 0, wire: float = 0, recv: int = 0):
        pg = dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group
        ranks = tuple(dist.get_process_group_ranks(pg))
        dim = (self.a2a_names if op == "all_to_all" else {}).get(ranks) or \
            self.names.get(ranks, "world" if pg.size() == dist.get_world_size() else str(ranks))
        s = self.stats[(dim, op)]
        s["calls"] += 1
        s["payload"] += payload
        s["wire"] += int(wire)
        s["recv"] += recv
        s["max"] = max(s["max"], payload)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        try:
            if ns in _FUNCOL:
                self._funcol(name, args)
            elif ns == "c10d":
                self._c10d(name, args)
        except Exception as e:  # never let accounting break the step
            self.stats[("error", f"{name}: {e}")]["calls"] += 1
        return func(*args, **kwargs)

    def _funcol(self, name, args):
        group = args[-1]
        if not isinstance(group, str):
            return  # wait_tensor, _wrap_tensor_autograd
        n = dist.distributed_c10d._resolve_process_group(group).size()
        s = _nbytes(args[0])
        if name.startswith("all_reduce"):
            self._record(group, "all_reduce", s, 2 * (n - 1) / n * s)
        elif name.startswith("all_gather_into_tensor"):
            self._record(group, "all_gather", s, (n - 1) * s)
        elif name.startswith("reduce_scatter_tensor"):
            self._record(group, "reduce_scatter", s, (n - 1) / n * s)
        elif name.startswith("all_to_all_single"):
            self._record(group, "all_to_all", s, (n - 1) / n * s)
        elif name.startswith("broadcast"):
            self._record(group, "broadcast", s, s)

    def _c10d(self, name, args):
        pg = next((_as_pg(a) for a in args if _as_pg(a) is not None), None)
        if pg is None:
            return
        n = pg.size()
        if name == "allreduce_":
            s = _nbytes(args[0])
            self._record(pg, "all_reduce", s, 2 * (n - 1) / n * s)
        elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            s = _nbytes(args[1])
            self._record(pg, "all_gather", s, (n - 1) * s)
        elif name == "allgather_":
            s = _nbytes(args[1])
            self._record(pg, "all_gather", s, (n - 1) * s)
        elif name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
            s = _nbytes(args[1])
            self._record(pg, "reduce_scatter", s, (n - 1) / n * s)
        elif name == "send":
            s = _nbytes(args[0])
            self._record(pg, "send", s, s)
        elif name == "recv_":
            self._record(pg, "recv", recv=_nbytes(args[0]))
        elif name == "broadcast_":
            s = _nbytes(args[0])
            self._record(pg, "broadcast", s, s)
        elif name in ("alltoall_base_", "alltoall_"):
            s = _nbytes(args[1])
            self._record(pg, "all_to_all", s, (n - 1) / n * s)

    def __enter__(self):
        super().__enter__()
        return self

    def bytes_per_dim(self) -> dict[str, int]:
        """Bytes this rank sent over each mesh dim (ring algorithms), e.g. {"dp": ..., "tp": ...}."""
        return {dim: d["wire"] for dim, d in self.by_dim().items() if dim in self.dims}

    def by_dim(self) -> dict:
        """{dim: {"wire": bytes sent, "payload": ..., "recv": ..., "ops": {op: calls}}}"""
        out = {}
        for (dim, op), s in sorted(self.stats.items()):
            d = out.setdefault(dim, {"wire": 0, "payload": 0, "recv": 0, "ops": {}})
            d["wire"] += s["wire"]
            d["payload"] += s["payload"]
            d["recv"] += s["recv"]
            d["ops"][op] = s["calls"]
        return out


class HostClock:
    """Marks are host times: on CPU the host runs the work, so its time is the work's."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """Marks are CUDA events recorded on the current stream: on a GPU the host only launches
    kernels, so host time around a chunk measures the launch, not the GPU's work. An event pair
    is read (`seconds`) only once the step's work is done: the report's sync (metrics.StepTimer)
    precedes every read, so timing adds no host sync to a step."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device):
    return CudaClock() if device.type == "cuda" else HostClock()


class PipelineTimer:
    """Busy time of this rank's stages inside a schedule step: forward_one_chunk,
    backward_one_chunk and backward_weight_one_chunk are pure compute (the schedule waits for
    receives before calling them and only posts sends after; on CUDA that wait is enqueued on the
    stream before the chunk's first mark). Bubble = 1 - busy / step time: waiting for
    neighbours, p2p and schedule overhead. Marks come from `clock` (host times on CPU, CUDA
    events on a GPU) and are read only in take(), after the step's sync. Theory for p stages,
    m microbatches and v stages per rank: (p - 1) / (v m + p - 1)."""

    def __init__(self, schedule, clock=None):
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        self.clock = clock or HostClock()
        self._chunks: list[tuple] = []  # (start, end) marks of every chunk since the last take()
        self._steps: list[tuple] = []  # ... and of every schedule step
        for st in stages:
            for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(st, meth, self._timed(getattr(st, meth)))

    def _timed(self, fn):
        def wrapper(*a, **k):
            if not self._in_step:  # validation's chunks (schedule.eval) are not timed
                return fn(*a, **k)
            start = self.clock.mark()
            try:
                return fn(*a, **k)
            finally:
                self._chunks.append((start, self.clock.mark()))
        return wrapper

    _in_step = False

    def measure(self, step_fn) -> None:
        """Run step_fn() (one schedule.step), marking it and its chunks."""
        start = self.clock.mark()
        self._in_step = True
        try:
            step_fn()
        finally:
            self._in_step = False
        self._steps.append((start, self.clock.mark()))

    def take(self) -> Optional[float]:
        """Bubble fraction over the steps measured since the last take(); call after a sync."""
        if not self._steps:
            return None
        seconds = self.clock.seconds
        busy = sum(seconds(a, b) for a, b in self._chunks)
        step = sum(seconds(a, b) for a, b in self._steps)
        self._chunks, self._steps = [], []
        return 1.0 - busy / step if step > 0 else None

    @staticmethod
    def theory(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
        return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
