"""`runs`, `report`, `generate`, `export`, `evaluate`: looking at what training left behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from raytrain_lm.cli.app import app, examples
from raytrain_lm.cli.options import JSON, STORAGE
from raytrain_lm.config.checks import check_sampling
from raytrain_lm.console import paint
from raytrain_lm.errors import UserError
from raytrain_lm.results.tables import build_report, compare_table, results_table, runs_table


def warn(line: str) -> None:
    """A line on stderr that a command goes on after (an invalid newer checkpoint skipped)."""
    typer.echo(paint(f"warning: {line}", "yellow", sys.stderr), err=True)


MODEL_ARG = typer.Argument(..., metavar="RUN|CHECKPOINT", help="Run name (in --storage), run "
                           "folder, or checkpoint folder.")
BEST = typer.Option(False, "--best", help="The run's best checkpoint (best_checkpoint/: the lowest "
                    "validation loss) instead of its latest.")


@app.command("runs", epilog=examples("python cli.py runs",
                                     "python cli.py runs --storage s3://bucket/runs --json",
                                     "python cli.py runs -q   # names only, one per line"))
def runs_(
    storage: str = STORAGE,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the run names."),
    as_json: bool = JSON,
) -> None:
    """List the runs in --storage: status, steps, final val loss, tokens/s, date."""
    from raytrain_lm.store.runs import list_runs

    found = list_runs(storage)
    if as_json:
        typer.echo(json.dumps([{k: v for k, v in r.items() if k != "config"} for r in found], indent=2))
    elif quiet:
        for r in found:
            typer.echo(r["name"])
    elif not found:
        typer.echo(f"no runs in {storage} (start one with `python cli.py train`)")
    else:
        typer.echo(runs_table(found, paint=paint))


@app.command(epilog=examples("python cli.py report tiny-20261130-075850",
                             "python cli.py report runs/tiny-20261130-075850 --json",
                             "python cli.py report base --compare wide deep --out compare.png"))
def report(
    run: str = typer.Argument(..., help="Run name (in --storage) or run folder."),
    compare: Optional[List[str]] = typer.Option(None, "--compare", help="More runs to overlay "
                                                "(repeat, or list them after one --compare)."),
    out: Optional[str] = typer.Option(None, help="Write the PNG here, a local file [default: "
                                      "report.png in the run's folder; compare.png with --compare]."),
    force: bool = typer.Option(False, help="Replace --out if it is a figure report wrote before "
                               "(nothing else is replaced)."),
    storage: str = STORAGE,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the PNG's path."),
    as_json: bool = JSON,
) -> None:
    """A run's results table and a PNG of its curves (train/val loss, tokens/s, learning rate)."""
    rep = build_report([run, *(compare or [])], storage, out=out, force=force)
    if as_json:
        typer.echo(json.dumps(rep, indent=2, default=str))
        return
    if not quiet:
        runs = rep["runs"]
        typer.echo(results_table(runs[0]) if len(runs) == 1 else compare_table(runs))
    typer.echo(rep["plot"] if quiet else f"plot: {rep['plot']}")


@app.command(epilog=examples("python cli.py generate tiny-20261130-075850 --prompt 'The list type'",
                             "python cli.py generate my-run --best --temperature 0 --max-new-tokens 100",
                             "python cli.py generate runs/my-run/checkpoint_00000300 --prompt 'def ' --seed 7",
                             "python cli.py generate my-run --prompt 'import' --json"))
