"""The planner (plan.py): memory, communication and step time of (dp, tp, pp) layouts, checked on
numbers computed by hand, and the `plan` / `train` commands around it. No Ray."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from conftest import cli_here, run_cli
from raytrain_lm.config.layout import Layout
from raytrain_lm.config.load import build_config
from raytrain_lm.config.presets import preset_config
from raytrain_lm.errors import UserError
from raytrain_lm.models import family, flops_per_token
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.gpt.gpt import GPT
from raytrain_lm.plan import network
from raytrain_lm.plan.comm import rank_comm, ring_bytes
from raytrain_lm.plan.estimate import bubble, estimate, estimate_layout, plan
from raytrain_lm.plan.fit import check_memory
from raytrain_lm.plan.hardware import Cluster
from raytrain_lm.plan.memory import chunks_in_flight, rank_memory
from raytrain_lm.plan.printout import recommendation
from raytrain_lm.plan.stages import rank_stages
from test_cli_errors import assert_clean_error

# A 2-layer model small enough to count by hand: width h=8, 2 heads, vocabulary V=16, context T=8,
# no biases. Per block 12 h^2 + 2 LayerNorms of h = 768 + 16 = 784; root V h + T h + h = 200.
TINY = ModelConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=False)


def tiny_layout(**kw) -> Layout:
    """tp=2, pp=2, fsdp over dp=2 (8 GPUs); S = 4 sequences of 8 tokens per data-parallel rank
    as 2 microbatches of 2 (1f1b), no recomputation, no sequence parallelism."""
    base = dict(dp=2, tp=2, pp=2, strategy="fsdp", ac="none", sp=False, schedule="1f1b",
                micro_batch=2, microbatches=2, seq_len=8)
    return Layout(**{**base, **kw})


@pytest.mark.parametrize("preset", ["tiny", "small", "gpt2", "gpt2-medium"])
def test_parameter_count_matches_the_model(preset):
    cfg = preset_config(preset).model
    cfg.vocab_size = cfg.vocab_size or 256
    with torch.device("meta"):
        assert family(cfg).counts(cfg).total == GPT(cfg).num_params()


def test_tensor_parallel_shard_of_a_block():
    m = ModelConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=True)
    p1, counts = family(m).tp_counts(m, 1), family(m).counts(m)
    assert p1["block"] == counts.block
    assert p1["wte"] + p1["wpe"] + p1["ln_f"] == counts.root
    # By hand at tp=2, h=8: c_attn (3*64 + 24)/2 = 108, c_fc (4*64 + 32)/2 = 144, attn.c_proj
    # weight 64/2 = 32 + bias 8 (whole), mlp.c_proj weight 256/2 = 128 + bias 8 (whole), two
    # LayerNorms 2 * 16 = 32 (whole): 460. wte 16*8/2 = 64, wpe 8*8/2 = 32, ln_f 16.
    assert family(m).tp_counts(m, 2) == {"block": 460, "wte": 64, "wpe": 32, "ln_f": 16}


def test_memory_of_tp2_pp2_fsdp2_by_hand():
    lay, cl = tiny_layout(), Cluster(gpus=8)
    first, last = rank_stages(TINY, 2, 1)
    # Per tp rank: block 12*64/2 + 2*8 = 400, wte 64, wpe 32, ln_f 8.
    # First stage: layer 0 + wte + wpe = 496 parameters. Last: layer 1 + wte copy + ln_f = 472.
    m0 = rank_memory(TINY, lay, cl, first, rank=0)
    assert (m0.params, m0.grads, m0.optimizer) == (4 * 496 / 2, 4 * 496 / 2, 8 * 496 / 2)  # fsdp /2
    assert m0.gathered == 496 * (2 + 4)  # pipelined FSDP: bf16 params gathered + fp32 grad accumulators
    # 16 tokens per microbatch; a layer keeps (5 + 12/2) * 8 elements per token in bf16: 2816 bytes;
    # the embedding output 16 * 8 * 2 = 256 (bf16 too); 1f1b: rank 0 holds min(2, 2 - 0) = 2.
    assert m0.activations == 2 * (2816 + 256)
    assert m0.logits == 0 and m0.total == 3968 + 2976 + 6144 == 13088
    m1 = rank_memory(TINY, lay, cl, last, rank=1)
    # one microbatch in flight; logits 16 tokens * 16/2 vocab * 12 bytes: the loss's backward
    # holds three fp32 tensors of the logits' size (more than its forward's 2 + 4 + 4).
    assert m1.activations == 2816 and m1.logits == 1536
    assert m1.total == 16 * 472 / 2 + 472 * 6 + 2816 + 1536 == 10960
    assert estimate_layout(TINY, lay, cl).memory.total == 13088  # the worst rank
    # An fp32 run keeps every activation in 4 bytes: twice as much.
    fp32 = rank_memory(TINY, lay, Cluster(gpus=8, precision="fp32"), first, rank=0)
    assert fp32.activations == 2 * m0.activations


def test_activation_variants_by_hand():
    cl = Cluster(gpus=8)
    first = rank_stages(TINY, 2, 1)[0]
    # Sequence parallelism: all 17 elements and the embedding output divide by tp:
    # 2 * (16*8*17/2*2 + 16*8*2/2) = 2 * (2176 + 128).
    assert rank_memory(TINY, tiny_layout(sp=True), cl, first, 0).activations == 4608
    # Selective: (3 + 8/2) * 8 * 2 bytes * 16 tokens = 1792 per layer.
    assert rank_memory(TINY, tiny_layout(ac="selective"), cl, first, 0).activations == 2 * (1792 + 256)
    # Full: the block input in bf16, 16*8*2 = 256 per layer and microbatch (a bf16 run
    # checkpoints bf16 inputs), plus one layer recomputed (2816); fp32 doubles the inputs.
    assert rank_memory(TINY, tiny_layout(ac="full"), cl, first, 0).activations == 2 * (256 + 256) + 2816
    fp32 = Cluster(gpus=8, precision="fp32")
    assert rank_memory(TINY, tiny_layout(ac="full"), fp32, first, 0).activations == 2 * (512 + 512) + 2 * 2816
    # GPipe holds both microbatches everywhere; the last stage keeps the other one's fp32
    # log-softmax too: 1280 + 128 * 4.
    last = rank_stages(TINY, 2, 1)[1]
    gpipe = rank_memory(TINY, tiny_layout(schedule="gpipe"), cl, last, 1)
    assert gpipe.activations == 2 * 2816 and gpipe.logits == 1536 + 512
    # Op (every other matmul kept): the block input whole, the c_attn, attention and c_fc outputs
    # divided, (1 + 8/2) * 8 * 2 * 16 = 1280 per layer; while a block runs backward what it did
    # not keep exists again: 2816 - 1280.
    assert rank_memory(TINY, tiny_layout(ac="op"), cl, first, 0).activations == \
        2 * (1280 + 256) + 2816 - 1280


def test_op_checkpointing_counted_by_hand():
    """Op recomputes the 2nd, 4th, ... matmul of each block but not its last (parallel/ac.py;
    tests/test_ac.py counts them in torch): the GPT's attention output projection (h x h), the
    Llama's k, o and up projections; it keeps the Llama's block input and down output whole and
    the q, v, attention and gate outputs divided."""
    from raytrain_lm.plan.estimate import recompute_flops_per_token

    assert recompute_flops_per_token(TINY, "op", 8) == 2 * 2 * 8 * 8
    llama = ModelConfig(arch="llama", bias=False, vocab_size=320, block_size=64, n_layer=2,
                        n_head=4, n_kv_head=2, n_embd=64, multiple_of=32)
    kv, f = 2 * 16, llama.hidden_dim  # k/v width: 2 kv heads of 16
    assert recompute_flops_per_token(llama, "op", 64) == 2 * 2 * (64 * kv + 64 * 64 + 64 * f)
    split = family(llama).activation_split
    assert split(llama, "op") == (2, 1 + 0.5 + 1 + f / 64)
    assert sum(split(llama, "op")) < sum(split(llama, "selective"))


def test_data_parallel_memory_and_comm_by_hand():
    cl = Cluster(gpus=4)
    only = rank_stages(TINY, 1, 1)[0]
    ddp = Layout(4, 1, 1, "ddp", "none", False, "-", 2, 1, 8)
    # All 1768 parameters everywhere; fp32 gradients all-reduced: 2 * 3/4 * 4 * 1768.
    assert rank_memory(TINY, ddp, cl, only, 0).model_state == 16 * 1768
    assert rank_comm(TINY, ddp, cl, only).dp == 10608
    fsdp = Layout(4, 1, 1, "fsdp", "none", False, "-", 2, 2, 8)  # 2 accumulation steps
    c = rank_comm(TINY, fsdp, cl, only)
    # Each micro-step gathers the blocks twice (forward, backward) and the root once, in bf16:
    # 2 * (2 * 1568 + 200) elements * 2 bytes * 3/4; gradients reduce-scattered once: 3/4 * 4 * 1768.
    assert (c.dp_gather, c.dp_reduce) == (10008, 5304)
    # Working set (FSDP2), at the start of backward: the current block and the prefetched next
    # one and the root (gathered for the head's backward) in bf16, (2 * 784 + 200) * 2, plus every
    # unsharded fp32 gradient kept between micro-steps, 1768 * 4, and the block's bf16 gradient
    # being computed, 784 * 2.
    assert rank_memory(TINY, fsdp, cl, only, 0).gathered == 3536 + 7072 + 1568
    # One micro-step: the block's gradient in bf16 and its fp32 copy for the reduce-scatter,
    # 784 * (2 + 4), and the tied head's (wte, 128) bf16 gradient, reduced with the root at the end.
    one = Layout(4, 1, 1, "fsdp", "none", False, "-", 2, 1, 8)
    assert rank_memory(TINY, one, cl, only, 0).gathered == 3536 + 784 * 6 + 128 * 2
    # In fp32 the gradient needs no copy: 784 * 4 + 128 * 4; the gathered parameters 4 bytes.
    assert rank_memory(TINY, one, Cluster(gpus=4, precision="fp32"), only, 0).gathered == \
        2 * 3536 + 784 * 4 + 128 * 4


def test_comm_of_tp2_pp2_fsdp2_by_hand():
    lay, cl = tiny_layout(), Cluster(gpus=8)
    first, last = rank_stages(TINY, 2, 1)
    c0 = rank_comm(TINY, lay, cl, first)
    # dp (2 ranks): gather bf16 params once (pipelined) 1/2 * 2 * 496; reduce-scatter 1/2 * 4 * 496.
    assert (c0.dp_gather, c0.dp_reduce) == (496, 992)
    # tp (2 ranks): 4 all-reduces for its layer + 1 for the embedding, each of S*seq*h bf16 =
    # 4*8*8*2 = 512 bytes, times 2(2-1)/2 = 1.
    assert c0.tp == 5 * 512
    # pp: 2 microbatches forward of 2*8*8 bf16 = 256 bytes (the run's dtype), plus the tied wte
    # gradient shard (16*8/2/2 fp32 = 128 bytes) all-reduced between first and last stage.
    assert c0.pp == 2 * 256 + 128
    c1 = rank_comm(TINY, lay, cl, last)
    assert (c1.dp_gather, c1.dp_reduce, c1.tp, c1.pp) == (472, 944, 2560, 640)
    # Sequence parallelism: the same tp volume; each tp rank sends its half of the sequence.
    sp = rank_comm(TINY, tiny_layout(sp=True), cl, first)
    assert sp.tp == 2560 and sp.pp == 2 * 128 + 128
    # fp32 sends 4 bytes a value.
    assert rank_comm(TINY, tiny_layout(), Cluster(gpus=8, precision="fp32"), first).pp == 2 * 512 + 128
    # Recomputation re-runs the attention output's all-reduce: 5 per layer.
    assert rank_comm(TINY, tiny_layout(ac="full"), cl, first).tp == 6 * 512


def test_ring_volumes():
    assert ring_bytes("all_reduce", 4, 100) == 150  # 2 (n-1)/n
    assert ring_bytes("all_gather", 4, 100) == ring_bytes("reduce_scatter", 4, 100) == 75
    assert ring_bytes("all_reduce", 1, 100) == 0


def test_bubble():
    assert bubble(4, 8) == 3 / 11
    assert bubble(4, 8, 2) == 3 / 19  # two stages per GPU halve it, about
    assert bubble(1, 8) == 0


def test_interleaved_in_flight_matches_torchs_schedule():
    """chunks_in_flight against the order torch's ScheduleInterleaved1F1B computes (a private
    method: if torch changes it, this says the memory model needs another look)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    for p, m in [(2, 4), (4, 8), (4, 16), (8, 32)]:
        rounds = max(1, m // p)
        for rank in range(p):
            fake = SimpleNamespace(n_local_stages=2, microbatches_per_round=m // rounds,
                                   pp_group_size=p, _n_microbatches=m, rank=rank,
                                   number_of_rounds=rounds)
            live = peak = 0
            for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank):
                if action is not None:
                    live += 1 if action.computation_type == _ComputationType.FORWARD else -1
                    peak = max(peak, live)
            lay = Layout(1, 1, p, "ddp", "none", False, "interleaved-1f1b", 1, m, 8)
            assert chunks_in_flight(lay, rank) == peak, (p, m, rank)
    one = Layout(1, 1, 4, "ddp", "none", False, "1f1b", 1, 8, 8)
    assert [chunks_in_flight(one, r) for r in range(4)] == [4, 3, 2, 1]


