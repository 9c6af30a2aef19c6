"""`tune` (Ray Tune sweeps with ASHA) and `lr-find` (the LR range test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from raytrain_lm.cli.app import app, examples
from raytrain_lm.cli.options import (
    CONFIG_FILE,
    JSON,
    PARAM,
    QUIET,
    SET,
    VERBOSE,
    ConfigPath,
    SetList,
    only_json_on_stdout,
    say_for,
    settings,
)
from raytrain_lm.config.load import build_config
from raytrain_lm.console import LiveTable
from raytrain_lm.errors import UserError
from raytrain_lm.tune.sweep_config import SweepSettings, new_sweep, resumed_sweep

# Search-space flags: a spec string each (LOW:HIGH, log:LOW:HIGH or A,B,C) -> the setting it tunes.
SPEC_FLAGS = {"lr": "lr", "warmup": "warmup_steps", "weight_decay": "weight_decay",
              "batch_size": "batch_size", "grad_accum": "grad_accum", "dropout": "model.dropout",
              "n_layer": "model.n_layer", "n_embd": "model.n_embd"}
WHERE = {"name": "Sweep name [default: tune-<preset>-<date>-<time>].",
         "storage": "Where sweeps live: a folder or s3://... [default: $RAYTRAIN_LM_STORAGE, else runs].",
         "workers": "Ray Train workers per trial.",
         "max_steps": "Steps of a trial that is not stopped (ASHA's max_t).",
         "eval_every": "Validation cadence [default: --grace-steps]; must divide --grace-steps."}


@app.command(epilog=examples(
    "python cli.py tune --lr 1e-4:1e-2 --trials 8 --max-steps 300",
    "python cli.py tune --search grid --lr 1e-3,3e-3,1e-2 --dropout 0,0.1",
    "python cli.py tune --space-file space.yaml --workers 4 --concurrent 2 --grace-steps 50",
    "python cli.py tune --name my-sweep --resume")
    + "\n\nSearch space specs: LOW:HIGH is a range (log-uniform for lr, uniform for other floats, "
      "inclusive for integers), log:LOW:HIGH a log-uniform range, A,B,C a list of values. --space "
      "takes any setting, e.g. --space model.n_head=2,4 --space beta2=0.95,0.99.")
@settings("workers", "use_gpu", "preset", "data", "max_steps", "eval_every", "name", "storage",
          "address", help=WHERE)
def tune(
    settings: dict,
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
    grace_steps: Optional[int] = typer.Option(None, help="Steps before ASHA may stop a trial [default: max-steps/10]."),
    reduction_factor: int = typer.Option(2, help="ASHA keeps the best 1/N of trials at each rung."),
    seed: Optional[int] = typer.Option(None, help="Seed of the random searcher."),
    target_width: Optional[int] = typer.Option(None, help="muTransfer (with --param mup): also "
                                               "write the best trial's settings at this model "
                                               "width, transfer.yaml, for train --config "
                                               "(docs/tuning.md)."),
    param: Optional[str] = PARAM,
    metric: str = typer.Option("val_loss", help="What ASHA compares and trials are ranked by: "
                               "val_loss (nats/token) or val_bpb (bits per byte: the same order "
                               "within a sweep, and comparable with sweeps on other tokenizers)."),
    config: ConfigPath = typer.Option(None, help="YAML/TOML/JSON file of fixed settings for every trial."),
    set_: SetList = typer.Option(None, "--set", help="Fixed setting for every trial: key=value."),
    resume: bool = typer.Option(False, help="Continue the sweep --name after its driver died."),
    track: SetList = typer.Option(None, "--track", metavar="mlflow|wandb", help="A tracking run per "
                                  "trial (its hyperparameters, rows, status), grouped by the sweep: "
                                  "an MLflow parent run, a W&B group (see train --track)."),
    scaling: bool = typer.Option(False, help="A scaling-law sweep: every point of a grid of sizes "
                                 "(--n-embd, --n-layer) x lengths (--steps) run to its "
                                 "end, then L(N, D) = E + A/N^alpha + B/D^beta fitted (Hoffmann et "
                                 "al.'s approach 3, the IsoFLOP minima beside it): scaling.json, "
                                 "scaling.png."),
    steps: Optional[str] = typer.Option(None, help="With --scaling: the grid's run lengths in steps, "
                                        "e.g. 100,200,400 (each trial's cosine schedule ends at its own)."),
    budget: Optional[float] = typer.Option(None, metavar="FLOPS", help="With --scaling: the "
                                           "compute-optimal N and D of the fit for this budget."),
    verbose: bool = VERBOSE,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No live table, only the results."),
    as_json: bool = JSON,
) -> None:
    """Tune hyperparameters: a Ray Tune sweep of full distributed trainings, ASHA early stopping;
    with --scaling, a grid of sizes and lengths and the scaling law fitted to it."""
    specs = {SPEC_FLAGS[k]: v for k, v in dict(lr=lr, warmup=warmup, weight_decay=weight_decay,
                                                batch_size=batch_size, grad_accum=grad_accum,
                                                dropout=dropout, n_layer=n_layer,
                                                n_embd=n_embd).items()}
    if resume and scaling:
        raise UserError("--scaling starts a new sweep; --resume continues one")
    if scaling and not resume and not (n_embd or n_layer or any(
            s.startswith(("model.n_embd=", "model.n_layer=")) for s in space or [])):
        raise UserError("--scaling needs a grid of sizes and lengths: --n-embd A,B,C (or --n-layer) "
                        "and --steps S1,S2,S3")
    if resume:
        others = {**specs, "space": space, "space-file": space_file, "config": config, "set": set_,
                  "track": track, "target-width": target_width, "param": param}
        cfg = resumed_sweep(settings, [k for k, v in others.items() if v])
        sweep_space = sweep = None
    else:
        if param is not None:
            settings["model"] = {"param": param}
        sweep = SweepSettings(search="grid" if scaling else search, trials=trials, concurrent=concurrent,
                              grace_steps=grace_steps, reduction_factor=reduction_factor, seed=seed,
                              metric=metric, target_width=target_width)
        cfg, sweep_space = new_sweep(settings, specs, space or [], str(space_file) if space_file else None,
                                     str(config) if config else None, set_, sweep)
        if scaling:
            from raytrain_lm.tune.scaling_sweep import setup_scaling

            setup_scaling(cfg, sweep_space, sweep, steps)
    from raytrain_lm.tune.sweep import run_sweep  # after the inputs' checks: it imports Ray Train

    table = LiveTable()
    with only_json_on_stdout(as_json) as stdout:
        summary = run_sweep(cfg, sweep_space, sweep, resume=resume, verbose=verbose,
                            say=say_for(quiet, as_json), live=None if quiet or as_json else table.draw,
                            live_interval=2.0 if table.tty else 30.0, track=track)
        if scaling:
            summary["scaling"] = scaling_fit(cfg, summary, budget)
        if as_json:
            typer.echo(json.dumps({k: v for k, v in summary.items() if k != "table"}, indent=2,
                                  default=str), file=stdout)
            return
    typer.echo(f"\nsweep {summary['name']}: {len(summary['trials'])} trials, "
               f"{sum(t['status'] == 'stopped' for t in summary['trials'])} stopped early by ASHA, "
               f"{summary['wall_seconds']:.0f} s")
    typer.echo(summary["table"])
    if summary["best"]:
        typer.echo(f"best config: {summary['best_config']}   "
                   f"(python cli.py train --config {summary['best_config']})")
    if summary.get("transfer_config"):
        typer.echo(f"muTransfer, the same at the target width: {summary['transfer_config']}   "
                   f"(python cli.py train --config {summary['transfer_config']})")
    if summary["plot"]:
        typer.echo(f"validation curves: {summary['plot']}")
    typer.echo(f"results: {summary['dir']}/results.json")
    if scaling:
        from raytrain_lm.tune.scaling_sweep import describe

        typer.echo(describe(summary["scaling"]))
        typer.echo(f"fit: {summary['scaling']['files']['json']}, plot: {summary['scaling']['files']['plot']}"
                   f"   (python cli.py plan --budget FLOPS --law {summary['scaling']['files']['json']})")


def scaling_fit(cfg, summary: dict, budget: Optional[float]) -> dict:
    """The scaling law of a finished --scaling sweep, written beside its results."""
    from raytrain_lm.store.storage import RunFolder
    from raytrain_lm.tune.scaling_sweep import fit_points, scaling_points, write_scaling

    folder = RunFolder(cfg.storage, cfg.name)
    result = fit_points(scaling_points(folder, summary["trials"]), budget)
    result["files"] = write_scaling(folder, result, f"sweep {cfg.name}: scaling law")
    return result


@app.command("lr-find", epilog=examples("python cli.py lr-find",
                                        "python cli.py lr-find --workers 4 --preset small --steps 200",
                                        "python cli.py lr-find --lr-min 1e-6 --lr-max 1e-1 --set batch_size=32"))
@settings("workers", "use_gpu", "preset", "data", "name", "storage", "address",
          help={"name": "Run name [default: lrfind-<preset>-<date>-<time>]."})
def lr_find(
    settings: dict,
    lr_min: float = typer.Option(1e-5, help="Learning rate of the first step."),
    lr_max: float = typer.Option(1.0, help="Learning rate of the last step."),
    steps: int = typer.Option(100, help="Steps of the test (one loss each)."),
    config: ConfigPath = CONFIG_FILE,
    set_: SetList = SET,
    verbose: bool = VERBOSE,
    quiet: bool = QUIET,
    as_json: bool = JSON,
) -> None:
    """LR range test: one short training with the learning rate rising exponentially; suggests an lr."""
    from raytrain_lm.tune.lr_find import check_range, next_range, run_lr_find

    check_range(lr_min, lr_max, steps)
    cfg = build_config(config_file=str(config) if config else None, flags=settings, sets=set_)

    def progress(row: dict) -> None:  # a row every lr_find.REPORT_EVERY steps, and the last
        typer.echo(f"step {row['step']:>{len(str(steps))}}/{steps} | lr {row['lr']:.2e} | "
                   f"loss {row['step_losses'][-1]:.4f}")  # this step's, at this lr

    with only_json_on_stdout(as_json) as stdout:
        found = run_lr_find(cfg, lr_min, lr_max, steps, verbose=verbose,
                            say=say_for(quiet, as_json), on_metrics=None if quiet or as_json else progress)
        if as_json:
            typer.echo(json.dumps({k: v for k, v in found.items() if k not in ("lrs", "losses")},
                                  indent=2), file=stdout)
            return
    typer.echo(f"  suggested lr          {found['suggested_lr']:.2e}   ({found['rule']})")
    typer.echo(f"  lr at minimum loss    {found['min_loss_lr']:.2e}   (smoothed loss "
               f"{found['min_smoothed_loss']:.4f}; the edge of stability)")
    if found["diverged_at_lr"]:
        typer.echo(f"  diverged from         {found['diverged_at_lr']:.2e}")
    if found["still_falling_at_end"]:
        typer.echo("  note: the loss was still falling at --lr-max; raise it and run again")
    typer.echo(f"plot: {found['plot']}")
    low, high = next_range(found)
    typer.echo(f"next: python cli.py tune --lr {low:.1e}:{high:.1e}")
