"""A prepared dataset's manifest.json: what its shards are and how to check them.

    manifest.json           tokenizer, vocab, dtype, source, token counts, sha256 of every shard
    train-00000.arrow ...   one uint8/uint16/uint32 column `tokens`, one record batch per file
    val-00000.arrow ...

One reader for a dataset folder on this machine and one on shared storage (s3://, gs://), with
the same checks: the format, the tokenizer, and every listed shard present.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pyarrow.fs as pafs

from raytrain_lm.errors import UserError
from raytrain_lm.files import MANIFEST, is_plain_name
from raytrain_lm.storage import is_remote, open_uri, sha256_file
from raytrain_lm.tokenizer import tokenizer_from_spec

FORMAT = "raytrain-lm-tokens/1"
SPLITS = ("train", "val")


def shard_files(manifest: dict) -> list[dict]:
    """Every shard of both splits: {"file", "tokens", "sha256"}."""
    return [s for split in SPLITS for s in manifest[split]["shards"]]


def check_manifest(manifest: dict, where: str, shard_ok: Callable[[dict], bool]) -> dict:
    """Raise a UserError unless `manifest` is ours and every shard passes `shard_ok`."""
    try:
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
        tokenizer_from_spec(manifest["tokenizer"])
        for shard in shard_files(manifest):
            if not is_plain_name(shard["file"]):  # never a path out of the dataset's folder
                raise ValueError(f"shard file name {shard['file']!r} is not a plain file name")
            if not shard_ok(shard):
                raise ValueError(f"missing or damaged shard {shard['file']}")
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
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{d} is not a valid dataset: {MANIFEST}: {e}") from None

    def ok(shard: dict) -> bool:
        path = d / shard["file"]
        return path.is_file() and (not verify or sha256_file(path) == shard["sha256"])

    return check_manifest(manifest, str(d), ok)


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
    except ValueError as e:
        raise UserError(f"{uri} is not a valid dataset: {MANIFEST}: {e}") from None
    return check_manifest(manifest, uri, lambda shard: shard["file"] in present)
