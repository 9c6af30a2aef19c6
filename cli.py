#!/usr/bin/env python
"""raytrain-lm: pretrain GPT-style language models with Ray Train.

The CLI parses, calls the library and prints; no logic lives only here.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from raytrain_lm.errors import UserError

app = typer.Typer(
    help="Pretrain GPT-style language models on N workers with Ray Train.\n\n"
         "Quick start: `python cli.py train` prepares the built-in corpus and trains the tiny "
         "preset on 2 CPU workers.",
    epilog="A session:\n\n  python cli.py train --max-steps 300 --name first\n\n"
           "  python cli.py runs\n\n  python cli.py report first\n\n"
           "  python cli.py generate first --prompt 'The list type'\n\n"
           "  python cli.py export first --out export/first\n\n"
           "Every command: python cli.py COMMAND --help.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _echo(msg: str, quiet: bool = False) -> None:
    if not quiet:
        typer.echo(msg)


@app.command(epilog="Examples:\n\n  python cli.py prepare\n\n"
                    "  python cli.py prepare --corpus stdlib --out data/stdlib\n\n"
                    "  python cli.py prepare --input my_texts/ --out data/mine\n\n"
                    "  python cli.py prepare --out s3://my-bucket/data/pydoc")
def prepare(
    corpus: str = typer.Option("pydoc", help="Built-in corpus: pydoc (Python's docs topics, "
                               "~0.47 MB) or stdlib (the standard library's sources, ~30 MB)."),
    input: Optional[List[Path]] = typer.Option(None, "--input", "-i", help="Your own corpus "
                                               "instead: a .txt/.md/.jsonl/.parquet file or a folder "
                                               "of them. Repeat for several."),
    out: Optional[str] = typer.Option(None, help="Dataset folder, or s3://... / gs://... to upload "
                                     "it to shared storage [default: data/<corpus>]."),
    text_column: str = typer.Option("text", help="Field of .jsonl rows / column of Parquet files."),
    val_every: int = typer.Option(20, help="Every Nth block of 2048 tokens goes to validation."),
    force: bool = typer.Option(False, help="Overwrite an existing dataset folder."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Tokenize a corpus into train/validation token shards (byte-level tokenizer)."""
    from raytrain_lm.data import BUILTIN_CORPORA, prepare_dataset

    if input:
        if len(input) > 1:
            raise UserError("give one --input path (a folder may hold many files)")
        source = str(input[0])
        default_out = Path("data") / input[0].stem
    else:
        if corpus not in BUILTIN_CORPORA:
            raise UserError(f"unknown corpus {corpus!r}; choose one of: {', '.join(BUILTIN_CORPORA)}, "
                            f"or pass --input PATH")
        source = corpus
        default_out = Path("data") / corpus
    out = out or str(default_out)
    tty = sys.stdout.isatty() and not quiet and not as_json
    last = [0.0]

    def progress(tokens: int) -> None:
        if tty and time.time() - last[0] > 0.5:
            last[0] = time.time()
            typer.echo(f"\r  tokenized {tokens / 1e6:.1f}M tokens", nl=False)

    manifest = prepare_dataset(source, out, text_field=text_column, val_every=val_every,
                               force=force, progress=progress)
    if tty:
        typer.echo("\r", nl=False)
    if as_json:
        typer.echo(json.dumps(manifest, indent=2))
        return
    _echo(f"prepared {out}: {manifest['train']['tokens']:,} train + {manifest['val']['tokens']:,} "
          f"validation tokens ({manifest['tokenizer']['type']} tokenizer, vocab "
          f"{manifest['vocab_size']})", quiet)


@app.command(epilog="Examples:\n\n  python cli.py train\n\n"
                    "  python cli.py train --workers 2 --max-steps 300 --preset tiny\n\n"
                    "  python cli.py train --workers 8 --use-gpu --preset gpt2 --data data/stdlib\n\n"
                    "  python cli.py train --config best.yaml --set model.dropout=0.1\n\n"
                    "  python cli.py train --config best.yaml --workers 8 --scale-lr sqrt\n\n"
                    "  python cli.py train --name my-run --resume")
