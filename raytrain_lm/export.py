"""Export a checkpoint's weights as safetensors plus a config JSON: the model without the
training state (optimizer, data position, RNG), in a format any framework can read.

Tied weights (the output projection shares the token embedding) are stored once; config.json's
"tied" says which names to point at which, so loading restores the tie and nothing is stored twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.checkpoint import load_checkpoint
from raytrain_lm.config import TrainConfig
from raytrain_lm.errors import UserError
from raytrain_lm.model import GPT
from raytrain_lm.storage import staged_folder

WEIGHTS, CONFIG = "model.safetensors", "config.json"
FORMAT = "raytrain-lm/gpt-1"


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

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UserError(f"{out} exists and is not empty; pass --force to overwrite it")
    state = load_checkpoint(folder, meta=meta)
    # The ties come from the model, not from how a checkpoint stored its tensors: a sharded (FSDP)
    # checkpoint gathers the tied embedding and output weights as two separate copies.
    model = GPT(TrainConfig.from_dict(state["config"]).model)
    model.load_state_dict(state["model"])
    weights, tied = _untie(model.state_dict())
    config = {
        "format": FORMAT,
        "model": state["config"]["model"],
        "tokenizer": state["tokenizer"],
        "tied": tied,
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
    return config
