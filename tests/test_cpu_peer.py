"""bench/cpu_peer.py compares like with like: its nanoGPT-style reference has the project's GPT's
parameters, shape for shape, for the presets it is run on."""

import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from cpu_peer import RefGPT  # noqa: E402
from raytrain_lm.config.presets import preset_config  # noqa: E402
from raytrain_lm.models import build_model  # noqa: E402


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_reference_has_the_projects_parameter_shapes(preset):
    m = preset_config(preset).model
    m.vocab_size = 256
    with torch.device("meta"):
        ours = build_model(m, seed=0)
        ref = RefGPT(256, m.block_size, m.n_layer, m.n_head, m.n_embd)
    shapes = lambda model: sorted(tuple(p.shape) for p in model.parameters())  # noqa: E731
    assert shapes(ref) == shapes(ours) and ref.lm_head.weight is ref.wte.weight


def test_both_benches_build_and_step_the_projects_train_step():
    """The benches build the project's TrainStep without Ray (they stand in for Ray's DDP
    wrapper): a change to how the step is built must not leave them broken."""
    import cpu_kernels
    from cpu_peer import threads_child

    assert threads_child(1) > 0  # cpu_peer's project side: builds and steps
    cfg, step = cpu_kernels.build_step("tiny", "mkl")
    assert step.model.modules[0] is step.model.parts[0]  # the bare model, no wrapper
