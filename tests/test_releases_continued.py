"""Releases as their makers ship them, continued: the README's example family (a Llama 2-shaped
folder: config.json with every field of Llama-2-7b-hf's, fp16 weights by transformers' own class,
the SentencePiece-style tokenizer.json transformers' Llama converter writes from a SentencePiece
model trained here, tokenizer_config.json and generation_config.json as the release has them),
Mistral-7B-v0.3's (its SentencePiece-style tokenizer, bf16) and Qwen2.5-0.5B's (its NFC byte-level
BPE by transformers' Qwen2 tokenizer, a vocabulary padded past the tokenizer, tied embeddings),
each prepared on the built-in corpus with the folder's tokenizer, continued on 2 ranks with
FSDP, exported, and loaded by transformers (tests/hub_tokenizers.py builds the tokenizers)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hub_tokenizers import copy_family
from test_release_export import logits_gap

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"

CARRIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def llama2_config(vocab_size: int, ids) -> dict:
    """Llama-2-7b-hf's config.json, field for field, at a small size."""
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1,
            "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 172, "max_position_embeddings": 4096, "model_type": "llama",
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.32.0.dev0", "use_cache": True, "vocab_size": vocab_size}


def mistral_config(vocab_size: int, ids) -> dict:
    """Mistral-7B-v0.3's config.json, field for field, at a small size."""
    return {"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
            "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 224, "max_position_embeddings": 32768, "model_type": "mistral",
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": vocab_size}


def qwen25_config(vocab_size: int, ids) -> dict:
    """Qwen2.5-0.5B's config.json, field for field, at a small size: its vocabulary padded past
    the tokenizer to a multiple of 64 plus 64 (151,936 rows for 151,665 tokens), tied embeddings."""
    eot = ids("<|endoftext|>")
    return {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": eot,
            "eos_token_id": eot, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 160, "max_position_embeddings": 32768, "max_window_layers": 2,
            "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False,
            "vocab_size": -(-vocab_size // 64) * 64 + 64}


# family: (its tokenizer folder's name in hub_tokenizers, config.json, the weights' dtype, the
# wrap's token ids as the manifest records them: a function of the tokenizer's ids)
RELEASES = {"llama2": ("llama2", llama2_config, torch.float16, lambda ids: ([1], [2])),
            "mistral": ("mistral", mistral_config, torch.bfloat16, lambda ids: ([1], [2])),
            "qwen2.5": ("qwen2", qwen25_config, torch.bfloat16, lambda ids: ([], [ids("<|endoftext|>")]))}


@pytest.fixture(scope="module", params=sorted(RELEASES))
def continued(request, tmp_path_factory):
    """The folder, then `prepare --tokenizer FOLDER` on the built-in corpus, `train --init-from`
    on 2 ranks of the local harness with FSDP (3 steps) and `export --format hf --dtype fp32`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from conftest import cli_here
    from local_mode import run_local
    from raytrain_lm.config.load import build_config
    from raytrain_lm.data.prepare import prepare_dataset
    from raytrain_lm.store.hf_folder import folder_model

    family, make_config, dtype, _ = RELEASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    folder = copy_family(family, root / f"{request.param}-tiny")
    tok = AutoTokenizer.from_pretrained(folder)
    config = make_config(len(tok), tok.convert_tokens_to_ids)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.to(dtype).save_pretrained(folder, max_shard_size="100KB")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # as shipped
    prepare_dataset("pydoc", root / "data", tokenizer=str(folder), block_tokens=1024)
    flags = dict(workers=2, strategy="fsdp", max_steps=3, batch_size=2, seq_len=48,
                 checkpoint_every=3, eval_every=3, eval_windows=2, log_every=1,
                 data=str(root / "data"), storage=str(root / "runs"), name="cont", seed=3)
    cfg = build_config(flags=flags, folder=folder_model(folder))
    run_local(cfg, init_from=str(folder), say=lambda m: None)
    res = cli_here("export", "cont", "--storage", str(root / "runs"), "--format", "hf",
                   "--dtype", "fp32", "--out", str(root / "out"))
    assert res.returncode == 0, res.stderr
    return folder, root, request.param


@pytest.mark.slow
def test_a_release_continued_with_fsdp_exports_what_transformers_loads(continued):
    """The dataset wraps each document in the family's tokens (Llama 2's and Mistral's <s> ...
    </s>, Qwen's ... <|endoftext|>); the export's config.json is the release's but its dtype
    (Qwen's padded vocabulary kept), its tokenizer and generation files the release's byte for
    byte; transformers loads it, encodes as the release does, and computes the trained
    checkpoint's logits within 1e-4 (fp32), every embedding row exported, the weights trained
    away from the release's."""
    from transformers import AutoTokenizer, GenerationConfig

    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.models import decoder_class
    from raytrain_lm.store.checkpoint_format import load_checkpoint
    from raytrain_lm.store.runs import find_checkpoint

    folder, root, name = continued
    theirs_tok = AutoTokenizer.from_pretrained(folder)
    manifest = json.loads((root / "data" / "manifest.json").read_text())
    wrap = RELEASES[name][3](theirs_tok.convert_tokens_to_ids)
    assert (manifest["documents"]["begin_ids"], manifest["documents"]["end_ids"]) == wrap
    out = root / "out"
    assert json.loads((out / "config.json").read_text()) == {
        **json.loads((folder / "config.json").read_text()), "torch_dtype": "float32"}
    for name in CARRIED:
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    ours_tok = AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x  # Python's docs, caf\u0065\u0301"  # NFC composes e + accent
    assert ours_tok(text)["input_ids"] == theirs_tok(text)["input_ids"]
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(folder).to_dict()
    found = find_checkpoint("cont", str(root / "runs"))
    assert found.step == 3
    state = load_checkpoint(found.path, meta=found.meta)
    m = TrainConfig.from_dict(state["config"]).model
    trained = decoder_class(m).from_state_dict(m, state["model"]).eval()
    assert logits_gap(trained, out, m.vocab_size) < 1e-4
    from safetensors.torch import load_file

    start = {}
    for shard in sorted(folder.glob("*.safetensors")):
        start.update(load_file(shard))
    exported = {}
    for shard in sorted(out.glob("*.safetensors")):
        exported.update(load_file(shard))
    assert set(exported) == set(start)
    assert any(not torch.equal(exported[k], start[k].float()) for k in start)
