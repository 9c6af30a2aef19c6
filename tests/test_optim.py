import math

import pytest
import torch

from raytrain_lm.config import TrainConfig
from raytrain_lm.optim import build_optimizer, lr_at


def test_warmup_then_cosine_to_min():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-3 / 11)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # rising during warmup
    assert lrs[10] == pytest.approx(1e-3)  # peak right after warmup
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111]))  # then never rising
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 9e-4)
    assert lrs[110] == pytest.approx(1e-4) and lrs[119] == pytest.approx(1e-4)


def test_no_weight_decay_on_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