def test_flops_match_the_model():
    """The one FLOPs count (models.flops_per_token, the planner's and the loop's MFU) is PaLM's
    6N + 12 L H Q T with N the built model's matmul parameters: all but the positions."""
    m = preset_config("gpt2").model
    m.vocab_size = 50304
    with torch.device("meta"):
        model = GPT(m)
    n = model.num_params() - model.wpe.weight.numel()
    assert flops_per_token(m, 1024) == 6 * n + 12 * m.n_layer * m.n_embd * 1024


def test_step_time_by_hand():
    # 4 GPUs per node: tp (blocks of 2) and dp (blocks of dp x tp = 4) run inside a node at
    # 0.008 Gb/s = 1e6 B/s, pp (all 8 ranks) between nodes at 1e5 B/s (one pp rank per node per
    # group, so one NIC's share: network.py), every link at 80% of its rate (x 1.25 below);
    # 1 MFLOP/s per GPU, all reached.
    cl = Cluster(gpus=8, gpus_per_node=4, intra_gbps=0.008, inter_gbps=0.0008, tflops=1e-6,
                 efficiency=1.0)
    e = estimate_layout(TINY, tiny_layout(), cl)
    # FLOPs per token 6 * (1768 - 64) + 12 * 2 * 8 * 8 = 11760: per layer 6 * 784 + 12 * 8 * 8 =
    # 5472, the head 6 * (128 + 8) = 816. Rank 0 runs layer 0, rank 1 layer 1 and the head: 6288
    # per token of its pipeline replica's 4 sequences x 8 tokens, split over tp 2, at 1e6 FLOP/s:
    # 0.100608 s (the two ranks' average is 0.09408 s: 752640 FLOPs over 8 GPUs).
    assert e.compute_s == pytest.approx(0.100608)
    # Rank 1 is the slowest: tp 2560 B / 1e6 = 0.00256 s, all exposed, stretched with compute
    # by the bubble 1/3. pp: one send (2 x 8 x 8 bf16 = 256 B) takes 0.00256 s; the fill and
    # drain cross the one boundary twice (2 (v pp - 1) = 2 sends, 0.00512 s); the steady state's
    # other sends hide under compute; the tied wte gradient (128 B, 0.00128 s) follows the last
    # microbatch. dp: the gather (0.000472 s) hides under compute, the gradient reduce-scatter
    # of its 400 + 64 + 8 parameters (0.000944 s) runs after the last microbatch.
    k = 1 / 0.8  # LINK_EFFICIENCY
    assert e.bubble == pytest.approx(1 / 3)
    assert e.pp_s == pytest.approx((0.00512 + 0.00128) * k)
    assert e.step_s == pytest.approx((0.100608 + 0.00256 * k) / (2 / 3) + (0.00512 + 0.00128 + 0.000944) * k)
    assert e.bubble_s == pytest.approx((0.100608 + 0.00256 * k) / 2)
    assert e.mfu == pytest.approx(752640 / (e.step_s * 8 * 1e6))


