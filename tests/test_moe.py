"""The mixture of experts (models/moe/) in one process: the layer against a token-by-token
reference, the grouped matmul against the loop, the balance loss (its value, its layout
independence, trained on but not reported), the family's counts, the expert-parallel
permutation and the 3-D initialisation. No Ray (the layouts: test_moe_parallel.py; the bad
inputs: test_bad_inputs.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from conftest import cli_here
from raytrain_lm.config.presets import preset_config
from raytrain_lm.models import build_model, family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.moe.moe import MoELayer, expert_ffn, grouped_mm_suits
from raytrain_lm.parallel.ep import apply_ep

# 2 layers, 4 experts of 48 units, 2 per token, a shared expert of 32.
SMALL = ModelConfig(arch="moe", bias=False, vocab_size=96, block_size=32, n_layer=2, n_head=4,
                    n_kv_head=2, n_embd=32, ffn_dim=48, n_experts=4, top_k=2, shared_ffn_dim=32)


def swiglu(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@pytest.mark.parametrize("norm_top_k", [True, False])
def test_the_layer_sends_each_token_to_its_top_k_experts(norm_top_k):
    """Dropless dispatch sorted by expert, the loop over experts and the combine give, for every
    token, the sum over its k likeliest experts of weight x SwiGLU_e(x) plus the shared expert,
    computed token by token. In float64: the two differ by the order of their sums (matrices of
    many rows against one), at most 48 terms, 48 * 2**-53 = 5e-15 of the terms' sizes; 1e-12."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**vars(SMALL), "norm_top_k": norm_top_k})
    model = build_model(cfg, seed=3).double()
    layer: MoELayer = model.h[0].mlp
    x = torch.randn(3, 10, cfg.n_embd, dtype=torch.float64)
    y = layer(x)
    ex = layer.experts
    expected = torch.empty_like(x)
    for b in range(3):
        for t in range(10):
            xt = x[b, t]
            probs = F.linear(xt, layer.router.weight).softmax(-1)
            w, e = probs.topk(cfg.top_k)
            if norm_top_k:
                w = w / w.sum()
            expected[b, t] = sum(w[j] * swiglu(xt, ex.gate_proj[e[j]], ex.up_proj[e[j]], ex.down_proj[e[j]])
                                 for j in range(cfg.top_k))
            expected[b, t] += swiglu(xt, layer.shared.gate_proj.weight, layer.shared.up_proj.weight,
                                     layer.shared.down_proj.weight)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_the_grouped_matmul_equals_the_loop_in_bf16():
    """In bf16 the experts run as torch's grouped matmul (CPU and CUDA have one), in fp32 as a
    loop; on the same rows (one expert given none) both give the same outputs and gradients,
    to bf16's rounding."""
    torch.manual_seed(0)
    E, D, H = 4, 32, 48
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(int(counts.sum()), D, requires_grad=True)
    weights = [torch.randn(E, H, D) * 0.1, torch.randn(E, H, D) * 0.1, torch.randn(E, D, H) * 0.1]
    weights = [w.requires_grad_() for w in weights]
    assert grouped_mm_suits(x.bfloat16(), H) and not grouped_mm_suits(x, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_mm_suits(x, H)  # autocast's dtype decides
        grouped = expert_ffn(x, counts, *weights)
    grouped.float().square().sum().backward()
    by_grouped = [t.grad.clone() for t in (x, *weights)]
    for t in (x, *weights):
        t.grad = None
    looped = expert_ffn(x.bfloat16(), counts, *(w.bfloat16() for w in weights))
    looped.float().square().sum().backward()
    torch.testing.assert_close(grouped.float(), looped.float(), rtol=2e-2, atol=2e-2)
    for a, t in zip(by_grouped, (x, *weights)):
        torch.testing.assert_close(a.float(), t.grad.float(), rtol=5e-2, atol=5e-2)
    assert weights[0].grad[1].abs().sum() == 0  # the expert without rows


def balance(layer, x):
    layer.train()
    layer(x)
    return layer.take_aux_loss() / layer.aux_weight


def test_the_balance_loss_is_one_when_balanced_and_the_same_for_any_split_of_the_batch():
    """E * sum_e f_e P_e (f: the share of routed slots, P: the mean probability): 1.0 under a
    router that gives every expert the same probability, about 2 under one that gives expert 0
    nearly all of it (each token's first pick); computed per sequence, so a batch's loss is the
    mean of its halves' (the data-parallel ranks' and micro-batches' losses average to the one
    worker's). The split in float64 (a mean of 8 sequences' against two of 4: they differ by the
    order of float64 sums, ~1e-16; 1e-12)."""
    torch.manual_seed(0)
    layer = build_model(SMALL, seed=3).h[0].mlp.double()
    x = torch.randn(8, 16, SMALL.n_embd, dtype=torch.float64)
    halves = (balance(layer, x[:4]) + balance(layer, x[4:])) / 2
    assert balance(layer, x).item() == pytest.approx(halves.item(), rel=1e-12)
    with torch.no_grad():
        layer.router.weight.zero_()
    assert balance(layer, x).item() == pytest.approx(1.0, rel=1e-6)
    u = F.normalize(torch.randn(SMALL.n_embd), dim=0)
    with torch.no_grad():
        layer.router.weight[0] = 5 * u
    assert balance(layer, x + 3 * u).item() == pytest.approx(2.0, rel=0.02)


def test_the_aux_loss_is_trained_on_but_not_reported():
    """In training the decoder's loss is still the cross-entropy (the value eval mode gives), but
    its gradient is the cross-entropy's plus the balance loss's: the routers' gradients move with
    model.aux_loss_coef, the rest do not depend on it. The layers keep their statistics: tokens
    per expert (k per token) and one forward."""
    torch.manual_seed(0)
    idx = torch.randint(0, SMALL.vocab_size, (4, 16))
    grads, losses = {}, {}
    for coef in (0.0, 0.5):
        cfg = ModelConfig(**{**vars(SMALL), "aux_loss_coef": coef})
        model = build_model(cfg, seed=3)
        loss = model(idx, idx)[1]
        loss.backward()
        losses[coef] = loss.item()
        grads[coef] = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.eval()
        assert model(idx, idx)[1].item() == pytest.approx(loss.item(), abs=0)
        stats = model.h[1].mlp.stats
        assert stats[:4].sum().item() == 4 * 16 * 2 and stats[-1].item() == 1
    assert losses[0.0] == losses[0.5]
    assert not torch.equal(grads[0.0]["h.0.mlp.router.weight"], grads[0.5]["h.0.mlp.router.weight"])
    torch.testing.assert_close(grads[0.0]["lm_head.weight"], grads[0.5]["lm_head.weight"], rtol=0, atol=0)


def test_the_aux_losses_trained_on_are_the_coefficients_times_their_mean_over_layers():
    """What the decoder adds to the loss (take_aux_losses, the sum of the layers' terms) is
    aux_loss_coef times the mean over the layers of their balance losses, plus z_loss_coef times
    the mean of their z-losses: each layer weighs its own by coef / n_layer. A layer weighing by
    the whole coefficient makes them n_layer (here 4) times too strong, and the metrics (the
    layers' statistics, the plain losses) do not show it. fp32: a sum of 4 terms, 1e-6."""
    from raytrain_lm.models.decoder import take_aux_losses

    cfg = ModelConfig(**{**vars(SMALL), "n_layer": 4, "aux_loss_coef": 0.3, "z_loss_coef": 0.02})
    model = build_model(cfg, seed=3).train()
    x = torch.randn(4, 16, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    for block in model.h:
        block.mlp(x)
    stats = torch.stack([block.mlp.stats for block in model.h])  # per layer: ..., balance, z, 1
    expected = 0.3 * stats[:, -3].mean() + 0.02 * stats[:, -2].mean()
    assert take_aux_losses(model).item() == pytest.approx(expected.item(), rel=1e-6)


def _ep_case():
    """SMALL in float64, and a batch of 8 sequences (each ep rank reads 4)."""
    model = build_model(SMALL, seed=3).double().train()
    return model, torch.randint(0, SMALL.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))


def _ep_grads(rank, store, out):
    """One ep rank (forked: the modules above are imported already, so a rank costs no imports)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model, idx = _ep_case()
    apply_ep(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"], list(model.h))
    mine = idx[4 * rank:4 * rank + 4]
    model(mine, mine)[1].backward()
    grads = {}
    for name, p in model.named_parameters():
        if isinstance(p.grad, DTensor):  # an expert's: the group's mean already (ep.py)
            grads[name] = p.grad.full_tensor()
        else:  # the rest: data parallelism's mean over the ranks
            dist.all_reduce(p.grad)
            grads[name] = p.grad / 2
    if rank == 0:
        torch.save(grads, out)
    dist.destroy_process_group()


@pytest.mark.slow  # two forked gloo ranks: 4-6 s of CPU at load 17 (the harness's ep runs: minutes)
def test_expert_parallelism_gives_every_gradient_of_one_process(tmp_path):
    """ep 2 on two gloo ranks, each with half the batch: with the experts' gradients as the
    all-to-all's backward leaves them and the rest averaged as data parallelism does, every
    parameter's gradient is one process's on the whole batch. The outputs must come back to
    their tokens (the inverse permutation) and the experts' gradients be scaled by 1/ep and
    their inputs' by ep: a wrong permutation changes the loss, a wrong scale doubles or halves
    gradients, which AdamW's steps hardly show in the losses (the harness test of the ep2 layout
    caught it only by 1.1-3.5x its tolerance). In float64, so the two differ only by the order
    of float64 sums (<= 512 routed rows a matmul: at most 512 * 2**-53 = 6e-14 of the terms'
    sizes): 1e-10 of each tensor's largest entry leaves room for cancellation."""
    mp.start_processes(_ep_grads, args=(tmp_path / "store", tmp_path / "grads.pt"), nprocs=2,
                       start_method="fork")
    model, idx = _ep_case()
    model(idx, idx)[1].backward()
    grads = torch.load(tmp_path / "grads.pt")
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        assert grads[name].dtype == torch.float64
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-10 * p.grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_moe_tiny_and_the_counts():
    """moe-tiny: 1,838,208 parameters with bytes, 1,051,776 active (2 of 4 experts), as the model
    built on the meta device holds them; FLOPs count the active matrices."""
    m = preset_config("moe-tiny").model
    m.vocab_size = 256
    f = family(m)
    with torch.device("meta"):
        model = build_model(m)
    assert model.num_params() == f.counts(m).total == 1_838_208
    inactive = m.n_layer * 2 * 3 * m.n_embd * m.ffn_dim  # 2 of the 4 experts per block
    assert f.active_params(m) == 1_838_208 - inactive == 1_051_776
    assert f.matmul_params(m) == f.active_params(m) - 256 * m.n_embd  # the embedding is a lookup
    assert f.expert_params(m) == 4 * 3 * m.n_embd * m.ffn_dim