def train(
    workers: Optional[int] = typer.Option(None, help="Ray Train workers (one process each) [default: 2]."),
    use_gpu: Optional[bool] = typer.Option(None, "--use-gpu/--no-use-gpu", help="One GPU per worker, NCCL."),
    preset: Optional[str] = typer.Option(None, help="Model preset: tiny, small, gpt2, gpt2-medium [default: tiny]."),
    data: Optional[str] = typer.Option(None, help="Prepared dataset: a folder or s3://... / gs://... [default: data/pydoc, prepared if missing]."),
    max_steps: Optional[int] = typer.Option(None, help="Optimizer steps [default: 300]."),
    batch_size: Optional[int] = typer.Option(None, help="Sequences per worker per micro-step."),
    seq_len: Optional[int] = typer.Option(None, help="Tokens per sequence (<= model.block_size)."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate (after warmup)."),
    grad_accum: Optional[int] = typer.Option(None, help="Micro-steps per optimizer step."),
    log_every: Optional[int] = typer.Option(None, help="Steps between metric reports [default: 10]."),
    eval_every: Optional[int] = typer.Option(None, help="Steps between validations [default: 100]."),
    checkpoint_every: Optional[int] = typer.Option(None, help="Steps between checkpoints; 0: only at the end."),
    keep_checkpoints: Optional[int] = typer.Option(None, help="Checkpoints to keep [default: 2]."),
    max_failures: Optional[int] = typer.Option(None, help="Worker-group restarts allowed [default: 0]."),
    seed: Optional[int] = typer.Option(None, help="Random seed [default: 1337]."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the model."),
    strategy: Optional[str] = typer.Option(None, help="ddp (a full replica per worker) or fsdp (FSDP2: shard parameters, gradients, optimizer state) [default: ddp]."),
    activation_checkpointing: Optional[str] = typer.Option(None, help="Recompute activations in backward: none, full or selective [default: none]."),
    precision: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (with a gradient scaler) [default: bf16 on GPU, fp32 on CPU]."),
    force: bool = typer.Option(False, help="Launch even if the memory plan says it will not fit."),
    name: Optional[str] = typer.Option(None, help="Run name [default: <preset>-<date>-<time>]."),
    storage: Optional[str] = typer.Option(None, help="Where runs live: a folder or s3://... [default: runs]."),
    address: Optional[str] = typer.Option(None, help="Ray cluster to use [default: RAY_ADDRESS, else start a local one]."),
    scale_timeout: Optional[float] = typer.Option(None, help="Seconds to wait for an autoscaler to add the nodes training needs [default: 900]."),
    config: Optional[Path] = typer.Option(None, help="YAML/TOML/JSON file of settings."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override any setting: key=value, e.g. model.n_layer=6."),
    resume: bool = typer.Option(False, help="Continue the run --name from its latest checkpoint."),
    init_from: Optional[Path] = typer.Option(None, help="Start from this checkpoint's weights (fresh optimizer)."),
    scale_lr: str = typer.Option("none", help="Scale lr to this run's global batch from the one it was "
                                 "chosen at (ref_batch_tokens): none, linear or sqrt (recommended for AdamW)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's logs and full tracebacks."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines, only the result."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON (nothing else on stdout)."),
) -> None:
    """Train a GPT model with Ray Train (DDP over gloo on CPU, NCCL on GPU)."""
    from raytrain_lm.config import TrainConfig, build_config
    from raytrain_lm.launch import run_training, saved_config
    from raytrain_lm.report import progress_line, results_table

    flags = dict(workers=workers, use_gpu=use_gpu, preset=preset, data=data, max_steps=max_steps,
                 batch_size=batch_size, seq_len=seq_len, lr=lr, grad_accum=grad_accum,
                 log_every=log_every, eval_every=eval_every, checkpoint_every=checkpoint_every,
                 keep_checkpoints=keep_checkpoints, max_failures=max_failures, seed=seed,
                 compile=compile, name=name, storage=storage, address=address, strategy=strategy,
                 activation_checkpointing=activation_checkpointing, precision=precision,
                 scale_timeout=scale_timeout)
    base = None
    if resume:
        if not name:
            raise UserError("--resume needs --name of the run to continue")
        base = saved_config(storage or TrainConfig.storage, name)
    cfg = build_config(preset=preset, config_file=str(config) if config else None, flags=flags,
                       sets=set_, base=base)
    quiet = quiet or as_json
    say = (lambda m: typer.echo(m, err=True)) if as_json else (lambda m: _echo(m, quiet))
    from raytrain_lm.lr_scaling import apply_lr_scaling

    scaled = apply_lr_scaling(cfg, scale_lr)
    if scaled:
        say(scaled)
    summary = run_training(
        cfg, resume=resume, init_from=str(init_from) if init_from else None, verbose=verbose,
        force=force, say=say, on_metrics=None if quiet else lambda row: typer.echo(progress_line(row, cfg.max_steps)),
    )
    if as_json:
        typer.echo(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
        return
    typer.echo(results_table(summary))
    typer.echo(f"results: {summary['run_dir']}/summary.json, metrics.jsonl")


@app.command(epilog="Examples:\n\n  python cli.py plan --preset gpt2 --workers 8\n\n"
                    "  python cli.py plan --preset gpt-70b --workers 64 --gpu-memory-gb 80\n\n"
                    "  python cli.py plan --preset small --set model.n_layer=24 --batch-size 32")
def plan(
    preset: str = typer.Option("gpt2", help="Model preset (any field overridable with --set)."),
    workers: int = typer.Option(8, help="Data-parallel workers."),
    gpu_memory_gb: float = typer.Option(80.0, help="Memory per GPU, GB."),
    batch_size: Optional[int] = typer.Option(None, help="Micro-batch per worker [default: preset's]."),
    seq_len: Optional[int] = typer.Option(None, help="Tokens per sequence [default: preset's]."),
    grad_accum: int = typer.Option(1, help="Micro-steps per optimizer step."),
    cpu: bool = typer.Option(False, help="Plan for CPU workers (fp32 activations)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a setting, e.g. model.n_layer=48."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Per-worker memory for each strategy and activation checkpointing, and what fits."""
    from dataclasses import asdict

    from raytrain_lm.config import build_config
    from raytrain_lm.plan import GB, all_plans, format_plans, param_counts, recommend

    flags = {"batch_size": batch_size, "seq_len": seq_len, "workers": workers}
    cfg = build_config(preset=preset, flags=flags, sets=set_)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = 256  # the byte-level tokenizer's
    if gpu_memory_gb <= 0:
        raise UserError("--gpu-memory-gb must be positive")
    n = param_counts(cfg.model)["total"]
    plans = all_plans(cfg.model, workers, cfg.batch_size, cfg.seq_len, gpu=not cpu)
    best = recommend(cfg.model, workers, cfg.batch_size, grad_accum, cfg.seq_len, gpu_memory_gb,
                     gpu=not cpu)
    if as_json:
        typer.echo(json.dumps({"parameters": n, "plans": [asdict(p) | {"total": p.total} for p in plans],
                               "recommendation": None if best is None else
                               {**asdict(best[0]), "grad_accum": best[1]}}, indent=2))
        return
    typer.echo(f"{cfg.preset}: {n / 1e9:.3f}B parameters; fp32 parameters alone {4 * n / GB:.1f} GB, "
               f"with gradients and AdamW states {16 * n / GB:.1f} GB")
    typer.echo(f"per worker, GB, {workers} workers, micro-batch {cfg.batch_size} x {cfg.seq_len} "
               f"tokens, {'fp32' if cpu else 'bf16'} activations, {gpu_memory_gb:g} GB per "
               f"{'worker' if cpu else 'GPU'} (90% usable):")
    typer.echo(format_plans(plans, gpu_memory_gb))
    if best is None:
        typer.echo("recommendation: does not fit at any micro-batch; add workers or shrink the model")
    else:
        p, accum = best
        typer.echo(f"recommendation: --strategy {p.strategy} --activation-checkpointing "
                   f"{p.activation_checkpointing} --batch-size {p.micro_batch} --grad-accum {accum} "
                   f"(~{p.total / GB:.1f} GB per worker)")
    typer.echo("assumptions: see raytrain_lm/plan.py (fp32 master weights and AdamW states, "
               "bf16 activations on GPU, fused attention)")


# The same default as `train` (TrainConfig.storage): RAYTRAIN_LM_STORAGE, else ./runs.
STORAGE_OPT = typer.Option("runs", envvar="RAYTRAIN_LM_STORAGE",
                           help="Where runs live: a folder or s3://...")


@app.command("runs", epilog="Examples:\n\n  python cli.py runs\n\n"
                            "  python cli.py runs --storage s3://bucket/runs --json\n\n"
                            "  python cli.py runs -q   # names only, one per line")
def runs_(
    storage: str = STORAGE_OPT,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the run names."),
    as_json: bool = typer.Option(False, "--json", help="Print the runs as a JSON list."),
) -> None:
    """List the runs in --storage: status, steps, final val loss, tokens/s, date."""
    from raytrain_lm.console import paint
    from raytrain_lm.report import runs_table
    from raytrain_lm.runs import list_runs

    found = list_runs(storage)
    if as_json:
        typer.echo(json.dumps([{k: v for k, v in r.items() if k != "config"} for r in found], indent=2))
        return
    if quiet:
        for r in found:
            typer.echo(r["name"])
        return
    if not found:
        typer.echo(f"no runs in {storage} (start one with `python cli.py train`)")
        return
    typer.echo(runs_table(found, paint=paint))


@app.command(epilog="Examples:\n\n  python cli.py report tiny-20261130-075850\n\n"
                    "  python cli.py report runs/tiny-20261130-075850 --json\n\n"
                    "  python cli.py report base --compare wide deep --out compare.png")
def report(
    run: str = typer.Argument(..., help="Run name (in --storage) or run folder."),
    compare: Optional[List[str]] = typer.Option(None, "--compare", help="More runs to overlay "
                                                "(repeat, or list them after one --compare)."),
    out: Optional[Path] = typer.Option(None, help="Write the PNG here [default: report.png in the "
                                       "run's folder; compare.png with --compare]."),
    storage: str = STORAGE_OPT,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the PNG's path."),
    as_json: bool = typer.Option(False, "--json", help="Print the summaries and the PNG's path as JSON."),
) -> None:
    """A run's results table and a PNG of its curves (train/val loss, tokens/s, learning rate)."""
    from raytrain_lm.report import build_report, compare_table, results_table

    refs = [run, *(compare or [])]
    rep = build_report(refs, storage, out=str(out) if out else None)
    if as_json:
        typer.echo(json.dumps(rep, indent=2, default=str))
        return
    if not quiet:
        runs = rep["runs"]
        typer.echo(results_table(runs[0]) if len(runs) == 1 else compare_table(runs))
    typer.echo(rep["plot"] if quiet else f"plot: {rep['plot']}")


@app.command(epilog="Examples:\n\n  python cli.py generate tiny-20261130-075850 --prompt 'The list type'\n\n"
                    "  python cli.py generate my-run --best --temperature 0 --max-new-tokens 100\n\n"
                    "  python cli.py generate runs/my-run/checkpoint_00000300 --prompt 'def ' --seed 7\n\n"
                    "  python cli.py generate my-run --prompt 'import' --json")
def generate(
    model: str = typer.Argument(..., metavar="RUN|CHECKPOINT", help="Run name (in --storage), run "
                                "folder, or checkpoint folder."),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue [default: start of a line]."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", help="Tokens to sample (bytes, for the byte tokenizer)."),
    temperature: float = typer.Option(0.8, help="Softmax temperature; 0 always takes the likeliest token."),
    top_k: int = typer.Option(40, help="Sample among the k likeliest tokens; 0: among all."),
    seed: int = typer.Option(0, help="Random seed: the same seed gives the same text on the same device."),
    best: bool = typer.Option(False, "--best", help="The checkpoint with the lowest validation loss "
                              "instead of the latest."),
    device: str = typer.Option("auto", help="auto (a GPU if there is one), cpu, cuda, cuda:N."),
    storage: str = STORAGE_OPT,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the generated text (no prompt, no stats)."),
    as_json: bool = typer.Option(False, "--json", help="Print text, token ids and stats as JSON at the end."),
) -> None:
    """Sample text from a run's latest (or best) checkpoint, streaming it as it comes (KV cache)."""
    from raytrain_lm.console import paint
    from raytrain_lm.generate import check_sampling, generate_text, pick_device
    from raytrain_lm.runs import choose_checkpoint

    check_sampling(max_new_tokens, temperature, top_k or None)
    pick_device(device)  # a bad --device fails before any loading
    chosen = choose_checkpoint(model, storage, best=best)
    info = lambda m: None if (quiet or as_json) else typer.echo(paint(m, "dim", sys.stderr), err=True)  # noqa: E731
    val = f", val loss {chosen.val_loss:.4f}" if chosen.val_loss is not None else ""
    info(f"checkpoint {chosen.source} (step {chosen.step}{val})")
    stream = not as_json
    if stream and not quiet:
        typer.echo(paint(prompt, "bold"), nl=False)

    def on_text(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    res = generate_text(chosen.path, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k or None, seed=seed, device=device,
                        on_text=on_text if stream else None, meta=chosen.meta)
    res.update(checkpoint=chosen.source, step=chosen.step)
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    typer.echo("")
    info(f"{res['tokens']} tokens in {res['seconds']:.2f} s ({res['tokens_per_second']:,.0f} tokens/s, "
         f"{res['device']}, seed {seed})")


@app.command(epilog="Examples:\n\n  python cli.py export tiny-20261130-075850 --out export/tiny\n\n"
                    "  python cli.py export my-run --best --out export/best --force\n\n"
                    "  python cli.py export runs/my-run/checkpoint_00000200 --out export/step200 --json")
def export(
    model: str = typer.Argument(..., metavar="RUN|CHECKPOINT", help="Run name (in --storage), run "
                                "folder, or checkpoint folder."),
    out: Path = typer.Option(..., help="Folder to write model.safetensors and config.json into."),
    best: bool = typer.Option(False, "--best", help="The checkpoint with the lowest validation loss "
                              "instead of the latest."),
    force: bool = typer.Option(False, help="Replace --out if it exists."),
    storage: str = STORAGE_OPT,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    as_json: bool = typer.Option(False, "--json", help="Print config.json's content and the files as JSON."),
) -> None:
    """Write a checkpoint's weights as safetensors plus a config JSON (loadable with plain PyTorch)."""
    from raytrain_lm.export import CONFIG, WEIGHTS, export_checkpoint
    from raytrain_lm.runs import choose_checkpoint

    chosen = choose_checkpoint(model, storage, best=best)
    config = export_checkpoint(chosen.path, out, source=chosen.source, force=force,
                               meta=chosen.meta)
    files = {"weights": str(out / WEIGHTS), "config": str(out / CONFIG)}
    if as_json:
        typer.echo(json.dumps({**files, **{k: v for k, v in config.items() if k != "train_config"}}, indent=2))
        return
    _echo(f"exported step {config['step']} of {chosen.source} ({config['num_parameters']:,} parameters, "
          f"{config['dtype']}) to {files['weights']} and {files['config']}", quiet)


@app.command(epilog="Examples:\n\n"
                    "  python cli.py tune --lr 1e-4:1e-2 --trials 8 --max-steps 300\n\n"
                    "  python cli.py tune --search grid --lr 1e-3,3e-3,1e-2 --dropout 0,0.1\n\n"
                    "  python cli.py tune --space-file space.yaml --workers 4 --concurrent 2 "
                    "--grace-steps 50\n\n"
                    "  python cli.py tune --name my-sweep --resume\n\n"
                    "Search space specs: LOW:HIGH is a range (log-uniform for lr, uniform for "
                    "other floats, inclusive for integers), log:LOW:HIGH a log-uniform range, "
                    "A,B,C a list of values. --space takes any setting, e.g. "
                    "--space model.n_head=2,4 --space beta2=0.95,0.99.")
def tune(
    lr: Optional[str] = typer.Option(None, help="Peak learning rate, e.g. 1e-4:1e-2 (log-uniform) or 1e-3,3e-3."),
    warmup: Optional[str] = typer.Option(None, help="Warmup steps, e.g. 0:100 or 0,30,100."),
    weight_decay: Optional[str] = typer.Option(None, help="AdamW weight decay, e.g. 0:0.2 or 0,0.1."),
    batch_size: Optional[str] = typer.Option(None, help="Sequences per worker per micro-step, e.g. 8,16,32."),
    grad_accum: Optional[str] = typer.Option(None, help="Micro-steps per optimizer step, e.g. 1,2,4."),
    dropout: Optional[str] = typer.Option(None, help="Model dropout, e.g. 0:0.2 or 0,0.1."),
    n_layer: Optional[str] = typer.Option(None, help="Model depth, e.g. 2:6 or 4,6."),
    n_embd: Optional[str] = typer.Option(None, help="Model width (a multiple of model.n_head), e.g. 128,192,256."),
    space: Optional[List[str]] = typer.Option(None, "--space", help="Any setting: key=SPEC, e.g. model.n_head=2,4."),
    space_file: Optional[Path] = typer.Option(None, help="YAML/JSON file of key: SPEC (or {loguniform: [a, b]}, ...)."),
    search: str = typer.Option("random", help="Searcher: random (samples --trials points) or grid (every point)."),
    trials: Optional[int] = typer.Option(None, help="Trials for random search [default: 8]."),
    concurrent: int = typer.Option(1, help="Trials at once (more than the cluster holds: the rest queue)."),
    max_steps: Optional[int] = typer.Option(None, help="Steps of a trial that is not stopped (ASHA's max_t)."),
    grace_steps: Optional[int] = typer.Option(None, help="Steps before ASHA may stop a trial [default: max-steps/10]."),
    reduction_factor: int = typer.Option(2, help="ASHA keeps the best 1/N of trials at each rung."),
    eval_every: Optional[int] = typer.Option(None, help="Validation cadence [default: --grace-steps]; must divide --grace-steps."),
    seed: Optional[int] = typer.Option(None, help="Seed of the random searcher."),
    workers: Optional[int] = typer.Option(None, help="Ray Train workers per trial [default: 2]."),
    use_gpu: Optional[bool] = typer.Option(None, "--use-gpu/--no-use-gpu", help="One GPU per worker."),
    preset: Optional[str] = typer.Option(None, help="Model preset the sweep starts from [default: tiny]."),
    data: Optional[str] = typer.Option(None, help="Prepared dataset folder [default: data/pydoc]."),
    config: Optional[Path] = typer.Option(None, help="YAML/TOML/JSON file of fixed settings for every trial."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Fixed setting for every trial: key=value."),
    name: Optional[str] = typer.Option(None, help="Sweep name [default: tune-<preset>-<date>-<time>]."),
    storage: Optional[str] = typer.Option(None, help="Where sweeps live [default: runs]."),
    address: Optional[str] = typer.Option(None, help="Ray cluster [default: RAY_ADDRESS, else a local one]."),
    resume: bool = typer.Option(False, help="Continue the sweep --name after its driver died."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's logs and full tracebacks."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No live table, only the results."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Tune hyperparameters: a Ray Tune sweep of full distributed trainings, ASHA early stopping."""
    from raytrain_lm.config import build_config
    from raytrain_lm.search_space import parse_space
    from raytrain_lm.tune import SweepSettings, check_settings, run_sweep

    specs = {"lr": lr, "warmup_steps": warmup, "weight_decay": weight_decay, "batch_size": batch_size,
             "grad_accum": grad_accum, "model.dropout": dropout, "model.n_layer": n_layer,
             "model.n_embd": n_embd}
    flags = dict(workers=workers, use_gpu=use_gpu, preset=preset, data=data, max_steps=max_steps,
                 eval_every=eval_every, name=name, storage=storage, address=address)
    quiet = quiet or as_json
    say = (lambda m: typer.echo(m, err=True)) if as_json else (lambda m: _echo(m, quiet))
    if resume:
        given = [k for k, v in {**specs, "space": space, "space-file": space_file, "config": config,
                                "set": set_}.items() if v] + [k for k, v in flags.items()
                                                              if v is not None and k not in ("name", "storage", "address")]
        if given:
            raise UserError(f"--resume continues the sweep as it was started; drop {', '.join(given)}")
        cfg = build_config(flags=dict(name=name, storage=storage, address=address))
        sweep_space = settings = None
    else:
        cfg = build_config(preset=preset, config_file=str(config) if config else None, flags=flags,
                           sets=set_)
        sweep_space = parse_space(specs, space or [], str(space_file) if space_file else None, cfg)
        settings = SweepSettings(search=search, trials=trials, concurrent=concurrent,
                                 grace_steps=grace_steps, reduction_factor=reduction_factor, seed=seed)
        check_settings(cfg, sweep_space, settings, eval_every_given=eval_every is not None or any(
            s.strip().startswith("eval_every=") for s in set_ or []))
    tty = sys.stdout.isatty()
    drawn = [0]

    def live(table: str) -> None:
        if tty and drawn[0]:  # redraw in place
            typer.echo(f"\x1b[{drawn[0]}F\x1b[J", nl=False)
        typer.echo(table if tty else table + "\n")
        drawn[0] = table.count("\n") + 1

    summary = run_sweep(cfg, sweep_space, settings, resume=resume, verbose=verbose, say=say,
                        live=None if quiet else live, live_interval=2.0 if tty else 30.0)
    if as_json:
        typer.echo(json.dumps({k: v for k, v in summary.items() if k != "table"}, indent=2, default=str))
        return
    typer.echo(f"\nsweep {summary['name']}: {len(summary['trials'])} trials, "
               f"{sum(t['status'] == 'stopped' for t in summary['trials'])} stopped early by ASHA, "
               f"{summary['wall_seconds']:.0f} s")
    typer.echo(summary["table"])
    if summary["best"]:
        typer.echo(f"best config: {summary['best_config']}   "
                   f"(python cli.py train --config {summary['best_config']})")
    if summary["plot"]:
        typer.echo(f"validation curves: {summary['plot']}")
    typer.echo(f"results: {summary['dir']}/results.json")


@app.command("lr-find", epilog="Examples:\n\n  python cli.py lr-find\n\n"
                               "  python cli.py lr-find --workers 4 --preset small --steps 200\n\n"
                               "  python cli.py lr-find --lr-min 1e-6 --lr-max 1e-1 --set batch_size=32")
def lr_find(
    lr_min: float = typer.Option(1e-5, help="Learning rate of the first step."),
    lr_max: float = typer.Option(1.0, help="Learning rate of the last step."),
    steps: int = typer.Option(100, help="Steps of the test (one loss each)."),
    workers: Optional[int] = typer.Option(None, help="Ray Train workers [default: 2]."),
    use_gpu: Optional[bool] = typer.Option(None, "--use-gpu/--no-use-gpu", help="One GPU per worker."),
    preset: Optional[str] = typer.Option(None, help="Model preset [default: tiny]."),
    data: Optional[str] = typer.Option(None, help="Prepared dataset folder [default: data/pydoc]."),
    config: Optional[Path] = typer.Option(None, help="YAML/TOML/JSON file of settings."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override any setting: key=value."),
    name: Optional[str] = typer.Option(None, help="Run name [default: lrfind-<preset>-<date>-<time>]."),
    storage: Optional[str] = typer.Option(None, help="Where runs live [default: runs]."),
    address: Optional[str] = typer.Option(None, help="Ray cluster [default: RAY_ADDRESS, else a local one]."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's logs and full tracebacks."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines, only the result."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """LR range test: one short training with the learning rate rising exponentially; suggests an lr."""
    from raytrain_lm.config import build_config
    from raytrain_lm.lr_find import check_range, run_lr_find

    check_range(lr_min, lr_max, steps)
    flags = dict(workers=workers, use_gpu=use_gpu, preset=preset, data=data, name=name,
                 storage=storage, address=address)
    cfg = build_config(preset=preset, config_file=str(config) if config else None, flags=flags,
                       sets=set_)
    quiet = quiet or as_json
    say = (lambda m: typer.echo(m, err=True)) if as_json else (lambda m: _echo(m, quiet))

    def progress(row: dict) -> None:  # a row every lr_find.REPORT_EVERY steps, and the last
        typer.echo(f"step {row['step']:>{len(str(steps))}}/{steps} | lr {row['lr']:.2e} | "
                   f"loss {row['step_losses'][-1]:.4f}")  # this step's, at this lr

    found = run_lr_find(cfg, lr_min, lr_max, steps, verbose=verbose, say=say,
                        on_metrics=None if quiet else progress)
    if as_json:
        typer.echo(json.dumps({k: v for k, v in found.items() if k not in ("lrs", "losses")}, indent=2))
        return
    typer.echo(f"  suggested lr          {found['suggested_lr']:.2e}   ({found['rule']})")
    typer.echo(f"  lr at minimum loss    {found['min_loss_lr']:.2e}   (smoothed loss "
               f"{found['min_smoothed_loss']:.4f}; the edge of stability)")
    if found["diverged_at_lr"]:
        typer.echo(f"  diverged from         {found['diverged_at_lr']:.2e}")
    if found["still_falling_at_end"]:
        typer.echo("  note: the loss was still falling at --lr-max; raise it and run again")
    typer.echo(f"plot: {found['plot']}")
    low, high = found["suggested_lr"] / 3, max(found["min_loss_lr"], found["suggested_lr"] * 3)
    typer.echo(f"next: python cli.py tune --lr {low:.1e}:{high:.1e}")


# ---------------------------------------------------------------- clusters and jobs

cluster_app = typer.Typer(
    help="Ray clusters: a local head on this machine, or cluster.yaml through Ray's launcher.",
    no_args_is_help=True, rich_markup_mode=None)
app.add_typer(cluster_app, name="cluster")
CONFIG_ARG = typer.Argument(Path("cluster.yaml"), help="Cluster-launcher config [default: cluster.yaml].")


@cluster_app.command("local-up", epilog="Examples:\n\n  python cli.py cluster local-up\n\n"
                                        "  python cli.py cluster local-up --port 6390 --dashboard-port 8266")
def cluster_local_up(
    port: int = typer.Option(6379, help="GCS port (the cluster's address is 127.0.0.1:PORT)."),
    dashboard_port: int = typer.Option(8265, help="Dashboard and jobs API port, on 127.0.0.1 only."),
    num_cpus: Optional[int] = typer.Option(None, help="Logical CPUs [default: all cores]."),
) -> None:
    """Start a Ray head on this machine (token authentication on, dashboard on 127.0.0.1)."""
    from raytrain_lm.cluster import local_up

    info = local_up(port=port, dashboard_port=dashboard_port, num_cpus=num_cpus, say=typer.echo)
    dash = info["dashboard"]
    typer.echo(f"Ray is running at {info['address']}; dashboard and jobs API: {dash}"
               f"{' (token auth on: ~/.ray/auth_token)' if info['auth'] else ''}\n"
               f"  submit training:  python cli.py submit --address {dash} -- --workers 2\n"
               f"  or with Ray:      RAY_AUTH_MODE=token ray job submit --address {dash} "
               f"--working-dir . -- python cli.py train --workers 2 --storage $PWD/runs\n"
               f"  train directly:   python cli.py train --address {info['address']}\n"
               f"  stop it:          python cli.py cluster local-down"
               f"{'' if port == 6379 else f' --port {port}'}")


@cluster_app.command("local-down", epilog="Example:\n\n  python cli.py cluster local-down")
def cluster_local_down(port: int = typer.Option(6379, help="GCS port the cluster was started with.")) -> None:
    """Stop the local cluster started by `cluster local-up` (its jobs, then its processes only)."""
    from raytrain_lm.cluster import local_down, local_temp_dir

    n = local_down(port=port, say=typer.echo)
    typer.echo(f"stopped the local Ray cluster on port {port} ({n} processes); logs stay in "
               f"{local_temp_dir(port)}" if n else f"no local Ray cluster was running on port {port}")


def _launcher(action: str, config: Path, yes: bool = False) -> None:
    from raytrain_lm.cluster import run_launcher

    raise typer.Exit(run_launcher(action, config, yes))


@cluster_app.command("up", epilog="Example:\n\n  python cli.py cluster up cluster.yaml --yes")
def cluster_up(config: Path = CONFIG_ARG, yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask.")) -> None:
    """Validate the config, then `ray up` (create or update the cluster)."""
    _launcher("up", config, yes)


@cluster_app.command("down", epilog="Example:\n\n  python cli.py cluster down cluster.yaml --yes")
def cluster_down(config: Path = CONFIG_ARG, yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask.")) -> None:
    """`ray down`: terminate every node of the cluster."""
    _launcher("down", config, yes)


@cluster_app.command("status", epilog="Example:\n\n  python cli.py cluster status")
def cluster_status(config: Path = CONFIG_ARG) -> None:
    """`ray status` on the cluster's head: nodes, pending launches, resource use."""
    _launcher("status", config)


@cluster_app.command("dashboard", epilog="Example:\n\n  python cli.py cluster dashboard  "
                                         "# then: python cli.py submit -- --workers 8 --use-gpu ...")
def cluster_dashboard(config: Path = CONFIG_ARG) -> None:
    """`ray dashboard`: an SSH tunnel to the head's dashboard and jobs API on 127.0.0.1:8265."""
    _launcher("dashboard", config)


ADDRESS_OPT = typer.Option(None, help="The cluster's dashboard URL [default: RAY_API_SERVER_ADDRESS, "
                                      "else http://127.0.0.1:8265].")


@app.command(epilog="Examples:\n\n  python cli.py submit -- --workers 2 --max-steps 300\n\n"
                    "  python cli.py submit --address http://127.0.0.1:8265 -- --workers 8 --use-gpu "
                    "--preset gpt2 --data s3://my-bucket/data/stdlib --storage s3://my-bucket/runs\n\n"
                    "  python cli.py submit --no-follow -- --workers 2")
def submit(
    train_args: Optional[List[str]] = typer.Argument(None, help="Arguments of `train`, after `--`."),
    address: Optional[str] = ADDRESS_OPT,
    follow: bool = typer.Option(True, "--follow/--no-follow", help="Stream the job's logs until it ends."),
) -> None:
    """Run `python cli.py train ...` on a cluster as a Ray job (the project is its working dir)."""
    from raytrain_lm.cluster import job_exit_code, submit as submit_job

    outcome = submit_job(train_args or [], address=address, follow=follow, say=typer.echo)
    if not follow:
        typer.echo(outcome["job_id"])
        return
    code = job_exit_code(outcome)
    if code:
        typer.echo(f"error: job {outcome['job_id']} {outcome['status']}: {outcome['message']}", err=True)
        raise typer.Exit(code)
    typer.echo(f"job {outcome['job_id']} SUCCEEDED; results: {outcome['results'] or 'see the logs above'}")


jobs_app = typer.Typer(help="List, follow and stop training jobs on a cluster.",
                       invoke_without_command=True, rich_markup_mode=None)
app.add_typer(jobs_app, name="jobs")


@jobs_app.callback(epilog="Examples:\n\n  python cli.py jobs\n\n  python cli.py jobs logs raysubmit_XYZ --follow\n\n"
                          "  python cli.py jobs stop raysubmit_XYZ")
def jobs_main(ctx: typer.Context, address: Optional[str] = ADDRESS_OPT) -> None:
    """Without a subcommand: list the cluster's jobs."""
    ctx.obj = address
    if ctx.invoked_subcommand is None:
        _list_jobs(address)


def _list_jobs(address: Optional[str]) -> None:
    import datetime as dt

    from raytrain_lm.cluster import list_jobs

    rows = list_jobs(address)
    if not rows:
        typer.echo("no jobs")
    for r in rows:
        start = dt.datetime.fromtimestamp(r["start_time"] / 1000).strftime("%Y-%m-%d %H:%M:%S") if r["start_time"] else "-"
        typer.echo(f"{r['job_id']:<28} {r['status']:<10} {start}  {r['entrypoint']}")


@jobs_app.command("list")
def jobs_list(ctx: typer.Context, address: Optional[str] = ADDRESS_OPT) -> None:
    """List the cluster's jobs: id, status, start time, command."""
    _list_jobs(address or ctx.obj)


@jobs_app.command("logs")
def jobs_logs(ctx: typer.Context, job_id: str, address: Optional[str] = ADDRESS_OPT,
              follow: bool = typer.Option(False, "--follow", "-f", help="Stream until the job ends.")) -> None:
    """Print a job's logs (the training's progress lines and results table)."""
    from raytrain_lm.cluster import follow_job, job_logs

    if follow:
        outcome = follow_job(job_id, address or ctx.obj, say=typer.echo)
        typer.echo(f"job {job_id} {outcome['status']}")
    else:
        typer.echo(job_logs(job_id, address or ctx.obj), nl=False)


@jobs_app.command("stop")
def jobs_stop(ctx: typer.Context, job_id: str, address: Optional[str] = ADDRESS_OPT) -> None:
    """Stop a running job (its training workers stop with it)."""
    from raytrain_lm.cluster import stop_job

    stopped = stop_job(job_id, address or ctx.obj)
    typer.echo(f"stopped job {job_id}" if stopped else f"job {job_id} had already ended")


def main() -> None:
    """The one place that turns errors into what the user sees: a UserError or bad usage is one
    line and exit code 2; anything unexpected is one line and exit code 1, with the traceback
    only under --verbose."""
    from raytrain_lm.console import paint, quiet_ray_logging

    verbose = "--verbose" in sys.argv or "-v" in sys.argv
    if not verbose:
        quiet_ray_logging()
    err = lambda m: typer.echo(paint("error:", "red", sys.stderr) + " " + m, err=True)  # noqa: E731
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as e:  # bad usage, from Typer's (vendored) click
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # `cli.py` or `cli.py COMMAND` alone: the help itself
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx else ""
        err(e.format_message().replace("\n", " ") + hint)
        sys.exit(getattr(e, "exit_code", 2))
    except UserError as e:
        if verbose:
            raise
        err(str(e))
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # `... | head`: the reader left; not an error
        sys.stderr.close()
        sys.exit(0)
    except Exception as e:
        if verbose:
            raise
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        err(f"unexpected {type(e).__name__}{': ' + first if first else ''} "
            f"(rerun with --verbose for the traceback)")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