@pytest.mark.parametrize("ac", ["none", "selective", "op", "full"])
def test_a_pipeline_runs_at_the_pace_of_the_rank_with_the_head(ac):
    """Each microbatch passes every stage, so a pipeline's step follows its slowest rank: with
    the layers split evenly, the last, which also runs the head (Llama 3 8B's 128256 x 4096 head
    holds 2.4 blocks' matmul weights: at seq 8192 rank 3 of 4 runs 23% more FLOPs than the
    others, 16% more than their average; 13% with full recomputation, which reruns the blocks
    only). The ranks' FLOPs add up to the model's, recomputation included; without a pipeline
    the one rank runs them all."""
    from raytrain_lm.plan.estimate import recompute_flops_per_token, stage_flops_per_token

    m = preset_config("llama3-8b").model
    seq = 8192
    whole = flops_per_token(m, seq) + recompute_flops_per_token(m, ac, seq)
    ranks = rank_stages(m, 4, 1)
    per_rank = [stage_flops_per_token(m, st, ac, seq) for st in ranks]
    assert sum(per_rank) == pytest.approx(whole)
    assert per_rank[0] == per_rank[1] == per_rank[2] < per_rank[3]
    assert stage_flops_per_token(m, rank_stages(m, 1, 1)[0], ac, seq) == pytest.approx(whole)
    cl = Cluster(gpus=4, efficiency=0.5)
    lay = Layout(1, 1, 4, "ddp", ac, False, "1f1b", 1, 8, seq)
    e = estimate_layout(m, lay, cl)
    assert e.compute_s == pytest.approx(per_rank[3] * 8 * seq / (cl.tflops * 1e12 * 0.5))
    assert e.compute_s > 1.1 * whole * 8 * seq / (4 * cl.tflops * 1e12 * 0.5)


