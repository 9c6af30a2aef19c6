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

import math
import re
from typing import Any, Optional

from raytrain_lm.errors import UserError, brief
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.hf import HFAdapter

HF_CONFIG = "config.json"  # named in messages (store/hf_folder.py reads it)

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
# Names a folder may hold that are no weight (our_name skips them; the check before launch too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # older exports saved the rotary buffer
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
    IGNORED_SUFFIXES = IGNORED_SUFFIXES
    # config.json's keys as the class defaults them where a folder leaves them out
    defaults: dict[str, Any] = {"num_key_value_heads": None, "head_dim": None,
                                "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                                "tie_word_embeddings": False}
    # config.json's other spellings of a key, as the class's `attribute_map` reads them: the
    # spelling transformers 5 writes -> the one this adapter reads (the Hub's)
    aliases: dict[str, str] = {}

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
            if hf.endswith(IGNORED_SUFFIXES):
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

    def expected_tensors(self, config: dict[str, Any], m: ModelConfig,
                         where: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """(every tensor a folder of the model `m` holds, with its shape; the names it may hold
        besides: a tied model's head, which some folders store anyway) for the check of the
        folder's headers before launch (store/hf_folder.check_tensors)."""
        shapes = self.hf_shapes(m)
        if m.tie_embeddings:
            shapes["lm_head.weight"] = (m.vocab_size, m.n_embd)
            return shapes, {"lm_head.weight"}
        return shapes, set()

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
        """Every ModelConfig field the folder's config.json fixes (the model is the folder), each
        value read checked for its type (`config_value`), after refusing, in one line, what
        llama.py does not compute. A key the folder leaves out takes the class's default (`defaults`)."""
        config = self._respelled(config, where)
        c = {**self.defaults, **{k: v for k, v in config.items() if v is not None or k == "sliding_window"}}
        problems: list[str] = []
        width = config_value(c, "hidden_size", "count", where)
        heads = config_value(c, "num_attention_heads", "count", where)
        head_dim = config_value(c, "head_dim", "count", where, width // heads)
        if c.get("head_dim") is None and width % heads:
            problems.append(f"hidden_size {width} is not a multiple of num_attention_heads {heads}")
        kv = config_value(c, "num_key_value_heads", "count", where, heads)
        if heads % kv:
            problems.append(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}")
        fields: dict[str, Any] = {
            "arch": self.family, "vocab_size": config_value(c, "vocab_size", "count", where),
            "block_size": config_value(c, "max_position_embeddings", "count", where),
            "n_embd": width, "n_layer": config_value(c, "num_hidden_layers", "count", where), "n_head": heads,
            "n_kv_head": kv, "head_size": None if head_dim * heads == width else head_dim,
            "ffn_dim": config_value(c, "intermediate_size", "count", where),
            "norm_eps": config_value(c, "rms_norm_eps", "number", where),
            "tie_embeddings": config_value(c, "tie_word_embeddings", "bool", where), "bias": False,
            "dropout": 0.0, "qkv_bias": False, "qk_norm": False, "sliding_window": None,
            **self._rope_fields(c, problems, where),
        }
        act = config_value(c, "hidden_act", "str", where, "silu")
        if act != "silu":
            problems.append(f"hidden_act {brief(act)}")
        if c.get("attention_dropout") not in (None, 0, 0.0):
            problems.append(f"attention_dropout {brief(c['attention_dropout'])} (no dropout here)")
        fields.update(self._own_fields(c, problems, where))
        if problems:
            raise UserError(f"{where} is a {self.architecture} this project cannot compute: "
                            f"{', '.join(problems)}")
        return fields

    def _respelled(self, config: dict[str, Any], where: str) -> dict[str, Any]:
        """config.json with each alias's value under the key this adapter reads, so a folder that
        transformers saved (its own spelling) does not fall back to the class's default."""
        for alias, key in self.aliases.items():
            if config.get(alias) is None:
                continue
            if config.get(key) is not None and config[key] != config[alias]:
                raise UserError(f"{where}: {HF_CONFIG} gives {key} {brief(config[key])} and "
                                f"{alias} {brief(config[alias])}, two values of one setting: "
                                f"keep one of them")
            config = {**{k: v for k, v in config.items() if k != alias}, key: config[alias]}
        return config

    def _rope_fields(self, c: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
        """rope_parameters (transformers 5) or rope_scaling (older folders), as transformers
        reads them: the dict's rope_theta, else the top-level one, else 10000."""
        rope = (config_value(c, "rope_parameters", "object", where, {})
                or config_value(c, "rope_scaling", "object", where, {}))
        kind = config_value(rope, "rope_type", "str", where,
                            config_value(rope, "type", "str", where, "default"))
        theta = config_value(rope, "rope_theta", "number", where,
                             config_value(c, "rope_theta", "number", where, 10000.0))
        out = {"rope_theta": theta, "rope_type": kind, **_ROPE_DEFAULTS}
        if kind not in ("default", *ROPE_KEYS):
            problems.append(f"rope_type {brief(kind)} (the rotary embeddings computed here: "
                            f"default, linear, llama3)")
            return out
        for key in ROPE_KEYS.get(kind, ()):
            if key.startswith("original"):
                out[ROPE_FIELDS[key]] = config_value(rope, key, "count", where, c["max_position_embeddings"])
            elif rope.get(key) is None:
                problems.append(f"rope_type {brief(kind)} without {key}")
            else:
                out[ROPE_FIELDS[key]] = config_value(rope, key, "number", where)
        partial = config_value(rope, "partial_rotary_factor", "number", where,
                       config_value(c, "partial_rotary_factor", "number", where, 1.0))
        if partial != 1.0:
            problems.append("partial_rotary_factor (every dimension rotates here)")
        return out

    def _own_fields(self, c: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
        problems += [f"{k}=true" for k in ("attention_bias", "mlp_bias")
                     if config_value(c, k, "bool", where, False)]
        return {}


def config_value(config: dict[str, Any], key: str, kind: str, where: str, default: Any = None) -> Any:
    """config[key] checked to be of `kind`: "count" (a whole number >= 1), "number" (positive and
    finite; returned as a float), "bool", "str" or "object"; `default` where it is absent or null (none: required).
    (How large a count may be is the run's to say: the fields make its checked model.)"""
    value = config.get(key)
    if value is None:
        if default is None:
            raise UserError(f"{where}: {HF_CONFIG} has no {key}")
        return default
    ok = {"count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
          and 0 < _float(v) < math.inf,
          "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
          "object": lambda v: isinstance(v, dict)}[kind](value)
    if not ok:
        what = {"count": "a whole number >= 1", "number": "a positive number",
                "bool": "true or false", "str": "a string", "object": "a JSON object"}[kind]
        raise UserError(f"{where}: {HF_CONFIG}'s {key} must be {what}, got {brief(value)}")
    return float(value) if kind == "number" else value


def _float(value: int | float) -> float:
    """A JSON number as a float; inf for an integer past float's range (10^400: JSON has no
    bound on an integer's digits, float() raises OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


ADAPTER = LlamaAdapter()
