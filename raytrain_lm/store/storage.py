"""Files on a local disk or any pyarrow filesystem (s3://, gs://): opening a URI, writing a file
or a folder so that readers never see half of it, and a run's folder `<storage>/<name>/` (its
claim: claims.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pyarrow.fs as pafs

from raytrain_lm.errors import UserError
from raytrain_lm.store import files


def parse_json(data: bytes | str, where: str) -> Any:
    """JSON read from a file; UserError naming `where` when the file is damaged: not JSON, not
    UTF-8, or nested deeper than the parser recurses (a crafted `[[[[...` line)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise UserError(f"{where} is damaged: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{where} is damaged: {str(e).splitlines()[0]}") from None


def parse_jsonl(data: bytes, where: str) -> list[dict]:
    """The rows of a .jsonl file, each a JSON object. A last line cut short (no newline after it,
    not JSON: what a kill in the middle of an append leaves) is left out; any other damaged line
    is a UserError naming it."""
    lines = data.split(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, f"{where} line {number}")
        except UserError:
            if number == len(lines):  # the last line, without its newline: torn
                break
            raise
        if not isinstance(row, dict):
            raise UserError(f"{where} line {number} is damaged: not a JSON object")
        rows.append(row)
    return rows


def is_remote(path) -> bool:
    """True for a URI of a remote filesystem (s3://, gs://, ...); local paths and file:// are not."""
    p = str(path)
    return "://" in p and not p.startswith("file://")


def open_uri(uri: str, what: str = "") -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) of a URI such as s3://bucket/prefix."""
    if is_remote(uri) and not uri.split("://", 1)[1].strip("/"):  # from_uri takes it: all buckets
        raise UserError(f"{what + ' ' if what else ''}{uri} names no bucket: give "
                        f"{uri.split('://', 1)[0]}://BUCKET/PREFIX")
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pafs.ArrowInvalid, OSError, ValueError) as e:
        raise UserError(f"cannot open {what + ' ' if what else ''}{uri}: "
                        f"{str(e).splitlines()[0]}") from None
    return fs, path.rstrip("/")


def resolve_storage(storage: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path inside it, the URI/absolute path Ray's RunConfig should get)."""
    if "://" in storage:
        fs, path = open_uri(storage, "storage")
        return fs, path, storage.rstrip("/")
    path = os.path.abspath(os.path.expanduser(storage))
    return pafs.LocalFileSystem(), path, path


def path_error(path: str, e: OSError, doing: str = "write") -> UserError:
    """The user's error for a path that cannot be created, read or written: which path and why
    (a file where a folder must be, a folder where a file must be, /proc, a read-only disk)."""
    blocker = None if is_remote(path) else _file_in_the_way(path)
    why = (f"{blocker} is a file, not a folder" if blocker else
           os.strerror(e.errno) if e.errno else str(e).splitlines()[0])
    return UserError(f"cannot {doing} {path}: {why}")


def _file_in_the_way(path: str) -> Optional[str]:
    """The nearest existing ancestor of local `path` if it is a file: nothing can go under it."""
    for parent in Path(path).absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else str(parent)
    return None


def check_can_create(path: str) -> None:
    """UserError naming `path` unless a folder can be created there, checked by creating and
    removing a probe folder in its nearest existing ancestor: nothing is left behind. Local
    paths only (object stores have no folders in the way; they answer at the first write)."""
    if is_remote(path):
        return
    target = Path(path).absolute()
    nearest = next(p for p in (target, *target.parents) if p.exists())
    try:
        if not nearest.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        os.rmdir(tempfile.mkdtemp(prefix=".raytrain-lm-probe-", dir=nearest))
    except OSError as e:
        raise path_error(path, e, "create") from None


def _exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def share_folder(src: str, dst: str, fs: pafs.FileSystem) -> None:
    """Fill the empty folder `dst` with the files of `src`. On a local disk the files are hard
    links: a checkpoint's files are never written again once it is reported, so sharing them
    costs neither time nor space (a copy of a 7B run's checkpoint is ~80 GB), and removing `src`
    later leaves `dst` whole. Elsewhere (s3://, or where links cannot be made) they are copied."""
    if isinstance(fs, pafs.LocalFileSystem):
        try:
            for folder, _, names in os.walk(src):
                into = os.path.join(dst, os.path.relpath(folder, src))
                os.makedirs(into, exist_ok=True)
                for name in names:
                    os.link(os.path.join(folder, name), os.path.join(into, name))
            return
        except OSError:  # another device, or no hard links here: start over with a copy
            fs.delete_dir_contents(dst)
    pafs.copy_files(src, dst, source_filesystem=fs, destination_filesystem=fs)


def copy_commit_last(src: str, dst: str, fs: pafs.FileSystem) -> None:
    """Replace folder `dst` with a copy of the checkpoint `src` where folders cannot be renamed
    (object stores): `dst` stops being a checkpoint first (its meta.json goes), then its files
    go, then the copy comes in commit order, meta.json last. A reader finds the old checkpoint,
    none (incomplete: skipped), or the new one whole; never a mix that passes the checks."""
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(f"{dst}/{files.META}")
    fs.delete_dir_contents(dst, missing_dir_ok=True)
    found = [i.path[len(src) + 1:] for i in fs.get_file_info(pafs.FileSelector(src, recursive=True))
             if i.type == pafs.FileType.File]
    last = {files.META: 2, **{name: 1 for name in found if files.is_rank_record(name)}}
    for rel in sorted(found, key=lambda rel: (last.get(rel, 0), rel)):
        if "/" in rel:
            fs.create_dir(f"{dst}/{rel.rsplit('/', 1)[0]}", recursive=True)
        fs.copy_file(f"{src}/{rel}", f"{dst}/{rel}")


@contextlib.contextmanager
def staged_folder(target: str | Path, fs: Optional[pafs.FileSystem] = None) -> Iterator[str]:
    """Yields a temporary sibling folder of `target` to fill. When the block ends without an error
    the folder takes `target`'s place, and a previous `target` is removed only after that; on an
    error it is deleted. Readers see the old folder or the complete new one, never half of one."""
    fs = fs or pafs.LocalFileSystem()
    target = str(target).rstrip("/")
    if isinstance(fs, pafs.LocalFileSystem):
        target = os.path.abspath(target)
    parent, name = target.rsplit("/", 1)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}-{socket.gethostname()}"
    tmp, old = f"{parent}/.{name}.tmp-{tag}", f"{parent}/.{name}.old-{tag}"
    local = isinstance(fs, pafs.LocalFileSystem)
    made = [p for p in (Path(parent), *Path(parent).parents) if not p.exists()] if local else []
    if local:
        remove_stale_stages(parent, name)
    try:
        fs.create_dir(tmp, recursive=True)
    except OSError as e:
        raise path_error(target, e, "create") from None
    try:
        yield tmp
        if _exists(fs, target):
            fs.move(target, old)
        fs.move(tmp, target)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.delete_dir(tmp)
        for folder in made:  # the parents made for it, innermost first: nothing is left
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    with contextlib.suppress(Exception):
        kind = fs.get_file_info(old).type
        if kind == pafs.FileType.Directory:
            fs.delete_dir(old)
        elif kind == pafs.FileType.File:  # a file stood where the folder goes (--force)
            fs.delete_file(old)


