"""Export a checkpoint's model without the training state (optimizer, data position, RNG):

- `native` (the default): safetensors plus a config JSON in this project's names, for plain
  PyTorch with models/. Tied weights (the output projection shares the token embedding) are
  stored once; config.json's "tied" says which names to point at which.
- `hf`: a Hugging Face model folder (config.json, model.safetensors under transformers' names,
  the tokenizer files), which transformers' Auto classes load without this project: each
  family's adapter gives the names and config.json (a GPT as GPT2LMHeadModel, models/gpt/hf_gpt.py;
  a Llama as LlamaForCausalLM, models/llama/hf_llama.py).

Either way a BPE's tokenizer.json goes along, byte for byte the dataset's and the checkpoint's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.data.tokenizer import EOT, Tokenizer, byte_tokenizer_json, tokenizer_from_spec
from raytrain_lm.errors import UserError
from raytrain_lm.models import family, hf_adapter
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.store.files import TOKENIZER
from raytrain_lm.store.hf_folder import HF_CONFIG, HF_WEIGHTS
from raytrain_lm.store.storage import is_remote, staged_folder

# What every export's safetensors metadata says as its source (export --force replaces only a
# folder whose weights say so); a native export's config.json names its family's format.
EXPORT_SOURCE = "raytrain-lm/gpt-2"
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

    from raytrain_lm.models import decoder_class
    from raytrain_lm.store.checkpoint_format import load_checkpoint  # torch: not before `out` is checked

    check_out(out, force)
    state = load_checkpoint(folder, meta=meta)
    tok = tokenizer_from_spec(state["tokenizer"], folder)
    # The ties come from the model, not from how a checkpoint stored its tensors: a sharded (FSDP)
    # checkpoint gathers the tied embedding and output weights as two separate copies.
    model_cfg = TrainConfig.from_dict(state["config"]).model
    model = decoder_class(model_cfg).from_state_dict(model_cfg, state["model"])
    weights, tied = _untie(model.state_dict())
    config = {
        "format": family(model_cfg).export_format,
        "model": state["config"]["model"],
        "tokenizer": state["tokenizer"],
        "tied": tied,
        **family(model_cfg).export_notes,
        "dtype": str(next(iter(weights.values())).dtype).removeprefix("torch."),
        "num_parameters": sum(t.numel() for t in weights.values()),
        "step": state["step"],
        "tokens": state["tokens"],
        "source": source,
        "train_config": state["config"],
    }
    with staged_folder(out) as tmp:
        save_file(weights, f"{tmp}/{HF_WEIGHTS}", metadata={"format": "pt", "source": EXPORT_SOURCE})
        Path(tmp, HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(f"{tmp}/{HF_WEIGHTS}", 0o666 & ~_umask())  # safetensors creates it owner-only
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
    return _safetensors_source(folder / HF_WEIGHTS) == EXPORT_SOURCE


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
# The family's adapter (Family.hf_adapter) gives the weights' names and config.json; writing the
# folder needs safetensors and tokenizers, not transformers.

HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_GENERATION_CONFIG = "generation_config.json"


def export_hf(state_dict: dict, cfg: ModelConfig, tok: Tokenizer, out: Path,
              force: bool = False) -> dict[str, Any]:
    """Write `out` as a Hugging Face model folder (its family's format); returns config.json's content. The
    vocabulary is the tokenizer's (the model's padding rows are dropped), so every id of the
    exported model is a token and the real tokens' logits are unchanged."""
    check_out(out, force)
    if cfg.vocab_size < tok.vocab_size:
        raise UserError(f"the model has {cfg.vocab_size} token embeddings but its tokenizer "
                        f"{tok.vocab_size} tokens")
    adapter = hf_adapter(cfg)
    weights = adapter.to_hf(state_dict, cfg, tok.vocab_size)
    config = adapter.hf_config(cfg, tok.vocab_size, tok.eot_id)
    config["dtype"] = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    _write_hf(out, weights, config, tok, cfg.block_size)
    return config


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
        save_file(weights, f"{tmp}/{HF_WEIGHTS}", metadata={"format": "pt", "source": EXPORT_SOURCE})
        os.chmod(f"{tmp}/{HF_WEIGHTS}", 0o666 & ~_umask())  # safetensors creates it owner-only
        Path(tmp, HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        Path(tmp, HF_GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        Path(tmp, HF_TOKENIZER_CONFIG).write_text(json.dumps(tok_config, indent=2) + "\n")
        # a BPE: the dataset's file itself; bytes: an equivalent tokenizer.json (id i = byte i)
        Path(tmp, TOKENIZER).write_bytes(tok.raw if tok.raw is not None else
                                         byte_tokenizer_json().encode())


def export_checkpoint_hf(folder: Path, out: Path, force: bool = False,
                         meta: Optional[dict] = None) -> dict[str, Any]:
    """`export --format hf`: a checkpoint folder -> a Hugging Face model folder."""
    from raytrain_lm.models import decoder_class
    from raytrain_lm.store.checkpoint_format import load_checkpoint

    check_out(out, force)
    state = load_checkpoint(folder, meta=meta)
    cfg = TrainConfig.from_dict(state["config"])
    tok = tokenizer_from_spec(state["tokenizer"], folder)
    # through the model: a sharded checkpoint gathers the tied weights as two copies
    model = decoder_class(cfg.model).from_state_dict(cfg.model, state["model"])
    config = export_hf(model.state_dict(), cfg.model, tok, out, force=force)
    return {**config, "step": state["step"]}
