"""The Llama (llama.py) and Hugging Face's LlamaForCausalLM, both ways: one table of weight names
(shared by every Llama-skeleton family: their classes name their tensors alike), and the
config.json either way (what a folder's config.json fixes for `--init-from`: the whole model;
what an export writes). Reading the folder itself: store/hf_folder.py; the interface:
models/hf.py.

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

# (our name, Hugging Face's) with {i} for the layer: every Llama-skeleton family's names (Qwen2's
# q/k/v biases and Qwen3's q/k norms exist only where the model has them)
NAMES = [
    ("wte.weight", "model.embed_tokens.weight"),
    ("ln_f.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("h.{i}.ln_1.weight", "model.layers.{i}.input_layernorm.weight"),
    ("h.{i}.ln_2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    *((f"h.{{i}}.attn.{p}_proj.weight", f"model.layers.{{i}}.self_attn.{p}_proj.weight") for p in "qkvo"),
    *((f"h.{{i}}.attn.{p}_proj.bias", f"model.layers.{{i}}.self_attn.{p}_proj.bias") for p in "qkv"),
    *((f"h.{{i}}.attn.{p}_norm.weight", f"model.layers.{{i}}.self_attn.{p}_norm.weight") for p in "qk"),
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


ROPE_KEYS = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
# the rope_parameters keys of each rope_type, and the ModelConfig fields they fill
ROPE_FIELDS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_context"}
_ROPE_DEFAULTS = {"rope_factor": 1.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                  "rope_original_context": None}


class LlamaAdapter(HFAdapter):
    """LlamaForCausalLM; the base of every Llama-skeleton family's adapter, which say what their
    class adds (`_own_fields`, `_own_config`) and what it cannot hold (`_cannot_hold`)."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    family = "llama"  # our model.arch
    # config.json's keys as the class defaults them where a folder leaves them out
    defaults: dict[str, Any] = {"num_key_value_heads": None, "head_dim": None,
                                "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                                "tie_word_embeddings": False}

    def hf_name(self, name: str, m: ModelConfig) -> Optional[str]:
        if name == "lm_head.weight" and m.tie_embeddings:
            return "model.embed_tokens.weight"  # tied: the head is the embedding
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
        if ours == "lm_head.weight" and m.tie_embeddings:
            return None  # a tied folder that stores its head anyway: the embedding is the head
        return ours

    def hf_shapes(self, m: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a folder of `m` holds, by the folder's name, with its shape (no head where
        it is tied; biases and q/k norms where the model has them)."""
        h, q, kv, f, V = m.n_embd, m.n_head * m.head_dim, m.kv_heads * m.head_dim, m.hidden_dim, m.vocab_size
        ours = {"wte.weight": (V, h), "ln_f.weight": (h,), "h.{i}.ln_1.weight": (h,),
                "h.{i}.ln_2.weight": (h,), "h.{i}.attn.q_proj.weight": (q, h),
                "h.{i}.attn.k_proj.weight": (kv, h), "h.{i}.attn.v_proj.weight": (kv, h),
                "h.{i}.attn.o_proj.weight": (h, q), "h.{i}.mlp.gate_proj.weight": (f, h),
                "h.{i}.mlp.up_proj.weight": (f, h), "h.{i}.mlp.down_proj.weight": (h, f)}
        if not m.tie_embeddings:
            ours["lm_head.weight"] = (V, h)
        if m.qkv_bias:
            ours.update({"h.{i}.attn.q_proj.bias": (q,), "h.{i}.attn.k_proj.bias": (kv,),
                         "h.{i}.attn.v_proj.bias": (kv,)})
        if m.qk_norm:
            ours.update({"h.{i}.attn.q_norm.weight": (m.head_dim,),
                         "h.{i}.attn.k_norm.weight": (m.head_dim,)})
        return {hf.replace("{i}", str(i)): ours[name] for name, hf in NAMES if name in ours
                for i in (range(m.n_layer) if "{i}" in name else [0])}

    # ---------------------------------------------------------------- export

    def hf_config(self, m: ModelConfig, vocab_size: int, eot: Optional[int]) -> dict[str, Any]:
        """The class's config.json for `m` with the tokenizer's vocabulary; a UserError (before
        anything is written) for a model the class cannot hold."""
        cannot = self._cannot_hold(m)
        if cannot:
            raise UserError(f"a {m.arch} with {', '.join(cannot)} has no Hugging Face class "
                            f"({self.architecture} has none): export it with --format native")
        rope = {"rope_type": m.rope_type, "rope_theta": m.rope_theta}
        for key in ROPE_KEYS.get(m.rope_type, ()):
            value = getattr(m, ROPE_FIELDS[key])
            rope[key] = value if value is not None else m.block_size
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
            # both spellings: rope_parameters (transformers 5); rope_theta and rope_scaling
            # (transformers 4 and the readers built on it, vLLM's among them)
            "rope_theta": m.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}
            if m.rope_type != "default" else None,
            "attention_dropout": 0.0,
            "tie_word_embeddings": m.tie_embeddings,
            "bos_token_id": eot, "eos_token_id": eot,
            **self._own_config(m),
        }

    def _cannot_hold(self, m: ModelConfig) -> list[str]:
        return [f"model.{k}" for k in ("qkv_bias", "qk_norm", "sliding_window") if getattr(m, k)]

    def _own_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": False, "mlp_bias": False}

    # ---------------------------------------------------------------- import (--init-from)

    def model_fields(self, config: dict[str, Any], where: str) -> dict[str, Any]:
        """Every ModelConfig field the folder's config.json fixes (the model is the folder),
        after refusing, in one line, what llama.py does not compute."""
        c = {**self.defaults, **{k: v for k, v in config.items() if v is not None or k == "sliding_window"}}
        problems: list[str] = []
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        fields: dict[str, Any] = {
            "arch": self.family, "vocab_size": c["vocab_size"], "block_size": c["max_position_embeddings"],
            "n_embd": c["hidden_size"], "n_layer": c["num_hidden_layers"], "n_head": heads,
            "n_kv_head": c.get("num_key_value_heads") or heads,
            "head_size": None if head_dim * heads == c["hidden_size"] else head_dim,
            "ffn_dim": c["intermediate_size"], "norm_eps": float(c["rms_norm_eps"]),
            "tie_embeddings": bool(c["tie_word_embeddings"]), "bias": False, "dropout": 0.0,
            "qkv_bias": False, "qk_norm": False, "sliding_window": None,
            **self._rope_fields(c, problems),
        }
        if c.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {c['hidden_act']!r}")
        if c.get("attention_dropout"):
            problems.append(f"attention_dropout {c['attention_dropout']} (no dropout here)")
        fields.update(self._own_fields(c, problems))
        if problems:
            raise UserError(f"{where} is a {self.architecture} this project cannot compute: "
                            f"{', '.join(problems)}")
        return fields

    def _rope_fields(self, c: dict[str, Any], problems: list[str]) -> dict[str, Any]:
        """rope_parameters (transformers 5) or rope_scaling (older folders), as transformers
        reads them: the dict's rope_theta, else the top-level one, else 10000."""
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        out = {"rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
               "rope_type": kind, **_ROPE_DEFAULTS}
        if kind not in ("default", *ROPE_KEYS):
            problems.append(f"rope_type {kind!r} (the rotary embeddings computed here: default, "
                            f"linear, llama3)")
            return out
        for key in ROPE_KEYS.get(kind, ()):
            value = rope.get(key, c["max_position_embeddings"] if key.startswith("original") else None)
            if value is None:
                problems.append(f"rope_type {kind!r} without {key}")
            else:
                out[ROPE_FIELDS[key]] = int(value) if key.startswith("original") else float(value)
        if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
            problems.append("partial_rotary_factor (every dimension rotates here)")
        return out

    def _own_fields(self, c: dict[str, Any], problems: list[str]) -> dict[str, Any]:
        problems += [f"{k}=true" for k in ("attention_bias", "mlp_bias") if c.get(k)]
        return {}


ADAPTER = LlamaAdapter()
