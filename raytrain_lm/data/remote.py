"""Prepared datasets on shared storage (s3://, gs://, any pyarrow filesystem URI).

The choice: a node keeps a local cache of the dataset and memory-maps shards from it exactly like
a local dataset, so training never reads tokens over the network. The cache starts with the
manifest and a BPE's tokenizer.json; a shard is downloaded when a worker first reads from it
(`fetch_shard`), checked against the sha256 in the manifest (a corrupted or half-written download
is never used), and the least recently used shards are deleted when the cache grows past its
bound (`RAYTRAIN_LM_CACHE_GB`, default 100). The sampler reads a large dataset a group of shards
at a time (data/sampler.py), so a node holds only those: a dataset larger than a node's disk
trains, and a small one is downloaded once and kept.

Cache: `$RAYTRAIN_LM_CACHE/datasets/<name>-<hash of the URI>/` (default `~/.cache/raytrain-lm`).
The workers of one node share it; a file lock lets one of them download while the others wait.
S3-compatible servers other than AWS (MinIO, moto, ...) are reached by setting
`AWS_ENDPOINT_URL` (pyarrow and boto read it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from raytrain_lm import env
from raytrain_lm.data.manifest import dataset_files, load_manifest
from raytrain_lm.errors import UserError
from raytrain_lm.store.digest import sha256_file
from raytrain_lm.store.files import MANIFEST, REMOTE_SOURCE, TOKENIZER
from raytrain_lm.store.storage import open_uri, staged_folder

DEFAULT_CACHE_GB = 100.0


def cache_dir_for(uri: str) -> Path:
    base = env.cache_dir()
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


def _same_files(a: dict, b: dict) -> bool:
    return [s["sha256"] for s in dataset_files(a)] == [s["sha256"] for s in dataset_files(b)]


def open_remote(uri: str) -> str:
    """This node's cache folder of the dataset at `uri`: its manifest and tokenizer.json
    (verified) now, its shards when first read (fetch_shard). A cache of an older version of the
    dataset (other sha256s) is replaced."""
    remote = load_manifest(uri)
    local = cache_dir_for(uri)
    with file_lock(local.parent / f".{local.name}.lock"):
        if (local / MANIFEST).is_file() and (local / REMOTE_SOURCE).is_file():
            with contextlib.suppress(OSError, ValueError, KeyError):
                if _same_files(json.loads((local / MANIFEST).read_text()), remote):
                    return str(local)
        with staged_folder(local) as tmp:
            if remote["tokenizer"].get("type") != "byte":
                _download(uri, remote["tokenizer"], Path(tmp) / TOKENIZER)
            (Path(tmp) / REMOTE_SOURCE).write_text(json.dumps({"uri": uri}))
            (Path(tmp) / MANIFEST).write_text(json.dumps(remote, indent=2))
    return str(local)


def fetch_shard(folder: Path, entry: dict) -> Path:
    """The local path of the shard `entry` of the cached dataset in `folder`, downloaded and
    verified first if this node does not have it; marks it as just used."""
    path = folder / entry["file"]
    if not path.is_file():
        with file_lock(folder / ".fetch.lock"):  # one download at a time per node and dataset
            if not path.is_file():
                uri = json.loads((folder / REMOTE_SOURCE).read_text())["uri"]
                _download(uri, entry, path)
                evict(folder, keep=path)
    os.utime(path)  # least recently used goes first
    return path


def evict(folder: Path, keep: Path) -> None:
    """Delete the least recently used shards until the cache is within its bound (never `keep`).
    A shard another worker has memory-mapped stays readable to it until it lets go."""
    limit = env.cache_gb(DEFAULT_CACHE_GB) * 1e9
    shards = sorted(folder.glob("*.arrow"), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in shards)
    for p in shards:
        if total <= limit:
            break
        if p != keep:
            total -= p.stat().st_size
            p.unlink(missing_ok=True)


def _download(uri: str, entry: dict, dst: Path) -> None:
    """`uri`/entry["file"] to `dst` (written under a temporary name, renamed when verified)."""
    fs, root = open_uri(uri, "dataset")
    tmp = dst.with_name(f".{dst.name}.part-{os.getpid()}")
    try:
        with fs.open_input_stream(f"{root}/{entry['file']}") as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
        if sha256_file(tmp) != entry["sha256"]:
            raise UserError(f"{uri}/{entry['file']} does not match the sha256 in its manifest; "
                            f"prepare the dataset again")
        os.replace(tmp, dst)
    except OSError as e:
        raise UserError(f"cannot download {uri}/{entry['file']}: {str(e).splitlines()[0]}") from None
    finally:
        tmp.unlink(missing_ok=True)
