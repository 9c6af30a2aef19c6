"""Activation checkpointing (parallel/ac.py) in one process: what each mode recomputes, counted
as the matmuls its backward runs (the gradients: test_llama.py, test_fsdp.py)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raytrain_lm.models import build_model
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.parallel.ac import apply_activation_checkpointing

LLAMA = ModelConfig(arch="llama", bias=False, vocab_size=320, block_size=64, n_layer=2, n_head=4,
                    n_kv_head=2, n_embd=64, multiple_of=32, rope_theta=500000.0)
GPT = ModelConfig(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_embd=64)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


def backward_matmuls(cfg: ModelConfig, mode: str) -> tuple[int, dict]:
    model = build_model(cfg, seed=4)
    apply_activation_checkpointing(model, mode)
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(6))
    loss = model(idx, idx)[1]
    with CountMatmuls() as count:
        loss.backward()
    return count.n, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg, full, op", [(LLAMA, 6, 3), (GPT, 3, 1)], ids=["llama", "gpt"])
def test_op_mode_recomputes_every_other_matmul(cfg, full, op):
    """The matmuls each mode runs again in backward, per block: selective none; op the 2nd,
    4th, ... (the Llama's k, o and up projections; the GPT's attention output projection); full
    all of them. Neither runs the block's last matmul again (the MLP's output projection: its
    output is not needed in backward, and torch's checkpoint stops recomputing once it has what
    backward needs). The gradients are those without recomputation."""
    base, grads = backward_matmuls(cfg, "none")
    want = {"selective": 0, "op": op, "full": full}
    for mode, extra in want.items():
        n, g = backward_matmuls(cfg, mode)
        assert n - base == cfg.n_layer * extra, mode
        for name in grads:
            assert torch.allclose(grads[name], g[name], atol=1e-7), (mode, name)
