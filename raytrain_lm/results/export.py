"""Export a checkpoint's model without the training state (optimizer, data position, RNG):

- `native` (the default): safetensors plus a config JSON in this project's names, for plain
  PyTorch with model.py. Tied weights (the output projection shares the token embedding) are
  stored once; config.json's "tied" says which names to point at which.
- `hf`: a Hugging Face model folder (config.json, model.safetensors under transformers' names,
  the tokenizer files), which transformers' Auto classes load without this project: a GPT as
  GPT2LMHeadModel, a Llama as LlamaForCausalLM (hf_llama.py).

Either way a BPE's tokenizer.json goes along, byte for byte the dataset's and the checkpoint's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.config.settings import ModelConfig, TrainConfig
from raytrain_lm.data.tokenizer import EOT, Tokenizer, byte_tokenizer_json, tokenizer_from_spec
from raytrain_lm.errors import UserError
from raytrain_lm.store.files import TOKENIZER
from raytrain_lm.store.storage import is_remote, staged_folder

WEIGHTS, CONFIG = "model.safetensors", "config.json"
# gpt-2: c_attn's rows are head-interleaved ([h0 q, h0 k, h0 v, h1 q, ...], model.py), which
# raytrain_lm.models.decoder.GPT reads as is; model.qkv_interleaved_to_gpt2 gives GPT-2's [q; k; v].
FORMAT = "raytrain-lm/gpt-2"
FORMATS_OF = {"gpt": FORMAT, "llama": "raytrain-lm/llama"}  # llama.py's names, as they are
FORMATS = ("native", "hf")


def _untie(state: dict) -> tuple[dict, dict[str, str]]:
    """Keep one name per shared storage: {name: tensor}, {dropped name: kept name}."""
    kept: dict[str, Any] = {}
    seen: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            kept[name] = t.contiguous()
    return kept, tied


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export_checkpoint(folder: Path, out: Path, source: str, force: bool = False,
                      meta: Optional[dict] = None) -> dict[str, Any]:
    """Write `out`/model.safetensors and `out`/config.json from the checkpoint in `folder`.
    `out` appears complete or not at all. Returns what config.json holds. `meta`: as for
    load_checkpoint."""
    from safetensors.torch import save_file

    from raytrain_lm.models.decoder import architecture
    from raytrain_lm.store.checkpoint_format import load_checkpoint  # torch: not before `out` is checked

    check_out(out, force)
    state = load_checkpoint(folder, meta=meta)
    tok = tokenizer_from_spec(state["tokenizer"], folder)
    # The ties come from the model, not from how a checkpoint stored its tensors: a sharded (FSDP)
    # checkpoint gathers the tied embedding and output weights as two separate copies.
    model_cfg = TrainConfig.from_dict(state["config"]).model
    model = architecture(model_cfg).from_state_dict(model_cfg, state["model"])
    weights, tied = _untie(model.state_dict())
    config = {
        "format": FORMATS_OF[model_cfg.arch],
        "model": state["config"]["model"],
        "tokenizer": state["tokenizer"],
        "tied": tied,
        **({"qkv_layout": "head-interleaved"} if model_cfg.arch == "gpt" else {}),
        "dtype": str(next(iter(weights.values())).dtype).removeprefix("torch."),
        "num_parameters": sum(t.numel() for t in weights.values()),
        "step": state["step"],
        "tokens": state["tokens"],
        "source": source,
        "train_config": state["config"],
    }
    with staged_folder(out) as tmp:
        save_file(weights, f"{tmp}/{WEIGHTS}", metadata={"format": "pt", "source": FORMAT})
        Path(tmp, CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(f"{tmp}/{WEIGHTS}", 0o666 & ~_umask())  # safetensors creates it owner-only
        if tok.raw is not None:
            Path(tmp, TOKENIZER).write_bytes(tok.raw)
    return config


# Every file an export may hold (native or hf).
EXPORT_FILES = frozenset({"model.safetensors", "config.json", "tokenizer.json",
                          "generation_config.json", "tokenizer_config.json"})


def check_out(out: str | Path, force: bool) -> None:
    """`--out` is a local folder that is new, empty, or (with --force) an export of ours;
    anything else is refused and left as it is."""
    if is_remote(out):
        raise UserError(f"export writes a local folder, not {out}: export here, then copy the "
                        f"folder (e.g. `aws s3 cp --recursive DIR {out}`)")
    out = Path(out)
    if not out.exists() and not out.is_symlink() or out.is_dir() and not any(out.iterdir()):
        return
    if not force:
        raise UserError(f"{out} exists and is not empty; pass --force to overwrite it")
    if not is_export(out):
        raise UserError(f"{out} is not an export of raytrain-lm, so --force does not replace it; "
                        f"choose another --out, or remove it yourself")


def is_export(folder: Path) -> bool:
    """A folder export wrote: only export's files, and a model.safetensors marked as ours."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    entries = list(folder.iterdir())
    if any(e.name not in EXPORT_FILES or e.is_symlink() or not e.is_file() for e in entries):
        return False
    return _safetensors_source(folder / WEIGHTS) == FORMAT


