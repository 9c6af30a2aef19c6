"""The mixture of experts and Hugging Face's MixtralForCausalLM and Qwen3MoeForCausalLM, both ways,
in one process: Hub-shaped folders made by transformers (per-expert tensors in bf16 shards with
an index) give our model transformers' logits; our model exported loads back in transformers as
the same class with the same logits and imports back to the same tensors. The --init-from of such
a folder into an expert-parallel layout: test_moe_parallel.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from raytrain_lm.data.tokenizer import ByteTokenizer
from raytrain_lm.models import build_model, hf_adapter
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.store.hf_folder import folder_model
from test_families import ours_from, save_hub_folder

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"

SMALL = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "hidden_act": "silu", "torch_dtype": "bfloat16", "rope_theta": 1000000.0}
# config.json as the Hub spells them, small: Mixtral (4 experts of 96, 2 per token, their weights
# renormalised), Qwen3-MoE (a head size of 32 on a width of 64, 8 experts of 48, 2 per token, its
# weights as the softmax gives them: norm_topk_prob false)
HUB = {
    "mixtral": {**SMALL, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                "router_aux_loss_coef": 0.02},
    "qwen3_moe": {**SMALL, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 48, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "tie_word_embeddings": False},
}
SEQ = 48


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-hub")
    for i, (case, config) in enumerate(HUB.items()):
        assert save_hub_folder(root / case, config, seed=10 + i) == config["architectures"][0]
    return {case: root / case for case in HUB}


def logits_gap(ours, theirs, vocab: int, seed: int) -> float:
    idx = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours(idx, targets=idx)[0][..., :vocab] - theirs(idx).logits).abs().max().item()


@pytest.mark.parametrize("case", HUB)
def test_logits_equal_transformers_on_hub_moe_folders(hub, case):
    """fp32, within 1e-5 at every position of 48 tokens: the folder's per-expert matrices
    (in bf16 shards with an index) stacked into our experts, its routers ours, the same
    tokens reaching the same experts with the same weights (renormalised or not)."""
    from transformers import AutoModelForCausalLM

    folder = hub[case]
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and any(".experts.3." in k for k in index)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = ours_from(folder)
    assert ours.cfg.arch == "moe" and ours.cfg.qk_norm == (case != "mixtral")
    assert logits_gap(ours, theirs, 320, seed=4) < 1e-5


@pytest.mark.parametrize("case", HUB)
def test_the_adapter_names_every_tensor_of_the_folder(hub, case):
    """hf_shapes (arithmetic on the config) is every tensor of the folder, with its shape; each
    of our expert tensors is E of them stacked (hf_stack), every other one is one (hf_name),
    and our_name maps each back."""
    from raytrain_lm.store.hf_folder import tensors

    m = ModelConfig(**folder_model(hub[case])[1])
    adapter = hf_adapter(m)
    found = {name: tuple(info.shape) for name, info in tensors(hub[case]).items()}
    assert adapter.hf_shapes(m) == found
    with torch.device("meta"):
        model = build_model(m)
    for name, p in model.named_parameters():
        stack = adapter.hf_stack(name, m)
        names = stack or [adapter.hf_name(name, m)]
        assert all(found[hf] == (tuple(p.shape[1:]) if stack else tuple(p.shape)) for hf in names)
        assert {adapter.our_name(hf, m) for hf in names} == {name}
        assert stack is None or len(stack) == m.n_experts


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_an_moe_export_loads_back_as_the_same_class(hub, case, tmp_path):
    """export --format hf of our mixture of experts: transformers loads it as the folder's class
    (Mixtral without q/k norms, Qwen3-MoE with them) with the same logits, and --init-from
    reads it back to the same tensors and model."""
    from transformers import AutoModelForCausalLM

    from raytrain_lm.results.hf_export import export_hf

    ours = ours_from(hub[case])
    m = ours.cfg
    # in shards of 40 KB: an expert tensor's matrices may fall in different files
    config = export_hf(ours.state_dict(), m, ByteTokenizer(), tmp_path / "out", dtype="fp32",
                       max_shard_size=40_000)
    assert config["architectures"] == HUB[case]["architectures"] and len(config["files"]) > 1
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(theirs).__name__ == HUB[case]["architectures"][0]
    assert logits_gap(ours, theirs, 256, seed=2) < 1e-5
    assert ModelConfig(**folder_model(tmp_path / "out")[1]) == ModelConfig(**{**vars(m), "vocab_size": 256})
    weights = ours_from(tmp_path / "out").state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(weights[name], t[:256] if name in ("wte.weight", "lm_head.weight") else t)


@pytest.mark.parametrize("case", HUB)
def test_a_folder_transformers_saved_keeps_its_expert_count(hub, case, tmp_path):
    """transformers 5 saves the count of experts as num_local_experts for both classes (its
    attribute_map), where the Hub's Qwen3-MoE folders say num_experts: a fine-tune saved by
    save_pretrained imports with its own count and logits, not the class's default of 128 (or 8).
    A folder giving both spellings two values is refused."""
    from transformers import AutoModelForCausalLM

    from raytrain_lm.errors import UserError

    theirs = AutoModelForCausalLM.from_pretrained(hub[case], dtype=torch.float32).eval()
    theirs.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["num_local_experts"] == HUB[case].get("num_experts", HUB[case].get("num_local_experts"))
    ours = ours_from(tmp_path / "saved")
    assert ours.cfg.n_experts == saved["num_local_experts"]
    assert logits_gap(ours, theirs, 320, seed=5) < 1e-5
    both = {**saved, "num_experts": saved["num_local_experts"] + 1}
    with pytest.raises(UserError, match="two values of one setting"):
        hf_adapter(ours.cfg).model_fields(both, "saved")


@pytest.mark.parametrize("case,change,expected", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise (the router's inputs are not jittered here)"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "dense layers among the MoE ones"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "dense layers among the MoE ones"),
])
def test_what_the_moe_does_not_compute_is_refused_in_one_line(case, change, expected):
    from raytrain_lm.errors import UserError
    from raytrain_lm.models import hf_importer

    config = {**HUB[case], **change}
    with pytest.raises(UserError, match="cannot compute: .*" + expected.split(" (")[0]):
        hf_importer(config["model_type"], "--init-from x").model_fields(config, "--init-from x")


def test_an_moe_with_a_shared_expert_has_no_hugging_face_class(tmp_path):
    """Neither class holds a shared expert: export refuses before writing anything."""
    from raytrain_lm.errors import UserError
    from raytrain_lm.results.hf_export import export_hf

    m = ModelConfig(arch="moe", bias=False, vocab_size=256, block_size=32, n_layer=1, n_head=4,
                    n_embd=32, ffn_dim=32, n_experts=4, top_k=2, shared_ffn_dim=16)
    with pytest.raises(UserError, match="model.shared_ffn_dim has no Hugging Face class"):
        export_hf(build_model(m, seed=0).state_dict(), m, ByteTokenizer(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", HUB)
def test_the_routing_fields_are_read_trained_with_and_written_back(hub, case, tmp_path):
    """router_aux_loss_coef, num_experts_per_tok and the renormalisation as transformers reads
    the folder (Mixtral's 0.02 as shipped; Qwen3-MoE's left out: the class's 0.001); the balance
    loss a training forward adds is, per layer, the folder's coefficient times transformers' own
    load_balancing_loss_func on the same router logits (one sequence: its batch is ours),
    averaged over the layers; the export writes the folder's values back (a run from the folder:
    its config.json as shipped)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from raytrain_lm.models.decoder import take_aux_losses
    from raytrain_lm.results.hf_export import export_hf
    from raytrain_lm.store.release import read_release

    theirs_cfg = AutoConfig.from_pretrained(hub[case])
    assert theirs_cfg.router_aux_loss_coef == HUB[case].get("router_aux_loss_coef", 0.001)
    ours = ours_from(hub[case])
    m = ours.cfg
    assert m.top_k == theirs_cfg.num_experts_per_tok
    assert m.norm_top_k == getattr(theirs_cfg, "norm_topk_prob", True)
    theirs = AutoModelForCausalLM.from_pretrained(hub[case], dtype=torch.float32).eval()
    idx = torch.randint(0, 320, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        router_logits = theirs(idx, output_router_logits=True).router_logits
        ours.train()
        x = ours.embed(idx)
        for block in ours.h:
            x, _ = block(x)
        aux = take_aux_losses(ours.h).item()
    per_layer = [load_balancing_loss_func((r,), m.n_experts, m.top_k).item() for r in router_logits]
    want = theirs_cfg.router_aux_loss_coef * sum(per_layer) / len(per_layer)
    assert aux == pytest.approx(want, rel=1e-5)
    config = export_hf(ours.state_dict(), m, ByteTokenizer(), tmp_path / "out", dtype="fp32")
    assert config["router_aux_loss_coef"] == theirs_cfg.router_aux_loss_coef
    assert config["num_experts_per_tok"] == theirs_cfg.num_experts_per_tok
    # a run from the folder: its config.json as shipped (the coefficient left out stays out)
    export_hf(ours.state_dict(), m, ByteTokenizer(), tmp_path / "release", release=read_release(hub[case]))
    assert json.loads((tmp_path / "release" / "config.json").read_text()) == HUB[case]
