"""The planner's hardware, network, framework and compute model (issue 44), checked by hand on
small numbers and through `plan`: the GPU kinds and the defaults a named GPU gives, the NICs a
group spanning nodes uses, FSDP's gradient accumulation and ZeRO-1 per framework, uneven interleaved
pipelines, the compute time by part, and the fitted constants `plan` names. No Ray."""

import json
from dataclasses import replace

import pytest

from conftest import cli_here
from raytrain_lm.config.layout import Layout
from raytrain_lm.config.presets import preset_config
from raytrain_lm.models import family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan import calibration, network
from raytrain_lm.plan.comm import rank_comm
from raytrain_lm.plan.estimate import estimate_layout, plan
from raytrain_lm.plan.frameworks import FRAMEWORKS, apply
from raytrain_lm.plan.hardware import GIB, Cluster, kind_cluster
from raytrain_lm.plan.kernels import layer_bytes, rank_compute_seconds
from raytrain_lm.plan.kinds import PATH, kind, kinds
from raytrain_lm.plan.memory import rank_memory
from raytrain_lm.plan.printout import PROFILE_CLAUSE
from raytrain_lm.plan.stages import rank_stages

TINY = ModelConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=False)


def test_every_kind_has_its_figures_and_their_sources():
    raw = json.loads(PATH.read_text())
    for key, k in raw["kinds"].items():
        assert k["sources"] and all(s in raw["sources"] for s in k["sources"]), key
        assert ("matmul_fraction" in k) != ("matmul_from" in k), key  # measured, or the same chip's
        got = kind(key)
        assert 0 < got.matmul_fraction < 1 and got.half_tflops > 0 and got.hbm_tbps > 0
        assert got.fp32_tflops < got.fp16_tflops and got.bf16_tflops in (None, got.fp16_tflops)
        assert got.memory_gb > 0 and got.intra_gbs > 0 and got.inter_gbps > 0
    assert kind("h200").matmul_fraction == kind("h100-sxm").matmul_fraction == pytest.approx(794.5 / 989, abs=1e-3)
    assert kind("a100-80gb").matmul_fraction == pytest.approx(271.2 / 312, abs=1e-3)
    assert {"h100-sxm", "h100-pcie", "h100-nvl", "h200", "h800", "b200", "a100-80gb", "a100-40gb",
            "l40s", "a10g", "mi300x"} <= set(kinds())


def test_plan_takes_every_default_from_the_named_gpu():
    """An A100 plan gets the A100's peak, memory, links and achievable rate, not the H100's
    (the CLI's ceiling was the H100's for every GPU); a flag overrides one figure."""
    cheap = ("--tp", "1", "--pp", "1", "--strategy", "ddp")  # one structure planned: fast
    a100 = cli_here("plan", "--preset", "gpt2", "--gpus", "16", "--gpu", "a100-80gb", "--json", *cheap)
    assert a100.returncode == 0, a100.stderr
    cl = json.loads(a100.stdout)["cluster"]
    assert (cl["tflops"], cl["memory_gb"], cl["hbm_tbps"], cl["intra_gbps"], cl["inter_gbps"]) == \
        (312, 80, 2.039, 2400, 200)
    assert cl["matmul_fraction"] == pytest.approx(0.869) and cl["kind"] == "a100-80gb"
    h100 = json.loads(cli_here("plan", "--preset", "gpt2", "--gpus", "16", "--json", *cheap).stdout)["cluster"]
    assert (h100["tflops"], h100["matmul_fraction"]) == (989, pytest.approx(0.803))
    mine = json.loads(cli_here("plan", "--preset", "gpt2", "--gpus", "16", "--gpu", "a100-40gb",
                               "--gpu-memory-gb", "32", "--json", *cheap).stdout)["cluster"]
    assert (mine["memory_gb"], mine["tflops"], mine["hbm_tbps"]) == (32, 312, 1.555)
    r = cli_here("plan", "--preset", "gpt2", "--gpus", "8", "--gpu", "h300")
    assert r.returncode == 2 and "--gpu must be one of h100-sxm" in r.stderr