def generate(
    model: str = MODEL_ARG,
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue [default: start of a line]."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n",
                                       help="Tokens to sample (bytes, for the byte tokenizer)."),
    temperature: float = typer.Option(0.8, help="Softmax temperature; 0 always takes the likeliest token."),
    top_k: int = typer.Option(40, help="Sample among the k likeliest tokens; 0: among all."),
    seed: int = typer.Option(0, help="Random seed: the same seed gives the same text on the same device."),
    best: bool = BEST,
    device: str = typer.Option("auto", help="auto (a GPU if there is one), cpu, cuda, cuda:N."),
    storage: str = STORAGE,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the generated text (no prompt, no stats)."),
    as_json: bool = typer.Option(False, "--json", help="Print text, token ids and stats as JSON at the end."),
) -> None:
    """Sample text from a run's latest (or best) checkpoint, streaming it as it comes (KV cache)."""
    from raytrain_lm.store.runs import find_checkpoint

    check_sampling(max_new_tokens, temperature, top_k or None)
    if device not in ("auto", "cpu"):  # torch is only needed to check the others (~3 s to import)
        from raytrain_lm.results.generate import pick_device  # torch: generate loads the model here

        pick_device(device)  # a bad --device fails before a checkpoint is fetched
    found = find_checkpoint(model, storage, best=best, say=warn)
    from raytrain_lm.results.generate import generate_text  # torch: generate loads the model here

    def info(m: str) -> None:
        if not (quiet or as_json):
            typer.echo(paint(m, "dim", sys.stderr), err=True)

    val = f", val loss {found.val_loss:.4f}" if found.val_loss is not None else ""
    info(f"checkpoint {found.source} (step {found.step}{val})")
    stream = not as_json
    if stream and not quiet:
        typer.echo(paint(prompt, "bold"), nl=False)

    def on_text(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        res = generate_text(found.path, prompt, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k or None, seed=seed, device=device,
                            on_text=on_text if stream else None, meta=found.meta)
    finally:
        found.cleanup()
    res.update(checkpoint=found.source, step=found.step)
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    typer.echo("")
    info(f"{res['tokens']} tokens in {res['seconds']:.2f} s ({res['tokens_per_second']:,.0f} tokens/s, "
         f"{res['device']}, seed {seed})")


@app.command(epilog=examples("python cli.py export tiny-20261130-075850 --out export/tiny",
                             "python cli.py export my-run --best --out export/best --force",
                             "python cli.py export my-run --format hf --out hf/my-run   # transformers",
                             "python cli.py export runs/my-run/checkpoint_00000200 --out export/step200 --json"))
def export(
    model: str = MODEL_ARG,
    out: str = typer.Option(..., help="Local folder to write the model into."),
    format: str = typer.Option("native", "--format", help="native: model.safetensors + "
                               "config.json for plain PyTorch and models/; hf: a Hugging Face "
                               "folder of the model's own class (GPT2LMHeadModel, "
                               "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                               "MistralForCausalLM), which AutoModelForCausalLM and "
                               "AutoTokenizer load."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="hf: the weights' dtype, bf16 (as "
                                        "the Hub's) or fp32 (exactly the checkpoint's) [default: bf16]."),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="hf: the largest "
                                                 "weight file, e.g. 5GB, 500MB, 2GiB; a larger model "
                                                 "is split into shards named by "
                                                 "model.safetensors.index.json [default: 5GB]."),
    best: bool = BEST,
    force: bool = typer.Option(False, help="Replace --out if it exists."),
    storage: str = STORAGE,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    as_json: bool = typer.Option(False, "--json", help="Print config.json's content and the files as JSON."),
) -> None:
    """Write a checkpoint's weights: safetensors + config JSON (plain PyTorch), or `--format hf`
    for Hugging Face transformers. A BPE's tokenizer.json goes along."""
    from raytrain_lm.results.export import (
        DEFAULT_MAX_SHARD,
        FORMATS,
        check_dtype_name,
        check_out,
        export_checkpoint,
        parse_size,
    )
    from raytrain_lm.store.runs import find_checkpoint

    if format not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format == "hf":
        dtype, max_shard_size = dtype or "bf16", max_shard_size or DEFAULT_MAX_SHARD
        check_dtype_name(dtype)
        parse_size(max_shard_size)
    elif dtype or max_shard_size:
        raise UserError("--dtype and --max-shard-size are for --format hf (native keeps the "
                        "checkpoint's fp32 in one file)")
    check_out(out, force)  # before a checkpoint is looked for or copied
    out = Path(out)
    found = find_checkpoint(model, storage, best=best, say=warn)
    try:
        if format == "hf":
            # torch: the export reads the checkpoint's tensors
            from raytrain_lm.results.hf_export import export_checkpoint_hf

            say = None if quiet or as_json else (lambda m: typer.echo(paint(m, "dim", sys.stderr), err=True))
            config = export_checkpoint_hf(found.path, out, force=force, meta=found.meta, dtype=dtype,
                                          max_shard_size=max_shard_size, say=say)
        else:
            config = export_checkpoint(found.path, out, source=found.source, force=force, meta=found.meta)
    finally:
        found.cleanup()
    files = sorted(str(p) for p in out.iterdir())
    if as_json:
        typer.echo(json.dumps({"files": files, **{k: v for k, v in config.items() if k != "train_config"}},
                              indent=2))
    elif not quiet:
        params = f"{config['num_parameters']:,} parameters, " if "num_parameters" in config else ""
        dtype = config.get("dtype") or config.get("torch_dtype")  # a release's config.json: the latter
        typer.echo(f"exported step {config['step']} of {found.source} ({params}{dtype}, "
                   f"{format} format) to {out}: {', '.join(Path(f).name for f in files)}")


