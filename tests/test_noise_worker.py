"""The gradient noise scale as a worker measures it (parallel/noise.py, worker/metrics.Meter): each
dp rank's gradient before the data-parallel reduction (DDP's comm hook, FSDP2's post-backward, on
every layout: tp, pp, experts), or one dp rank's first micro-batch, against the same gradients
computed in one process from the same weights and batches."""

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
    """Fixed micro-batches of `rows` sequences, in order, from a seed of their own."""

    def __init__(self, seed: int, n: int, rows: int = MICRO):
        g = torch.Generator().manual_seed(seed)
        self.xs = [torch.randint(0, 64, (rows, 16), generator=g) for _ in range(n)]
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
    assert step.small_sq[0].item() == pytest.approx(sq(grad_of(before, batches.xs[:1])), rel=1e-5)
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
        assert got["small"][0].item() == pytest.approx(sq(local[r]), rel=1e-5)
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
        assert one["small"][0].item() == pytest.approx(sq(grad_of(model, Batches(10 + r, 2).xs)), rel=1e-5)
        assert one["norm"] == pytest.approx(got["norm"].item(), rel=1e-5)


# ---------------------------------------------------------------- every data-parallel layout

MOE = ["model.arch=moe", "model.n_experts=4", "model.top_k=2", "model.ffn_dim=32",
       "model.aux_loss_coef=0", "model.z_loss_coef=0"]
# name: (model sets beyond SETS, flags, sequences per batches.next(), batches.next() per step).
# 4 ranks each; the ranks run in float64 (torch's default dtype), as the reference does.
LAYOUTS = {
    "ddp-tp2-accum2": ([], dict(tp=2, strategy="ddp", grad_accum=2), MICRO, 2),
    "fsdp-tp2-sp": ([], dict(tp=2, strategy="fsdp", sequence_parallel=True), MICRO, 1),
    "zero2-tp2-sp-accum2": ([], dict(tp=2, strategy="zero2", sequence_parallel=True, grad_accum=2), MICRO, 2),
    "ddp-pp2": ([], dict(pp=2, strategy="ddp", pp_schedule="1f1b", microbatches=2, batch_size=2 * MICRO),
                2 * MICRO, 1),
    "fsdp-pp2": ([], dict(pp=2, strategy="fsdp", pp_schedule="gpipe", microbatches=2, batch_size=2 * MICRO),
                 2 * MICRO, 1),
    "tp4-accum2-sp": (["model.n_head=4"], dict(tp=4, grad_accum=2, sequence_parallel=True), MICRO, 2),
    "fsdp-ep2": (MOE, dict(ep=2, strategy="fsdp"), MICRO, 1),
    "ddp-cp2-accum2": ([], dict(cp=2, strategy="ddp", grad_accum=2), MICRO, 2),
    "zero2-cp2": ([], dict(cp=2, strategy="zero2"), MICRO, 1),
    "cp4-accum2": ([], dict(cp=4, grad_accum=2), MICRO, 2),
    "fsdp-cp2-ep2": (MOE, dict(cp=2, ep=2, strategy="fsdp"), MICRO, 1),
}


def layout_config(name):
    sets, flags, rows, _ = LAYOUTS[name]
    return build_config(sets=SETS + sets, flags={"workers": 4, "lr": 1e-3, "seq_len": 16,
                                                 "batch_size": MICRO, **flags})


def layout_batches(name, dp_rank):
    _, _, rows, n = LAYOUTS[name]  # every rank of a dp rank reads the same batches
    return Batches(10 + dp_rank, n, rows)


