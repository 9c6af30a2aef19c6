"""A tokenizer as a dataset's manifest or a checkpoint records it (its spec: the type, size, the
tokenizer.json's sha256, the documents' wrap), checked and rebuilt from it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.data.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, Tokenizer
from raytrain_lm.errors import UserError


def check_spec(spec: dict, folder: Optional[str | Path] = None, verify: bool = False) -> None:
    """Cheap check of a manifest's or checkpoint's tokenizer spec (no vocabulary parsed):
    a known type, and for a BPE its file present in `folder` (and its sha256, with `verify`)."""
    kind = spec.get("type")
    if kind == "byte":
        return
    if kind != "bpe":
        raise UserError(f"unknown tokenizer {kind!r} in dataset or checkpoint")
    # Always this one name: a crafted spec cannot point outside the folder.
    if spec.get("file") != TOKENIZER_FILE or not isinstance(spec.get("sha256"), str):
        raise UserError(f"the BPE tokenizer spec {spec} does not name {TOKENIZER_FILE} and its sha256")
    if folder is None:
        return
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise UserError(f"{folder} has no {TOKENIZER_FILE} (its BPE tokenizer's vocabulary)")
    if verify:
        h = hashlib.sha256(path.read_bytes()).hexdigest()
        if h != spec["sha256"]:
            raise UserError(f"{path} does not match the sha256 its dataset or checkpoint recorded")


def vocabulary_of(spec: dict) -> dict:
    """What in a spec fixes what the token ids mean (its type, size, file hash): a checkpoint
    and a dataset agree on it whether or not either recorded the documents' wrap."""
    return {k: v for k, v in spec.items() if k != "documents"}


def tokenizer_from_spec(spec: dict, folder: Optional[str | Path] = None) -> Tokenizer:
    """The tokenizer a spec describes; a BPE's file is read from `folder` and its hash checked."""
    check_spec(spec, folder)
    if spec["type"] == "byte":
        return ByteTokenizer()
    if folder is None:
        raise UserError("a BPE tokenizer needs the folder that holds its tokenizer.json")
    tok = BPETokenizer(Path(folder) / TOKENIZER_FILE, sha256=spec["sha256"])
    if tok.vocab_size != spec["vocab_size"]:
        raise UserError(f"{tok.path} has {tok.vocab_size} tokens, its spec says {spec['vocab_size']}")
    wrap = spec.get("documents")  # absent: written before the spec carried it, or no wrap
    if wrap is not None:
        tok.doc_begin, tok.doc_end = (_token_ids(wrap, key, tok.vocab_size, folder)
                                      for key in ("begin_ids", "end_ids"))
    return tok


def _token_ids(wrap: Any, key: str, vocab_size: int, folder) -> tuple[int, ...]:
    ids = wrap.get(key, []) if isinstance(wrap, dict) else None
    if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise UserError(f"the tokenizer spec of {folder}: its documents' {key} must be a list of "
                        f"token ids below {vocab_size}")
    return tuple(ids)
