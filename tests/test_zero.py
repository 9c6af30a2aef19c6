"""ZeRO-1 (optim.ZeroOneAdamW over DDP) on two real gloo processes, no Ray: the same parameters
as plain AdamW step for step, half of AdamW's states on each rank, and a checkpoint that loads
back into ZeRO-1 and into a plain AdamW (another layout)."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain_lm.config.load import build_config
from raytrain_lm.models import build_model
from raytrain_lm.worker.optim import ZeroOneAdamW, build_optimizer, owners

SETS = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
        "model.vocab_size=64", "model.dropout=0"]
STEPS = 4


def config(strategy):
    return build_config(sets=SETS, flags={"strategy": strategy, "workers": 2, "lr": 1e-2,
                                          "seq_len": 16})


def train(rank, strategy, folder=None):
    """STEPS steps of DDP with `strategy`'s optimizer; the parameters and the states held."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = config(strategy)
    model = build_model(cfg.model, seed=3)
    ddp = DDP(model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    for _ in range(STEPS):
        x = torch.randint(0, 64, (4, 16), generator=g)
        _, loss = ddp(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if folder is not None:
        from raytrain_lm.store.checkpoint_format import save_checkpoint

        save_checkpoint(folder, rank, SimpleNamespace(parts=[model], optimizers=[opt]),
                        {"step": STEPS} if rank == 0 else None, commit=False)
    held = sum(v.numel() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, held, opt


def worker(rank, port, out, folder):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on a small machine
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    plain, plain_held, _ = train(rank, "ddp")
    zero, zero_held, opt = train(rank, "zero1", folder)
    assert isinstance(opt, ZeroOneAdamW)
    # Reload the checkpoint into a fresh ZeRO-1 optimizer: this rank's states come back.
    from raytrain_lm.store.checkpoint_format import load_state

    cfg = config("zero1")
    model = build_model(cfg.model, seed=9)
    fresh = build_optimizer(model, cfg, torch.device("cpu"))
    load_state(folder, SimpleNamespace(parts=[model], optimizers=[fresh]))
    same_state = all(torch.equal(fresh.state[p2][k], opt.state[p1][k])
                     for p1, p2 in zip(opt.all_params, fresh.all_params) if p1 in opt.state
                     for k in ("exp_avg", "exp_avg_sq"))
    reloaded = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), zero.values()))
    torch.save({"plain": plain, "zero": zero, "held": (plain_held, zero_held),
                "same_state": same_state, "reloaded": reloaded}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.distributed.checkpoint  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import raytrain_lm.store.checkpoint_format  # noqa: F401  (imported once, before the fork)

    out = tmp_path_factory.mktemp("zero1")
    folder = out / "ckpt"
    mp.start_processes(worker, args=(free_port(), str(out), folder), nprocs=2, start_method="fork")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)], folder


def test_zero1_trains_the_ddp_model_and_holds_half_the_states(results):
    ranks, _ = results
    for r in ranks:
        for k in r["plain"]:
            assert torch.allclose(r["zero"][k], r["plain"][k], rtol=1e-6, atol=1e-7), k
        plain_held, zero_held = r["held"]
        assert 0.3 < zero_held / plain_held < 0.7  # about half of AdamW's moments each
    assert sum(r["held"][1] for r in ranks) == ranks[0]["held"][0]  # together: all of them
    for k in ranks[0]["zero"]:  # the broadcast keeps the replicas identical
        assert torch.equal(ranks[0]["zero"][k], ranks[1]["zero"][k])


def test_a_zero1_checkpoint_loads_back_and_into_plain_adamw(results):
    ranks, folder = results
    assert all(r["same_state"] and r["reloaded"] for r in ranks)
    # One process, plain AdamW (another layout): every parameter's state is in the checkpoint.
    from raytrain_lm.store.checkpoint_format import load_state

    cfg = config("ddp")
    model = build_model(cfg.model, seed=9)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    load_state(folder, SimpleNamespace(parts=[model], optimizers=[opt]))
    assert len(opt.state) == len(list(model.parameters()))
    for k, v in model.state_dict().items():
        assert torch.equal(v, ranks[0]["zero"][k]), k


def test_owners_balance_whole_parameters():
    params = [torch.empty(n) for n in (10, 1, 7, 3, 3)]
    assert owners(params, 2) == [0, 1, 1, 1, 0]  # 10 + 3 against 7 + 3 + 1
    assert owners(params, 1) == [0] * 5