def layouts_rank(rank, store, out):
    """One step of every layout of LAYOUTS on 4 ranks: what each rank measured and its Meter row
    (a replicated layout in nn.parallel.DistributedDataParallel, as Ray's prepare_model wraps it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_lm.parallel.ddp import DDP_KWARGS
    from raytrain_lm.worker.metrics import Meter
    from raytrain_lm.worker.step import TrainStep

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    got = {}
    for name in LAYOUTS:
        step = TrainStep(layout_config(name), CPU, ddp_wrap=lambda m: DDP(m, **DDP_KWARGS))
        meter = Meter(CPU, 4, 1.0, None, 1, 0.0, loss_ranks=step.dp, noise_batches=step.noise_batches)
        step.train()
        loss, norm = step(layout_batches(name, step.model.coords.dp), 1e-3)
        small = None if step.small_sq is None else step.small_sq.clone()
        meter.add_step(loss, 1, norm, step.small_sq)
        row = meter.row(1, 1e-3, norm, step)
        got[name] = {"small": small, "norm": float(norm), "batches": step.noise_batches,
                     "dp": step.dp, "row": row}
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def layout_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("noise-layouts")
    mp.start_processes(layouts_rank, args=(str(out / "store"), str(out)), nprocs=4, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def reference(name):
    """(|G_b|^2 averaged over the dp ranks, |G_B|^2, b, B, whether parameters are left out, and
    for the experts under expert parallelism over edp > 1: their |G_b|^2 averaged over the ep
    groups, their |G_B|^2, their b; else None) in one float64 process from the same initial
    weights and batches: each dp rank's gradient of its mean loss (a cp group's whole windows),
    the step's their mean (one dp rank: its first micro-batch's, the step's), an ep group's the
    mean of its dp ranks'. The parameters the layout leaves out (parallel/noise.py: the
    pipeline's tied embedding, the experts where ep = dp) are left out here; the experts
    measured at their own batch are out of the first pair."""
    from raytrain_lm.models import build_model, family

    cfg = layout_config(name)
    torch.set_default_dtype(torch.float64)  # the ranks' initial values are drawn in float64
    try:
        model = build_model(cfg.model, seed=cfg.seed)
    finally:
        torch.set_default_dtype(torch.float32)
    names = [n for n, _ in model.named_parameters()]
    tp, pp, cp, ep = cfg.tp, cfg.pp, cfg.cp, cfg.ep
    dp = 4 // (tp * pp * cp)
    expert = [i for i, n in enumerate(names) if ep > 1 and f".{family(cfg.model).experts}." in f".{n}"]
    keep = [i for i, n in enumerate(names)
            if not (cfg.pp > 1 and family(cfg.model).tied(cfg.model) and n == "wte.weight")
            and i not in expert]
    xs = [layout_batches(name, r).xs for r in range(dp)]
    if dp == 1:
        small = [grad_of(model, xs[0][:1])]
        big = grad_of(model, xs[0])
        b, big_b = len(xs[0][0]), len(xs[0][0]) * len(xs[0])
    else:
        small = [grad_of(model, x) for x in xs]
        big = [sum(gs) / dp for gs in zip(*small)]
        b = len(xs[0][0]) * len(xs[0])
        big_b = b * dp
    kept = lambda grads, which: [grads[i] for i in which]  # noqa: E731
    experts = None
    if ep > 1 and dp > ep:  # an ep group (ep consecutive dp ranks): the mean of their gradients
        groups = [[sum(gs) / ep for gs in zip(*small[g:g + ep])] for g in range(0, dp, ep)]
        experts = (sum(sq(kept(g, expert)) for g in groups) / len(groups), sq(kept(big, expert)), ep * b)
    left_out = len(keep) + (len(expert) if experts else 0) < len(names)
    return (sum(sq(kept(g, keep)) for g in small) / len(small), sq(kept(big, keep)), b, big_b,
            left_out, experts)


@pytest.mark.slow  # four spawned ranks, eleven layouts: ~60 s
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_gives_the_one_process_formula(layout_ranks, name):
    """tp (replicate, FSDP, ZeRO-2, sequence parallel: Partial gradients), pp (a tied embedding
    left out, the schedule's summed microbatches), one dp rank over tp4 or cp4 (its first
    micro-batch), cp over DDP, ZeRO-2 and with experts (each cp rank's gradient a part of its dp
    rank's: the cp ranks' cross terms), experts over ep (at their own batch ep x b where edp >
    1, left out where ep = dp), with and without accumulation: the ranks' squares summed over
    every rank (as the row's all-gather does) are the dp ranks' mean |G_b|^2 (the experts': the
    ep groups'), the clipping norm less the excluded and the experts' parts |G_B|^2, and the
    row's |G|^2 and tr(Sigma) the formula on them (summed over the two parameter sets), all
    from float64 gradients computed in one process."""
    small_ref, big_ref, b, big_b, left_out, experts = reference(name)
    got = [r[name] for r in layout_ranks]
    assert all(g["batches"] == (b, big_b) + ((experts[2],) if experts else ()) for g in got)
    small = sum(g["small"] for g in got)
    # float64 sums of the same squares in other orders (and other reduction orders of the
    # gradients): relative rounding ~1e-13 per sum
    assert float(small[0]) / got[0]["dp"] == pytest.approx(small_ref, rel=1e-9)
    assert got[0]["norm"] ** 2 - float(small[1]) - float(small[3]) == pytest.approx(big_ref, rel=1e-9)
    assert (float(small[1]) > 0) == left_out
    sets = [(small_ref, big_ref, b)]
    if experts:
        edp = got[0]["dp"] * b // experts[2]
        assert float(small[2]) / edp == pytest.approx(experts[0], rel=1e-9)
        assert float(small[3]) == pytest.approx(experts[1], rel=1e-9)
        sets.append(experts)
    else:
        assert float(small[2]) == float(small[3]) == 0
    estimates = [two_batch_estimates(s, big, small_b, big_b) for s, big, small_b in sets]
    g2, trace = sum(e[0] for e in estimates), sum(e[1] for e in estimates)
    # the estimates are differences of the squares: float64 rounding amplified by the sum of
    # the terms' magnitudes over the result's
    scale_g2 = sum((big_b * big + small_b * s) / (big_b - small_b) for s, big, small_b in sets)
    scale_trace = sum((s + big) / (1 / small_b - 1 / big_b) for s, big, small_b in sets)
    for g in got:
        assert g["row"]["noise_grad_sq"] == pytest.approx(g2, rel=1e-9 * scale_g2 / abs(g2))
        assert g["row"]["noise_trace"] == pytest.approx(trace, rel=1e-9 * scale_trace / abs(trace))
