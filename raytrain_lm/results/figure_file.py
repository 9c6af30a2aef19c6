"""Where `report` writes its figure with `--out`: a new file, or (with --force) a figure report
wrote before, known by the mark its PNG carries (a tEXt chunk, plots.MARK). Anything else there,
a user's notes, a symlink, a folder, is refused and left as it is: the rule of `export` and
`prepare` (--force replaces only what we wrote)."""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

from raytrain_lm.errors import UserError

MARK = ("Source", "raytrain-lm report")  # the PNG tEXt entry every figure of report carries
_PNG = b"\x89PNG\r\n\x1a\n"


def is_report_figure(path: Path) -> bool:
    """A regular file (no symlink) that is a PNG whose text chunks, before its image data, carry
    MARK. Reads the chunk headers only (a few hundred bytes)."""
    if path.is_symlink() or not path.is_file():
        return False
    wanted = f"{MARK[0]}\0{MARK[1]}".encode()
    with open(path, "rb") as f:
        if f.read(8) != _PNG:
            return False
        while len(head := f.read(8)) == 8:
            length, kind = struct.unpack(">I4s", head)
            if kind == b"IDAT" or length > 1 << 16:  # text chunks of matplotlib's come first
                return False
            data = f.read(length)
            if kind == b"tEXt" and data == wanted:
                return True
            f.seek(4, os.SEEK_CUR)  # the chunk's CRC
    return False


def check_out(out: str, force: bool) -> None:
    """`--out` may be written: it is new, or --force and a figure report wrote. A folder is left
    to the write to refuse (one line naming it, as any path that cannot be written)."""
    path = Path(out)
    if path.is_symlink():
        raise UserError(f"--out {out} is a symlink; give the file itself")
    if not path.exists() or path.is_dir():
        return
    if not is_report_figure(path):
        raise UserError(f"{out} exists and is not a figure written by report, so it is not "
                        f"replaced (--force neither); choose another --out, or remove it yourself")
    if not force:
        raise UserError(f"{out} exists (a figure of report's); pass --force to replace it")


def write(out: str, png: bytes) -> None:
    """The figure at `out`, whole or not at all: written beside it, then renamed over it."""
    path = Path(out).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(21, os.strerror(21), str(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(png)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