def test_70b_on_64_h100s_needs_sharding_and_keeps_tp_in_a_node():
    m = preset_config("gpt-70b").model
    m.vocab_size = 50304
    n = family(m).counts(m).total
    cl = Cluster(gpus=64, gpus_per_node=8, memory_gb=80)
    ranked = plan(m, cl, global_batch=64, seq_len=4096)
    fitting = [e for e in ranked if e.fits]
    assert fitting and all(e.reserved <= cl.budget for e in fitting)
    # 16 bytes per parameter of a full replica (1.1 TB) never fits: every layout that fits shards.
    for e in fitting:
        lay = e.layout
        assert lay.sharded or lay.optimizer_shards > 1 or lay.tp > 1 or lay.pp > 1
        assert e.memory.model_state < 16 * n / 8
    best = recommendation(ranked)
    assert best is fitting[0] and best.layout.tp in (1, 2, 4, 8)  # tp never leaves a node
    assert all(e.layout.tp <= 8 for e in ranked)
    assert recommendation(plan(m, Cluster(gpus=8, memory_gb=80), 8, 4096)) is None  # 640 GB < 1.1 TB


def test_recommendation_follows_the_node_size():
    m = preset_config("gpt-70b").model
    m.vocab_size = 50304
    ranked = plan(m, Cluster(gpus=64, gpus_per_node=4, memory_gb=80), 64, 4096)
    assert {e.layout.tp for e in ranked} == {1, 2, 4}


