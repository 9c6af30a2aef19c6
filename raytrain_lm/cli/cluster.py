"""`cluster` (a local head, or cluster.yaml through Ray's launcher), `submit` and `jobs`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from raytrain_lm.cli.app import app, examples
from raytrain_lm.cli.train import train_paths
from raytrain_lm.cluster.jobs import follow_job, job_exit_code, job_logs, list_jobs, stop_job
from raytrain_lm.cluster.jobs import submit as submit_job
from raytrain_lm.cluster.launcher import run_launcher
from raytrain_lm.cluster.local import local_down, local_temp_dir, local_up

cluster_app = typer.Typer(
    help="Ray clusters: a local head on this machine, or cluster.yaml through Ray's launcher.",
    no_args_is_help=True, rich_markup_mode=None)
app.add_typer(cluster_app, name="cluster")
CONFIG_ARG = typer.Argument(Path("cluster.yaml"), help="Cluster-launcher config [default: cluster.yaml].")
YES = typer.Option(False, "--yes", "-y", help="Do not ask.")
ADDRESS = typer.Option(None, help="The cluster's dashboard URL [default: RAY_API_SERVER_ADDRESS, "
                                  "else http://127.0.0.1:8265].")


@cluster_app.command("local-up", epilog=examples("python cli.py cluster local-up",
                                                 "python cli.py cluster local-up --port 6390 --dashboard-port 8266"))
def cluster_local_up(
    port: int = typer.Option(6379, help="GCS port (the cluster's address is 127.0.0.1:PORT)."),
    dashboard_port: int = typer.Option(8265, help="Dashboard and jobs API port, on 127.0.0.1 only."),
    num_cpus: Optional[int] = typer.Option(None, help="Logical CPUs [default: all cores]."),
    public: bool = typer.Option(False, "--public", help="Listen on every network interface, so "
                                "that other machines can join (`ray start --address`); without "
                                "it every port is on 127.0.0.1 only."),
) -> None:
    """Start a Ray head on this machine (token authentication on; every port on 127.0.0.1 unless
    --public)."""
    info = local_up(port=port, dashboard_port=dashboard_port, num_cpus=num_cpus, public=public,
                    say=typer.echo)
    dash = info["dashboard"]
    typer.echo(f"Ray is running at {info['address']}; dashboard and jobs API: {dash}"
               f"{' (token auth on: ~/.ray/auth_token)' if info['auth'] else ''}\n"
               f"  submit training:  python cli.py submit --address {dash} -- --workers 2\n"
               f"  or with Ray:      RAY_AUTH_MODE=token ray job submit --address {dash} "
               f"--working-dir . -- python cli.py train --workers 2 --storage $PWD/runs\n"
               f"  train directly:   python cli.py train   (joins this cluster while it runs)\n"
               f"  stop it:          python cli.py cluster local-down"
               f"{'' if port == 6379 else f' --port {port}'}")


@cluster_app.command("local-down", epilog=examples("python cli.py cluster local-down"))
def cluster_local_down(port: int = typer.Option(6379, help="GCS port the cluster was started with.")) -> None:
    """Stop the local cluster started by `cluster local-up` (its jobs, then its processes only)."""
    n = local_down(port=port, say=typer.echo)
    typer.echo(f"stopped the local Ray cluster on port {port} ({n} processes); logs stay in "
               f"{local_temp_dir(port)}" if n else f"no local Ray cluster was running on port {port}")


def _launcher(action: str, config: Path, yes: bool = False) -> None:
    raise typer.Exit(run_launcher(action, config, yes))


@cluster_app.command("up", epilog=examples("python cli.py cluster up cluster.yaml --yes"))
def cluster_up(config: Path = CONFIG_ARG, yes: bool = YES) -> None:
    """Validate the config, then `ray up` (create or update the cluster)."""
    _launcher("up", config, yes)


@cluster_app.command("down", epilog=examples("python cli.py cluster down cluster.yaml --yes"))
def cluster_down(config: Path = CONFIG_ARG, yes: bool = YES) -> None:
    """`ray down`: terminate every node of the cluster."""
    _launcher("down", config, yes)


@cluster_app.command("status", epilog=examples("python cli.py cluster status"))
def cluster_status(config: Path = CONFIG_ARG) -> None:
    """`ray status` on the cluster's head: nodes, pending launches, resource use."""
    _launcher("status", config)


@cluster_app.command("dashboard", epilog=examples(
    "python cli.py cluster dashboard  # then: python cli.py submit -- --workers 8 --use-gpu ..."))
def cluster_dashboard(config: Path = CONFIG_ARG) -> None:
    """`ray dashboard`: an SSH tunnel to the head's dashboard and jobs API on 127.0.0.1:8265."""
    _launcher("dashboard", config)


@app.command(epilog=examples(
    "python cli.py submit -- --workers 2 --max-steps 300",
    "python cli.py submit --address http://127.0.0.1:8265 -- --workers 8 --use-gpu --preset gpt2 "
    "--data s3://my-bucket/data/stdlib --storage s3://my-bucket/runs",
    "python cli.py submit --no-follow -- --workers 2"))
def submit(
    train_args: Optional[List[str]] = typer.Argument(None, help="Arguments of `train`, after `--`."),
    address: Optional[str] = ADDRESS,
    follow: bool = typer.Option(True, "--follow/--no-follow", help="Stream the job's logs until it ends."),
) -> None:
    """Run `python cli.py train ...` on a cluster as a Ray job (the project is its working dir)."""
    given = train_paths(train_args) if train_args and train_args != ["train"] else {}
    outcome = submit_job(train_args or [], given, address=address, follow=follow, say=typer.echo)
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


@jobs_app.callback(epilog=examples("python cli.py jobs", "python cli.py jobs logs raysubmit_XYZ --follow",
                                   "python cli.py jobs stop raysubmit_XYZ"))
def jobs_main(ctx: typer.Context, address: Optional[str] = ADDRESS) -> None:
    """Without a subcommand: list the cluster's jobs."""
    ctx.obj = address
    if ctx.invoked_subcommand is None:
        _list_jobs(address)


def _list_jobs(address: Optional[str]) -> None:
    import datetime as dt

    rows = list_jobs(address)
    if not rows:
        typer.echo("no jobs")
    for r in rows:
        start = (dt.datetime.fromtimestamp(r["start_time"] / 1000).strftime("%Y-%m-%d %H:%M:%S")
                 if r["start_time"] else "-")
        typer.echo(f"{r['job_id']:<28} {r['status']:<10} {start}  {r['entrypoint']}")


@jobs_app.command("list")
def jobs_list(ctx: typer.Context, address: Optional[str] = ADDRESS) -> None:
    """List the cluster's jobs: id, status, start time, command."""
    _list_jobs(address or ctx.obj)


@jobs_app.command("logs")
def jobs_logs(ctx: typer.Context, job_id: str, address: Optional[str] = ADDRESS,
              follow: bool = typer.Option(False, "--follow", "-f", help="Stream until the job ends.")) -> None:
    """Print a job's logs (the training's progress lines and results table)."""
    if follow:
        outcome = follow_job(job_id, address or ctx.obj, say=typer.echo)
        typer.echo(f"job {job_id} {outcome['status']}")
    else:
        typer.echo(job_logs(job_id, address or ctx.obj), nl=False)


@jobs_app.command("stop")
def jobs_stop(ctx: typer.Context, job_id: str, address: Optional[str] = ADDRESS) -> None:
    """Stop a running job (its training workers stop with it)."""
    stopped = stop_job(job_id, address or ctx.obj)
    typer.echo(f"stopped job {job_id}" if stopped else f"job {job_id} had already ended")
