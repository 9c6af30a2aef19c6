"""A checkpoint's commit, and the one check of it every reader makes before loading anything.

Each rank writes its commit record, `rank{R}.json` (the sha256 of every file it wrote); rank 0
writes meta.json last (step, world size, format, validation loss, config, tokenizer). A checkpoint
is valid only if meta.json holds what this version writes (check_meta: every field, its type and
range), every rank's record is there, each file a record names is a regular file inside the
checkpoint matching its digest, and no file is left that no record vouches for. A reader that
finds the newest checkpoint invalid takes the one before (store/runs.py), as for a torn write.

No torch: the driver checks a checkpoint (`--init-from`, `--resume`) with this before it starts
anything; the loading itself is checkpoint_format.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.config.checks import MAX_COUNT, MAX_VOCAB, check_model
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.errors import UserError, brief
from raytrain_lm.store import untrusted
from raytrain_lm.store.files import META, TOKENIZER, rank_record

# 2: a global data position (data/sampler.py), RNG states as tensors and plain data (loadable with
#    weights_only), the validation loss in meta.json.
# 3: the model's fused q/k/v in head-interleaved order (models/gpt/gpt.py); model and optimizer always in
#    dcp/ (FQN-keyed, optimizer state flattened), so any layout loads any other.
VERSION = 3
FORMATS = ("dcp", "full")  # full: the model in state.pt, before version 3
# meta.json and a record list names and digests: a few KB, a few hundred KB for a large world.
MAX_META_BYTES = 1 << 20
MAX_RECORD_BYTES = 16 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


def commit(folder: Path, rank: int, meta: Optional[dict[str, Any]]) -> list[Path]:
    """This rank's commit record and, on rank 0 (`meta`: meta_of(state)), meta.json. Returns the
    rank's files in the order to copy them anywhere: its data files, then its record, then
    meta.json, so a copy cut short lacks a record and never loads."""
    written = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != META)
    record = {p.relative_to(folder).as_posix(): untrusted.digest(p) for p in written}
    (folder / rank_record(rank)).write_text(json.dumps(record, indent=1))
    order = [*written, folder / rank_record(rank)]
    if meta is not None:
        (folder / META).write_text(json.dumps(meta, indent=2))
        order.append(folder / META)
    return order


def meta_of(state: dict[str, Any]) -> dict[str, Any]:
    """meta.json of rank 0's training state."""
    return {"version": VERSION, "step": state["step"], "world_size": state["world_size"],
            "format": "dcp", "val_loss": state.get("val_loss"), "config": state["config"],
            "tokenizer": state["tokenizer"]}


def _whole(value: Any, low: int, high: Optional[int] = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def check_meta(meta: Any) -> str:
    """What is wrong with a meta.json's content ("" if nothing): every field this version reads,
    of its type and in its range, the config a valid TrainConfig and the tokenizer a spec."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    version = meta.get("version", 1)
    if not _whole(version, 1):
        return f"version {brief(version)}"
    if version > VERSION:
        return f"version {version}: written by a newer raytrain-lm (this one reads up to {VERSION})"
    checks = [("step", _whole(meta.get("step"), 0)),
              ("world_size", _whole(meta.get("world_size"), 1, MAX_COUNT)),
              ("format", meta.get("format") in (("dcp",) if version >= 3 else FORMATS)),
              ("val_loss", meta.get("val_loss") is None or (isinstance(meta["val_loss"], (int, float))
                                                           and not isinstance(meta["val_loss"], bool)))]
    for key, ok in checks:
        if not ok:
            return f"{key} {brief(meta.get(key))}"
    try:
        if not isinstance(meta.get("config"), dict):
            raise UserError(f"not a mapping: {brief(meta.get('config'))}")
        check_model(TrainConfig.from_dict(meta["config"]).model)
    except UserError as e:  # TrainConfig.from_dict's messages start with "config: " already
        return str(e) if str(e).startswith("config: ") else f"config: {e}"
    return _spec_problem(meta.get("tokenizer"))


def _spec_problem(spec: Any) -> str:
    """A tokenizer spec's shape (spec.check_spec then checks its file)."""
    if not isinstance(spec, dict) or spec.get("type") not in ("byte", "bpe"):
        return f"tokenizer {brief(spec)}"
    if spec["type"] == "bpe" and not (_whole(spec.get("vocab_size"), 1, MAX_VOCAB)
                                      and spec.get("file") == TOKENIZER
                                      and isinstance(spec.get("sha256"), str)
                                      and _SHA256.fullmatch(spec["sha256"])):
        return f"tokenizer {brief(spec)}"
    return ""


def peek_meta(data: bytes) -> Optional[dict[str, Any]]:
    """meta.json's content if it parses and check_meta finds nothing wrong, else None: for a
    quick look (the newest checkpoint's step and tokenizer) where the files are not checked."""
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return None if check_meta(meta) else meta


def _read_json(path: Path, limit: int, where: str) -> Any:
    try:
        return json.loads(untrusted.read_bytes(path, limit))
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply
        raise UserError(f"{where} is corrupted") from None


def read_meta(folder: Path) -> dict[str, Any]:
    """meta.json, after checking it and every rank's files (see the module's docstring)."""
    meta_path = folder / META
    if not meta_path.is_file():
        raise UserError(f"{folder} is not a complete checkpoint (no {META})")
    meta = _read_json(meta_path, MAX_META_BYTES, f"{folder}/{META}")
    problem = check_meta(meta)
    if problem:
        raise UserError(f"{folder}/{META} is corrupted: {problem}")
    vouched = {META}
    for r in range(meta["world_size"]):
        record_path = folder / rank_record(r)
        if not record_path.is_file():
            raise UserError(f"{folder} is incomplete (nothing committed by rank {r})")
        record = _read_json(record_path, MAX_RECORD_BYTES, str(record_path))
        if not isinstance(record, dict):
            raise UserError(f"{record_path} is corrupted")
        for rel, digest in record.items():
            path = untrusted.inside(folder, rel, str(record_path))
            if rel in (META, *(rank_record(i) for i in range(meta["world_size"]))):
                raise UserError(f"{record_path} is corrupted: it names {rel}")
            if not path.is_file() or path.is_symlink() or untrusted.digest(path) != digest:
                raise UserError(f"{folder}/{rel} is corrupted (checksum mismatch)")
        vouched |= {rank_record(r), *record}
    # Every file is some rank's, checked above: a meta.json that names fewer ranks than wrote the
    # checkpoint leaves files no record vouches for.
    unvouched = sorted(rel for p in folder.rglob("*") if p.is_file() or p.is_symlink()
                       if (rel := p.relative_to(folder).as_posix()) not in vouched)
    if unvouched:
        raise UserError(f"{folder}/{unvouched[0]} is corrupted (no commit record vouches for it)")
    return meta
