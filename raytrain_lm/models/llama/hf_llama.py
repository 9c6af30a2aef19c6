"""The Llama (llama.py) and Hugging Face's LlamaForCausalLM, both ways: one table of weight names,
and the config.json either way (what a folder's config.json fixes for `--init-from`, and what an
export writes). Reading and checking the folder itself: store/hf_folder.py, run/preflight.py.

The weights need no conversion but their names: llama.py computes rotary embeddings in
transformers' convention (rotate_half), its RMSNorm as LlamaRMSNorm (fp32, then the weight), and
its projections are separate q/k/v/o and gate/up/down matrices as transformers' are.
The vocabulary: an export keeps the tokenizer's rows (the padding rows are never a token); an
import takes the folder's, which must be the model's (`--set model.vocab_size`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.family import ModelConfig

# (our name, Hugging Face's) with {i} for the layer
_NAMES = [
    ("wte.weight", "model.embed_tokens.weight"),
    ("ln_f.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("h.{i}.ln_1.weight", "model.layers.{i}.input_layernorm.weight"),
    ("h.{i}.ln_2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    *((f"h.{{i}}.attn.{p}_proj.weight", f"model.layers.{{i}}.self_attn.{p}_proj.weight") for p in "qkvo"),
    *((f"h.{{i}}.mlp.{p}_proj.weight", f"model.layers.{{i}}.mlp.{p}_proj.weight")
      for p in ("gate", "up", "down")),
]


def _rename(name: str, src: int) -> Optional[str]:
    """`name` in the other naming (src 0: ours -> HF, 1: HF -> ours); None if it has no match."""
    for pair in _NAMES:
        pattern = "^" + re.escape(pair[src]).replace(r"\{i\}", r"(\d+)") + "$"
        m = re.match(pattern, name)
        if m:
            return pair[1 - src].replace("{i}", m.group(1)) if m.groups() else pair[1 - src]
    return None


def to_hf(state: dict, cfg: ModelConfig, vocab_size: int) -> dict:
    """Our Llama's state dict under LlamaForCausalLM's names, the embedding and head cut to the
    tokenizer's `vocab_size` rows."""
    out = {}
    for name, t in state.items():
        hf = _rename(name, 0)
        if hf is None:
            raise ValueError(f"no Hugging Face name for {name}")
        out[hf] = (t[:vocab_size] if name in ("wte.weight", "lm_head.weight") else t).detach().contiguous()
    return out


def from_hf(weights: dict) -> dict:
    """A LlamaForCausalLM state dict under our names. A tied checkpoint (no lm_head.weight, as
    Llama 3.2 1B/3B) gives the head a copy of the embedding: ours is untied from then on."""
    out = {}
    for name, t in weights.items():
        ours = _rename(name, 1)
        if ours is None:
            if name.endswith("rotary_emb.inv_freq"):  # older exports saved the rotary buffer
                continue
            raise UserError(f"{name} is not a weight of a Llama this project builds")
        out[ours] = t
    if "lm_head.weight" not in out and "wte.weight" in out:
        out["lm_head.weight"] = out["wte.weight"].clone()
    return out


def hf_config(cfg: ModelConfig, vocab_size: int, eot: Optional[int]) -> dict[str, Any]:
    """LlamaForCausalLM's config.json for `cfg` with the tokenizer's vocabulary."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        # both spellings: rope_parameters (transformers 5), rope_theta (older readers)
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": eot, "eos_token_id": eot,
    }


# ---------------------------------------------------------------- import (--init-from)

def model_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig fields a LlamaForCausalLM config.json fixes, after refusing what llama.py
    does not compute (other architectures, rope scaling, biases, other activations)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    problems = [f"rope_type {kind!r} (only the default rotary embedding is built here)"] \
        if kind != "default" else []
    problems += [f"{k}=true" for k in ("attention_bias", "mlp_bias") if config.get(k)]
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']!r}")
    heads = config["num_attention_heads"]
    if config.get("head_dim") not in (None, config["hidden_size"] // heads):
        problems.append(f"head_dim {config['head_dim']} is not hidden_size / num_attention_heads")
    if problems:
        raise UserError(f"{where} is a Llama this project cannot compute: {', '.join(problems)}")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return {"arch": "llama", "vocab_size": config["vocab_size"], "n_embd": config["hidden_size"],
            "n_layer": config["num_hidden_layers"], "n_head": heads,
            "n_kv_head": config.get("num_key_value_heads") or heads,
            "ffn_dim": config["intermediate_size"], "rope_theta": float(theta),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6))}
