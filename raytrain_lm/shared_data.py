"""Prepared datasets on shared storage (s3://, gs://, any pyarrow filesystem URI).

The choice: a dataset on shared storage is *downloaded once per node* into a local cache, every
shard checked against the sha256 in its manifest, and then memory-mapped exactly like a local
dataset. Training never reads tokens over the network, so a remote dataset trains as fast as a
local one after the first download, and a corrupted or half-written download is never used.

Cache: `$RAYTRAIN_LM_CACHE/datasets/<hash of the URI>/` (default `~/.cache/raytrain-lm`). The
workers of one node share it; a file lock lets one of them download while the others wait.
S3-compatible servers other than AWS (MinIO, moto, ...) are reached by setting
`AWS_ENDPOINT_URL` (pyarrow and boto read it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pyarrow.fs as pafs

from raytrain_lm.errors import UserError

CACHE_ENV = "RAYTRAIN_LM_CACHE"


def is_remote(path) -> bool:
    """True for a URI of a remote filesystem (s3://, gs://, ...); local paths and file:// are not."""
    p = str(path)
    return "://" in p and not p.startswith("file://")


def _open(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pafs.ArrowInvalid, OSError, ValueError) as e:
        raise UserError(f"cannot open {uri}: {str(e).splitlines()[0]}") from None
    return fs, path.rstrip("/")


def read_remote_manifest(uri: str) -> dict:
    """The manifest of a dataset at `uri`, after checking that every shard it lists is there."""
    from raytrain_lm.data import FORMAT, MANIFEST
    from raytrain_lm.tokenizer import tokenizer_from_spec

    fs, root = _open(uri)
    try:
        info = fs.get_file_info(f"{root}/{MANIFEST}")
        if info.type == pafs.FileType.NotFound:
            if fs.get_file_info(root).type == pafs.FileType.NotFound:
                raise UserError(f"dataset not found: {uri} (upload one with "
                                f"`python cli.py prepare --out {uri}`)")
            raise UserError(f"{uri} is not a prepared dataset (no {MANIFEST})")
        with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
            manifest = json.loads(f.read())
        present = {i.base_name: i.size for i in fs.get_file_info(pafs.FileSelector(root))}
    except OSError as e:
        raise UserError(f"cannot read dataset {uri}: {str(e).splitlines()[0]}") from None
    try:
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
        tokenizer_from_spec(manifest["tokenizer"])
        for split in ("train", "val"):
            for shard in manifest[split]["shards"]:
                if shard["file"] not in present:
                    raise ValueError(f"missing shard {shard['file']}")
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{uri} is not a valid dataset: {e}") from None
    return manifest


def upload_dataset(local_dir: str | Path, uri: str) -> None:
    """Copy a prepared dataset folder to `uri`; the manifest goes last, so a reader never sees a
    manifest whose shards are still on their way."""
    from raytrain_lm.data import MANIFEST

    fs, root = _open(uri)
    local = Path(local_dir)
    try:
        fs.create_dir(root, recursive=True)
        for f in sorted(local.iterdir(), key=lambda p: p.name == MANIFEST):
            with open(f, "rb") as src, fs.open_output_stream(f"{root}/{f.name}") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    except OSError as e:
        raise UserError(f"cannot write dataset to {uri}: {str(e).splitlines()[0]}") from None


def remote_exists(uri: str) -> bool:
    fs, root = _open(uri)
    try:
        return fs.get_file_info(root).type != pafs.FileType.NotFound
    except OSError as e:
        raise UserError(f"cannot reach {uri}: {str(e).splitlines()[0]}") from None


def cache_dir_for(uri: str) -> Path:
    base = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "raytrain-lm")
    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    name = uri.rstrip("/").rsplit("/", 1)[-1] or "dataset"
    return base / "datasets" / f"{name}-{key}"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of one node (the workers sharing a cache)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _same_shards(a: dict, b: dict) -> bool:
    return all([s["sha256"] for s in a[k]["shards"]] == [s["sha256"] for s in b[k]["shards"]]
               for k in ("train", "val"))


def fetch_dataset(uri: str) -> str:
    """A verified local copy of the dataset at `uri` (downloaded once per node); its path."""
    from raytrain_lm.data import MANIFEST, load_manifest
    from raytrain_lm.storage import sha256_file

    remote = read_remote_manifest(uri)
    local = cache_dir_for(uri)
    with file_lock(local.parent / f".{local.name}.lock"):
        if (local / MANIFEST).is_file():
            try:
                if _same_shards(load_manifest(local), remote):
                    return str(local)
            except UserError:
                pass  # a damaged cache entry: download again
        fs, root = _open(uri)
        tmp = Path(tempfile.mkdtemp(prefix=f".{local.name}.tmp-", dir=local.parent))
        try:
            for split in ("train", "val"):
                for shard in remote[split]["shards"]:
                    dst = tmp / shard["file"]
                    with fs.open_input_stream(f"{root}/{shard['file']}") as src, open(dst, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 22)
                    if sha256_file(dst) != shard["sha256"]:
                        raise UserError(f"{uri}/{shard['file']} does not match the sha256 in its "
                                        f"manifest; prepare and upload the dataset again")
            (tmp / MANIFEST).write_text(json.dumps(remote, indent=2))
            if local.exists():
                shutil.rmtree(local)
            tmp.rename(local)
        except OSError as e:
            raise UserError(f"cannot download dataset {uri}: {str(e).splitlines()[0]}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(local)
