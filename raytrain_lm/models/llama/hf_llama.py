"""The Llama (llama.py) and Hugging Face's LlamaForCausalLM, both ways: one table of weight names,
the config.json either way, and reading a Hugging Face folder for `--init-from`.

The weights need no conversion but their names: llama.py computes rotary embeddings in
transformers' convention (rotate_half), its RMSNorm as LlamaRMSNorm (fp32, then the weight), and
its projections are separate q/k/v/o and gate/up/down matrices as transformers' are.
The vocabulary: an export keeps the tokenizer's rows (the padding rows are never a token); an
import takes the folder's, which must be the model's (`--set model.vocab_size`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.store.files import META

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"

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

def is_hf_folder(path: str | Path) -> bool:
    """A model folder with a config.json and safetensors weights that is not a checkpoint of ours
    (`model_fields` then says whether it is a Llama)."""
    p = Path(path)
    return ((p / CONFIG).is_file() and not (p / META).is_file()
            and ((p / WEIGHTS).is_file() or (p / INDEX).is_file()))


def read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((Path(folder) / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{folder}/{CONFIG} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"{folder}/{CONFIG} is not a JSON object")
    return config


def model_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig fields a LlamaForCausalLM config.json fixes, after refusing what llama.py
    does not compute (other architectures, rope scaling, biases, other activations)."""
    if config.get("model_type") != "llama":
        raise UserError(f"{where} holds a {config.get('model_type')!r} model; --init-from takes "
                        f"Hugging Face Llama folders (model_type llama) or this project's checkpoints")
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


def check_init_from(folder: str | Path, cfg: ModelConfig, manifest: dict) -> str:
    """A Hugging Face Llama folder fits this run: the model's shape (the ffn size as computed,
    kv heads as given or n_head) and the dataset's tokenizer (the folder's tokenizer.json, byte
    for byte). Returns the folder, resolved."""
    folder = Path(folder)
    where = f"--init-from {folder}"
    fields = model_fields(read_config(folder), where)
    ours = {"arch": cfg.arch, "vocab_size": cfg.vocab_size, "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_kv_head": cfg.kv_heads,
            "ffn_dim": cfg.hidden_dim, "rope_theta": cfg.rope_theta, "norm_eps": cfg.norm_eps}
    diff = [k for k in fields if fields[k] != ours[k]]
    if diff:
        theirs = ", ".join(f"{k}: {fields[k]} vs {ours[k]}" for k in diff)
        sets = " ".join(f"--set model.{k}={fields[k]}" for k in diff)
        raise UserError(f"{where} is another model shape ({theirs}); train with {sets}")
    path = folder / "tokenizer.json"
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != tokenizer_sha256(manifest):
        raise UserError(f"{where}: its tokenizer.json is not the dataset's tokenizer, so its token ids "
                        f"mean other text; prepare the dataset with `prepare --tokenizer {folder}`")
    return str(folder.resolve())


def tokenizer_sha256(manifest: dict) -> str:
    """sha256 of the tokenizer.json an export of a model of this dataset carries (export.py): a
    BPE's own file, or the byte tokenizer's equivalent."""
    from raytrain_lm.data.tokenizer import byte_tokenizer_json

    spec = manifest["tokenizer"]
    if spec.get("type") == "byte":
        return hashlib.sha256(byte_tokenizer_json().encode()).hexdigest()
    return spec["sha256"]


def read_weights(folder: str | Path) -> dict:
    """Every tensor of the folder's safetensors file(s), under our names."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if (folder / INDEX).is_file():
        files = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    else:
        files = [WEIGHTS]
    weights = {}
    for name in files:
        weights.update(load_file(str(folder / name)))
    return from_hf(weights)


def load_weights(folder: str | Path, parallel) -> None:
    """The folder's weights into this rank's parts (each rank reads the full tensors and keeps
    its shards), for --init-from; the optimizer starts fresh."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = read_weights(folder)
    for part in parallel.parts:
        keys = part.state_dict().keys()
        set_model_state_dict(part, {k: full[k] for k in keys},
                             options=StateDictOptions(full_state_dict=True))