def test_plan_names_the_fitted_constants_beside_its_estimates():
    cheap = ("--tp", "1", "--pp", "1", "--strategy", "ddp")
    r = cli_here("plan", "--preset", "gpt2", "--gpus", "8", "--gpu", "h100-sxm-96gb-500w", *cheap)
    line = next(x for x in r.stdout.splitlines() if x.startswith("fitted: "))
    c = calibration.constants()
    for name in ("eta", "clock_factor:h100-sxm-96gb-500w", "allocator", "f_half"):
        assert f"{c[name]['label']} {c[name]['value']:.3g} (" in line
        assert f" on {len(c[name]['rows'])} published row" in line or f"by {len(c[name]['rows'])} published row" in line
    assert "500 W clock" not in cli_here("plan", "--preset", "gpt2", "--gpus", "8", *cheap).stdout
    assert line.endswith(PROFILE_CLAUSE)  # plan says which profile it plans: this project's trainer
    out = json.loads(cli_here("plan", "--preset", "gpt2", "--gpus", "8", "--json", *cheap).stdout)
    assert {x["name"]: len(x["rows"]) for x in out["fitted_constants"]} == \
        {n: len(c[n]["rows"]) for n in ("eta", "f_half", "allocator")}


def test_a_group_across_nodes_uses_all_the_nodes_nics():
    """NICs of 100 Gb/s per GPU share (8 per node of 8), links 1000 Gb/s inside a node, 80% of
    each reached. dp over all 16 GPUs (2 nodes, 8 dp ranks per node): the node's 8 NICs at once,
    8 x 100 = 800 Gb/s per GPU (it charged one NIC: 100). With tp 8 inside each node each dp
    group has one rank per node: one NIC's worth. pp with dp x tp = 4 (2 pp ranks per node): two
    NICs' worth. Capped at the links inside the node."""
    cl = Cluster(gpus=16, gpus_per_node=8, intra_gbps=1000, inter_gbps=100)
    dp16 = Layout(16, 1, 1, "ddp", "none", False, "-", 1, 1, 8)
    assert network.bandwidth(cl, dp16, "dp") == pytest.approx(800e9 / 8 * 0.8)
    tp8 = Layout(2, 8, 1, "ddp", "none", False, "-", 1, 1, 8)
    assert network.bandwidth(cl, tp8, "dp") == pytest.approx(100e9 / 8 * 0.8)
    assert network.bandwidth(cl, tp8, "tp") == pytest.approx(1000e9 / 8 * 0.8)
    pp4 = Layout(2, 2, 4, "ddp", "none", False, "1f1b", 1, 4, 8)
    assert network.bandwidth(cl, pp4, "pp") == pytest.approx(200e9 / 8 * 0.8)
    assert network.bandwidth(replace(cl, inter_gbps=500), dp16, "dp") == pytest.approx(1000e9 / 8 * 0.8)
    inside = Layout(8, 1, 1, "ddp", "none", False, "-", 1, 1, 8)
    assert network.bandwidth(replace(cl, gpus=8), inside, "dp") == pytest.approx(1000e9 / 8 * 0.8)


def test_fsdp_accumulation_with_and_without_a_reduce_scatter_per_micro_step():
    """FSDP2 under no_sync (this project) keeps every unsharded fp32 gradient until the last of
    4 micro-steps; FSDP1 under Composer reduce-scatters each micro-step: it holds the shard only
    and sends 4 reduce-scatters (30B on 8 A100s planned 180 GiB against 72 under the first
    model, and ran)."""
    lay = Layout(4, 1, 1, "fsdp", "none", False, "-", 2, 4, 8)
    only = rank_stages(TINY, 1, 1)[0]
    mine, composer = Cluster(gpus=4), apply(Cluster(gpus=4), "composer-fsdp")
    held = sum([2 * 784, 200])  # the rank's parameters: 2 blocks, root (wte, wpe, ln_f)
    a, b = rank_memory(TINY, lay, mine, only, 0), rank_memory(TINY, lay, composer, only, 0)
    # unsharded: every fp32 gradient and a block's bf16 one; per micro-step: a block's and the
    # head's bf16 gradients and a block's fp32 copy for its reduce-scatter
    assert a.gathered - b.gathered == held * 4 + 784 * 2 - ((784 + 128) * 2 + 784 * 4)
    assert rank_comm(TINY, lay, composer, only).dp_reduce == 4 * rank_comm(TINY, lay, mine, only).dp_reduce
    assert FRAMEWORKS["composer-fsdp"].accumulate == "reduce_scatter"
    m = preset_config("gpt2").model
    m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.block_size, m.bias = 48, 56, 7168, 50368, 2048, False
    big = Layout(8, 1, 1, "fsdp", "full", False, "-", 3, 21, 2048)
    cl = kind_cluster("a100-80gb", 8)
    assert not estimate_layout(m, big, cl).fits and estimate_layout(m, big, apply(cl, "composer-fsdp")).fits


def test_zero1_is_fsdp2s_here_and_each_frameworks_own_in_its_rows():
    """This project's ZeRO-1 is FSDP2's: parameters and gradients sharded at rest, a bf16 gather
    and an fp32 reduce-scatter a step, overlapped with compute. DeepSpeed's (MT-NLG's and
    BLOOM's profile) keeps the whole parameters and gradients, all-reduces the fp32 gradients and
    gathers the updated bf16 parameters after the optimizer step, both exposed; Megatron-LM's
    distributed optimizer reduce-scatters its (fp16) gradients instead of the all-reduce."""
    lay = Layout(4, 1, 1, "zero1", "none", False, "-", 2, 1, 8)
    only = rank_stages(TINY, 1, 1)[0]
    held = 1768  # the rank's parameters: 2 blocks of 784, wte, wpe and ln_f
    mine, deepspeed, megatron = (apply(Cluster(gpus=4), name)
                                 for name in ("raytrain-lm", "megatron-deepspeed", "megatron-2022"))
    m = rank_memory(TINY, lay, mine, only, 0)
    assert (m.params, m.grads, m.optimizer) == (held, held, 2 * held) and m.gathered > 0
    c = rank_comm(TINY, lay, mine, only)
    assert (c.dp_gather, c.dp_reduce) == (3 / 4 * 2 * held, 3 / 4 * 4 * held)
    d = rank_memory(TINY, lay, deepspeed, only, 0)
    assert (d.params, d.grads, d.optimizer, d.gathered) == (4 * held, 4 * held, 2 * held, 0)
    c = rank_comm(TINY, lay, deepspeed, only)
    assert (c.dp_gather, c.dp_reduce) == (3 / 4 * 2 * held, 2 * 3 / 4 * 4 * held)
    c = rank_comm(TINY, lay, megatron, only)
    assert (c.dp_gather, c.dp_reduce) == (3 / 4 * 2 * held, 3 / 4 * 2 * held)
    gpt2 = preset_config("gpt2").model
    gpt2.vocab_size = 50304
    big = Layout(16, 1, 1, "zero1", "none", False, "-", 8, 1, 1024)
    cl = Cluster(gpus=16, gpus_per_node=8, efficiency=0.5)
    here, there = estimate_layout(gpt2, big, cl), estimate_layout(gpt2, big, apply(cl, "megatron-deepspeed"))
    bw = network.bandwidth(cl, big, "dp")
    assert here.dp_exposed_s == pytest.approx(max(0.0, here.comm.dp / bw - here.compute_s))
    assert there.dp_exposed_s == pytest.approx(there.comm.dp / bw)
    assert there.dp_exposed_s > here.dp_exposed_s


