"""A Hugging Face model folder on disk: config.json and safetensors weights (one file, or shards
named by model.safetensors.index.json). Reading it here, by its own names; a model family's
adapter (models/<family>/hf_*.py) maps those names to its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models import hf_importer
from raytrain_lm.store.files import META

HF_CONFIG, HF_WEIGHTS, HF_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"


def is_hf_folder(path: str | Path) -> bool:
    """A model folder with a config.json and safetensors weights that is not a checkpoint of ours
    (its family's adapter then says whether this project computes it)."""
    p = Path(path)
    return ((p / HF_CONFIG).is_file() and not (p / META).is_file()
            and ((p / HF_WEIGHTS).is_file() or (p / HF_INDEX).is_file()))


def read_config(folder: str | Path) -> dict[str, Any]:
    try:
        config = json.loads((Path(folder) / HF_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{folder}/{HF_CONFIG} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"{folder}/{HF_CONFIG} is not a JSON object")
    return config


def folder_model(path: str | Path) -> Optional[tuple[str, dict[str, Any]]]:
    """For --init-from: (how to name the folder, the ModelConfig fields its config.json fixes),
    or None where `path` is not a Hugging Face folder. A family must import its model_type
    (else one line: the model types that are)."""
    if not is_hf_folder(path):
        return None
    where = f"--init-from {path}"
    config = read_config(path)
    return where, hf_importer(config.get("model_type"), where).model_fields(config, where)


def read_tensors(folder: str | Path) -> dict:
    """Every tensor of the folder's safetensors file(s), under the folder's own names."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if (folder / HF_INDEX).is_file():
        files = sorted(set(json.loads((folder / HF_INDEX).read_text())["weight_map"].values()))
    else:
        files = [HF_WEIGHTS]
    tensors = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors
