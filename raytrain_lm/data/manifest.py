"""A prepared dataset's manifest.json: what its shards are and how to check them.

    manifest.json           tokenizer spec (a BPE's with the sha256 of its file), vocab, dtype,
                            source, token and text-byte counts, sha256 of every shard
    tokenizer.json          a BPE's vocabulary and merges (none for the byte tokenizer)
    train-00000.arrow ...   one uint8/uint16/uint32 column `tokens`, one record batch per file,
    val-00000.arrow ...     and where the tokenizer rewrites text (a normalizer, a prefix space)
                            a column `bytes`: each token's share of the documents' bytes as read

One reader for a dataset folder on this machine and one on shared storage (s3://, gs://), with
the same checks: the format, the tokenizer, and every listed file present.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import pyarrow.fs as pafs

from raytrain_lm.config.checks import MAX_VOCAB, is_plain_name
from raytrain_lm.data.spec import check_spec, tokenizer_from_spec
from raytrain_lm.data.vocab import byte_tokenizer_json
from raytrain_lm.errors import UserError
from raytrain_lm.store import untrusted
from raytrain_lm.store.digest import sha256_file
from raytrain_lm.store.files import MANIFEST, REMOTE_SOURCE
from raytrain_lm.store.storage import is_remote, open_uri

TOKENS_FORMAT = "raytrain-lm-tokens/1"
MAX_MANIFEST_BYTES = 64 << 20  # ~150 bytes a shard: 400,000 shards
SPLITS = ("train", "val")
BYTES_COLUMN = "bytes"  # a shard's second column, where there is one (data/prepare.py)


def shard_files(manifest: dict) -> list[dict]:
    """Every shard of both splits: {"file", "tokens", "sha256"}."""
    return [s for split in SPLITS for s in manifest[split]["shards"]]


def dataset_files(manifest: dict) -> list[dict]:
    """Every file a dataset's manifest vouches for, {"file", "sha256", ...}: the shards, and a
    BPE's tokenizer.json (its spec names it and holds its sha256)."""
    spec = manifest["tokenizer"]
    return shard_files(manifest) + ([spec] if spec.get("type") != "byte" else [])


def check_manifest(manifest: dict, where: str, file_ok: Callable[[dict], bool]) -> dict:
    """Raise a UserError unless `manifest` is ours and every file passes `file_ok`."""
    try:
        if manifest.get("format") != TOKENS_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
        check_spec(manifest["tokenizer"])
        vocab = manifest["vocab_size"]  # sizes the model's embedding: a number, and not a huge one
        if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"vocab_size {vocab!r} is not a number of tokens from 1 to {MAX_VOCAB:,}")
        if manifest["tokenizer"].get("vocab_size") != vocab:
            raise ValueError(f"vocab_size {vocab} is not its tokenizer's "
                             f"({manifest['tokenizer'].get('vocab_size')!r})")
        for entry in dataset_files(manifest):
            if not is_plain_name(entry["file"]):  # never a path out of the dataset's folder
                raise ValueError(f"shard file name {entry['file']!r} is not a plain file name")
            if not file_ok(entry):
                what = "tokenizer file" if entry is manifest["tokenizer"] else "shard"
                raise ValueError(f"missing or damaged {what} {entry['file']}")
    except UserError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{where} is not a valid dataset: {e}") from None
    return manifest


def load_manifest(data: str | Path, verify: bool = False) -> dict:
    """The checked manifest of a dataset folder or URI; `verify` also checks every local shard's
    sha256 (a remote dataset is verified when a node downloads it)."""
    if is_remote(data):
        return _load_remote(str(data))
    d = Path(data)
    if not d.exists():
        raise UserError(f"dataset not found: {d} (create one with `python cli.py prepare`)")
    if not d.is_dir():
        raise UserError(f"dataset {d} is a file; a dataset is the folder `python cli.py prepare` writes")
    if not (d / MANIFEST).is_file():
        raise UserError(f"{d} is not a prepared dataset (no {MANIFEST}); "
                        f"create one with `python cli.py prepare --out {d}`")
    try:  # a regular file of a bounded size: not a symlink to /proc/self/pagemap, read forever
        manifest = json.loads(untrusted.read_bytes(d / MANIFEST, MAX_MANIFEST_BYTES))
    except RecursionError:
        raise UserError(f"{d} is not a valid dataset: {MANIFEST} is nested too deeply") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{d} is not a valid dataset: {MANIFEST}: {e}") from None

    # A node's cache of a dataset on shared storage (data/remote.py) fetches shards when first
    # read, verifying each then: only its tokenizer.json must be there already.
    partial = (d / REMOTE_SOURCE).is_file()

    def ok(entry: dict) -> bool:
        path = d / entry["file"]
        if not path.is_file():
            return partial and entry is not manifest["tokenizer"]
        return not verify or sha256_file(path) == entry["sha256"]

    return check_manifest(manifest, str(d), ok)


def dataset_tokenizer(data_dir: str | Path):
    """The tokenizer of a local dataset folder (a BPE's tokenizer.json read from it, its sha256
    checked against the manifest), with the wrap of documents the manifest records."""
    manifest = load_manifest(data_dir)
    spec = manifest["tokenizer"]
    if isinstance(manifest.get("documents"), dict) and spec.get("type") != "byte":
        spec = {**spec, "documents": manifest["documents"]}
    return tokenizer_from_spec(spec, data_dir)


def _load_remote(uri: str) -> dict:
    fs, root = open_uri(uri, "dataset")
    try:
        if fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.NotFound:
            if fs.get_file_info(root).type == pafs.FileType.NotFound:
                raise UserError(f"dataset not found: {uri} (upload one with "
                                f"`python cli.py prepare --out {uri}`)")
            raise UserError(f"{uri} is not a prepared dataset (no {MANIFEST})")
        with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
            manifest = json.loads(f.read())
        present = {i.base_name for i in fs.get_file_info(pafs.FileSelector(root))}
    except OSError as e:
        raise UserError(f"cannot read dataset {uri}: {str(e).splitlines()[0]}") from None
    except (ValueError, RecursionError) as e:
        raise UserError(f"{uri} is not a valid dataset: {MANIFEST}: {e}") from None
    return check_manifest(manifest, uri, lambda shard: shard["file"] in present)


def tokenizer_sha256(manifest: dict) -> str:
    """sha256 of the tokenizer.json an export of a model of this dataset carries (export.py): a
    BPE's own file, or the byte tokenizer's equivalent."""
    spec = manifest["tokenizer"]
    if spec.get("type") == "byte":
        return hashlib.sha256(byte_tokenizer_json().encode()).hexdigest()
    return spec["sha256"]