def test_recomputation_lowers_activation_memory():
    m = ModelConfig(vocab_size=256, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    none, sel, full = (estimate(m, 8, "ddp", ac, 8, 1024).activations
                       for ac in ("none", "selective", "full"))
    assert full < sel < none


def test_config_layout_and_memory_check():
    cfg = build_config(preset="gpt-70b", flags={"workers": 64, "use_gpu": True, "tp": 8, "pp": 2,
                                                "batch_size": 8, "microbatches": 8,
                                                "model": {"vocab_size": 50304}})
    lay = Layout.of(cfg)
    assert (lay.dp, lay.tp, lay.pp, lay.micro_batch, lay.microbatches) == (4, 8, 2, 1, 8)
    check_memory(cfg, 80)  # fits: nothing raised
    with pytest.raises(UserError, match="GiB per worker.*try --tp"):
        check_memory(cfg, 24)


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()
            and line.endswith((" yes", " no"))]


PLAN_70B = ["plan", "--preset", "gpt-70b", "--gpus", "64", "--gpus-per-node", "8",
            "--gpu-memory-gb", "80"]


def test_plan_cli_table_and_reason():
    r = cli_here(*PLAN_70B)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(table_rows(r.stdout)) == 10  # the best ten, not hundreds
    rec = next(line for line in lines if line.startswith("recommendation: --tp"))
    assert "GiB per GPU" in rec and "MFU" in rec
    why = next(line for line in lines if line.startswith("why: "))
    # compared with data parallelism alone, which fits 70B on 64 GPUs of 80 GB (as FSDP) but is slower
    assert re.search(r"; data parallelism alone would take \d+\.\dx as long$", why), why
    if "TP " in why:
        assert "inside a node" in why.split("TP ")[1].split(",")[0]
    small = ["plan", "--preset", "tiny", "--gpus", "4"]  # the same CLI, a quicker plan
    r = cli_here(*small)
    assert cli_here("plan", "--preset", "tiny", "--workers", "4").stdout == r.stdout  # the alias
    assert len(table_rows(cli_here(*small, "--top", "3").stdout)) == 3


def test_plan_cli_json_and_restrictions():
    r = cli_here(*PLAN_70B, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["layouts"]) > 100 and out["recommendation"]["fits"] and out["reason"]
    assert out["recommendation"] == out["layouts"][0]
    r = cli_here(*PLAN_70B, "--json", "--tp", "8", "--strategy", "fsdp")
    out = json.loads(r.stdout)
    assert {(x["tp"], x["strategy"]) for x in out["layouts"]} == {(8, "fsdp")}
    assert "data parallelism alone" not in out["reason"]  # it was not planned
    r = cli_here("plan", "--preset", "gpt2", "--gpus", "8")
    # data parallelism alone, the optimizer's step sharded, before DDP: ZeRO-1, which at one
    # micro-step ties with ZeRO-2 (both FSDP2 keeping the gathered parameters to backward) and
    # comes first among equals
    assert r.returncode == 0 and "recommendation: --tp 1 --pp 1 --strategy zero1" in r.stdout