def remove_stale_stages(parent: str, name: str) -> list[str]:
    """Delete the staging folders of `name` (staged_folder's `.NAME.tmp-*` and `.NAME.old-*`)
    whose process, on this machine, has died: a killed `prepare` or `export` leaves one behind.
    Those of live processes, and of other machines sharing the folder, are left. Returns the
    paths removed."""
    import glob
    import shutil

    removed = []
    for kind in ("tmp", "old"):
        for path in Path(parent).glob(f".{glob.escape(name)}.{kind}-*"):
            pid, _, rest = path.name[len(f".{name}.{kind}-"):].partition("-")
            host = rest.partition("-")[2]  # empty: made before tags named their machine
            if not pid.isdigit() or host not in ("", socket.gethostname()) or process_alive(int(pid)):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


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

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(f"{self.path}/{rel}") as f:
            return f.read()

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def check_can_create(self) -> None:
        """Before a new run or sweep starts: UserError unless its folder can be created."""
        if self.local:
            check_can_create(self.path)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write whole, then move into place: readers never see half a file. Where a full local
        disk has no room for the second copy, a file that exists is overwritten in place
        instead (its blocks are already there), so that a run that stops for want of space can
        still say so in its summary.json."""
        folder, _, name = f"{self.path}/{rel}".rpartition("/")  # rel may hold folders: eval/x.json
        tmp, target = f"{folder}/.{name}.tmp-{os.getpid()}", f"{self.path}/{rel}"
        try:
            self.fs.create_dir(folder, recursive=True)
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, target)
        except OSError as e:
            with contextlib.suppress(OSError):
                self.fs.delete_file(tmp)
            if not (self.local and e.errno == errno.ENOSPC and self._overwrite(target, data)):
                raise path_error(self.display_path(rel), e) from None

    @staticmethod
    def _overwrite(path: str, data: bytes) -> bool:
        """Overwrite `path` with `data` if that needs no new blocks (else it could stop half
        way, for the same want of space)."""
        try:
            if os.stat(path).st_blocks * 512 < len(data):
                return False
            with open(path, "r+b") as f:
                f.write(data)
                f.truncate()
            return True
        except OSError:
            return False

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_text(rel, json.dumps(obj, indent=2, default=str) + "\n")

    def read_json(self, rel: str) -> Any:
        """A JSON file of the run; UserError when it is damaged."""
        return parse_json(self.read_bytes(rel), self.display_path(rel))

    def read_jsonl(self, rel: str) -> list[dict]:
        """The rows of a .jsonl file of the run (see parse_jsonl); [] when there is none."""
        if not self.exists(rel):
            return []
        return parse_jsonl(self.read_bytes(rel), self.display_path(rel))

    def display_path(self, rel: str = "") -> str:
        base = f"{self.storage_uri}/{self.name}"
        return f"{base}/{rel}" if rel else base


class MetricsLog:
    """metrics.jsonl: one line per logged step. A report for a step already logged means the run
    restarted from a checkpoint, so the lines after that step are dropped and the curve stays the
    one the model actually followed."""


    def __init__(self, run: RunFolder):
        self.run = run
        self.rows: list[dict] = run.read_jsonl(files.METRICS)
        if run.exists(files.METRICS) and not run.read_bytes(files.METRICS).endswith(b"\n"):
            self._rewrite()  # a torn last line: the next row goes on a line of its own

    def add(self, row: dict) -> None:
        step = row["step"]
        if self.rows and self.rows[-1]["step"] >= step:
            self.rows = [r for r in self.rows if r["step"] < step]
            self.rows.append(row)
            self._rewrite()
            return
        self.rows.append(row)
        if self.run.local:
            try:
                os.makedirs(self.run.path, exist_ok=True)
                with open(f"{self.run.path}/{files.METRICS}", "a") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as e:
                raise path_error(self.run.display_path(files.METRICS), e) from None
        else:  # object stores cannot append: rewrite the (small) file
            self._rewrite()

    def _rewrite(self) -> None:
        self.run.write_text(files.METRICS, "".join(json.dumps(r) + "\n" for r in self.rows))
