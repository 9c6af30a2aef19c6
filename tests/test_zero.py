"""The data-parallel strategies' arithmetic and traffic on two real gloo processes, no Ray, each
built and stepped by the worker's own `step.TrainStep`: ZeRO-1 (FSDP2: reduce-scatter, gather once
per step) trains the DDP model step for step with half of AdamW's states on each rank, sends no
more bytes than DDP's all-reduce, keeps one fp16 scale on every rank when only one rank's
gradient shard overflows, and its checkpoint loads into a plain AdamW; DDP over a sharded layout
(FSDP2's replicate) reduces each block's gradients as its backward ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain_lm.config.load import build_config
from raytrain_lm.models import build_model
from raytrain_lm.worker.optim import build_optimizer

pytestmark = pytest.mark.slow  # two spawned ranks (fresh interpreters importing torch): ~9 s

SETS = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
        "model.vocab_size=64", "model.dropout=0"]
STEPS = 4
CPU = torch.device("cpu")


def config(strategy, **flags):
    # two micro-steps a step: DDP all-reduces once, ZeRO-1 gathers and reduce-scatters once
    return build_config(sets=SETS, flags={"strategy": strategy, "workers": 2, "lr": 1e-2,
                                          "seq_len": 16, "batch_size": 4, "grad_accum": 2,
                                          **flags})


class Batches:
    """Each rank its own batches, the same ones for every strategy."""

    def __init__(self, rank):
        self.g = torch.Generator().manual_seed(100 + rank)

    def next(self):
        x = torch.randint(0, 64, (4, 16), generator=self.g)
        return x, x


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def build(strategy, **kw):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_lm.parallel.ddp import DDP_KWARGS
    from raytrain_lm.worker.step import TrainStep

    cfg = config(strategy, **kw.pop("flags", {}))
    return TrainStep(cfg, CPU, ddp_wrap=lambda m: DDP(m, **DDP_KWARGS), **kw)


def train(rank, strategy, folder=None):
    """STEPS steps of `strategy`: the parameters, the AdamW state elements held, the bytes of
    step 3 by op (DDP's second step also rebuilds its buckets: two small broadcasts, once)."""
    from raytrain_lm.parallel.traffic import CommCounter

    torch.manual_seed(0)
    step, batches = build(strategy), Batches(rank)
    step.train()
    for i in range(STEPS):
        with CommCounter() as counter:
            step(batches, 1e-2)
        if i == 2:
            comm = counter.by_dim()
    if folder is not None:
        from raytrain_lm.store.checkpoint_format import save_checkpoint

        save_checkpoint(folder, rank, step, {"step": STEPS} if rank == 0 else None, commit=False)
    held = sum(v.to_local().numel() if hasattr(v, "to_local") else v.numel()
               for opt in step.optimizers for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    params = {k: full(v) for k, v in step.parts[0].state_dict().items()}
    return params, held, comm


def fp16_one_rank_overflows(rank):
    """A ZeRO-1 fp16 step in which only rank 1's shard of one gradient overflows: (scale after,
    whether this rank's parameters moved)."""
    from raytrain_lm.parallel.fsdp import local

    torch.manual_seed(0)
    step = build("zero1", flags={"precision": "fp16"})
    before = [local(p.detach()).clone() for p in step.model.params()]
    step._forward_backward(Batches(rank))
    if rank == 1:
        local(step.model.params()[0].grad).view(-1)[0] = float("inf")
    step._clip_and_step()
    moved = any(not torch.equal(a, local(p.detach())) for a, p in zip(before, step.model.params()))
    return step.scaler.get_scale(), moved


def ddp_reductions_per_step(rank):
    """All-reduces over dp in one step of DDP on a sharded layout (a tp dim of one rank)."""
    from raytrain_lm.parallel.traffic import CommCounter

    torch.manual_seed(0)
    step = build("ddp", force=frozenset({"tp"}))
    step(Batches(rank), 1e-2)
    with CommCounter(step.model.mesh) as counter:
        step(Batches(rank), 1e-2)
    return counter.by_dim()["dp"]["ops"]


def attempt(fn, rank):
    """fn(rank), or its error as a string: one claim's failure fails its own test only."""
    try:
        return fn(rank)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def worker(rank, store, out, folder):
    torch.set_num_threads(1)  # two processes on a small machine
    # a file store: a free port picked before the ranks bind it may be taken by then
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    plain, plain_held, plain_comm = train(rank, "ddp")
    zero, zero_held, zero_comm = train(rank, "zero1", folder)
    result = {"plain": plain, "zero": zero, "held": (plain_held, zero_held),
              "comm": (plain_comm, zero_comm), "fp16": attempt(fp16_one_rank_overflows, rank),
              "ddp_tp_ops": attempt(ddp_reductions_per_step, rank)}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Both ranks' results. The ranks are fresh interpreters (spawn), not forks of this test
    process: a fork inherits torch.distributed's state from the tests before (a fake-backend
    group's meshes made DCP's save plan see one rank's shards only)."""
    out = tmp_path_factory.mktemp("zero1")
    folder = out / "ckpt"
    mp.start_processes(worker, args=(str(out / "store"), str(out), folder), nprocs=2, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], folder


def test_zero1_trains_the_ddp_model_and_holds_half_the_states(results):
    ranks, _ = results
    for r in ranks:
        for k in r["plain"]:
            # (atol: the query and key biases' gradients are zero up to rounding, attention being
            # blind to them, and AdamW scales rounding noise up to steps of about lr)
            assert torch.allclose(r["zero"][k], r["plain"][k], rtol=1e-5, atol=2e-5), k
        plain_held, zero_held = r["held"]
        assert 0.3 < zero_held / plain_held < 0.7  # about half of AdamW's moments each
    assert sum(r["held"][1] for r in ranks) == ranks[0]["held"][0]  # together: all of them


def test_zero1_sends_no_more_than_ddp(results):
    """ZeRO-1's reduce-scatter of the gradients and gather of the parameters move the bytes of
    DDP's one all-reduce (it used to all-reduce, then broadcast: 1.5x), with two micro-steps a
    step too (the parameters stay gathered between them); beyond them only the global gradient
    norm's one fp32 scalar crosses dp."""
    ranks, _ = results
    for r in ranks:
        plain, zero = (c["world"] for c in r["comm"])
        assert set(plain["ops"]) == {"all_reduce"}
        assert set(zero["ops"]) == {"reduce_scatter", "all_gather", "all_reduce"}
        assert zero["ops"]["all_reduce"] == 1  # the norm
        assert 0.99 * plain["wire"] <= zero["wire"] - 4 <= plain["wire"]  # all the gradients


def test_zero1_fp16_skips_together_when_one_rank_overflows(results):
    """Each rank unscales only its gradient shards; the scaler agrees over the ranks, so both skip
    the step and halve the scale (each used to decide alone: rank 0 stepped, the scales split)."""
    ranks, _ = results
    (scale0, moved0), (scale1, moved1) = (r["fp16"] for r in ranks)
    assert scale0 == scale1 == 2.0 ** 15
    assert not moved0 and not moved1


def test_ddp_on_a_sharded_layout_reduces_each_block_during_backward(results):
    """FSDP2's replicate per block, then the root: one all-reduce per block and one for the
    embeddings, head and final norm (it used to be one, after the whole backward)."""
    ranks, _ = results
    n_layer = config("ddp").model.n_layer
    for r in ranks:
        assert r["ddp_tp_ops"] == {"all_reduce": n_layer + 1}


def test_a_zero1_checkpoint_loads_into_plain_adamw(results):
    """One process, plain AdamW (another layout): every parameter's state is in the checkpoint."""
    ranks, folder = results
    from raytrain_lm.store.checkpoint_format import load_state

    cfg = config("ddp")
    model = build_model(cfg.model, seed=9)
    opt = build_optimizer(model, cfg, CPU)
    load_state(folder, SimpleNamespace(parts=[model], optimizers=[opt]))
    assert len(opt.state) == len(list(model.parameters()))
    for k, v in model.state_dict().items():
        assert torch.equal(v, ranks[0]["zero"][k]), k
