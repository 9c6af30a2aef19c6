import math

import pytest
import torch

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.worker.optim import build_optimizer, lr_at


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


def test_wsd_is_stable_then_decays_linearly_over_the_last_fraction():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=100, min_lr_ratio=0.1, schedule="wsd",
                      decay_fraction=0.2)
    lrs = [lr_at(s, cfg) for s in range(110)]
    assert lrs[10:80] == [1e-3] * 70  # stable
    assert lrs[90] == pytest.approx(1e-3 - 9e-4 * 10 / 20)  # halfway down the decay
    assert lrs[100:] == [pytest.approx(1e-4)] * 10


def step_jumps(lrs):
    return [abs(b - a) for a, b in zip(lrs, lrs[1:])]


@pytest.mark.parametrize("schedule,resume_at,horizon", [
    ("cosine", 150, 300),  # decaying: the old end stays, then the minimum is held
    ("cosine", 20, None),  # still warming up: the schedule stretches to the new end
    ("wsd", 150, None),  # stable: the decay moves to the new end
    ("wsd", 280, 300),  # decaying: the old end stays
])
def test_a_longer_resumed_run_never_jumps(schedule, resume_at, horizon):
    """--resume --max-steps 600 on a 300-step run: no step-to-step change of the learning rate
    across the resume is larger than the schedule's own largest change (cosine's horizon moving
    from 300 to 600 made it jump 5.9x)."""
    from raytrain_lm.worker.optim import resumed_horizon

    saved = TrainConfig(lr=3e-3, warmup_steps=30, max_steps=300, schedule=schedule)
    longer = resumed_horizon(saved, TrainConfig(lr=3e-3, warmup_steps=30, max_steps=600,
                                                schedule=schedule), resume_at)
    assert longer.horizon == horizon
    lrs = [lr_at(s, saved) for s in range(resume_at)] + [lr_at(s, longer) for s in range(resume_at, 600)]
    assert max(step_jumps(lrs)) <= max(step_jumps([lr_at(s, saved) for s in range(300)])) + 1e-12
    assert resumed_horizon(saved, TrainConfig(lr=3e-3, warmup_steps=30, max_steps=300,
                                              schedule=schedule), resume_at).horizon is None
    # A later resume from a checkpoint of the longer run inherits its horizon.
    again = resumed_horizon(longer, TrainConfig(lr=3e-3, warmup_steps=30, max_steps=600,
                                                schedule=schedule), 500)
    assert again.horizon == horizon
