"""The planner's context-parallel rows against the arithmetic (plan/comm.py, plan/memory.py,
plan/estimate.py): a cp rank's activations, the whole window's K/V it holds, the bytes its
gathers move, and cp ranked for long sequences only."""

from __future__ import annotations

import dataclasses

import pytest

from raytrain_lm.config.layout import Layout
from raytrain_lm.config.presets import preset_config
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan.comm import rank_comm, ring_bytes
from raytrain_lm.plan.context import CP_FROM_SEQ
from raytrain_lm.plan.estimate import plan
from raytrain_lm.plan.hardware import Cluster
from raytrain_lm.plan.memory import layer_activation_bytes, rank_memory
from raytrain_lm.plan.printout import recommendation
from raytrain_lm.plan.stages import rank_stages

# 2 layers, width 8, 4 query heads over 2 kv heads of 2 dims: K/V are 2 x 2 x 2 = 8 numbers a token
SMALL = ModelConfig(arch="llama", bias=False, vocab_size=16, block_size=64, n_layer=2, n_head=4,
                    n_kv_head=2, n_embd=8, multiple_of=8)


def layout(cp: int, ac: str = "none", tp: int = 1) -> Layout:
    return Layout(dp=1, tp=tp, pp=1, strategy="ddp", ac=ac, sp=False, schedule="-", micro_batch=2,
                  microbatches=3, seq_len=64, cp=cp)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_comm_is_the_windows_kv_gathered_per_layer(cp, ac):
    """Per micro-batch and layer: K/V of b x seq tokens (2 x kv heads x head dim numbers each, in
    the activation dtype) all-gathered in forward and again in backward, their gradients
    reduce-scattered, gathered once more where full checkpointing recomputes the layer."""
    cl = Cluster(gpus=cp)
    lay = layout(cp, ac)
    kv = 2 * 2 * 64 * 2 * 2 * cl.act_bytes  # 2 (K, V) x b 2 x seq 64 x 2 heads x 2 dims
    passes = 4 if ac == "full" else 3
    expected = 3 * 2 * passes * ring_bytes("all_gather", cp, kv)  # microbatches x layers x passes
    assert rank_comm(SMALL, lay, cl, rank_stages(SMALL, 1, 1)[0]).cp == pytest.approx(expected)
    assert rank_comm(SMALL, layout(1, ac), Cluster(gpus=1), rank_stages(SMALL, 1, 1)[0]).cp == 0


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_activations_are_a_share_plus_the_gathered_kv(cp):
    """A cp rank saves its 1/cp of every layer's activations; the other ranks' K/V (and in
    backward their gradients) are in flight for one layer at a time; its logits are 1/cp of the
    window's."""
    cl = Cluster(gpus=cp)
    stages = rank_stages(SMALL, 1, 1)[0]
    one, split = rank_memory(SMALL, layout(1), cl, stages, 0), rank_memory(SMALL, layout(cp), cl, stages, 0)
    others_kv = 2 * 2 * 64 * 2 * 2 * cl.act_bytes * (cp - 1) / cp  # one layer's, K/V and gradients
    assert split.activations == pytest.approx(one.activations / cp + 2 * others_kv)
    assert layer_activation_bytes(SMALL, layout(cp), cl, "none") == \
        pytest.approx(layer_activation_bytes(SMALL, layout(1), cl, "none") / cp)
    assert split.logits == pytest.approx(one.logits / cp)


def test_cp_is_planned_for_long_sequences_only():
    """The 70B on 64 H100s (tp 8, fsdp: the search kept small): at 128k tokens per window a
    layout with cp is the fastest that fits;
    at 4k none is planned (below CP_FROM_SEQ, cp only adds traffic)."""
    m = dataclasses.replace(preset_config("llama2-70b").model, block_size=131072)
    cl = Cluster(gpus=64, gpus_per_node=8, memory_gb=80)
    long = recommendation(plan(m, cl, 64, 131072, tp=8, strategy="fsdp"))
    assert long is not None and long.layout.cp > 1 and long.comm.cp > 0
    assert 4096 < CP_FROM_SEQ
    assert all(e.layout.cp == 1 for e in plan(m, cl, 64, 4096, tp=8, strategy="fsdp"))


def test_cp_with_ep_routes_a_share_and_is_planned():
    """A mixture of experts at --cp 2 --ep 2: a cp rank routes its half of each window, so its
    all-to-alls move b (s/cp) k h values each (4 per layer and micro-batch: dispatch and
    combine, forward and backward), (ep-1)/ep of them off the GPU; and at a long window the
    planner ranks layouts with both cp and ep (ep dividing dp / cp)."""
    m = dataclasses.replace(preset_config("moe-tiny").model, vocab_size=256, block_size=16384)
    cl = Cluster(gpus=8)
    stages = rank_stages(m, 1, 1)[0]
    lay = Layout(dp=4, tp=1, pp=1, strategy="fsdp", ac="none", sp=False, schedule="-", micro_batch=1,
                 microbatches=2, seq_len=16384, ep=2, cp=2)
    expected = 2 * m.n_layer * 4 * (1 * 16384 / 2 * m.top_k * m.n_embd * cl.act_bytes) * (2 - 1) / 2
    assert rank_comm(m, lay, cl, stages).ep == pytest.approx(expected)
    planned = plan(m, cl, 16, 16384, strategy="fsdp")
    both = [e.layout for e in planned if e.layout.cp > 1 and e.layout.ep > 1]
    assert both and all((b.dp // b.ep) * b.ep == b.dp for b in both)
    assert all(not b.problems(m) for b in both)
