"""Where documents come from: the built-in corpora (CPython's own docs and sources, on every
machine) or the user's files (.txt/.md, .jsonl, Parquet; local paths or s3:// / gs:// URIs).

A corpus is planned as a list of `Unit`s in corpus order: slices of about 1 MiB that one task
reads and tokenizes on its own (data/tokenize.py), in this process or in parallel Ray tasks.
The plan depends only on the input, never on how many CPUs tokenize it, so the shards come out
the same every time. A unit holds whole documents (a group of pydoc topics or stdlib files, a
range of .jsonl lines, a Parquet row group), except that a large text file, which is one
document, is cut into pieces where cutting cannot change its tokens (see `_SAFE_CUT`).
"""

from __future__ import annotations

import json
import os
import random
import re
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_lm.errors import UserError
from raytrain_lm.store.storage import is_remote, open_uri

BUILTIN_CORPORA = ("pydoc", "stdlib")
TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
PIECE_BYTES = 1 << 20  # the size of a unit: big enough that per-task overhead is small

# Where a text file may be cut without changing its tokens: right after a newline that has a
# printable ASCII character on both sides ("X\n|Y"). Byte-level BPE pre-tokenizers (GPT-2's
# regex, Llama 3's) always split there: a newline never joins the word after it, and no token
# reaches across it. ASCII on both sides keeps the rule a byte test (a byte >= 0x80 may belong to
# a whitespace character), so it works on byte ranges before decoding. A file with no such point
# within SEARCH_LIMIT bytes (minified text) is cut at a character boundary instead.
_SAFE_CUT = re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])")
SEARCH_LIMIT = 4 * PIECE_BYTES


@dataclass(frozen=True)
class Unit:
    """A slice of the corpus that one task reads: its documents, in order."""

    kind: str  # pydoc | stdlib | text | jsonl | parquet
    path: str = ""  # the file: an absolute local path or a URI
    start: int = 0  # text/jsonl: byte range [start, end); parquet: the row group; pydoc: topics
    end: int = 0
    nbytes: int = 0  # about how many bytes of text it holds (to sample a BPE's training text)
    files: tuple[str, ...] = field(default=())  # stdlib: its files, one document each
    text_field: str = "text"

    @property
    def opens_document(self) -> bool:
        """False only for the second and later pieces of a text file: nothing goes before them."""
        return self.kind != "text" or self.start == 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Unit":
        d = json.loads(text)
        return cls(**{**d, "files": tuple(d["files"])})


# ---------------------------------------------------------------- files, local or remote


def _fs(path: str) -> tuple[pafs.FileSystem, str]:
    if is_remote(path):
        return open_uri(path, "corpus")
    return pafs.LocalFileSystem(), os.path.abspath(path)


def _unreadable(path: str, e: Exception) -> UserError:
    why = getattr(e, "strerror", None) or str(e).splitlines()[0]
    return UserError(f"cannot read corpus file {path}: {why}")


def _files(source: str) -> list[str]:
    """The corpus files of a path or URI (a file, or a folder's files in name order)."""
    fs, root = _fs(source)
    try:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise UserError(f"corpus not found: {source} (a path, or one of: "
                            f"{', '.join(BUILTIN_CORPORA)})")
        if info.type == pafs.FileType.File:
            found = [root]
        else:
            found = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
                           if i.type == pafs.FileType.File and i.path.endswith(SUFFIXES))
            if not found:
                raise UserError(f"no .txt, .md, .jsonl or .parquet files under {source}")
    except OSError as e:
        raise UserError(f"cannot read corpus {source}: {str(e).splitlines()[0]}") from None
    # a URI's files as URIs again (the filesystem's paths lack the scheme)
    if is_remote(source):
        scheme = source.split("://", 1)[0]
        return [f"{scheme}://{p}" for p in found]
    return found


def check_source(source: str) -> None:
    """UserError unless `source` is a built-in corpus or a path holding corpus files."""
    if source not in BUILTIN_CORPORA:
        for f in _files(source):
            if not f.endswith(SUFFIXES):
                raise UserError(f"unsupported corpus file {f}: use .txt, .md, .jsonl or .parquet")


def input_megabytes(sources: list[str]) -> float:
    """About how much text `sources` hold, in MB (local files and built-in corpora)."""
    total = 0
    for source in sources:
        if source == "pydoc":
            total += sum(len(t.encode("utf-8")) for t in _pydoc_topics())
        elif source == "stdlib":
            total += sum(os.path.getsize(f) for f in _stdlib_files())
        elif not is_remote(source):
            total += sum(os.path.getsize(f) for f in _files(source))
    return total / 1e6


