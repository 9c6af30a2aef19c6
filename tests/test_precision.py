"""Mixed precision: which precision `auto` picks, and one mechanism per layout (no Ray, no GPU).

Layouts are built for rank 0 of a 2-rank world in this process (torch's fake process group:
collectives return at once, so values are meaningless but dtypes and structure are real)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.worker.step import TrainStep, resolve_precision


@pytest.mark.parametrize("precision, device, native, pp, expected", [
    ("auto", "cuda", True, 1, "bf16"),  # A100, H100, L4, A10G
    ("auto", "cuda", False, 1, "fp16"),  # T4, V100: bf16 only emulated
    ("auto", "cuda", False, 2, "fp32"),  # ... and pipelining takes no gradient scaler
    ("auto", "cpu", False, 1, "fp32"),
    ("bf16", "cuda", False, 1, "bf16"),  # asked for: kept
    ("fp32", "cuda", True, 1, "fp32"),
])
def test_auto_precision_uses_fp16_where_bf16_is_only_emulated(precision, device, native, pp, expected):
    assert resolve_precision(precision, device, native, pp) == expected


@pytest.fixture
def two_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _step(**layout) -> TrainStep:
    cfg = TrainConfig()
    cfg.precision, cfg.batch_size, cfg.seq_len = "bf16", 2, 16
    m = cfg.model
    m.vocab_size, m.n_layer, m.n_embd, m.n_head, m.block_size = 64, 1, 32, 2, 16
    for k, v in layout.items():
        setattr(cfg, k, v)
    return TrainStep(cfg, torch.device("cpu"))


def _projection_dtype(step: TrainStep) -> torch.dtype:
    """The dtype a block's q/k/v projection computes in, over one forward and backward."""
    seen = []
    part = step.model.parts[0]
    part.h[0].attn.c_attn.register_forward_hook(lambda mod, i, out: seen.append(out.dtype))
    x = torch.randint(0, 64, (2, 16))
    with step.autocast, step.model.loss_ctx():
        _, loss = step.model.modules[0](x, x)
        loss.backward()
    assert all(p.grad is not None for p in part.parameters())
    return seen[0]


def test_fsdp_computes_in_bf16_by_its_policy_alone_and_tp_by_autocast(two_ranks):
    for strategy in ("fsdp", "zero2"):  # zero2 is fully_shard too: the same single mechanism
        fsdp = _step(strategy=strategy)
        assert fsdp.model.mixed_by_fsdp and isinstance(fsdp.autocast, nullcontext), strategy
        assert _projection_dtype(fsdp) == torch.bfloat16  # the MixedPrecisionPolicy's gather
    tp = _step(tp=2)
    assert not tp.model.mixed_by_fsdp and isinstance(tp.autocast, torch.autocast)
    assert _projection_dtype(tp) == torch.bfloat16  # autocast over DTensor matmuls
    assert all(p.dtype == torch.float32 for p in tp.model.parts[0].parameters())
