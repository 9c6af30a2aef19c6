"""A run's folder `<storage>/<name>/` on a local disk or any pyarrow filesystem (s3://, gs://)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import pyarrow.fs as pafs

from raytrain_lm.errors import UserError


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def resolve_storage(storage: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path inside it, the URI/absolute path Ray's RunConfig should get)."""
    if "://" in storage:
        try:
            fs, path = pafs.FileSystem.from_uri(storage)
        except (pafs.ArrowInvalid, OSError, ValueError) as e:
            raise UserError(f"cannot open storage {storage}: {e}") from None
        return fs, path.rstrip("/"), storage.rstrip("/")
    path = os.path.abspath(os.path.expanduser(storage))
    return pafs.LocalFileSystem(), path, path


class RunFolder:
    """Reads and writes the files we keep beside Ray's own in a run's folder."""

    def __init__(self, storage: str, name: str, filesystem: Optional[pafs.FileSystem] = None):
        fs, root, self.storage_uri = resolve_storage(storage)
        self.fs = filesystem or fs
        self.name = name
        self.path = f"{root}/{name}"
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def exists(self, rel: str = "") -> bool:
        target = f"{self.path}/{rel}" if rel else self.path
        return self.fs.get_file_info(target).type != pafs.FileType.NotFound

    def read_text(self, rel: str) -> str:
        with self.fs.open_input_stream(f"{self.path}/{rel}") as f:
            return f.read().decode()

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write whole, then move into place: readers never see half a file."""
        self.fs.create_dir(self.path, recursive=True)
        tmp = f"{self.path}/.{rel}.tmp-{os.getpid()}"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, f"{self.path}/{rel}")

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_text(rel, json.dumps(obj, indent=2, default=str) + "\n")

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_text(rel))

    def read_jsonl(self, rel: str) -> list[dict]:
        if not self.exists(rel):
            return []
        return [json.loads(line) for line in self.read_text(rel).splitlines() if line.strip()]

    def display_path(self, rel: str = "") -> str:
        base = f"{self.storage_uri}/{self.name}"
        return f"{base}/{rel}" if rel else base


class MetricsLog:
    """metrics.jsonl: one line per logged step. A report for a step already logged means the run
    restarted from a checkpoint, so the lines after that step are dropped and the curve stays the
    one the model actually followed."""

    FILE = "metrics.jsonl"

    def __init__(self, run: RunFolder):
        self.run = run
        self.rows: list[dict] = run.read_jsonl(self.FILE)

    def add(self, row: dict) -> None:
        step = row["step"]
        if self.rows and self.rows[-1]["step"] >= step:
            self.rows = [r for r in self.rows if r["step"] < step]
            self.rows.append(row)
            self._rewrite()
            return
        self.rows.append(row)
        if self.run.local:
            os.makedirs(self.run.path, exist_ok=True)
            with open(f"{self.run.path}/{self.FILE}", "a") as f:
                f.write(json.dumps(row) + "\n")
        else:  # object stores cannot append: rewrite the (small) file
            self._rewrite()

    def _rewrite(self) -> None:
        self.run.write_text(self.FILE, "".join(json.dumps(r) + "\n" for r in self.rows))
