"""The Llama (llama.py) and Hugging Face's LlamaForCausalLM, both ways: one table of weight names,
and the config.json either way (what a folder's config.json fixes for `--init-from`, and what an
export writes). Reading the folder itself: store/hf_folder.py; the interface: models/hf.py.

The weights need no conversion but their names: llama.py computes rotary embeddings in
transformers' convention (rotate_half), its RMSNorm as LlamaRMSNorm (fp32, then the weight), and
its projections are separate q/k/v/o and gate/up/down matrices as transformers' are.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.hf import HFAdapter

# (our name, Hugging Face's) with {i} for the layer
NAMES = [
    ("wte.weight", "model.embed_tokens.weight"),
    ("ln_f.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("h.{i}.ln_1.weight", "model.layers.{i}.input_layernorm.weight"),
    ("h.{i}.ln_2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    *((f"h.{{i}}.attn.{p}_proj.weight", f"model.layers.{{i}}.self_attn.{p}_proj.weight") for p in "qkvo"),
    *((f"h.{{i}}.mlp.{p}_proj.weight", f"model.layers.{{i}}.mlp.{p}_proj.weight")
      for p in ("gate", "up", "down")),
]
_PATTERNS = [tuple(re.compile("^" + re.escape(n).replace(r"\{i\}", r"(\d+)") + "$") for n in pair)
             for pair in NAMES]


def rename(name: str, src: int) -> Optional[str]:
    """`name` in the other naming (src 0: ours -> HF, 1: HF -> ours); None if it has no match."""
    for pair, patterns in zip(NAMES, _PATTERNS):
        found = patterns[src].match(name)
        if found:
            return pair[1 - src].replace("{i}", found.group(1)) if found.groups() else pair[1 - src]
    return None


class LlamaAdapter(HFAdapter):
    model_type = "llama"
    architecture = "LlamaForCausalLM"

    def hf_name(self, name: str, m: ModelConfig) -> Optional[str]:
        hf = rename(name, 0)
        if hf is None:
            raise ValueError(f"no Hugging Face name for {name}")
        return hf

    def our_name(self, hf: str, m: ModelConfig) -> Optional[str]:
        ours = rename(hf, 1)
        if ours is None:
            if hf.endswith("rotary_emb.inv_freq"):  # older exports saved the rotary buffer
                return None
            raise UserError(f"{hf} is not a weight of a {self.architecture} this project builds")
        return ours

    def hf_config(self, m: ModelConfig, vocab_size: int, eot: Optional[int]) -> dict[str, Any]:
        """LlamaForCausalLM's config.json for `m` with the tokenizer's vocabulary."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": vocab_size,
            "hidden_size": m.n_embd,
            "intermediate_size": m.hidden_dim,
            "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head,
            "num_key_value_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": m.block_size,
            "rms_norm_eps": m.norm_eps,
            # both spellings: rope_parameters (transformers 5), rope_theta (older readers)
            "rope_theta": m.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": eot, "eos_token_id": eot,
        }

    def model_fields(self, config: dict[str, Any], where: str) -> dict[str, Any]:
        """The ModelConfig fields a LlamaForCausalLM config.json fixes, after refusing what
        llama.py does not compute (other architectures, rope scaling, biases, other activations)."""
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


ADAPTER = LlamaAdapter()