def test_expert_major_order():
    """The rows an expert-parallel rank receives (rank-major: rank 0's rows for its experts 0, 1,
    then rank 1's) reordered expert-major (expert 0's rows from rank 0 then rank 1, ...)."""
    from raytrain_lm.parallel.ep import expert_major

    by_rank = torch.tensor([[2, 1], [0, 3]])  # rank 0 sends 2 rows to expert 0, 1 to expert 1...
    # rows: r0e0 r0e0 r0e1 r1e1 r1e1 r1e1 -> e0: 0, 1; e1: 2 (rank 0), 3, 4, 5 (rank 1)
    assert expert_major(by_rank, 6).tolist() == [0, 1, 2, 3, 4, 5]
    by_rank = torch.tensor([[1, 2], [3, 0]])  # r0e0 r0e1 r0e1 r1e0 r1e0 r1e0
    assert expert_major(by_rank, 6).tolist() == [0, 3, 4, 5, 1, 2]


def test_the_experts_initialise_by_rows_as_any_shard_does():
    """3-D expert weights initialise by expert: the rows of a shard (experts 2..3) are the full
    tensor's, so an expert-parallel rank fills its experts with the one-process values."""
    from raytrain_lm.models.decoder import init_region_

    full, part = torch.empty(4, 6, 5), torch.empty(2, 6, 5)
    init_region_(full, "h.0.mlp.experts.up_proj", ("normal", 0.02), full.shape, (0, 0, 0), seed=7)
    init_region_(part, "h.0.mlp.experts.up_proj", ("normal", 0.02), full.shape, (2, 0, 0), seed=7)
    assert torch.equal(full[2:], part)


