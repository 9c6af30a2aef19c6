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
    quiet: bool = typer.Option(False, "--quiet", "-q"),
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
    name: Optional[str] = typer.Option(None, help="Run name [default: <preset>-<date>-<time>]."),
    storage: Optional[str] = typer.Option(None, help="Where runs live: a folder or s3://... [default: runs]."),
    address: Optional[str] = typer.Option(None, help="Ray cluster to use [default: RAY_ADDRESS, else start a local one]."),
    scale_timeout: Optional[float] = typer.Option(None, help="Seconds to wait for an autoscaler to add the nodes training needs [default: 900]."),
    config: Optional[Path] = typer.Option(None, help="YAML/TOML/JSON file of settings."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override any setting: key=value, e.g. model.n_layer=6."),
    resume: bool = typer.Option(False, help="Continue the run --name from its latest checkpoint."),
    init_from: Optional[Path] = typer.Option(None, help="Start from this checkpoint's weights (fresh optimizer)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's logs and full tracebacks."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines, only the result."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON (nothing else on stdout)."),
) -> None:
    """Train a GPT model with Ray Train (DDP over gloo on CPU, NCCL on GPU)."""
    from raytrain_lm.config import build_config
    from raytrain_lm.launch import run_training
    from raytrain_lm.report import progress_line, results_table

    flags = dict(workers=workers, use_gpu=use_gpu, preset=preset, data=data, max_steps=max_steps,
                 batch_size=batch_size, seq_len=seq_len, lr=lr, grad_accum=grad_accum,
                 log_every=log_every, eval_every=eval_every, checkpoint_every=checkpoint_every,
                 keep_checkpoints=keep_checkpoints, max_failures=max_failures, seed=seed,
                 compile=compile, name=name, storage=storage, address=address,
                 scale_timeout=scale_timeout)
    cfg = build_config(preset=preset, config_file=str(config) if config else None, flags=flags,
                       sets=set_)
    quiet = quiet or as_json
    say = (lambda m: typer.echo(m, err=True)) if as_json else (lambda m: _echo(m, quiet))
    summary = run_training(
        cfg, resume=resume, init_from=str(init_from) if init_from else None, verbose=verbose,
        say=say, on_metrics=None if quiet else lambda row: typer.echo(progress_line(row, cfg.max_steps)),
    )
    if as_json:
        typer.echo(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
        return
    typer.echo(results_table(summary))
    typer.echo(f"results: {summary['run_dir']}/summary.json, metrics.jsonl")


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
    verbose = "--verbose" in sys.argv or "-v" in sys.argv
    try:
        app()
    except UserError as e:
        if verbose:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