@pytest.mark.parametrize("args,expected", [
    (["--gpus", "0"], "--gpus must be at least 1"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
    (["--gpus", "12"], "--gpus 12 is not a whole number of nodes of --gpus-per-node 8"),
    (["--gpus", "64", "--tp", "16"], "--tp 16 does not fit in a node of 8 GPUs"),
    (["--gpus", "64", "--tp", "3"], "--tp 3 does not divide --gpus 64"),
    (["--gpus", "8", "--tp", "8", "--preset", "gpt2"], "must divide model.n_head (12)"),
    (["--gpus", "64", "--pp", "3"], "--gpus 64 is not a multiple of tp x pp = 1 x 3"),
    (["--preset", "gpt-70b", "--gpus", "64", "--tp", "8", "--pp", "16"],
     "not a multiple of tp x pp = 8 x 16"),
    (["--strategy", "zero3"], "--strategy must be one of ddp, zero1, zero2, fsdp"),
    (["--gpu-memory-gb", "0"], "--gpu-memory-gb must be positive"),
    (["--inter-node-gbps", "-1"], "--inter-node-gbps must be positive"),
    (["--compute-efficiency", "1.5"], "--compute-efficiency must be in (0, 1]"),
    (["--top", "0"], "--top must be at least 1"),
    (["--preset", "gpt-70b", "--gpus", "8", "--pp", "100"], "not a multiple of tp x pp"),
])
def test_plan_rejects_bad_inputs(args, expected):
    assert_clean_error(cli_here("plan", *args), expected)


TRAIN_70B = ["train", "--preset", "gpt-70b", "--use-gpu", "--set", "gpu_memory_gb=80",
             # An address nothing answers at: were the memory check to pass, the run would stop
             # there instead of starting Ray.
             "--address", "127.0.0.1:1"]


def test_train_refuses_a_layout_that_does_not_fit_before_ray(tmp_path, pydoc_data):
    r = cli_here(*TRAIN_70B, "--workers", "64", "--strategy", "ddp", "--data", str(pydoc_data),
                "--storage", str(tmp_path / "runs"))
    assert_clean_error(r, "GiB per worker")
    assert "try --tp" in r.stderr and "--force" in r.stderr and not (tmp_path / "runs").exists()
    r = cli_here(*TRAIN_70B, "--workers", "64", "--tp", "8", "--pp", "2", "--strategy", "fsdp",
                "--batch-size", "64", "--microbatches", "2", "--data", str(pydoc_data),
                "--storage", str(tmp_path / "runs"))
    assert_clean_error(r, "GiB per worker")  # tp x pp alone: too many microbatch sequences
    r = cli_here(*TRAIN_70B, "--workers", "8", "--tp", "8", "--data", str(pydoc_data),
                "--storage", str(tmp_path / "runs"))
    assert_clean_error(r, "nothing fits on this many workers")


def test_train_passes_a_layout_that_fits(tmp_path, pydoc_data):
    r = cli_here(*TRAIN_70B, "--workers", "64", "--tp", "8", "--pp", "2", "--strategy", "fsdp",
                "--batch-size", "8", "--microbatches", "8", "--data", str(pydoc_data),
                "--storage", str(tmp_path / "runs"), timeout=60)
    assert_clean_error(r, "no Ray cluster answers at 127.0.0.1:1")  # past the memory check


def gpt2_plan(**kw) -> str:
    """`plan`'s output for GPT-2 on 8 H100s, in process (what the CLI prints)."""
    from raytrain_lm.plan.printout import plan_command

    cfg = build_config(preset="gpt2", flags={"workers": 8, "model": {"vocab_size": 50304}})
    cluster = kw.pop("cluster", Cluster(gpus=8))
    return plan_command(cfg, cluster, **kw)


def test_memory_is_planned_in_gib_as_cards_are_sold():
    """--gpu-memory-gb 80 is an 80 GB card: 80 x 2^30 bytes, less 1 GiB for CUDA and NCCL, and what
    the allocator reserves must fit in it; a CPU worker plans for 90% of its memory."""
    import typer.main

    from raytrain_lm.cli import app
    from raytrain_lm.plan.calibration import constant

    assert Cluster(gpus=8, memory_gb=80).budget == 79 * 2 ** 30
    assert Cluster(gpus=8, memory_gb=80, gpu=False).budget == 80 * 2 ** 30 * 0.9
    e = estimate_layout(TINY, tiny_layout(), Cluster(gpus=8))
    assert e.reserved == pytest.approx(e.memory.total * constant("allocator")) and e.reserved > e.memory.total
    command = typer.main.get_command(app).commands["plan"]
    option = next(p for p in command.params if p.name == "gpu_memory_gb")
    assert "GiB" in option.help and "as cards are sold" in option.help


@pytest.mark.parametrize("kw,expected", [
    (dict(strategy="zero1", tp=2), "--strategy zero1 works with --tp 1 --pp 1"),
    (dict(virtual_stages=1), "--virtual-stages must be at least 2"),
    (dict(cluster=Cluster(gpus=8, peak_fraction=2.0)), "--peak-fraction must be in (0, 1]"),
    (dict(cluster=Cluster(gpus=8, precision="fp8")), "--precision must be one of"),
    (dict(global_batch=7, tp=1, pp=1), "can split a global batch of 7 sequences"),
    (dict(explain="tp=3x"), "tp must be a positive whole number"),
    (dict(explain="colour=red"), "expected a row number"),
    (dict(explain="tp=8"), "no layout of the plan matches"),
    (dict(explain="999999"), "the plan has rows 1 to"),
])
def test_plan_rejects_bad_new_inputs(kw, expected):
    with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        gpt2_plan(**kw)


def test_zero1_and_zero2_memory_and_comm_by_hand():
    cl = Cluster(gpus=4)
    only = rank_stages(TINY, 1, 1)[0]
    z2 = Layout(4, 1, 1, "zero2", "none", False, "-", 2, 1, 8)
    m2 = rank_memory(TINY, z2, cl, only, 0)
    # ZeRO-2 on FSDP2 (reshard_after_forward=False): everything sharded at rest; every
    # parameter stays gathered (bf16) from forward to backward, plus the same gradients as fsdp.
    assert (m2.params, m2.grads, m2.optimizer) == (1768, 1768, 2 * 1768)
    assert m2.gathered == 1768 * 2 + 784 * 6 + 128 * 2
    c2 = rank_comm(TINY, z2, cl, only)
    assert (c2.dp_gather, c2.dp_reduce) == (3 / 4 * 2 * 1768, 5304)  # one gather per micro-step
    # ZeRO-1, FSDP2 too: the same at one micro-step; with accumulation it gathers once a step.
    z1 = Layout(4, 1, 1, "zero1", "none", False, "-", 2, 1, 8)
    assert rank_memory(TINY, z1, cl, only, 0) == m2 and rank_comm(TINY, z1, cl, only) == c2
    z1, z2 = (Layout(4, 1, 1, s, "none", False, "-", 2, 3, 8) for s in ("zero1", "zero2"))
    assert rank_comm(TINY, z1, cl, only).dp_gather == 3 / 4 * 2 * 1768
    assert rank_comm(TINY, z2, cl, only).dp_gather == 3 * 3 / 4 * 2 * 1768


def test_zero1_overlaps_as_zero2_and_fsdp_gathers_twice():
    """ZeRO-1's gather is FSDP2's, prefetched during forward: its exposed time is ZeRO-2's (it
    was a broadcast after the optimizer step, all exposed); FSDP's backward re-gather makes it
    send more than ZeRO-2."""
    m = preset_config("gpt2").model
    m.vocab_size = 50304
    cl = Cluster(gpus=16, gpus_per_node=8, efficiency=0.5)
    base = dict(dp=16, tp=1, pp=1, ac="none", sp=False, schedule="-", micro_batch=8,
                microbatches=1, seq_len=1024)
    z1 = estimate_layout(m, Layout(strategy="zero1", **base), cl)
    z2 = estimate_layout(m, Layout(strategy="zero2", **base), cl)
    assert z1.dp_exposed_s == z2.dp_exposed_s
    fsdp = estimate_layout(m, Layout(strategy="fsdp", **base), cl)
    assert z2.comm.dp_gather < fsdp.comm.dp_gather and z2.memory.gathered > fsdp.memory.gathered


def test_matmul_rate_grows_with_size_and_the_flags_override_it():
    """A matmul of F FLOPs runs at the kind's achievable rate x F / (F + F_HALF), F_HALF a fixed
    time per kernel at that rate (so larger on a faster GPU); --peak-fraction replaces the
    achievable fraction, --compute-efficiency the whole compute model with a constant."""
    from dataclasses import replace

    from raytrain_lm.plan.hardware import kind_cluster
    from raytrain_lm.plan.kernels import f_half, matmul_flops, matmul_rate

    m = preset_config("gpt2").model
    m.vocab_size = 50304
    h100, a100 = kind_cluster("h100-sxm", 8), kind_cluster("a100-80gb", 8)
    assert f_half(a100) == pytest.approx(1e10)  # where it was pinned
    assert f_half(h100) == pytest.approx(1e10 * 989 * 0.803 / (312 * 0.869))
    small, large = (matmul_rate(h100, matmul_flops(m, b, 1024, 1)) for b in (1, 64))
    assert small < large < 989e12 * 0.803
    assert matmul_rate(h100, matmul_flops(m, 1, 1024, 4)) < small  # tp narrows each GPU's matmul
    assert matmul_flops(m, 1, 1024, 1) == 2 * 1024 * 768 * 768
    f = 1e12
    assert matmul_rate(replace(h100, peak_fraction=0.5), f) == pytest.approx(
        989e12 * 0.5 * f / (f + 1e10 * 989 * 0.5 / (312 * 0.869)))
    lay = Layout(8, 1, 1, "ddp", "none", False, "-", 4, 1, 1024)
    e = estimate_layout(m, lay, Cluster(gpus=8, efficiency=0.25))
    assert e.compute_s == pytest.approx(flops_per_token(m, 1024) * 4 * 1024 / (989e12 * 0.25))


def test_virtual_stages_any_number():
    """Interleaving v stages per GPU: the bubble (p-1)/(v m + p-1), v m chunks of 1/v of the
    layers, and the layouts tried: any v from 2 to 8 the layers fill, evenly or not (the extra
    layers to the middle stages), or as asked."""
    from raytrain_lm.plan.estimate import virtual_stage_counts

    m = ModelConfig(vocab_size=256, block_size=64, n_layer=16, n_head=4, n_embd=64)
    assert virtual_stage_counts(m, 2) == [2, 3, 4, 5, 6, 7, 8]
    assert virtual_stage_counts(m, 4) == [2, 3, 4]  # 4 x 5 stages would outnumber 16 layers
    assert virtual_stage_counts(m, 4, fixed=3) == [3]
    lay = Layout(1, 1, 4, "ddp", "none", False, "interleaved-1f1b", 1, 8, 64, virtual=4)
    e = estimate_layout(m, lay, Cluster(gpus=4, efficiency=0.5))
    assert lay.v == 4 and e.bubble == pytest.approx(3 / (4 * 8 + 3))
    assert "--virtual-stages 4" in lay.flags()
    ranked = plan(m, Cluster(gpus=4, efficiency=0.5), 8, 64, pp=4, virtual_stages=4)
    assert {e.layout.v for e in ranked if e.layout.schedule == "interleaved-1f1b"} == {4}


def test_global_batch_any_size_a_layout_splits():
    m = preset_config("gpt2").model
    m.vocab_size = 50304
    ranked = plan(m, Cluster(gpus=8), global_batch=12, seq_len=1024)
    assert ranked and {e.layout.dp for e in ranked} <= {1, 2, 4}  # 8 does not divide 12
    assert all(e.layout.dp * e.layout.sequences == 12 for e in ranked)
    assert json.loads(gpt2_plan(global_batch=12, as_json=True))["global_batch"] == 12


def test_explain_breaks_the_step_and_the_memory_down():
    from raytrain_lm.plan.printout import plan_command

    cfg = build_config(preset="gpt-70b", flags={"workers": 64, "model": {"vocab_size": 50304}})
    out = json.loads(plan_command(cfg, Cluster(gpus=64), as_json=True,
                                  explain="tp=8,pp=8,strategy=ddp,ac=full,schedule=1f1b"))
    assert (out["tp"], out["pp"], out["strategy"], out["ac"]) == (8, 8, "ddp", "full")
    sec = out["seconds"]  # the parts add up to the step
    assert sec["compute"] + sec["tp"] + sec["bubble"] + sec["pp"] + sec["dp_exposed"] == \
        pytest.approx(sec["step"])
    mem = out["memory_gib"]
    assert sum(v for k, v in mem.items() if k != "total") == pytest.approx(mem["total"])
    text = run_cli("plan", "--preset", "gpt-70b", "--gpus", "64", "--explain", "1").stdout  # the CLI
    for part in ("compute", "exposed tp", "bubble", "exposed pp", "exposed dp", "parameters",
                 "optimizer", "FSDP working set", "activations", "logits", "rank 1 of"):
        assert part in text, part


def test_framework_inputs_reduce_dtype_and_overlap():
    """A framework that reduces fp16 gradients sends half the bytes; one that reduces after
    backward exposes all of it (Megatron-LM of 2021, in docs/planner.md's validation)."""
    cl = Cluster(gpus=4, efficiency=0.5)
    only = rank_stages(TINY, 1, 1)[0]
    ddp = Layout(4, 1, 1, "ddp", "none", False, "-", 2, 1, 8)
    assert rank_comm(TINY, ddp, Cluster(gpus=4, reduce_bytes=2), only).dp_reduce == 10608 / 2
    hidden = estimate_layout(TINY, ddp, cl)
    exposed = estimate_layout(TINY, ddp, Cluster(gpus=4, efficiency=0.5, overlap_reduce=False))
    bw = network.bandwidth(cl, ddp, "dp")
    assert hidden.dp_exposed_s == pytest.approx(max(0.0, 10608 / bw - hidden.compute_s))
    assert exposed.dp_exposed_s == pytest.approx(10608 / bw)


def test_framework_inputs_recompute_and_pipeline_sends():
    """torch's checkpoint stops before a block's last matmul (tests/test_ac.py counts it), so
    full recomputation skips the GPT's MLP output projection (4 h^2) and its all-reduce;
    Megatron-LM's reruns the whole block. A framework that waits for each pipeline send exposes
    all of them (Megatron-LM of 2021)."""
    from raytrain_lm.plan.comm import tp_comm
    from raytrain_lm.plan.estimate import recompute_flops_per_token

    block, attention = 12 * 8 * 8 + 2 * 8, 4 * 2 * 8 * 8  # TINY: h 8, 2 layers, 8 tokens, no biases
    assert recompute_flops_per_token(TINY, "full", 8) == 2 * 2 * (block - 4 * 8 * 8) + attention
    assert recompute_flops_per_token(TINY, "full", 8, early_stop=False) == 2 * 2 * block + attention
    only = rank_stages(TINY, 1, 1)[0]
    full = Layout(1, 2, 1, "ddp", "full", False, "-", 2, 1, 8)
    cl, whole = Cluster(gpus=2), Cluster(gpus=2, recompute_early_stop=False)
    assert tp_comm(TINY, full, cl, only) / 12 == tp_comm(TINY, full, whole, only) / 14  # 2 x 5 + 2, 2 x 6 + 2
    lay, ecl = tiny_layout(microbatches=8), Cluster(gpus=8, efficiency=0.5)
    comm = rank_comm(TINY, lay, ecl, rank_stages(TINY, 2, 1)[0])
    waits = estimate_layout(TINY, lay, Cluster(gpus=8, efficiency=0.5, overlap_pp=False))
    overlaps = estimate_layout(TINY, lay, ecl)
    assert waits.pp_s == pytest.approx(comm.pp / network.bandwidth(ecl, lay, "pp")) and overlaps.pp_s < waits.pp_s
