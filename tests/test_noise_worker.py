"""The gradient noise scale as a worker measures it (parallel/noise.py, worker/metrics.Meter): each
rank's gradient before DDP's all-reduce, or one worker's first micro-batch, against the same
gradients computed in one process from the same weights and batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain_lm.config.load import build_config
from raytrain_lm.plan.noise_scale import NoiseScale, two_batch_estimates

SETS = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
        "model.vocab_size=64", "model.dropout=0"]
CPU = torch.device("cpu")
MICRO = 4  # sequences per micro-batch


def config(workers, accum, **flags):
    return build_config(sets=SETS, flags={"workers": workers, "lr": 1e-3, "seq_len": 16,
                                          "batch_size": MICRO, "grad_accum": accum, **flags})


class Batches:
    """Fixed micro-batches, in order, from a seed of their own."""

    def __init__(self, seed: int, n: int):
        g = torch.Generator().manual_seed(seed)
        self.xs = [torch.randint(0, 64, (MICRO, 16), generator=g) for _ in range(n)]
        self.i = 0

    def next(self):
        x = self.xs[self.i]
        self.i += 1
        return x, x


def build(workers, accum, wrap, **flags):
    from raytrain_lm.worker.step import TrainStep

    torch.manual_seed(0)
    return TrainStep(config(workers, accum, **flags), CPU, ddp_wrap=wrap)


def grad_of(model, xs) -> list[torch.Tensor]:
    """The gradient of the mean loss over the micro-batches `xs` (float64 copies)."""
    model = copy.deepcopy(model).double()
    model.zero_grad()
    loss = sum(model(x, x)[1] for x in xs) / len(xs)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def sq(grads) -> float:
    return float(sum((g ** 2).sum() for g in grads))


def test_one_worker_with_accumulation_measures_its_first_micro_batch():
    """b = one micro-batch (its gradient after the first backward, scaled back by the number of
    micro-batches), B = the step; the step's norm is the whole step's gradient."""
    step = build(1, 2, wrap=lambda m: m)
    assert step.noise_batches == (MICRO, 2 * MICRO)
    before = copy.deepcopy(step.parts[0])
    batches = Batches(1, 2)
    step.train()
    _, norm = step(batches, 1e-3)
    # float32 sums of squares against float64: relative rounding ~1e-6
    assert step.small_sq.item() == pytest.approx(sq(grad_of(before, batches.xs[:1])), rel=1e-5)
    assert norm.item() ** 2 == pytest.approx(sq(grad_of(before, batches.xs)), rel=1e-5)


def test_layouts_without_a_small_batch_report_none():
    """One worker, one micro-batch: there is no second batch size, so no estimate and no field."""
    step = build(1, 1, wrap=lambda m: m)
    assert step.noise_batches is None
    step(Batches(1, 1), 1e-3)
    assert step.small_sq is None


def ddp_rank(rank, store, out):
    """One step of 2 ranks with 2 micro-batches each, DDP and then ZeRO-1 and FSDP (FSDP2); DDP's
    Meter row of it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_lm.parallel.ddp import DDP_KWARGS
    from raytrain_lm.worker.metrics import Meter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    step = build(2, 2, wrap=lambda m: DDP(m, **DDP_KWARGS))
    before = {k: v.clone() for k, v in step.parts[0].state_dict().items()}
    meter = Meter(CPU, 2, 1.0, None, 1, 0.0, loss_ranks=2, noise_batches=step.noise_batches)
    step.train()
    loss, norm = step(Batches(10 + rank, 2), 1e-3)
    small = step.small_sq.clone()
    meter.add_step(loss, 1, norm, step.small_sq)
    row = meter.row(1, 1e-3, norm, step)
    sharded = {}
    for strategy in ("zero1", "fsdp"):
        s = build(2, 2, wrap=None, strategy=strategy)
        start = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                 for k, v in s.parts[0].state_dict().items()}
        s.train()
        _, s_norm = s(Batches(10 + rank, 2), 1e-3)
        sharded[strategy] = {"small": s.small_sq.clone(), "norm": float(s_norm.full_tensor()
                             if hasattr(s_norm, "full_tensor") else s_norm), "batches": s.noise_batches,
                             "same_start": all(torch.equal(start[k], before[k]) for k in before)}
    torch.save({"before": before, "small": small, "norm": norm, "row": row,
                "batches": step.noise_batches, "sharded": sharded}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("noise")
    mp.start_processes(ddp_rank, args=(str(out / "store"), str(out)), nprocs=2, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow  # two spawned ranks (fresh interpreters importing torch): ~9 s
def test_two_ddp_workers_give_the_one_process_formula(ddp_ranks):
    """Each rank's small-batch norm is its own gradient's (2 micro-batches, b = 8), the step's
    norm that of the mean of both (B = 16), and the row's smoothed |G|^2 and tr(Sigma) after one
    step are the formula on them, the small one averaged over the ranks."""
    from raytrain_lm.models import build_model

    cfg = config(2, 2)
    model = build_model(cfg.model, seed=0)
    model.load_state_dict(ddp_ranks[0]["before"])
    assert ddp_ranks[0]["batches"] == (2 * MICRO, 4 * MICRO)
    local = [grad_of(model, Batches(10 + r, 2).xs) for r in range(2)]
    mean = [(a + b) / 2 for a, b in zip(*local)]
    for r, got in enumerate(ddp_ranks):
        assert got["small"].item() == pytest.approx(sq(local[r]), rel=1e-5)
        assert got["norm"].item() ** 2 == pytest.approx(sq(mean), rel=1e-5)
    g2, trace = two_batch_estimates((sq(local[0]) + sq(local[1])) / 2, sq(mean), 2 * MICRO, 4 * MICRO)
    for got in ddp_ranks:
        row = got["row"]
        # the difference of two close squared norms: float32's rounding is amplified by
        # |G_b|^2 / (|G_b|^2 - |G_B|^2), a few here
        assert row["noise_grad_sq"] == pytest.approx(g2, rel=1e-4)
        assert row["noise_trace"] == pytest.approx(trace, rel=1e-4)
        expected = NoiseScale()
        expected.update((sq(local[0]) + sq(local[1])) / 2, sq(mean), 2 * MICRO, 4 * MICRO)
        assert row["noise_scale"] == pytest.approx(expected.b_simple, rel=1e-4)


def test_the_progress_line_and_the_plot_show_the_noise_scale():
    """The row's B_simple in the progress line, and a fourth panel of the report's figure for it
    (the PNG's width: IHDR bytes 16-20); rows without it keep three panels and no word."""
    import struct

    from raytrain_lm.results.plots import plot_runs
    from raytrain_lm.results.tables import progress_line

    row = {"step": 5, "loss": 2.0, "lr": 1e-3, "tokens_per_second": 10.0, "step_time": 0.1,
           "data_wait_frac": 0.0, "peak_mem_gb": 1.0}
    assert "B_noise" not in progress_line(row, 10)
    assert "B_noise 37.5" in progress_line({**row, "noise_scale": 37.5}, 10)

    def width(rows):
        return struct.unpack(">I", plot_runs([("r", rows)], dpi=20)[16:20])[0]

    assert width([{**row, "noise_scale": 37.5}]) > width([row]) * 1.2


@pytest.mark.slow  # (the same two ranks)
@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_zero_and_fsdp_workers_measure_their_own_gradient(ddp_ranks, strategy):
    """FSDP2's reduce-scatter input is each rank's whole gradient (its 2 micro-batches): the
    custom reduce-scatter's squares equal the rank's own gradient's, as DDP's hook does, from the
    same initial weights."""
    from raytrain_lm.models import build_model

    model = build_model(config(2, 2).model, seed=0)
    model.load_state_dict(ddp_ranks[0]["before"])
    for r, got in enumerate(ddp_ranks):
        one = got["sharded"][strategy]
        assert one["same_start"] and one["batches"] == (2 * MICRO, 4 * MICRO)
        assert one["small"].item() == pytest.approx(sq(grad_of(model, Batches(10 + r, 2).xs)), rel=1e-5)
        assert one["norm"] == pytest.approx(got["norm"].item(), rel=1e-5)
