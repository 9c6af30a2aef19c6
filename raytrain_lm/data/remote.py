"""Prepared datasets on shared storage (s3://, gs://, any pyarrow filesystem URI).

The choice: a dataset on shared storage is *downloaded once per node* into a local cache, every
shard (and a BPE's tokenizer.json) checked against the sha256 in its manifest, and then
memory-mapped exactly like a local dataset. Training never reads tokens over the network, so a
remote dataset trains as fast as a local one after the first download, and a corrupted or
half-written download is never used.

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
from pathlib import Path
from typing import Iterator


from raytrain_lm.data.manifest import dataset_files, load_manifest
from raytrain_lm.errors import UserError
from raytrain_lm.files import MANIFEST
from raytrain_lm.storage import open_uri, sha256_file, staged_folder

CACHE_ENV = "RAYTRAIN_LM_CACHE"


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


def _same_files(a: dict, b: dict) -> bool:
    return [s["sha256"] for s in dataset_files(a)] == [s["sha256"] for s in dataset_files(b)]


def fetch_dataset(uri: str) -> str:
    """A verified local copy of the dataset at `uri` (downloaded once per node); its path."""
    remote = load_manifest(uri)
    local = cache_dir_for(uri)
    with file_lock(local.parent / f".{local.name}.lock"):
        if (local / MANIFEST).is_file():
            with contextlib.suppress(UserError):  # a damaged cache entry: download again
                if _same_files(load_manifest(local), remote):
                    return str(local)
        fs, root = open_uri(uri, "dataset")
        try:
            with staged_folder(local) as tmp:
                for entry in dataset_files(remote):  # the shards and a BPE's tokenizer.json
                    dst = Path(tmp) / entry["file"]
                    with fs.open_input_stream(f"{root}/{entry['file']}") as src, open(dst, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 22)
                    if sha256_file(dst) != entry["sha256"]:
                        raise UserError(f"{uri}/{entry['file']} does not match the sha256 in its "
                                        f"manifest; prepare and upload the dataset again")
                (Path(tmp) / MANIFEST).write_text(json.dumps(remote, indent=2))
        except OSError as e:
            raise UserError(f"cannot download dataset {uri}: {str(e).splitlines()[0]}") from None
    return str(local)
