"""`prepare`: a corpus into train/validation token shards."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from raytrain_lm import env
from raytrain_lm.cli.app import app, examples
from raytrain_lm.cli.options import JSON, VERBOSE
from raytrain_lm.console import Progress
from raytrain_lm.errors import UserError

# Below this much input, starting Ray (5-10 s) costs more than tokenizing in this process saves.
RAY_FROM_MB = 16


@app.command(epilog=examples("python cli.py prepare",
                             "python cli.py prepare --corpus stdlib --tokenizer bpe --vocab-size 8192",
                             "python cli.py prepare --input my_texts/ --out data/mine",
                             "python cli.py prepare --input intro.md --input chapters/ --out data/book",
                             "python cli.py prepare --input corpus.jsonl --tokenizer gpt2/tokenizer.json",
                             "python cli.py prepare --input s3://bucket/raw/ --out s3://bucket/data/web "
                             "--address HEAD:6379"))
def prepare(
    corpus: str = typer.Option("pydoc", help="Built-in corpus: pydoc (Python's docs topics, "
                               "~0.47 MB) or stdlib (the standard library's sources, ~30 MB)."),
    input: Optional[List[str]] = typer.Option(None, "--input", "-i", help="Your own corpus "
                                              "instead: a .txt/.md/.jsonl/.parquet file or a folder "
                                              "of them, local or s3://... Repeat for several: read "
                                              "in the order given; the default --out is named "
                                              "after the first."),
    out: Optional[str] = typer.Option(None, help="Dataset folder, or s3://... / gs://... to write "
                                     "it straight to shared storage [default: data/<corpus>]."),
    tokenizer: str = typer.Option("byte", help="byte (UTF-8 bytes, vocab 256), bpe (a byte-level "
                                  "BPE trained here on the corpus), or the path of a "
                                  "tokenizer.json (GPT-2's, your own; or a folder holding one: "
                                  "a release's, whose documents get its own special tokens)."),
    vocab_size: Optional[int] = typer.Option(None, help="--tokenizer bpe: tokens in the "
                                             "vocabulary, at least 257 [default: 8192]."),
    tokenizer_sample_mb: float = typer.Option(100.0, help="--tokenizer bpe: train it on at most "
                                              "this many MB, sampled across the corpus."),
    text_column: str = typer.Option("text", help="Field of .jsonl rows / column of Parquet files."),
    val_every: int = typer.Option(20, help="Every Nth block of 2048 tokens goes to validation."),
    shard_tokens: int = typer.Option(1 << 24, help="Tokens per shard file."),
    ray: Optional[bool] = typer.Option(None, "--ray/--no-ray", help="Tokenize in parallel Ray "
                                       f"tasks [default: with --address, an s3:// "
                                       f"input, or more than {RAY_FROM_MB} MB of input]."),
    address: Optional[str] = typer.Option(None, help="Ray cluster to tokenize on [default: "
                                          "RAY_ADDRESS, else a local Ray]."),
    cpus: Optional[int] = typer.Option(None, help="Tokenizing tasks (--ray) or threads "
                                       "(--no-ray) at once [default: one per CPU of the cluster, "
                                       "or of this machine]."),
    force: bool = typer.Option(False, help="Overwrite an existing dataset."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    as_json: bool = JSON,
    verbose: bool = VERBOSE,
) -> None:
    """Tokenize a corpus into train/validation token shards (byte-level or BPE tokenizer)."""
    from raytrain_lm.data.prepare import check_prepare, prepare_dataset
    from raytrain_lm.data.sources import corpus_source, input_megabytes

    if cpus is not None and cpus < 1:
        raise UserError(f"--cpus must be at least 1, got {cpus}")
    sources, default_out = corpus_source(corpus, list(input or []))
    out = out or default_out
    settings = dict(tokenizer=tokenizer, vocab_size=vocab_size, tokenizer_sample_mb=tokenizer_sample_mb,
                    val_every=val_every, shard_tokens=shard_tokens, force=force)
    check_prepare(sources, out, **settings)  # before Ray starts: a bad input costs a second
    address = address or env.ray_address()
    if ray is None:
        ray = bool(address) or any("://" in s for s in sources) or \
            input_megabytes(sources) > RAY_FROM_MB

    def say(m: str) -> None:
        if not (quiet or as_json):
            typer.echo(m, err=True)

    started = False
    if ray:
        from raytrain_lm.cluster.connect import connect_ray

        started = connect_ray(address, cpus or 1, verbose)
        say(f"tokenizing in Ray tasks ({'a local Ray' if started else address})")
    progress = Progress(enabled=not (quiet or as_json))
    try:
        manifest = prepare_dataset(sources, out, text_field=text_column, use_ray=ray, cpus=cpus,
                                   progress=lambda n: progress.show(f"tokenized {n / 1e6:.1f}M tokens"),
                                   **settings)
    finally:
        progress.done()
        if started:
            import ray as ray_

            ray_.shutdown()
    if as_json:
        typer.echo(json.dumps(manifest, indent=2))
    elif not quiet:
        tok = manifest["tokenizer"]
        typer.echo(f"prepared {out}: {manifest['train']['tokens']:,} train + "
                   f"{manifest['val']['tokens']:,} validation tokens ({tok['type']} tokenizer, "
                   f"vocab {manifest['vocab_size']}, "
                   f"{manifest['train']['bytes'] / manifest['train']['tokens']:.2f} bytes/token)")
        if "documents" in manifest:  # a release's wrap, read from its folder
            wrap = manifest["documents"]
            typer.echo(f"each document: {' '.join(wrap['begin'] + ['...'] + wrap['end'])}")