def test_uneven_pipeline_with_more_stages_per_gpu():
    """126 layers over pp 16 x v 7 = 112 stages: the 14 extra layers go to the middle stages
    (one each), the first and last ranks, which hold the embedding and the head, stay short; the
    planner tries every v to 8 (it stopped at 2 where the layers did not divide evenly) and runs
    at the slowest rank's pace."""
    from raytrain_lm.plan.estimate import virtual_stage_counts

    m = preset_config("llama3-405b").model
    ranks = rank_stages(m, 16, 7)
    layers = [sum(st.layers for st in r) for r in ranks]
    assert sum(layers) == 126 and layers[0] == layers[-1] == 7 and max(layers) == 8
    assert virtual_stage_counts(m, 16) == [2, 3, 4, 5, 6, 7]
    cl = kind_cluster("h100-sxm", 256)
    ranked = plan(m, cl, 256, 8192, tp=8, pp=16, strategy="fsdp")
    assert {e.layout.v for e in ranked if e.layout.schedule == "interleaved-1f1b"} == {2, 3, 4, 5, 6, 7}


def test_compute_time_by_hand():
    """TINY on one GPU of 1e12 FLOP/s peak, matmuls at 0.5 of it before the size factor, flash
    attention at 0.25, 1 TB/s of HBM, fused kernels and loss, bf16: one micro-batch of 2 x 8 tokens.
    matmuls 6 x (2 x 768 + 16 x 8) = 9984 FLOPs per token; attention 2 x 4 x 8 x 8 x 3 = 1536
    FLOPs per token on half the scores; memory-bound elements per token: 2 layers x (norms 2 x
    5 x 8 + residual adds 2 x 6 x 8 + GeLU 20 x 8) + the loss 2 x 16 = 704, 2 bytes each; AdamW 32
    bytes per parameter (1768 + 64); all over the fitted kernel efficiency."""
    cl = Cluster(gpus=1, tflops=1.0, matmul_fraction=0.5, attention_fraction=0.25, hbm_tbps=1.0,
                 kernels="fused", loss="fused", precision="bf16")
    lay = Layout(1, 1, 1, "ddp", "none", False, "-", 2, 1, 8)
    f = 2 * 2 * 8 * 8 * 8
    rate = 0.5e12 * f / (f + 1e10 * 0.5e12 / (312e12 * 0.869))
    p = rank_compute_seconds(TINY, lay, cl, rank_stages(TINY, 1, 1)[0], 1768 + 64)
    assert layer_bytes(TINY, "fused") == ((2 * 2 * 8 + 2 * 3 * 8, 2 * 3 * 8 + 2 * 3 * 8), (8 * 8, 12 * 8))
    assert p["matmul"] == pytest.approx(9984 * 16 / rate)
    assert p["attention"] == pytest.approx(0.5 * 1536 * 16 / 0.25e12)
    assert p["memory"] == pytest.approx((704 * 2 * 16 + 32 * (1768 + 64)) / 1e12)
    assert p["total"] == pytest.approx((p["matmul"] + p["attention"] + p["memory"]) / calibration.constant("eta"))
    eager = rank_compute_seconds(TINY, lay, replace(cl, loss="fp32"), rank_stages(TINY, 1, 1)[0], 1832)
    assert eager["memory"] - p["memory"] == pytest.approx((16 - 2) * 16 * 2 * 16 / 1e12)


