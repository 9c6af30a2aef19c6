"""Where documents come from: the built-in corpora (CPython's own docs and sources, on every
machine) or the user's files (.txt/.md, .jsonl, Parquet), streamed one document at a time.

A document is an iterable of text pieces: a large text file is one document read in chunks, so it
never has to fit in memory and nothing is put between its chunks."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa

from raytrain_lm.errors import UserError

BUILTIN_CORPORA = ("pydoc", "stdlib")
TEXT_SUFFIXES = (".txt", ".md")


def _pydoc_documents() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _stdlib_documents() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test fixtures are deliberately not UTF-8


def _read_text_file(path: Path, chunk_chars: int = 1 << 20) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            while chunk := f.read(chunk_chars):
                yield chunk
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read corpus file {path}: {e}") from None


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:  # one document per row
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    text = row[text_field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UserError(f"{path}:{lineno}: expected a JSON object with a "
                                    f"{text_field!r} string field") from None
                if not isinstance(text, str):
                    raise UserError(f"{path}:{lineno}: field {text_field!r} is not a string")
                yield text
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read corpus file {path}: {e}") from None


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read corpus file {path}: {e}") from None
    if text_field not in pf.schema_arrow.names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                        f"use --text-column")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and
                   p.suffix in TEXT_SUFFIXES + (".jsonl", ".parquet"))
    if not files:
        raise UserError(f"no .txt, .md, .jsonl or .parquet files under {path}")
    return files


def check_source(source: str) -> list[Path]:
    """The files of a corpus path (empty for a built-in corpus); raises UserError if unusable."""
    if source in BUILTIN_CORPORA:
        return []
    path = Path(source)
    if not path.exists():
        raise UserError(f"corpus not found: {source} (a path, or one of: {', '.join(BUILTIN_CORPORA)})")
    return _files_under(path)


def corpus_source(corpus: str, inputs: list[str]) -> tuple[list[str], str]:
    """(sources, default output folder) of `prepare`: the --input paths in the order given (the
    folder is named after the first), else a built-in corpus."""
    if inputs:
        return list(inputs), str(Path("data") / Path(inputs[0]).stem)
    if corpus not in BUILTIN_CORPORA:
        raise UserError(f"unknown corpus {corpus!r}; choose one of: {', '.join(BUILTIN_CORPORA)}, "
                        f"or pass --input PATH")
    return [corpus], str(Path("data") / corpus)


def iter_documents(source: str, text_field: str = "text") -> Iterator[Iterable[str]]:
    """Documents of a built-in corpus ('pydoc', 'stdlib') or of a file/folder path, each an
    iterable of its text pieces."""
    if source == "pydoc":
        yield from ((doc,) for doc in _pydoc_documents())
        return
    if source == "stdlib":
        yield from ((doc,) for doc in _stdlib_documents())
        return
    for f in check_source(source):
        if f.suffix in TEXT_SUFFIXES:
            yield _read_text_file(f)
        elif f.suffix == ".jsonl":
            yield from ((doc,) for doc in _read_jsonl(f, text_field))
        elif f.suffix == ".parquet":
            yield from ((doc,) for doc in _read_parquet(f, text_field))
        else:
            raise UserError(f"unsupported corpus file {f}: use .txt, .md, .jsonl or .parquet")