# ---------------------------------------------------------------- the planner

@pytest.mark.parametrize("preset,total,active", [("mixtral-8x7b", 46.7e9, 12.9e9),
                                                 ("mixtral-8x22b", 141e9, 39e9),
                                                 ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                                 ("qwen3-235b-a22b", 235e9, 22e9)])
def test_released_moe_presets_have_the_published_counts(preset, total, active):
    """Mistral's and Qwen's published totals and active parameters (46.7B / 12.9B, 141B / 39B,
    30.5B / 3.3B, 235B / 22B) as the meta-built model and the planner count them: the totals
    within 0.5%, the active counts within one of the published figure's last digit (Qwen's 3.3B
    is 3.35B, its 22B 22.19B)."""
    m = preset_config(preset).model
    with torch.device("meta"):
        model = build_model(m)
    assert model.num_params() == family(m).counts(m).total == pytest.approx(total, rel=0.005)
    digit = 1e9 if active % 1e9 == 0 else 0.1e9  # the published figure's last digit
    assert abs(family(m).active_params(m) - active) < digit


def small_moe_plan(ep: int, strategy: str, ac: str = "none"):
    from raytrain_lm.config.layout import Layout
    from raytrain_lm.plan.estimate import estimate_layout
    from raytrain_lm.plan.hardware import Cluster

    m = ModelConfig(**{**vars(SMALL), "shared_ffn_dim": 0})
    lay = Layout(dp=8, tp=1, pp=1, strategy=strategy, ac=ac, sp=False, schedule="-", micro_batch=2,
                 microbatches=1, seq_len=32, ep=ep)
    return m, lay, estimate_layout(m, lay, Cluster(gpus=8, gpus_per_node=8, precision="bf16"))


