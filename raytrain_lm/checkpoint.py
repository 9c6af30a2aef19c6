"""Full training state in a Ray Checkpoint folder, written so a partial write never loads.

Each rank writes into its own local folder and Ray merges them in the run's storage. Layout:
    state.pt          rank 0: step, tokens, data position, scaler, config, tokenizer, metrics;
                      with DDP also the model (unwrapped: no `module.`/`_orig_mod.` prefixes)
                      and the optimizer
    dcp/              FSDP only: model and optimizer shards, torch.distributed.checkpoint format
                      (every rank writes its shard; loadable at any world size, or in one process)
    rng-rank{R}.pt    every RNG state of rank R
    rank{R}.json      rank R's commit record: sha256 of every file it wrote
    tokenizer.json    rank 0, BPE runs: the dataset's tokenizer file, byte for byte, so generate
                      and export need nothing but the checkpoint (its sha256 is in the spec)
    meta.json         rank 0's commit record, written last: step, world size, format, config

A checkpoint is valid only if meta.json and every rank's record are present and every file
matches its checksum; the loader skips an invalid one for the one before it.
"""

from __future__ import annotations

import json
import pickle
import random
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from raytrain_lm.errors import UserError
from raytrain_lm.files import DCP_DIR, META, STATE, TOKENIZER, rank_record, rng_file
from raytrain_lm.storage import sha256_file


# Version 2: a global data position (data/sampler.py), RNG states as tensors and plain data
# (loadable with weights_only), the validation loss in meta.json.
VERSION = 2


def rng_state() -> dict[str, Any]:
    """Every RNG state of this process, as tensors and plain Python data only."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def safe_load(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """torch.load of tensors and plain data only (`weights_only`): a file that holds anything
    else (a pickled object can run code when loaded) is refused, not unpickled."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise UserError(f"{path} is corrupted: {str(e).splitlines()[0]}") from None
        raise UserError(f"refusing to load {path}: it holds Python objects, not only tensors and "
                        f"plain data (a raytrain-lm checkpoint never does)") from None
    except (RuntimeError, EOFError) as e:
        raise UserError(f"{path} is corrupted: {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------- saving


def save_checkpoint(folder: Path, rank: int, model: torch.nn.Module, optimizer, sharded: bool,
                    state: Optional[dict[str, Any]], tokenizer_raw: Optional[bytes] = None) -> None:
    """Called on every rank (a collective when `sharded`). Rank 0 passes the training `state`
    and, for a BPE, its tokenizer.json (`Tokenizer.raw`)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / rng_file(rank))
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder / DCP_DIR))
    if rank == 0:
        assert state is not None
        state = {**state, "format": "dcp" if sharded else "full"}
        if not sharded:
            state.update(model=model.state_dict(), optimizer=optimizer.state_dict())
        torch.save(state, folder / STATE)
        if tokenizer_raw is not None:
            (folder / TOKENIZER).write_bytes(tokenizer_raw)
    written = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != META)
    record = {str(p.relative_to(folder)): sha256_file(p) for p in written}
    (folder / rank_record(rank)).write_text(json.dumps(record, indent=1))
    if rank == 0:
        meta = {"version": VERSION, "step": state["step"], "world_size": state["world_size"],
                "format": state["format"],
                "val_loss": state.get("val_loss"), "config": state["config"],
                "tokenizer": state["tokenizer"]}
        (folder / META).write_text(json.dumps(meta, indent=2))


# ---------------------------------------------------------------- checking and loading


def read_meta(folder: Path) -> dict[str, Any]:
    """meta.json, after checking that every rank's files are there and match their checksums."""
    meta_path = folder / META
    if not meta_path.is_file():
        raise UserError(f"{folder} is not a complete checkpoint (no {META})")
    try:
        meta = json.loads(meta_path.read_text())
        world = int(meta["world_size"])
    except (json.JSONDecodeError, KeyError, ValueError):
        raise UserError(f"{folder}/{META} is corrupted") from None
    for r in range(world):
        record_path = folder / rank_record(r)
        if not record_path.is_file():
            raise UserError(f"{folder} is incomplete (nothing committed by rank {r})")
        try:
            record = json.loads(record_path.read_text())
        except json.JSONDecodeError:
            raise UserError(f"{record_path} is corrupted") from None
        for rel, digest in record.items():
            path = folder / rel
            if not path.is_file() or sha256_file(path) != digest:
                raise UserError(f"{folder}/{rel} is corrupted (checksum mismatch)")
    return meta


def _full_state_from_dcp(folder: Path) -> dict[str, Any]:
    """Gather a sharded checkpoint into plain tensors in this one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder / DCP_DIR), f"{tmp}/full.pt")
        return safe_load(Path(tmp, "full.pt"))


def load_checkpoint(folder: Path, map_location: str | torch.device = "cpu",
                    meta: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The whole training state, with `model` as a plain state dict whatever the strategy that
    saved it (so generate/export/--init-from work on FSDP checkpoints in one process). `meta`:
    what read_meta already returned for `folder`, so its checksums are not computed twice."""
    meta = meta or read_meta(folder)
    state = safe_load(folder / STATE, map_location)
    if meta.get("format") == "dcp":
        state["model"] = _full_state_from_dcp(folder)["model"]
    return state


def load_sharded(folder: Path, model: torch.nn.Module, optimizer) -> None:
    """Load a dcp/ checkpoint into an FSDP model and its optimizer (any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(folder / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def load_resume_state(folder: Path, meta: dict[str, Any],
                      rank: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(state.pt, this rank's RNG states or None if the saving run had no such rank) of a
    checkpoint that read_meta has checked (`meta`: what it returned)."""
    if meta.get("version", 1) < VERSION:
        raise UserError(f"{folder} was written by an older raytrain-lm, whose data position this "
                        f"one cannot continue from; start a new run from its weights with "
                        f"--init-from {folder}")
    state = safe_load(folder / STATE)
    rng_path = folder / rng_file(rank)
    return state, safe_load(rng_path) if rng_path.is_file() else None