def test_framework_inputs_of_memory_and_sends():
    """A fused MLP does not save its activation's output (4h for the GPT); a fused loss holds the
    logits and their gradient in bf16 rather than three fp32 tensors; Megatron's scatter/gather
    splits pipeline sends over tp; its backward tp all-reduces hide behind the weight gradients."""
    from raytrain_lm.plan.comm import pp_send_bytes
    from raytrain_lm.plan.memory import layer_activation_bytes, logits_bytes

    lay = Layout(1, 2, 2, "ddp", "none", False, "1f1b", 2, 2, 8)
    cl = Cluster(gpus=4, precision="bf16")
    fused = replace(cl, kernels="fused", loss="fused")
    assert layer_activation_bytes(TINY, lay, cl, "none") - layer_activation_bytes(TINY, lay, fused, "none") == \
        2 * 8 * 8 * 4 / 2 * 2
    last = [rank_stages(TINY, 2, 1)[1][0]]
    assert logits_bytes(TINY, lay, cl, last) == 2 * 8 * 16 / 2 * 12
    assert logits_bytes(TINY, lay, fused, last) == 2 * 8 * 16 / 2 * 4
    assert pp_send_bytes(TINY, lay, apply(cl, "megatron-2021")) == pp_send_bytes(TINY, lay, cl) / 2
    plain = estimate_layout(TINY, lay, replace(cl, efficiency=0.5))
    hidden = estimate_layout(TINY, lay, replace(cl, efficiency=0.5, tp_overlap_backward=True))
    assert hidden.tp_s == pytest.approx(plain.tp_s * (1 - 2 / 4))
    assert family(TINY).tp_counts(TINY, 2)["block"] > 0  # counts unchanged by the framework
    assert GIB == 2 ** 30


def test_a_software_generation_divides_by_its_own_efficiency():
    """The same compute over each generation's fitted kernel efficiency: megatron-core-2024 and
    Meta's stack over eta:2024, this project's trainer (plan's default cluster) over eta."""
    cl = Cluster(gpus=1, tflops=1.0, matmul_fraction=0.5, attention_fraction=0.25, hbm_tbps=1.0,
                 kernels="fused", loss="fused", precision="bf16")
    lay = Layout(1, 1, 1, "ddp", "none", False, "-", 2, 1, 8)
    stages = rank_stages(TINY, 1, 1)[0]
    old = rank_compute_seconds(TINY, lay, cl, stages, 1832)
    new = rank_compute_seconds(TINY, lay, replace(cl, eta_key="eta:2024"), stages, 1832)
    assert new["total"] == pytest.approx((new["matmul"] + new["attention"] + new["memory"])
                                         / calibration.constant("eta:2024"))
    assert new["total"] / old["total"] == pytest.approx(calibration.constant("eta") / calibration.constant("eta:2024"))
    assert apply(cl, "megatron-core-2024").eta_key == apply(cl, "meta-llama3").eta_key == "eta:2024"
    assert apply(cl, "raytrain-lm").eta_key == Cluster(gpus=1).eta_key == "eta"


def test_tp_pipelined_with_the_matmuls_is_exposed_only_beyond_the_compute():
    """Transformer Engine's tp overlap (megatron-core-2024): the tp time the step's compute does
    not cover: the remainder on an H100's rate (the tiny model's matmuls are shorter than its
    all-reduces), nothing on a GPU of 1 GFLOP/s (its compute covers them)."""
    lay = Layout(1, 2, 1, "ddp", "none", False, "-", 2, 1, 8)
    for tflops in (989.0, 1e-3):
        cl = Cluster(gpus=2, precision="bf16", efficiency=0.5, tflops=tflops)
        plain = estimate_layout(TINY, lay, cl)
        te = estimate_layout(TINY, lay, replace(cl, tp_overlap_matmul=True))
        assert plain.tp_s > 0
        assert te.tp_s == pytest.approx(max(0.0, plain.tp_s - plain.compute_s))
        assert (te.tp_s > 0) == (tflops > 1)
        assert te.step_s == pytest.approx(plain.step_s - (plain.tp_s - te.tp_s))
    assert apply(cl, "megatron-core-2024").tp_overlap_matmul and not apply(cl, "raytrain-lm").tp_overlap_matmul


