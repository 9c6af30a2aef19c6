"""Reading a folder that came from elsewhere (a checkpoint, a Hugging Face model folder): a file
it names is a relative path of plain names that stays inside the folder, a regular file (not a
symlink, a device, a FIFO or a /proc file, whose size says nothing of what it yields), and is read
no further than its size, or than a bound for the small ones. What a file in it names never
makes a reader open something outside the folder, or read without end."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

from raytrain_lm.errors import UserError, brief

# One entry of a path a folder's file names: letters, digits, '.', '_' and '-', never '.' or '..'.
_PART = re.compile(r"[A-Za-z0-9._-]{1,255}")


def inside(folder: Path, rel: object, where: str) -> Path:
    """`rel` (a name a file of `folder` holds) as a path inside `folder`, checked: a relative path
    of plain names, not itself a symlink, that stays inside `folder` through the folders on its
    way. UserError naming `where` (the file that names it) otherwise."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or not all(_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise UserError(f"{where} names {brief(rel)}, which is not a file inside {folder}")
    path = folder.joinpath(*parts)
    if path.is_symlink():
        raise UserError(f"{where} names {rel}, a symlink: only the folder's own files are read")
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:  # a symlinked folder on the way leads out
        raise UserError(f"{where} names {rel}, which leads out of {folder}") from None
    return path


def _open_regular(path: Path, limit: int | None):
    """(the open file, its size): a regular file that is no symlink, at most `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        why = "a symlink" if os.path.islink(path) else os.strerror(e.errno) if e.errno else str(e)
        raise UserError(f"{path} cannot be read: {why}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UserError(f"{path} is not a regular file")
    if limit is not None and info.st_size > limit:
        os.close(fd)
        raise UserError(f"{path} is {info.st_size:,} bytes, more than the {limit:,} such a file "
                        f"can hold")
    return os.fdopen(fd, "rb"), info.st_size


def _read_exactly(f, size: int, path: Path):
    """The file's `size` bytes in chunks; UserError if it yields more or fewer (a file whose size
    says 0 but yields without end, or one that changed while read)."""
    left = size
    while left:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            raise UserError(f"{path} is shorter than its size says (it changed while read)")
        left -= len(chunk)
        yield chunk
    if f.read(1):
        raise UserError(f"{path} yields more bytes than its size says: not a regular file")


def read_bytes(path: Path, limit: int) -> bytes:
    """A small file's bytes (a record, a config), at most `limit` of them."""
    f, size = _open_regular(path, limit)
    with f:
        return b"".join(_read_exactly(f, size, path))


def digest(path: Path) -> str:
    """sha256 of a regular file, read to its size and no further."""
    f, size = _open_regular(path, None)
    h = hashlib.sha256()
    with f:
        for chunk in _read_exactly(f, size, path):
            h.update(chunk)
    return h.hexdigest()


def size_of(path: Path) -> int:
    """The size of a regular file that is no symlink (UserError otherwise)."""
    f, size = _open_regular(path, None)
    f.close()
    return size