def _safetensors_source(path: Path) -> Optional[str]:
    """The "source" of a safetensors file's metadata, read from its header (8 bytes of length,
    then JSON), without loading a tensor."""
    try:
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= 1 << 24:
                return None
            header = json.loads(f.read(length))
        return header.get("__metadata__", {}).get("source")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


# ---------------------------------------------------------------- Hugging Face format
#
# Our GPT is GPT-2's architecture (pre-LayerNorm, tanh GELU, learned positions, tied embeddings,
# fused qkv), so it exports as transformers' GPT2LMHeadModel; our Llama as LlamaForCausalLM
# (hf_llama.py: names and config). Writing either needs safetensors and tokenizers, not
# transformers.

HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_GENERATION_CONFIG = "generation_config.json"
# nn.Linear weights (out, in) that GPT-2 keeps in its Conv1D modules as (in, out)
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def c_attn_to_gpt2(t, n_head: int):
    """c_attn's weight (3C, C) or bias (3C,) with its output rows in GPT-2's order: [q | k | v],
    each split by head. Ours are head-interleaved ([h0: q,k,v][h1: q,k,v]..., model.py: so that
    tensor parallelism's contiguous row split hands each rank whole heads); GPT-2 reads the same
    rows as q, k, v one after another, so without this permutation transformers would load the
    weights silently (same shapes) and compute something else."""
    from raytrain_lm.models.decoder import qkv_interleaved_to_gpt2

    return qkv_interleaved_to_gpt2(t, n_head)


def gpt2_state_dict(state: dict, cfg: ModelConfig, vocab_size: int) -> dict:
    """Our GPT's state dict under transformers' GPT2LMHeadModel names ({name: contiguous
    tensor}); the embedding keeps its first `vocab_size` rows (the tokenizer's: the padding rows
    are never a token). The head is tied to the embedding, so it is not stored."""
    import torch

    C = cfg.n_embd

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=state["wte.weight"].dtype)

    out = {"transformer.wte.weight": state["wte.weight"][:vocab_size],
           "transformer.wpe.weight": state["wpe.weight"]}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"transformer.{p}{ln}.weight"] = state[p + ln + ".weight"]
            # GPT-2 always has biases: a bias=False model's are zero (exactly what it computes)
            out[f"transformer.{p}{ln}.bias"] = state.get(p + ln + ".bias", zeros(C))
        for mod in _CONV1D:
            w = state[p + mod + ".weight"]
            b = state.get(p + mod + ".bias", zeros(w.shape[0]))
            if mod == "attn.c_attn":
                w, b = c_attn_to_gpt2(w, cfg.n_head), c_attn_to_gpt2(b, cfg.n_head)
            out[f"transformer.{p}{mod}.weight"] = w.t()  # Conv1D: (in, out)
            out[f"transformer.{p}{mod}.bias"] = b
    out["transformer.ln_f.weight"] = state["ln_f.weight"]
    out["transformer.ln_f.bias"] = state.get("ln_f.bias", zeros(C))
    return {k: v.detach().contiguous() for k, v in out.items()}


