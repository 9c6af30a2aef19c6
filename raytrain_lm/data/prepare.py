"""Corpus -> token shards (Arrow IPC) + manifest.json, written whole or not at all.

Training memory-maps the shards (zero-copy numpy views), so a corpus larger than RAM is fine.
"""

from __future__ import annotations

import datetime as _dt
import json
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa

from raytrain_lm.data.manifest import FORMAT
from raytrain_lm.data.remote import remote_exists, upload_dataset
from raytrain_lm.data.sources import check_source, iter_documents
from raytrain_lm.errors import UserError
from raytrain_lm.files import MANIFEST
from raytrain_lm.storage import is_remote, sha256_file, staged_folder
from raytrain_lm.tokenizer import ByteTokenizer


class _ShardWriter:
    """Buffers tokens of one split and writes fixed-size Arrow IPC shards."""

    def __init__(self, out: Path, split: str, dtype, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[dict] = []
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        self.buf.append(tokens)
        self.buffered += len(tokens)
        while self.buffered >= self.shard_tokens:
            joined = np.concatenate(self.buf)
            self._write(joined[: self.shard_tokens])
            rest = joined[self.shard_tokens:]
            self.buf, self.buffered = ([rest] if len(rest) else []), len(rest)

    def close(self) -> dict:
        if self.buffered:
            self._write(np.concatenate(self.buf))
            self.buf, self.buffered = [], 0
        return {"tokens": self.tokens, "shards": self.shards}

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self.split}-{len(self.shards):05d}.arrow"
        path = self.out / name
        table = pa.table({"tokens": pa.array(tokens.astype(self.dtype, copy=False))})
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=len(tokens))  # one batch: zero-copy mmap reads
        self.shards.append({"file": name, "tokens": int(len(tokens)), "sha256": sha256_file(path)})
        self.tokens += int(len(tokens))


def prepare_dataset(
    source: str | Sequence[str],
    out_dir: str | Path,
    *,
    text_field: str = "text",
    val_every: int = 20,
    block_tokens: int = 2048,
    shard_tokens: int = 1 << 24,
    force: bool = False,
    progress: Optional[Callable[[int], None]] = None,
) -> dict:
    """Tokenize `source` (a corpus, or several one after the other) into train/val shards under
    `out_dir`; returns the manifest.

    The token stream is cut into blocks of `block_tokens`; block k goes to validation when
    k % val_every == 1, so even a small corpus gets a validation split spread over its length.
    Everything is written into a temporary sibling folder that takes `out_dir`'s place only when
    complete: a crash never leaves a folder that looks like a dataset.
    """
    if val_every < 2:
        raise UserError(f"--val-every must be at least 2, got {val_every}")
    sources = [source] if isinstance(source, str) else list(source)
    for s in sources:
        check_source(s)
    settings = dict(text_field=text_field, val_every=val_every, block_tokens=block_tokens,
                    shard_tokens=shard_tokens, progress=progress)
    if is_remote(out_dir):  # prepare locally, then upload
        if remote_exists(str(out_dir)) and not force:
            raise UserError(f"{out_dir} already exists; pass --force to overwrite it")
        with tempfile.TemporaryDirectory(prefix="raytrain-lm-prepare-") as tmp:
            manifest = prepare_dataset(sources, Path(tmp) / "dataset", **settings)
            upload_dataset(Path(tmp) / "dataset", str(out_dir))
        return manifest
    out = Path(out_dir)
    if out.exists() and not force:
        raise UserError(f"{out} already exists; pass --force to overwrite it")
    with staged_folder(out) as tmp:
        manifest = _write_shards(sources, Path(tmp), **settings)
    return manifest


def _token_pieces(sources: list[str], text_field: str, tok: ByteTokenizer) -> Iterator[np.ndarray]:
    """The corpora as a stream of token arrays: "\n\n" between documents, nothing inside one."""
    sep = tok.encode("\n\n")
    docs = (doc for source in sources for doc in iter_documents(source, text_field))
    for i, doc in enumerate(docs):
        if i:
            yield sep
        for text in doc:
            yield tok.encode(text)


def _write_shards(sources: list[str], out: Path, *, text_field: str, val_every: int, block_tokens: int,
                  shard_tokens: int, progress: Optional[Callable[[int], None]]) -> dict:
    tok = ByteTokenizer()
    writers = {s: _ShardWriter(out, s, tok.dtype, shard_tokens) for s in ("train", "val")}
    pending = np.empty(0, dtype=tok.dtype)
    block_idx = 0
    total = 0

    def route(block: np.ndarray) -> None:
        nonlocal block_idx
        writers["val" if block_idx % val_every == 1 else "train"].add(block)
        block_idx += 1

    for ids in _token_pieces(sources, text_field, tok):
        pending = np.concatenate([pending, ids])
        total += len(ids)
        while len(pending) >= block_tokens:
            route(pending[:block_tokens])
            pending = pending[block_tokens:]
        if progress:
            progress(total)
    if len(pending):
        route(pending)
    splits = {s: w.close() for s, w in writers.items()}
    if splits["val"]["tokens"] < 2 or splits["train"]["tokens"] < 2:
        raise UserError(f"corpus {', '.join(sources)} is too small ({total} tokens): it needs at least "
                        f"{2 * block_tokens} tokens for a train and a validation split")
    manifest = {
        "format": FORMAT,
        "source": sources[0] if len(sources) == 1 else sources,
        "tokenizer": tok.spec(),
        "vocab_size": tok.vocab_size,
        "dtype": np.dtype(tok.dtype).name,
        "split": {"block_tokens": block_tokens, "val_every": val_every},
        "train": splits["train"],
        "val": splits["val"],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