def test_the_plan_holds_the_experts_over_ep_and_counts_the_all_to_alls():
    """DDP keeps every parameter whole but the experts, split over ep (4 bytes x 3/4 of them
    fewer at ep 4); FSDP spreads all of them over dp whatever ep (the experts over ep x edp),
    and gathers only a rank's E/ep experts of a block. The all-to-alls: dispatch and combine,
    forward and backward, per MoE layer and micro-batch, b s k h values of 2 bytes, (ep-1)/ep
    of them leaving the GPU; 6 per layer where full checkpointing reruns the forward."""
    m, _, one = small_moe_plan(1, "ddp")
    _, lay, four = small_moe_plan(4, "ddp")
    experts = m.n_layer * family(m).expert_params(m)
    assert one.memory.params - four.memory.params == pytest.approx(4 * experts * 3 / 4)
    assert one.comm.ep == 0
    one_call = 2 * 32 * m.top_k * m.n_embd * 2 * 3 / 4
    assert four.comm.ep == pytest.approx(m.n_layer * 4 * one_call)
    assert small_moe_plan(4, "ddp", "full")[2].comm.ep == pytest.approx(m.n_layer * 6 * one_call)
    _, _, sharded1 = small_moe_plan(1, "fsdp")
    _, _, sharded4 = small_moe_plan(4, "fsdp")
    assert sharded1.memory.params == pytest.approx(sharded4.memory.params)
    # per gathered block element: two blocks in bf16 (4 bytes), one's bf16 gradient and its fp32
    # copy for the reduce-scatter (2 + 4); E/ep of the experts of each
    assert sharded1.memory.gathered - sharded4.memory.gathered == pytest.approx(
        10 * family(m).expert_params(m) * 3 / 4)


