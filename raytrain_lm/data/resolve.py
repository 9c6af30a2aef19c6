"""Which local folder a worker memory-maps for `--data` (called on every worker, on every node)."""

from __future__ import annotations

import socket
from pathlib import Path

from raytrain_lm.data.prepare import prepare_dataset
from raytrain_lm.data.remote import file_lock, open_remote
from raytrain_lm.data.sources import BUILTIN_CORPORA
from raytrain_lm.errors import UserError
from raytrain_lm.store.files import MANIFEST
from raytrain_lm.store.storage import is_remote


def resolve_dataset(data: str) -> str:
    """The local folder this node memory-maps for `data`:

    - a URI (s3://, gs://, ...): this node's cache of it, each shard downloaded when first read
      and verified against its manifest's sha256 (data/remote.py);
    - a local folder that exists: itself (the fast path, nothing copied);
    - a built-in corpus folder (`.../data/pydoc`, `.../data/stdlib`) missing on this node, as on
      the other nodes of a cluster: tokenized here (deterministic, the same shards everywhere);
    - anything else missing: a UserError that says how to share the dataset.
    """
    if is_remote(data):
        return open_remote(data)
    path = Path(data)
    if (path / MANIFEST).is_file():
        return data
    if path.parent.name == "data" and path.name in BUILTIN_CORPORA:
        with file_lock(path.parent / f".{path.name}.lock"):
            if not (path / MANIFEST).is_file():
                prepare_dataset(path.name, path, force=path.exists())
        return data
    raise UserError(f"dataset {data} is not on node {socket.gethostname()}; on a cluster of "
                    f"several machines put it on shared storage: `python cli.py prepare ... --out "
                    f"s3://BUCKET/data/NAME` and train with --data s3://BUCKET/data/NAME")
