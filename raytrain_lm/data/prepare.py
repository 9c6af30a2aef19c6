"""Corpus -> token shards (Arrow IPC) + tokenizer.json + manifest.json, written whole or not at all.

    plan the corpus into units (data/sources.py) -> the tokenizer (byte, a BPE trained on a
    sample, or a given tokenizer.json) -> tokenize the units, here or in Ray tasks
    (data/tokenize.py), in order -> one token stream, documents separated -> blocks routed to
    train/val -> fixed-size shards, each hashed as written -> the manifest last.

Training memory-maps the shards (zero-copy numpy views), so a corpus larger than RAM is fine.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_lm.data.manifest import BYTES_COLUMN, TOKENS_FORMAT, check_manifest, dataset_files
from raytrain_lm.data.sources import PIECE_BYTES, check_source, plan_units, read_unit, sample_units
from raytrain_lm.data.tokenizer import DEFAULT_SAMPLE_MB, Tokenizer, check_choice, make_tokenizer
from raytrain_lm.errors import UserError
from raytrain_lm.store.files import MANIFEST, TOKENIZER
from raytrain_lm.store.storage import (
    check_can_create,
    is_remote,
    open_uri,
    path_error,
    staged_folder,
)

DEFAULT_SHARD_TOKENS = 1 << 24


class _ShardWriter:
    """Buffers tokens of one split and writes fixed-size Arrow IPC shards into a folder of any
    pyarrow filesystem, hashing each as it is written. Counts, per shard and in all, the UTF-8
    bytes of text the tokens stand for, which bits per byte needs: `byte_lengths[token]` for an
    exact tokenizer; for one that rewrites the text first (a normalizer, a prefix space), each
    token's share of the documents' bytes as read, which the shard also stores as a second
    column `bytes` (validation sums it over the windows it evaluates)."""

    def __init__(self, fs: pafs.FileSystem, root: str, split: str, dtype, shard_tokens: int,
                 byte_lengths: np.ndarray, counted: bool):
        self.fs, self.root, self.split, self.dtype = fs, root, split, dtype
        self.shard_tokens, self.byte_lengths, self.counted = shard_tokens, byte_lengths, counted
        self.buf: list[np.ndarray] = []
        self.shares: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[dict] = []
        self.tokens = 0
        self.bytes = 0

    def add(self, tokens: np.ndarray, shares: Optional[np.ndarray] = None) -> None:
        self.buf.append(tokens)
        if self.counted:
            self.shares.append(shares)
        self.buffered += len(tokens)
        while self.buffered >= self.shard_tokens:
            joined = np.concatenate(self.buf)
            counts = np.concatenate(self.shares) if self.counted else None
            self._write(joined[: self.shard_tokens], None if counts is None else counts[: self.shard_tokens])
            rest = joined[self.shard_tokens:]
            self.buf, self.buffered = ([rest] if len(rest) else []), len(rest)
            if self.counted:
                self.shares = [counts[self.shard_tokens:]] if len(rest) else []

    def close(self) -> dict:
        if self.buffered:
            self._write(np.concatenate(self.buf), np.concatenate(self.shares) if self.counted else None)
            self.buf, self.shares, self.buffered = [], [], 0
        return {"tokens": self.tokens, "bytes": self.bytes, "shards": self.shards}

    def _write(self, tokens: np.ndarray, shares: Optional[np.ndarray]) -> None:
        name = f"{self.split}-{len(self.shards):05d}.arrow"
        columns = {"tokens": pa.array(tokens.astype(self.dtype, copy=False))}
        if shares is not None:  # the smallest type that holds the largest share
            columns[BYTES_COLUMN] = pa.array(shares.astype(np.uint16 if shares.max(initial=0) < 1 << 16
                                                           else np.uint32))
        table = pa.table(columns)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=len(tokens))  # one batch: zero-copy mmap reads
        data = sink.getvalue()
        with self.fs.open_output_stream(f"{self.root}/{name}") as out:
            out.write(data)
        nbytes = int(shares.sum()) if shares is not None else int(self.byte_lengths[tokens].sum())
        self.shards.append({"file": name, "tokens": int(len(tokens)), "bytes": nbytes,
                            "sha256": hashlib.sha256(data).hexdigest()})
        self.tokens += int(len(tokens))
        self.bytes += nbytes


def prepare_dataset(
    source: str | Sequence[str],
    out_dir: str | Path,
    *,
    tokenizer: str = "byte",
    vocab_size: Optional[int] = None,
    tokenizer_sample_mb: float = DEFAULT_SAMPLE_MB,
    text_field: str = "text",
    val_every: int = 20,
    block_tokens: int = 2048,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    force: bool = False,
    use_ray: bool = False,
    cpus: Optional[int] = None,
    progress: Optional[Callable[[int], None]] = None,
    piece_bytes: int = PIECE_BYTES,
) -> dict:
    """Tokenize `source` (a corpus, or several one after the other) into train/val shards under
    `out_dir` (a folder, or s3://... / gs://...); returns the manifest.

    `tokenizer`: "byte", "bpe" (trained here on a `tokenizer_sample_mb` MB sample, `vocab_size`
    tokens) or a tokenizer.json path or a release's folder (stored in the dataset byte for
    byte). Each document is wrapped in the family's special tokens where its folder says them
    (data/wrap.py); else documents are joined by "\\n\\n" for bytes, <|endoftext|> for a BPE.
    `use_ray`: tokenize in parallel Ray tasks (`cpus` at once; Ray must be initialized),
    each a unit of about `piece_bytes` of the corpus; else in `cpus` threads here (default: one
    per CPU of this machine).
    The token stream is cut into blocks of `block_tokens`; block k goes to validation when
    k % val_every == 1, so even a small corpus gets a validation split spread over its length.
    A local dataset is written into a temporary sibling folder that takes `out_dir`'s place only
    when complete; on shared storage the manifest is written last (readers look for it) and a
    failure removes what was written.
    """
    sources = [source] if isinstance(source, str) else list(source)
    check_prepare(sources, out_dir, tokenizer=tokenizer, vocab_size=vocab_size,
                  tokenizer_sample_mb=tokenizer_sample_mb, val_every=val_every,
                  shard_tokens=shard_tokens, force=force)
    units = plan_units(sources, text_field, piece_bytes)
    tok = make_tokenizer(tokenizer, lambda: _texts(sample_units(units, int(tokenizer_sample_mb * 1e6))),
                         vocab_size=vocab_size)
    if use_ray:
        from raytrain_lm.data.tokenize import tokenize_on_ray

        stream = tokenize_on_ray(units, tok, cpus)
    else:
        from raytrain_lm.data.tokenize import tokenize_here

        stream = tokenize_here(units, tok, cpus or os.cpu_count() or 1)

    def write(fs, root):
        return _write_dataset(stream, tok, fs, root, sources=sources, val_every=val_every,
                              block_tokens=block_tokens, shard_tokens=shard_tokens, progress=progress)

    if is_remote(out_dir):
        fs, root = open_uri(str(out_dir), "dataset")
        with _written_in_place(fs, root, str(out_dir)):
            return write(fs, root)
    with staged_folder(out_dir) as tmp:
        return write(pafs.LocalFileSystem(), tmp)


def check_prepare(sources: list[str], out_dir: str | Path, *, tokenizer: str, vocab_size: Optional[int],
                  tokenizer_sample_mb: float, val_every: int, shard_tokens: int, force: bool) -> None:
    """The checks that need nothing read: UserError before anything is tokenized or written."""
    if val_every < 2:
        raise UserError(f"--val-every must be at least 2, got {val_every}")
    if shard_tokens < 2:
        raise UserError(f"--shard-tokens must be at least 2, got {shard_tokens}")
    check_choice(tokenizer, vocab_size, tokenizer_sample_mb)
    if tokenizer not in ("byte", "bpe"):  # a tokenizer.json from elsewhere: read and checked here
        make_tokenizer(tokenizer)
    for s in sources:
        check_source(s)
    if _exists(out_dir):
        if not force:
            raise UserError(f"{out_dir} already exists; pass --force to overwrite it")
        check_replaceable(str(out_dir))
    check_can_create(str(out_dir))


def check_replaceable(out_dir: str) -> None:
    """--force replaces only what `prepare` wrote: an empty folder, or a dataset whose folder
    holds nothing but its manifest and the files it lists. Anything else (a corpus, a file,
    someone's folder) is refused and left as it is."""
    fs, root = open_uri(out_dir, "dataset") if is_remote(out_dir) else \
        (pafs.LocalFileSystem(), os.path.abspath(out_dir))
    refuse = UserError(f"{out_dir} is not a dataset written by prepare, so --force does not "
                       f"replace it; choose another --out, or remove it yourself")
    try:
        if fs.get_file_info(root).type != pafs.FileType.Directory:
            raise refuse
        entries = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        if not entries:
            return
        with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
            manifest = json.loads(f.read())
        check_manifest(manifest, out_dir, lambda entry: True)
        ours = {MANIFEST} | {entry["file"] for entry in dataset_files(manifest)}
    except (OSError, ValueError, RecursionError, UserError):
        raise refuse from None
    if any(e.type != pafs.FileType.File or e.path[len(root) + 1:] not in ours for e in entries):
        raise refuse


def _texts(units) -> Iterator[str]:
    for unit in units:
        yield from read_unit(unit)


def _exists(out_dir: str | Path) -> bool:
    if not is_remote(out_dir):
        return Path(out_dir).exists()
    fs, root = open_uri(str(out_dir), "dataset")
    try:
        return fs.get_file_info(root).type != pafs.FileType.NotFound
    except OSError as e:
        raise UserError(f"cannot reach {out_dir}: {str(e).splitlines()[0]}") from None


@contextlib.contextmanager
def _written_in_place(fs: pafs.FileSystem, root: str, uri: str):
    """Object stores cannot rename a folder, so a dataset on shared storage is written in place:
    an old one is removed first (its manifest before its shards: no reader ever sees a manifest
    whose shards are gone), the manifest goes last, and on any error what was written goes."""
    try:
        if fs.get_file_info(root).type != pafs.FileType.NotFound:
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(f"{root}/{MANIFEST}")
            fs.delete_dir(root)
        fs.create_dir(root, recursive=True)
    except OSError as e:
        raise path_error(uri, e) from None
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            fs.delete_dir(root)
        raise


def _write_dataset(stream: Iterator[tuple[np.ndarray, Optional[np.ndarray], bool]], tok: Tokenizer,
                   fs: pafs.FileSystem, root: str, *, sources: list[str], val_every: int,
                   block_tokens: int, shard_tokens: int,
                   progress: Optional[Callable[[int], None]]) -> dict:
    counted = not tok.exact
    writers = {s: _ShardWriter(fs, root, s, tok.dtype, shard_tokens, tok.text_byte_lengths(), counted)
               for s in ("train", "val")}
    pending = np.empty(0, dtype=tok.dtype)
    shares = np.empty(0, dtype=np.int64)  # each pending token's bytes as read (counted only)
    block_idx, total, started = 0, 0, False
    sep, begin = tok.separator(), np.array(tok.doc_begin, dtype=tok.dtype)

    def route(block: np.ndarray, block_shares: np.ndarray) -> None:
        nonlocal block_idx
        writers["val" if block_idx % val_every == 1 else "train"].add(block, block_shares)
        block_idx += 1

    def extend(*parts: tuple[np.ndarray, Optional[np.ndarray]]) -> None:
        nonlocal pending, shares
        pending = np.concatenate([pending] + [ids for ids, _ in parts])
        if counted:  # wrap tokens count for no bytes of the text
            shares = np.concatenate([shares] + [np.zeros(len(ids), np.int64) if c is None else c
                                                for ids, c in parts])

    def flush(final: bool) -> None:
        nonlocal pending, shares
        while len(pending) >= block_tokens or (final and len(pending)):
            route(pending[:block_tokens], shares[:block_tokens] if counted else None)
            pending = pending[block_tokens:]
            shares = shares[block_tokens:] if counted else shares

    try:
        for ids, counts, opens in stream:
            if opens:
                extend((sep if started else begin, None), (ids, counts))
            else:
                extend((ids, counts))
            started = started or opens
            total += len(ids)
            flush(final=False)
            if progress:
                progress(total)
        if started:
            extend((np.array(tok.doc_end, dtype=tok.dtype), None))
        flush(final=True)
        splits = {s: w.close() for s, w in writers.items()}
    except OSError as e:
        raise path_error(root, e) from None
    if splits["val"]["tokens"] < 2 or splits["train"]["tokens"] < 2:
        raise UserError(f"corpus {', '.join(sources)} is too small ({total} tokens): it needs at least "
                        f"{2 * block_tokens} tokens for a train and a validation split")
    manifest = {
        "format": TOKENS_FORMAT,
        "source": sources[0] if len(sources) == 1 else sources,
        "tokenizer": tok.spec(),
        "vocab_size": tok.vocab_size,
        "dtype": np.dtype(tok.dtype).name,
        "separator": "wrap" if tok.doc_begin or tok.doc_end else
                     "eot" if tok.eot_id is not None else "\n\n",
        "split": {"block_tokens": block_tokens, "val_every": val_every},
        "train": splits["train"],
        "val": splits["val"],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if tok.doc_begin or tok.doc_end:
        manifest["documents"] = {
            "begin": [tok.token_bytes(i).decode("utf-8", "replace") for i in tok.doc_begin],
            "begin_ids": list(tok.doc_begin),
            "end": [tok.token_bytes(i).decode("utf-8", "replace") for i in tok.doc_end],
            "end_ids": list(tok.doc_end)}
    # "bytes" of splits and shards: the documents' bytes as read, counted per token (a column of
    # every shard) where the tokenizer rewrites text, else the tokens' own bytes (the same thing)
    manifest["bytes_counted"] = "as read, per token" if counted else "token bytes"
    if tok.raw is not None:  # the BPE's own file, byte for byte: its sha256 is in the spec
        with fs.open_output_stream(f"{root}/{TOKENIZER}") as out:
            out.write(tok.raw)
    with fs.open_output_stream(f"{root}/{MANIFEST}") as out:  # last: it makes this a dataset
        out.write(json.dumps(manifest, indent=2).encode())
    return manifest