def test_plan_prints_total_and_active_parameters_and_ranks_ep_layouts():
    """`plan --preset mixtral-8x7b` says 46.7B parameters, 12.9B active, and ranks its layouts
    with an ep column and their all-to-all GB; on 16 H100s the fastest (what --layout auto
    trains) splits the experts over a node's 8 GPUs."""
    from raytrain_lm.config.load import build_config
    from raytrain_lm.plan.auto import choose_layout
    from raytrain_lm.plan.hardware import kind_cluster

    out = cli_here("plan", "--preset", "mixtral-8x7b", "--gpus", "16", "--tp", "1", "--pp", "1")
    assert out.returncode == 0, out.stderr
    assert "46,702,792,704 parameters (46.70B), 12,879,925,248 active per token (12.88B" in out.stdout
    header = next(line for line in out.stdout.splitlines() if line.lstrip().startswith("#"))
    assert " ep " in header and "ep GB" in header and "--ep " in out.stdout
    cfg = build_config(preset="mixtral-8x7b", flags=dict(workers=16, use_gpu=True, batch_size=1))
    best, why = choose_layout(cfg, kind_cluster("h100-sxm", 16, memory_gb=80, gpu=True, precision="bf16"))
    assert best.layout.ep == 8 and "EP 8 inside a node" in why
    best.layout.apply(cfg)
    assert cfg.ep == 8 and "--ep 8" in best.layout.flags()


class HostReads:
    """Counts what would make a CUDA step wait for the device (a sync), on any device: the ops
    that read a tensor's values on the host (item, nonzero, bincount: its CUDA kernel reads the
    min and max, repeat_interleave without output_size: the total), seen by a dispatch mode,
    and tensors turned into Python lists (tolist reads below the dispatcher, so it is wrapped)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.bincount.default, torch.ops.aten.masked_select.default}

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.reads = []
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in HostReads.READS or (func is torch.ops.aten.repeat_interleave.Tensor
                                               and kwargs.get("output_size") is None):
                    counter.reads.append(str(func))
                return func(*args, **kwargs)

        tolist = torch.Tensor.tolist

        def counted_tolist(t):
            counter.reads.append("tolist")
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_moe_step_reads_the_device_once_per_layer_at_most(monkeypatch, ep, dtype):
    """A training step of the MoE layers (forward and backward) reads device values on the host
    once per layer at most: never with every expert here in bf16 (the grouped matmul), once
    for the loop's split sizes in fp32, once through the expert-parallel all-to-all (its split
    sizes, the loop's with them): here on a one-rank gloo group, counted by HostReads (CUDA's
    sync debug mode needs CUDA). Counting with bincount read the device twice per layer on
    CUDA, repeat_interleave without output_size once more."""
    import torch.distributed as dist

    from raytrain_lm.parallel.ep import AllToAllDispatch

    model = build_model(SMALL, seed=0).train()
    x = torch.randn(2, 8, SMALL.n_embd, requires_grad=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layers = [block.mlp for block in model.h]
        if ep:
            for layer in layers:
                layer.dispatch = AllToAllDispatch(dist.group.WORLD)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), \
                HostReads(monkeypatch) as counted:
            y = x
            for layer in layers:
                y = layer(y)
            (y.float().square().sum() + sum(layer.take_aux_loss() for layer in layers)).backward()
    finally:
        dist.destroy_process_group()
    assert x.grad is not None and all(layer.experts.gate_proj.grad is not None for layer in layers)
    grouped_here = dtype == torch.bfloat16 and not ep
    assert counted.reads == ([] if grouped_here else ["tolist"] * len(layers)), counted.reads


def test_blackwell_takes_the_loop_until_its_grouped_matmul_zeroes_idle_experts():
    """The grouped matmul on CUDA from sm80 (Ampere, Hopper) but not on compute capability 10.x
    (B200/GB200), whose grouped matmul gives experts without tokens non-zero gradients."""
    from raytrain_lm.models.moe.moe import grouped_mm_capable

    assert grouped_mm_capable((8, 0)) and grouped_mm_capable((9, 0)) and grouped_mm_capable((12, 0))
    assert not grouped_mm_capable((7, 5)) and not grouped_mm_capable((10, 0))
    assert not grouped_mm_capable((10, 3))


def _moe_step():
    """A TrainStep of a small MoE (the module itself, no DDP wrapper)."""
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.worker.step import TrainStep

    cfg = TrainConfig()
    for k, v in vars(SMALL).items():
        setattr(cfg.model, k, v)
    cfg.batch_size, cfg.seq_len, cfg.warmup_steps = 2, 8, 0
    return TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda m: m)


class _Batches:
    def __init__(self):
        self.g = torch.Generator().manual_seed(0)

    def next(self):
        t = torch.randint(0, SMALL.vocab_size, (2, 9), generator=self.g)
        return t[:, :-1], t[:, 1:]


def test_moe_metrics_ride_in_the_sends_one_gather():
    """The mixture of experts' row keys (aux_loss, z_loss, expert_load) are made global in the
    one all-gather of a send with the rows' other values: three rows kept, then sent, make one
    collective (two per kept row before: a width and a table all-reduce). Each row's values are
    those of its own interval's statistics (here in one process: the layers' own)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from raytrain_lm.parallel.ep import moe_layers
    from raytrain_lm.worker.metrics import Meter

    step = _moe_step()
    meter = Meter(torch.device("cpu"), 1, 1.0, None, 1, 0.0)  # values: no process group
    batches, expected = _Batches(), []
    for s in (1, 2, 3):
        for _ in range(s):  # intervals of 1, 2 and 3 steps
            meter.add_step(step(batches, 1e-3)[0], 16)
        table = torch.stack([layer.stats for _, layer in moe_layers(step.parts[0])])
        expected.append(((table[:, -3] / table[:, -1]).mean().item(),
                         (table[:, :-3].max(1).values / table[:, :-3].mean(1)).tolist()))
        meter.keep(s, 1e-3, torch.tensor(1.0), step)
        meter.next_interval(exclude_since_row=False)
    rows = meter.rows()
    assert [(r["aux_loss"], r["expert_load"]) for r in rows] == expected
    assert all(r["z_loss"] > 0 for r in rows)

    calls = []

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                calls.append(str(func))
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        meter = Meter(torch.device("cpu"), 2, 1.0, None, 1, 0.0)  # collectives: two fake ranks
        for s in (1, 2, 3):
            meter.add_step(step(batches, 1e-3)[0], 16)
            with Collectives():
                meter.keep(s, 1e-3, torch.tensor(1.0), step)
            meter.next_interval(exclude_since_row=False)
        with Collectives():
            rows = meter.rows()
    finally:
        dist.destroy_process_group()
    assert len(rows) == 3 and len(calls) == 1, calls