def corpus_source(corpus: str, inputs: list[str]) -> tuple[list[str], str]:
    """(sources, default output folder) of `prepare`: the --input paths in the order given (the
    folder is named after the first), else a built-in corpus."""
    if inputs:
        return list(inputs), str(Path("data") / Path(inputs[0].rstrip("/")).stem)
    if corpus not in BUILTIN_CORPORA:
        raise UserError(f"unknown corpus {corpus!r}; choose one of: {', '.join(BUILTIN_CORPORA)}, "
                        f"or pass --input PATH")
    return [corpus], str(Path("data") / corpus)


# ---------------------------------------------------------------- planning


def plan_units(sources: list[str], text_field: str = "text",
               piece_bytes: int = PIECE_BYTES) -> list[Unit]:
    """The units of the corpora `sources`, in corpus order. Reads only file sizes, Parquet
    footers and a few bytes around each cut; UserError for anything unusable."""
    units: list[Unit] = []
    for source in sources:
        if source == "pydoc":
            units += _plan_pydoc(piece_bytes)
        elif source == "stdlib":
            units += _plan_stdlib(piece_bytes)
        else:
            for f in _files(source):
                if f.endswith(TEXT_SUFFIXES):
                    units += _plan_ranges(f, "text", piece_bytes, text_field)
                elif f.endswith(".jsonl"):
                    units += _plan_ranges(f, "jsonl", piece_bytes, text_field)
                elif f.endswith(".parquet"):
                    units += _plan_parquet(f, text_field)
                else:
                    raise UserError(f"unsupported corpus file {f}: use .txt, .md, .jsonl or .parquet")
    return units


def _pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _plan_pydoc(piece_bytes: int) -> list[Unit]:
    sizes = [len(t.encode("utf-8")) for t in _pydoc_topics()]
    return [Unit("pydoc", start=a, end=b, nbytes=sum(sizes[a:b])) for a, b in _groups(sizes, piece_bytes)]


def _stdlib_files() -> list[str]:
    # os.walk prunes site-packages instead of walking every installed package (rglob did: 1.2 s
    # of a 0.06 s plan); Path order, as before, so the datasets stay byte for byte the same
    found = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [d for d in subfolders if d != "site-packages"]
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    return [str(p) for p in sorted(found)]


def _plan_stdlib(piece_bytes: int) -> list[Unit]:
    files = _stdlib_files()
    sizes = [os.path.getsize(f) for f in files]
    return [Unit("stdlib", files=tuple(files[a:b]), nbytes=sum(sizes[a:b]))
            for a, b in _groups(sizes, piece_bytes)]


def _groups(sizes: list[int], piece_bytes: int) -> list[tuple[int, int]]:
    """Consecutive index ranges whose sizes add up to about `piece_bytes` (at least one item)."""
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= piece_bytes:
            out.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def _plan_ranges(path: str, kind: str, piece_bytes: int, text_field: str) -> list[Unit]:
    """Byte ranges of a text file (cut at safe points) or of a .jsonl file (cut after a line)."""
    fs, p = _fs(path)
    try:
        size = fs.get_file_info(p).size
        cuts = [0]
        with fs.open_input_file(p) as f:
            while size - cuts[-1] > piece_bytes:
                cut = (_safe_cut if kind == "text" else _line_end)(f, cuts[-1] + piece_bytes, size)
                if cut >= size:
                    break
                cuts.append(cut)
    except OSError as e:
        raise _unreadable(path, e) from None
    cuts.append(size)
    return [Unit(kind, path, a, b, nbytes=b - a, text_field=text_field)
            for a, b in zip(cuts, cuts[1:])] or [Unit(kind, path, 0, 0, text_field=text_field)]


def _safe_cut(f, pos: int, size: int) -> int:
    """The first safe cut after `pos` (see _SAFE_CUT); none before the end of the file: no cut
    (`size`, the rest is one piece); none within SEARCH_LIMIT bytes: the first UTF-8 character
    boundary at or after `pos`."""
    f.seek(pos - 1)
    window = b""
    while len(window) < SEARCH_LIMIT:
        block = f.read(1 << 16)
        if not block:
            return size
        window += block
        m = _SAFE_CUT.search(window)
        if m:
            return pos - 1 + m.start() + 2
    for i in range(1, len(window)):
        if window[i] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return pos - 1 + i
    return size


def _line_end(f, pos: int, size: int) -> int:
    """Just after the first newline at or after `pos`: .jsonl pieces hold whole lines."""
    f.seek(pos)
    offset = pos
    while offset < size:
        block = f.read(1 << 16)
        i = block.find(b"\n")
        if i >= 0:
            return offset + i + 1
        offset += len(block)
    return size