def export_hf(state_dict: dict, cfg: ModelConfig, tok: Tokenizer, out: Path,
              force: bool = False) -> dict[str, Any]:
    """Write `out` as a Hugging Face model folder (GPT-2, or Llama); returns config.json's content. The
    vocabulary is the tokenizer's (the model's padding rows are dropped), so every id of the
    exported model is a token and the real tokens' logits are unchanged."""
    check_out(out, force)
    if cfg.vocab_size < tok.vocab_size:
        raise UserError(f"the model has {cfg.vocab_size} token embeddings but its tokenizer "
                        f"{tok.vocab_size} tokens")
    eot = tok.eot_id
    if cfg.arch == "llama":
        from raytrain_lm.models.llama import hf_llama

        weights = hf_llama.to_hf(state_dict, tok.vocab_size)
        config = hf_llama.hf_config(cfg, tok.vocab_size, eot)
    else:
        weights = gpt2_state_dict(state_dict, cfg, tok.vocab_size)
        config = gpt2_config(cfg, tok.vocab_size, eot)
    config["dtype"] = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    _write_hf(out, weights, config, tok, cfg.block_size)
    return config


def gpt2_config(cfg: ModelConfig, vocab_size: int, eot) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,  # 4 * n_embd, as our MLP
        "activation_function": "gelu_new",  # GPT-2's tanh GELU = F.gelu(approximate="tanh")
        "layer_norm_epsilon": 1e-5,  # torch.nn.LayerNorm's default, which our model uses
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,  # 1/sqrt(head_dim), as scaled_dot_product_attention
        "tie_word_embeddings": True,
        # GPT2Config defaults both to 50256 (GPT-2's <|endoftext|>): wrong for any other
        # vocabulary, and generate() would stop on it. None where the tokenizer has no EOT.
        "bos_token_id": eot, "eos_token_id": eot,
    }


def _write_hf(out: Path, weights: dict, config: dict, tok: Tokenizer, block_size: int) -> None:
    from safetensors.torch import save_file

    eot = tok.eot_id
    generation = {"bos_token_id": eot, "eos_token_id": eot}
    # PreTrainedTokenizerFast (transformers' tokenizer.json-as-is class): without a
    # tokenizer_config.json AutoTokenizer would pick GPT2Tokenizer from config.json, which
    # rebuilds the pipeline from vocab and merges with its own pre-tokenizer settings.
    # clean_up_tokenization_spaces=False: True rewrites " ." to "." on decode.
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
                  "clean_up_tokenization_spaces": False, "add_prefix_space": False}
    if eot is not None:
        tok_config.update(bos_token=EOT, eos_token=EOT)
    with staged_folder(out) as tmp:
        # metadata format=pt: transformers refuses a safetensors file without it; source: ours
        # (export --force replaces only a folder whose weights say so)
        save_file(weights, f"{tmp}/{WEIGHTS}", metadata={"format": "pt", "source": FORMAT})
        os.chmod(f"{tmp}/{WEIGHTS}", 0o666 & ~_umask())  # safetensors creates it owner-only
        Path(tmp, CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        Path(tmp, HF_GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        Path(tmp, HF_TOKENIZER_CONFIG).write_text(json.dumps(tok_config, indent=2) + "\n")
        # a BPE: the dataset's file itself; bytes: an equivalent tokenizer.json (id i = byte i)
        Path(tmp, TOKENIZER).write_bytes(tok.raw if tok.raw is not None else
                                         byte_tokenizer_json().encode())


def export_checkpoint_hf(folder: Path, out: Path, force: bool = False,
                         meta: Optional[dict] = None) -> dict[str, Any]:
    """`export --format hf`: a checkpoint folder -> a Hugging Face model folder."""
    from raytrain_lm.models.decoder import architecture
    from raytrain_lm.store.checkpoint_format import load_checkpoint

    check_out(out, force)
    state = load_checkpoint(folder, meta=meta)
    cfg = TrainConfig.from_dict(state["config"])
    tok = tokenizer_from_spec(state["tokenizer"], folder)
    # through the model: a sharded checkpoint gathers the tied weights as two copies
    model = architecture(cfg.model).from_state_dict(cfg.model, state["model"])
    config = export_hf(model.state_dict(), cfg.model, tok, out, force=force)
    return {**config, "step": state["step"]}