def test_selective_recompute_keeps_the_matmul_outputs_whatever_the_kernels():
    """Selective keeps every matmul's output and recomputes the rest, so a fused MLP has no
    activation output to drop from it (the fused count took GeLU's 4h off the GPT's 3 + 8, and
    SwiGLU's 2f off the Llama's). Llama 2 70B, FSDP over 64 H100s, micro-batch 2 x 4096 tokens,
    as a fused 2024 stack: per token per layer, the block input and the two row-parallel outputs
    (3h), q, k and v (h + 2 x 8 x 128), attention's output (h), gate and up (2 x 28672): 80
    layers of it are 122.5 GiB, so selective recomputation cannot fit an 80 GB card there."""
    from raytrain_lm.plan.memory import layer_activation_bytes

    lay = Layout(1, 2, 1, "ddp", "selective", False, "-", 2, 1, 8)
    eager, fused = Cluster(gpus=2, precision="bf16"), Cluster(gpus=2, precision="bf16", kernels="fused")
    for cl in (eager, fused):
        assert layer_activation_bytes(TINY, lay, cl, "selective") == 2 * 8 * 8 * (3 + 8 / 2) * 2
    m = preset_config("llama2-70b").model
    h, f = 8192, 28672
    assert (m.n_embd, family(m).hidden_dim(m), m.kv_heads, m.head_dim, m.n_layer) == (h, f, 8, 128, 80)
    lay = Layout(64, 1, 1, "fsdp", "selective", False, "-", 2, 1, 4096)
    run = kind_cluster("h100-sxm", 64)
    per_layer = 2 * 4096 * (3 * h + h + 2 * 8 * 128 + h + 2 * f) * 2
    for name in ("raytrain-lm", "meta-llama3"):
        cl = apply(run, name)
        assert layer_activation_bytes(m, lay, cl, "selective") == per_layer
        e = estimate_layout(m, lay, cl)
        assert e.memory.activations == 80 * per_layer + 2 * 4096 * h * 2 and not e.fits  # + the embedding's output
    assert 80 * per_layer / GIB == pytest.approx(122.5, abs=0.05)


def test_the_docs_table_of_gpu_kinds_is_the_json():
    from pathlib import Path

    from raytrain_lm.plan.kinds import kinds_markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    assert kinds_markdown() in doc, "docs/planner.md's GPU kinds differ: paste plan.kinds.kinds_markdown()"


def test_layout_auto_plans_for_the_gpu_ray_reports():
    """train --layout auto takes the kind from Ray's accelerator label (an A100's memory tells its
    two sizes apart; every device kind of the table has its label: a T4 node was planned with the
    H100's 989 TFLOP/s), else the default kind's figures, and says so."""
    from types import SimpleNamespace

    from raytrain_lm.plan.auto import auto_cluster, cluster_kind, kind_text

    node = lambda label: {"Alive": True, "Resources": {"GPU": 8.0, f"accelerator_type:{label}": 1.0}}  # noqa: E731
    assert cluster_kind([node("A100")], 80.0) == "a100-80gb" and cluster_kind([node("A100")], 40.0) == "a100-40gb"
    assert cluster_kind([node("H100"), node("H100")], 80.0) == "h100-sxm"
    assert cluster_kind([node("H100"), node("A100")], 80.0) is None
    assert cluster_kind([node("RTX-PRO-6000")], 96.0) is None
    cfg = SimpleNamespace(workers=16, use_gpu=True, precision="auto")
    cl = auto_cluster(cfg, 8, 80.0, "a100-80gb")
    assert (cl.tflops, cl.kind, cl.memory_gb, cl.gpus_per_node) == (312, "a100-80gb", 80.0, 8)
    t4 = auto_cluster(cfg, 8, 16.0, cluster_kind([node("T4")], 16.0))
    assert (t4.kind, t4.tflops, t4.hbm_tbps, t4.intra_gbps) == ("t4", 65, 0.32, 16 * 8)  # fp16: no bf16 units
    assert auto_cluster(cfg, 8, 80.0).kind == "h100-sxm"
    assert kind_text(None, True) == "a GPU gpu_kinds.json does not know: h100-sxm's rates assumed"
    assert kind_text("t4", True) == "t4" and kind_text(None, False) == "CPU workers"
