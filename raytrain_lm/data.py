"""Corpus -> token shards (Arrow IPC) -> memory-mapped windows -> sharded, resumable batches.

Layout of a prepared dataset folder:
    manifest.json           tokenizer, vocab, dtype, source, token counts, sha256 of every shard
    train-00000.arrow ...   one uint8/uint16/uint32 column `tokens`, one record batch per file
    val-00000.arrow ...

Training memory-maps the shards (zero-copy numpy views), so a corpus larger than RAM is fine.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset, DistributedSampler

from raytrain_lm.errors import UserError
from raytrain_lm.storage import sha256_file
from raytrain_lm.shared_data import fetch_dataset, file_lock, is_remote, read_remote_manifest
from raytrain_lm.tokenizer import ByteTokenizer, tokenizer_from_spec

MANIFEST = "manifest.json"
FORMAT = "raytrain-lm-tokens/1"
BUILTIN_CORPORA = ("pydoc", "stdlib")
TEXT_SUFFIXES = (".txt", ".md")


# ---------------------------------------------------------------- sources


def _pydoc_documents() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _stdlib_documents() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test fixtures are deliberately not UTF-8


def _read_text_file(path: Path, chunk_chars: int = 1 << 20) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            while chunk := f.read(chunk_chars):
                yield chunk
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read corpus file {path}: {e}") from None


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    text = row[text_field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UserError(f"{path}:{lineno}: expected a JSON object with a "
                                    f"{text_field!r} string field") from None
                if not isinstance(text, str):
                    raise UserError(f"{path}:{lineno}: field {text_field!r} is not a string")
                yield text
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read corpus file {path}: {e}") from None


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read corpus file {path}: {e}") from None
    if text_field not in pf.schema_arrow.names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                        f"use --text-column")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and
                   p.suffix in TEXT_SUFFIXES + (".jsonl", ".parquet"))
    if not files:
        raise UserError(f"no .txt, .md, .jsonl or .parquet files under {path}")
    return files


def check_source(source: str) -> list[Path]:
    """The files of a corpus path (empty for a built-in corpus); raises UserError if unusable."""
    if source in BUILTIN_CORPORA:
        return []
    path = Path(source)
    if not path.exists():
        raise UserError(f"corpus not found: {source} (a path, or one of: {', '.join(BUILTIN_CORPORA)})")
    return _files_under(path)


def iter_documents(source: str, text_field: str = "text") -> Iterator[str]:
    """Documents of a built-in corpus ('pydoc', 'stdlib') or of a file/folder path."""
    if source == "pydoc":
        yield from _pydoc_documents()
        return
    if source == "stdlib":
        yield from _stdlib_documents()
        return
    for f in check_source(source):
        if f.suffix in TEXT_SUFFIXES:
            yield from _read_text_file(f)
        elif f.suffix == ".jsonl":
            yield from _read_jsonl(f, text_field)
        elif f.suffix == ".parquet":
            yield from _read_parquet(f, text_field)
        else:
            raise UserError(f"unsupported corpus file {f}: use .txt, .md, .jsonl or .parquet")


# ---------------------------------------------------------------- writing shards


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
    source: str,
    out_dir: str | Path,
    *,
    text_field: str = "text",
    val_every: int = 20,
    block_tokens: int = 2048,
    shard_tokens: int = 1 << 24,
    force: bool = False,
    progress: Optional[Callable[[int], None]] = None,
) -> dict:
    """Tokenize `source` into train/val shards under `out_dir`; returns the manifest.

    The token stream is cut into blocks of `block_tokens`; block k goes to validation when
    k % val_every == 1, so even a small corpus gets a validation split spread over its length.
    Everything is written into a temporary sibling folder that is renamed into place only when
    complete: a crash never leaves a folder that looks like a dataset.
    """
    if val_every < 2:
        raise UserError(f"--val-every must be at least 2, got {val_every}")
    check_source(source)
    if is_remote(out_dir):  # prepare locally, then upload (shared_data.py)
        return _prepare_remote(source, str(out_dir), force=force, text_field=text_field,
                               val_every=val_every, block_tokens=block_tokens,
                               shard_tokens=shard_tokens, progress=progress)
    out = Path(out_dir)
    if out.exists() and not force:
        raise UserError(f"{out} already exists; pass --force to overwrite it")
    tok = ByteTokenizer()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writers = {s: _ShardWriter(tmp, s, tok.dtype, shard_tokens) for s in ("train", "val")}
        pending = np.empty(0, dtype=tok.dtype)
        block_idx = 0
        total = 0
        sep = tok.encode("\n\n")

        def route(block: np.ndarray) -> None:
            nonlocal block_idx
            writers["val" if block_idx % val_every == 1 else "train"].add(block)
            block_idx += 1

        first = True
        for doc in iter_documents(source, text_field):
            ids = tok.encode(doc)
            pending = np.concatenate([pending] + ([] if first else [sep]) + [ids])
            first = False
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
            raise UserError(f"corpus {source} is too small ({total} tokens): it needs at least "
                            f"{2 * block_tokens} tokens for a train and a validation split")
        manifest = {
            "format": FORMAT,
            "source": source,
            "tokenizer": tok.spec(),
            "vocab_size": tok.vocab_size,
            "dtype": np.dtype(tok.dtype).name,
            "split": {"block_tokens": block_tokens, "val_every": val_every},
            "train": splits["train"],
            "val": splits["val"],
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if out.exists():  # --force: swap the old dataset out only once the new one is complete
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------- reading


def load_manifest(data_dir: str | Path, verify: bool = False) -> dict:
    """Read and sanity-check a dataset's manifest; `verify` also checks every shard's sha256."""
    if is_remote(data_dir):
        return read_remote_manifest(str(data_dir))
    d = Path(data_dir)
    mf = d / MANIFEST
    if not d.exists():
        raise UserError(f"dataset not found: {d} (create one with `python cli.py prepare`)")
    if not mf.is_file():
        raise UserError(f"{d} is not a prepared dataset (no {MANIFEST}); "
                        f"create one with `python cli.py prepare --out {d}`")
    try:
        manifest = json.loads(mf.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
        tokenizer_from_spec(manifest["tokenizer"])
        for split in ("train", "val"):
            for shard in manifest[split]["shards"]:
                path = d / shard["file"]
                if not path.is_file():
                    raise ValueError(f"missing shard {shard['file']}")
                if verify and sha256_file(path) != shard["sha256"]:
                    raise ValueError(f"checksum mismatch in {shard['file']}")
    except UserError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{d} is not a valid dataset: {e}") from None
    return manifest


def _prepare_remote(source: str, uri: str, force: bool, **kwargs) -> dict:
    from raytrain_lm.shared_data import remote_exists, upload_dataset

    if remote_exists(uri) and not force:
        raise UserError(f"{uri} already exists; pass --force to overwrite it")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="raytrain-lm-prepare-") as tmp:
        manifest = prepare_dataset(source, Path(tmp) / "dataset", **kwargs)
        upload_dataset(Path(tmp) / "dataset", uri)
    return manifest


def resolve_dataset(data: str) -> str:
    """The local folder this node memory-maps for `data` (called on every worker).

    - a URI (s3://, gs://, ...): downloaded once per node into a cache, each shard verified
      against its manifest's sha256 (shared_data.fetch_dataset);
    - a local folder that exists: itself (the fast path, nothing copied);
    - a built-in corpus folder (`.../data/pydoc`, `.../data/stdlib`) missing on this node, as on
      the other nodes of a cluster: tokenized here (deterministic, the same shards everywhere);
    - anything else missing: a UserError that says how to share the dataset.
    """
    if is_remote(data):
        return fetch_dataset(data)
    path = Path(data)
    if (path / MANIFEST).is_file():
        return data
    if path.parent.name == "data" and path.name in BUILTIN_CORPORA:
        with file_lock(path.parent / f".{path.name}.lock"):
            if not (path / MANIFEST).is_file():
                prepare_dataset(path.name, path, force=path.exists())
        return data
    import socket

    raise UserError(f"dataset {data} is not on node {socket.gethostname()}; on a cluster of "
                    f"several machines put it on shared storage: `python cli.py prepare ... --out "
                    f"s3://BUCKET/data/NAME` and train with --data s3://BUCKET/data/NAME")


class TokenWindows(Dataset):
    """Fixed-length windows over memory-mapped token shards.

    Item i is `seq_len + 1` consecutive tokens (inputs and shifted targets); windows start every
    `seq_len` tokens and never cross a shard boundary. Shards are mapped lazily so the dataset
    pickles cheaply into DataLoader worker processes.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int):
        self.data_dir, self.split, self.seq_len = str(data_dir), split, seq_len
        manifest = load_manifest(data_dir)
        self.shard_files = [s["file"] for s in manifest[split]["shards"]]
        counts = [max(0, (s["tokens"] - 1) // seq_len) for s in manifest[split]["shards"]]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.offsets[-1] == 0:
            raise UserError(f"the {split} split of {data_dir} is shorter than one window of "
                            f"{seq_len + 1} tokens; lower --seq-len or use a larger corpus")
        self._arrays: Optional[list[np.ndarray]] = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None}

    def _shards(self) -> list[np.ndarray]:
        if self._arrays is None:
            arrays = []
            for f in self.shard_files:
                source = pa.memory_map(os.path.join(self.data_dir, f), "r")
                batch = pa.ipc.open_file(source).get_batch(0)
                arrays.append(batch.column(0).to_numpy(zero_copy_only=True))
            self._arrays = arrays
        return self._arrays

    def _window(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        start = (i - int(self.offsets[s])) * self.seq_len
        return self._shards()[s][start: start + self.seq_len + 1]

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self._window(i).astype(np.int64))

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        # One (B, T+1) int64 array per batch: the DataLoader calls this instead of B __getitem__s.
        return torch.from_numpy(np.stack([self._window(i) for i in indices]).astype(np.int64))


def collate_windows(batch):
    """`__getitems__` already returns the stacked batch; split it into inputs and targets."""
    if isinstance(batch, list):
        batch = torch.stack(batch)
    return batch[:, :-1], batch[:, 1:]


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler (ranks get disjoint slices of one seeded permutation per epoch) that
    can start part-way into an epoch, so a resumed run sees exactly the batches it would have."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=True)
        self.start_index = 0

    def set_start(self, index: int) -> None:
        self.start_index = index

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.start_index:])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class BatchStream:
    """An endless stream of batches over epochs, whose position (epoch, batch) can be saved."""

    def __init__(self, loader, sampler: ResumableDistributedSampler, batch_size: int):
        self.loader, self.sampler, self.batch_size = loader, sampler, batch_size
        self.batches_per_epoch = sampler.num_samples // batch_size
        if self.batches_per_epoch == 0:
            raise UserError(f"the training split has fewer than batch_size={batch_size} windows per "
                            f"worker; lower --batch-size or --seq-len, or use a larger corpus")
        self.epoch, self.batch_in_epoch = 0, 0
        self._it = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
        self._it = None

    def next(self):
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch, self._it = self.epoch + 1, 0, None
        if self._it is None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.set_start(self.batch_in_epoch * self.batch_size)
            self._it = iter(self.loader)
        batch = next(self._it)
        self.batch_in_epoch += 1
        return batch