def _plan_parquet(path: str, text_field: str) -> list[Unit]:
    import pyarrow.parquet as pq

    fs, p = _fs(path)
    try:
        with fs.open_input_file(p) as f:
            meta = pq.ParquetFile(f).metadata
            names = meta.schema.to_arrow_schema().names
    except (OSError, pa.ArrowException) as e:
        raise _unreadable(path, e) from None
    if text_field not in names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); "
                        f"use --text-column")
    if names.count(text_field) > 1:
        raise UserError(f"{path}: {names.count(text_field)} columns are named {text_field!r}; "
                        f"a column of text needs a name of its own")
    kind = meta.schema.to_arrow_schema().field(text_field).type
    if pa.types.is_dictionary(kind):  # what pandas writes for a categorical: text, encoded
        kind = kind.value_type
    if not any(is_text(kind) for is_text in (pa.types.is_string, pa.types.is_large_string,
                                               pa.types.is_string_view)):
        raise UserError(f"{path}: column {text_field!r} holds {kind}, not text; use --text-column "
                        f"to name the column of text")
    return [Unit("parquet", path, g, g + 1, nbytes=meta.row_group(g).total_byte_size,
                 text_field=text_field) for g in range(meta.num_row_groups)]


def sample_units(units: list[Unit], sample_bytes: int, seed: int = 0) -> list[Unit]:
    """At most about `sample_bytes` of the corpus, as units kept at random (seeded) in the
    proportion that spreads the sample over the whole corpus, not its first files."""
    total = sum(u.nbytes for u in units)
    keep = 1.0 if total <= sample_bytes else sample_bytes / total
    rng = random.Random(seed)
    out, taken = [], 0
    for u in units:
        if keep < 1.0 and rng.random() >= keep:
            continue
        out.append(u)
        taken += u.nbytes
        if taken >= sample_bytes:
            break
    return out or units[:1]  # a unit larger than the whole sample: it, rather than nothing


# ---------------------------------------------------------------- reading


def read_unit(unit: Unit) -> list[str]:
    """The texts of a unit: its documents, or for a text-file piece the piece."""
    if unit.kind == "pydoc":
        return _pydoc_topics()[unit.start:unit.end]
    if unit.kind == "stdlib":
        return [text for f in unit.files if (text := _read_stdlib_file(f)) is not None]
    if unit.kind == "text":
        return [_read_text(unit)]
    if unit.kind == "jsonl":
        return list(_jsonl_documents(unit))
    if unit.kind == "parquet":
        return _parquet_documents(unit)
    raise ValueError(f"unknown unit kind {unit.kind!r}")


def _read_stdlib_file(path: str) -> Optional[str]:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a handful of test fixtures are deliberately not UTF-8


def _read_text(unit: Unit) -> str:
    """The unit's byte range of its file, decoded (UTF-8: a cut is never inside a character)."""
    if unit.end == unit.start:
        return ""
    fs, p = _fs(unit.path)
    try:
        with fs.open_input_file(p) as f:
            f.seek(unit.start)
            return f.read(unit.end - unit.start).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _unreadable(unit.path, e) from None


def _jsonl_documents(unit: Unit) -> Iterator[str]:
    """One document per row. Errors name the line (counted from the unit's start, which is the
    file's line number for a file of one unit; else the line's byte offset)."""
    offset = unit.start
    for lineno, line in enumerate(_read_text(unit).split("\n"), 1):
        where = f"{unit.path}:{lineno}" if unit.start == 0 else f"{unit.path} (line at byte {offset})"
        offset += len(line.encode("utf-8")) + 1
        if not line.strip():
            continue
        try:
            text = json.loads(line)[unit.text_field]
        except (json.JSONDecodeError, KeyError, TypeError, IndexError, RecursionError):
            raise UserError(f"{where}: expected a JSON object with a {unit.text_field!r} string "
                            f"field") from None
        if not isinstance(text, str):
            raise UserError(f"{where}: field {unit.text_field!r} is not a string")
        yield text


def _parquet_documents(unit: Unit) -> list[str]:
    import pyarrow.parquet as pq

    fs, p = _fs(unit.path)
    try:
        with fs.open_input_file(p) as f:
            column = pq.ParquetFile(f).read_row_group(unit.start, columns=[unit.text_field]).column(0)
    except (OSError, pa.ArrowException) as e:
        raise _unreadable(unit.path, e) from None
    return [text for text in column.to_pylist() if text is not None]