@pytest.mark.parametrize("rank", [0, 5, 9])
def test_the_tied_group_joins_the_end_stages_under_ep_and_tp(rank):
    """A tied embedding at --pp 3 --ep 2 --tp 2 (12 workers, a 4-D mesh pp, edp, ep, tp): each
    rank of the first or last stage is grouped with the rank of the other end stage at the same
    (edp, ep, tp) coordinates, 8 ranks apart (the group computation raised on 4-D meshes);
    a middle stage's rank joins none. On fake ranks: the groups' members, not their traffic."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from raytrain_lm.config.layout import Layout
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.parallel.mesh import build_mesh
    from raytrain_lm.parallel.pp import tied_group

    cfg = TrainConfig()
    for k, v in vars(SMALL).items():
        setattr(cfg.model, k, v)
    cfg.pp, cfg.ep, cfg.tp, cfg.strategy, cfg.batch_size = 3, 2, 2, "fsdp", 12
    layout = Layout.of(cfg, 12)
    assert layout.mesh_shape == {"pp": 3, "edp": 1, "ep": 2, "tp": 2}
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=12)
    try:
        group = tied_group(build_mesh(torch.device("cpu"), layout))
        members = None if group is None else dist.get_process_group_ranks(group)
    finally:
        dist.destroy_process_group()
    per_stage = 12 // 3
    stage, within = divmod(rank, per_stage)
    assert members == (None if stage == 1 else [within, within + 2 * per_stage])