@app.command(epilog=examples("python cli.py evaluate my-run --tasks hellaswag,arc_easy",
                             "python cli.py evaluate my-run --best --tasks lambada_openai --limit 500",
                             "python cli.py evaluate runs/my-run/checkpoint_00000200 --tasks my_task "
                             "--include-path tasks/",
                             "python cli.py evaluate hf/my-run --tasks arc_easy --device cuda --json"))
def evaluate(
    model: str = typer.Argument(..., metavar="RUN|CHECKPOINT|HF_FOLDER", help="Run name (in "
                                "--storage), run folder, checkpoint folder, or a Hugging Face "
                                "model folder (`export --format hf`)."),
    tasks: str = typer.Option(..., help="lm-evaluation-harness tasks, comma-separated (hellaswag,"
                              "arc_easy, ...: their data comes from the Hugging Face Hub)."),
    include_path: Optional[Path] = typer.Option(None, help="A folder of task YAML files of your own "
                                                "(lm-eval's --include_path): local data, no Hub. "
                                                "A task folder is code, like a script you run: "
                                                "its YAML runs Python (!function) and its "
                                                "templates are not sandboxed; use only your own."),
    limit: Optional[float] = typer.Option(None, help="Examples per task (a fraction if < 1) "
                                          "[default: all]."),
    batch_size: int = typer.Option(8, help="Sequences per forward pass."),
    num_fewshot: Optional[int] = typer.Option(None, help="Examples in each prompt [default: the task's]."),
    device: str = typer.Option("cpu", help="Where the model runs: cpu, cuda, cuda:1, ..."),
    best: bool = BEST,
    storage: str = STORAGE,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the scores."),
    as_json: bool = typer.Option(False, "--json", help="Print the scores as JSON."),
) -> None:
    """Score a model with lm-evaluation-harness (its `hf` model on an export made on the fly);
    for a run: eval/<task>.json, its summary table, and its tracking runs (train --track)."""
    from raytrain_lm.results.evaluate import check_tasks
    from raytrain_lm.results.evaluate import evaluate as run_evaluation

    names = check_tasks(tasks, str(include_path) if include_path else None)
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if limit is not None and not limit > 0:
        raise UserError(f"--limit must be positive, got {limit}")
    say = (lambda m: typer.echo(m, err=True)) if as_json else ((lambda m: None) if quiet else typer.echo)
    done = run_evaluation(model, names, storage=storage, best=best,
                          include_path=str(include_path) if include_path else None, limit=limit,
                          batch_size=batch_size, num_fewshot=num_fewshot, device=device, say=say)
    if as_json:
        typer.echo(json.dumps({"model": done.model, "step": done.step, "scores": done.scores,
                               "files": done.written}, indent=2))
        return
    for task, metrics in done.scores.items():
        typer.echo(f"  {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                             if not k.endswith("_stderr")))
    if done.written and not quiet:
        typer.echo(f"results: {', '.join(done.written)} (and the run's summary.json)")
