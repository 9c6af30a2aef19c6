"""The sha256 of a local file: what a checkpoint's commit records and a dataset's manifest hold.
Plain Python (no pyarrow), so a GPU host with torch alone writes and verifies checkpoints
(bench/gpu_check.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
