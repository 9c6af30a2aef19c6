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

import math
import re
from typing import Any, Optional

from raytrain_lm.errors import UserError, brief
from raytrain_lm.models.family import ModelConfig

HF_CONFIG = "config.json"  # named in messages (store/hf_folder.py reads it)

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
# Names a folder may hold that are no weight (from_hf skips them; the check before launch too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # older exports saved the rotary buffer


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
            if name.endswith(IGNORED_SUFFIXES):
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

def _get(config: dict[str, Any], key: str, kind: str, where: str, default: Any = None) -> Any:
    """config[key] checked to be of `kind`: "count" (a whole number >= 1), "number" (positive and
    finite), "bool", "str" or "object"; `default` where it is absent or null. (How large a count
    may be is the run's to say: the fields are compared with its checked model.)"""
    value = config.get(key)
    if value is None:
        if default is None:
            raise UserError(f"{where}: {HF_CONFIG} has no {key}")
        return default
    ok = {"count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
          and 0 < v < math.inf,
          "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
          "object": lambda v: isinstance(v, dict)}[kind](value)
    if not ok:
        what = {"count": "a whole number >= 1", "number": "a positive number",
                "bool": "true or false", "str": "a string", "object": "a JSON object"}[kind]
        raise UserError(f"{where}: {HF_CONFIG}'s {key} must be {what}, got {brief(value)}")
    return value


def model_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig fields a LlamaForCausalLM config.json fixes, every field read checked,
    after refusing what llama.py does not compute (other architectures, rope scaling, biases,
    other activations). (Its model_type chose this family: models.hf_importer.)"""
    rope = (_get(config, "rope_parameters", "object", where, {}) or
            _get(config, "rope_scaling", "object", where, {}))
    rope_kind = _get(rope, "rope_type", "str", where, _get(rope, "type", "str", where, "default"))
    problems = [f"rope_type {rope_kind!r} (only the default rotary embedding is built here)"] \
        if rope_kind != "default" else []
    problems += [f"{k}=true" for k in ("attention_bias", "mlp_bias") if _get(config, k, "bool", where, False)]
    act = _get(config, "hidden_act", "str", where, "silu")
    if act != "silu":
        problems.append(f"hidden_act {brief(act)}")
    width = _get(config, "hidden_size", "count", where)
    heads = _get(config, "num_attention_heads", "count", where)
    if width % heads:
        problems.append(f"hidden_size {width} is not a multiple of num_attention_heads {heads}")
    elif config.get("head_dim") not in (None, width // heads):
        problems.append(f"head_dim {brief(config['head_dim'])} is not hidden_size / num_attention_heads")
    kv = _get(config, "num_key_value_heads", "count", where, heads)
    if heads % kv:
        problems.append(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    if problems:
        raise UserError(f"{where} is a Llama this project cannot compute: {', '.join(problems)}")
    theta = _get(rope, "rope_theta", "number", where, _get(config, "rope_theta", "number", where, 10000.0))
    return {"arch": "llama", "vocab_size": _get(config, "vocab_size", "count", where),
            "n_embd": width, "n_layer": _get(config, "num_hidden_layers", "count", where),
            "n_head": heads, "n_kv_head": kv,
            "ffn_dim": _get(config, "intermediate_size", "count", where),
            "rope_theta": float(theta),
            "norm_eps": float(_get(config, "rms_norm_eps", "number", where, 1e-6))}


def expected_tensors(config: dict[str, Any], m: ModelConfig, where: str) -> tuple[dict, set[str]]:
    """(the shape of every tensor a folder of this config.json holds for a model `m`, by its
    Hugging Face name; the names it may leave out: lm_head.weight where the embedding is the head)."""
    tied = _get(config, "tie_word_embeddings", "bool", where, False)
    return hf_shapes(m, tied=False), {"lm_head.weight"} if tied else set()


def hf_shapes(cfg: ModelConfig, tied: bool) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a LlamaForCausalLM of `cfg` holds, by its Hugging Face name (no
    lm_head.weight where `tied`: the embedding is the head)."""
    h, q, kv, f = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden_dim
    ours = {"wte.weight": (cfg.vocab_size, h), "ln_f.weight": (h,), "lm_head.weight": (cfg.vocab_size, h),
            "h.{i}.ln_1.weight": (h,), "h.{i}.ln_2.weight": (h,), "h.{i}.attn.q_proj.weight": (q, h),
            "h.{i}.attn.k_proj.weight": (kv, h), "h.{i}.attn.v_proj.weight": (kv, h),
            "h.{i}.attn.o_proj.weight": (h, q), "h.{i}.mlp.gate_proj.weight": (f, h),
            "h.{i}.mlp.up_proj.weight": (f, h), "h.{i}.mlp.down_proj.weight": (h, f)}
    out = {}
    for name, hf in _NAMES:
        if tied and name == "lm_head.weight":
            continue
        for i in range(cfg.n_layer) if "{i}" in name else [None]:
            out[hf.replace("{i}", str(i))] = ours[name]
    return out
