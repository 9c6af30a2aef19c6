"""Export a checkpoint's model without the training state (optimizer, data position, RNG):

- `native` (the default): safetensors plus a config JSON in this project's names, for plain
  PyTorch with models/. Tied weights (the output projection shares the token embedding) are
  stored once; config.json's "tied" says which names to point at which.
- `hf`: a Hugging Face model folder (results/hf_export.py), which transformers' Auto classes
  load without this project: each family's adapter gives the names and config.json (a GPT as
  GPT2LMHeadModel, models/gpt/hf_gpt.py; a Llama as LlamaForCausalLM, models/llama/hf_llama.py).

Either way a BPE's tokenizer.json goes along, byte for byte the dataset's and the checkpoint's,
and a run started from a release (train --init-from a Hugging Face folder) carries its release
files (store/release.py) into either: its tokenizer_config.json (chat template, special tokens),
generation_config.json (eos list, sampling defaults), special_tokens_map.json and
chat_template.jinja as shipped. A native export's config.json is this project's, so the
release's config.json goes inside it, as its "release_config" (the object as shipped).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.data.spec import tokenizer_from_spec
from raytrain_lm.errors import UserError
from raytrain_lm.models import family
from raytrain_lm.store.files import TOKENIZER
from raytrain_lm.store.hf_folder import HF_CONFIG, HF_WEIGHTS
from raytrain_lm.store.release import RELEASE_CONFIG, RELEASE_FILES, check_release, parse, write_beside
from raytrain_lm.store.storage import is_remote, staged_folder

# What every export's safetensors metadata says as its source (export --force replaces only a
# folder whose weights say so); a native export's config.json names its family's format.
EXPORT_SOURCE = "raytrain-lm/gpt-2"
FORMATS = ("native", "hf")
HF_DTYPES = ("bf16", "fp32")  # export --format hf --dtype
DEFAULT_MAX_SHARD = "5GB"  # the Hub's shards (transformers 4's default; transformers 5 writes 50GB)


def check_dtype_name(dtype: str) -> str:
    if dtype not in HF_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(HF_DTYPES)}, got {dtype!r}")
    return dtype


def parse_size(text: str) -> int:
    """`--max-shard-size`: bytes, as transformers reads it ("5GB" = 5e9, "500MiB", "1000000")."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B)?\s*", str(text), re.IGNORECASE)
    if not m or int(m.group(1)) == 0:
        raise UserError(f"--max-shard-size must be a positive size such as 5GB, 500MB or 2GiB, "
                        f"got {text!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    return int(m.group(1)) * scale[unit]


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


def umask() -> int:
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
    release = check_release(state.get("release"), str(folder)) or {}
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
        **({"release_config": parse(release[RELEASE_CONFIG], f"{folder}: {RELEASE_CONFIG}")}
           if RELEASE_CONFIG in release else {}),
    }
    with staged_folder(out) as tmp:
        save_file(weights, f"{tmp}/{HF_WEIGHTS}", metadata={"format": "pt", "source": EXPORT_SOURCE})
        Path(tmp, HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(f"{tmp}/{HF_WEIGHTS}", 0o666 & ~umask())  # safetensors creates it owner-only
        if tok.raw is not None:
            Path(tmp, TOKENIZER).write_bytes(tok.raw)
        write_beside(Path(tmp), release)
    return config


# Every file an export may hold (native or hf): these, and hf's weight shards.
EXPORT_FILES = frozenset({"model.safetensors", "config.json", "tokenizer.json",
                          "generation_config.json", "tokenizer_config.json",
                          "model.safetensors.index.json", *RELEASE_FILES})
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


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
    """A folder export wrote: only export's files, every safetensors file marked as ours."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    entries = list(folder.iterdir())
    if any(e.name not in EXPORT_FILES and not SHARD_FILE.fullmatch(e.name) or e.is_symlink()
           or not e.is_file() for e in entries):
        return False
    weights = [e for e in entries if e.name.endswith(".safetensors")]
    return bool(weights) and all(_safetensors_source(e) == EXPORT_SOURCE for e in weights)


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
