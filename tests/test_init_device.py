"""Initial values are drawn on the parameters' device (no Ray, no GPU): a GPU draws its own
blocks; the CPU and meta tensors use the host generator, so CPU runs keep their values."""

from __future__ import annotations

import torch

from raytrain_lm.models import build_model
from raytrain_lm.models.decoder import init_device
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.parallel.init import materialize_


def test_a_gpu_parameter_is_initialised_by_its_own_devices_generator():
    assert init_device(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert init_device(torch.device("cpu")) == torch.device("cpu")
    assert init_device(torch.device("meta")) == torch.device("cpu")


def test_materialised_on_a_device_the_weights_are_the_single_process_builds():
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    whole = build_model(cfg, seed=7)
    with torch.device("meta"):
        built = build_model(cfg)
    materialize_(built, cfg, 7, "cpu")
    for (name, a), b in zip(whole.state_dict().items(), built.state_dict().values()):
        assert torch.equal(a, b), name
