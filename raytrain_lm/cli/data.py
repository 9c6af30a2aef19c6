"""`prepare`: a corpus into train/validation token shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from raytrain_lm.cli.app import app, examples
from raytrain_lm.cli.options import JSON
from raytrain_lm.console import Progress


@app.command(epilog=examples("python cli.py prepare",
                             "python cli.py prepare --corpus stdlib --out data/stdlib",
                             "python cli.py prepare --input my_texts/ --out data/mine",
                             "python cli.py prepare --input intro.md --input chapters/ --out data/book",
                             "python cli.py prepare --out s3://my-bucket/data/pydoc"))
def prepare(
    corpus: str = typer.Option("pydoc", help="Built-in corpus: pydoc (Python's docs topics, "
                               "~0.47 MB) or stdlib (the standard library's sources, ~30 MB)."),
    input: Optional[List[Path]] = typer.Option(None, "--input", "-i", help="Your own corpus "
                                               "instead: a .txt/.md/.jsonl/.parquet file or a folder "
                                               "of them. Repeat for several: read in the order "
                                               "given; the default --out is named after the first."),
    out: Optional[str] = typer.Option(None, help="Dataset folder, or s3://... / gs://... to upload "
                                     "it to shared storage [default: data/<corpus>]."),
    text_column: str = typer.Option("text", help="Field of .jsonl rows / column of Parquet files."),
    val_every: int = typer.Option(20, help="Every Nth block of 2048 tokens goes to validation."),
    force: bool = typer.Option(False, help="Overwrite an existing dataset folder."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    as_json: bool = JSON,
) -> None:
    """Tokenize a corpus into train/validation token shards (byte-level tokenizer)."""
    from raytrain_lm.data.prepare import prepare_dataset
    from raytrain_lm.data.sources import corpus_source

    sources, default_out = corpus_source(corpus, [str(p) for p in input or []])
    out = out or default_out
    progress = Progress(enabled=not (quiet or as_json))
    manifest = prepare_dataset(sources, out, text_field=text_column, val_every=val_every,
                               force=force, progress=lambda n: progress.show(
                                   f"tokenized {n / 1e6:.1f}M tokens"))
    progress.done()
    if as_json:
        typer.echo(json.dumps(manifest, indent=2))
    elif not quiet:
        typer.echo(f"prepared {out}: {manifest['train']['tokens']:,} train + "
                   f"{manifest['val']['tokens']:,} validation tokens ({manifest['tokenizer']['type']} "
                   f"tokenizer, vocab {manifest['vocab_size']})")
