"""Full training state in a Ray Checkpoint folder, written so a partial write never loads.

A checkpoint folder holds:
    state.pt          model (unwrapped, no `module.`/`_orig_mod.` prefixes), optimizer, step,
                      tokens, data position, config, tokenizer (written by rank 0)
    rng-rank{R}.pt    every RNG state of rank R (each rank writes its own; Ray merges the folders)
    meta.json         written last by rank 0: step and the sha256 of state.pt

`meta.json` is the commit record: a folder without it, or whose state.pt does not match its
checksum, is rejected, and the loader falls back to an older checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from raytrain_lm.errors import UserError

STATE, META = "state.pt", "meta.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_checkpoint(folder: Path, rank: int, state: Optional[dict[str, Any]]) -> None:
    """Rank 0 passes the full state; every rank writes its RNG file."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / f"rng-rank{rank}.pt")
    if state is not None:
        torch.save(state, folder / STATE)
        meta = {"step": state["step"], "sha256": _sha256(folder / STATE),
                "config": state["config"], "tokenizer": state["tokenizer"]}
        (folder / META).write_text(json.dumps(meta, indent=2))


def read_meta(folder: Path) -> dict[str, Any]:
    """The checkpoint's meta.json, after checking state.pt against its checksum."""
    meta_path, state_path = folder / META, folder / STATE
    if not meta_path.is_file() or not state_path.is_file():
        raise UserError(f"{folder} is not a complete checkpoint (missing {META} or {STATE})")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{folder}/{META} is corrupted") from None
    if _sha256(state_path) != meta.get("sha256"):
        raise UserError(f"{folder}/{STATE} is corrupted (checksum mismatch)")
    return meta


def load_checkpoint(folder: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    read_meta(folder)
    return torch.load(folder / STATE, map_location=map_location, weights_only=False)


def load_rng(folder: Path, rank: int) -> Optional[dict[str, Any]]:
    path = folder / f"rng-rank{rank}.pt"
    return torch.load(path, weights_only=False) if path.is_file() else None


def load_latest_valid(ray_checkpoint, rank: int) -> tuple[dict[str, Any], Optional[dict]]:
    """Load `ray_checkpoint`, or if it is incomplete or corrupted, the newest older valid
    checkpoint beside it in the run's storage. Returns (state, this rank's RNG state or None)."""
    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    fs, path = ray_checkpoint.filesystem, ray_checkpoint.path.rstrip("/")
    parent, name = path.rsplit("/", 1)
    infos = fs.get_file_info(pafs.FileSelector(parent))
    names = sorted((i.base_name for i in infos
                    if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")
                    and i.base_name <= name), reverse=True)
    problems = []
    for candidate in names:
        with Checkpoint(f"{parent}/{candidate}", fs).as_directory() as d:
            try:
                state = load_checkpoint(Path(d))
            except UserError as e:
                problems.append(str(e))
                if rank == 0:
                    print(f"[checkpoint] skipping {candidate}: {e}", flush=True)
                continue
            return state, load_rng(Path(d), rank)
    raise UserError(f"no valid checkpoint in {parent}: " + "; ".join(problems))
