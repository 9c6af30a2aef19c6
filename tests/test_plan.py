import json

import pytest
import torch

from conftest import run_cli
from raytrain_lm.config import ModelConfig, preset_config
from raytrain_lm.model import GPT
from raytrain_lm.plan import GB, estimate, param_counts, recommend


@pytest.mark.parametrize("preset", ["tiny", "small", "gpt2", "gpt2-medium"])
def test_parameter_count_matches_the_model(preset):
    cfg = preset_config(preset).model
    cfg.vocab_size = cfg.vocab_size or 256
    with torch.device("meta"):
        assert param_counts(cfg)["total"] == GPT(cfg).num_params()


def test_70b_numbers():
    m = preset_config("gpt-70b").model
    n = param_counts(m)["total"]
    assert 69e9 < n < 71e9
    ddp = estimate(m, 64, "ddp", "none", 1, 4096)
    assert ddp.params / GB == pytest.approx(4 * n / GB) and 270 < ddp.params / GB < 290  # ~280 GB
    assert ddp.model_state == pytest.approx(4 * ddp.params)  # params + grads + 2 Adam moments
    fsdp = estimate(m, 64, "fsdp", "none", 1, 4096)
    assert fsdp.model_state == pytest.approx(ddp.model_state / 64)
    best, accum = recommend(m, 64, 1, 1, 4096, memory_gb=80)
    assert best.strategy == "fsdp" and best.total < 72 * GB
    assert recommend(m, 2, 1, 1, 4096, memory_gb=80) is None  # 2 GPUs can never hold it


def test_recomputation_lowers_activation_memory():
    m = ModelConfig(vocab_size=256, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    none, sel, full = (estimate(m, 8, "ddp", ac, 8, 1024).activations
                       for ac in ("none", "selective", "full"))
    assert full < sel < none


def test_plan_cli_json_and_table():
    r = run_cli("plan", "--preset", "gpt-70b", "--workers", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["recommendation"]["strategy"] == "fsdp" and len(out["plans"]) == 6
    r = run_cli("plan", "--preset", "gpt2", "--workers", "8")
    assert r.returncode == 0 and "recommendation: --strategy ddp" in r.stdout


def test_train_refuses_what_cannot_fit(tmp_path, pydoc_data, ray_address):
    r = run_cli("train", "--preset", "gpt-70b", "--workers", "2", "--data", str(pydoc_data),
                "--address", ray_address, "--storage", str(tmp_path / "runs"), "--seq-len", "256")
    assert r.returncode == 2, r.stderr
    assert "GB per worker" in r.stderr and "--force" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()
