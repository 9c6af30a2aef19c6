"""Options shared by several commands, declared once.

A training setting's flag takes its help text and default from its field in `TrainConfig`
(`config.setting(...)`): `@settings("workers", "lr", ...)` adds one `--flag` per setting to a
command, and the command receives them as `settings: dict` with None for the flags not given, so
presets, config files and --set still decide those (config.build_config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import typing
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from raytrain_lm.config.presets import PRESETS, preset_help
from raytrain_lm.config.settings import TrainConfig, default_storage, setting_fields
from raytrain_lm.env import STORAGE_ENV

VERBOSE = typer.Option(False, "--verbose", "-v", help="Show Ray's logs and full tracebacks.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress lines, only the result.")
JSON = typer.Option(False, "--json", help="Print the result as JSON (nothing else on stdout).")
CONFIG_FILE = typer.Option(None, help="YAML/TOML/JSON file of settings.")
SET = typer.Option(None, "--set", help="Override any setting: key=value, e.g. model.n_layer=6.")
TRACK = typer.Option(None, "--track", metavar="mlflow|wandb", help="Send the run to MLflow or Weights & "
                     "Biases from the driver: config, every metrics row, summary, curves, status "
                     "(repeat for both). Settings: their own variables (MLFLOW_TRACKING_URI, "
                     "MLFLOW_EXPERIMENT_NAME; WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE). Needs "
                     "pip install 'raytrain-lm[track]'.")
PARAM = typer.Option(None, "--param", metavar="sp|mup", help="The parametrization (model.param): "
                     "sp (standard), or mup (maximal update: the best lr stays put as the model "
                     "widens; model.mup_base_width is the proxy's width; docs/tuning.md) "
                     "[default: sp].")
# The read commands find runs where `train` puts them: --storage, else RAYTRAIN_LM_STORAGE, else runs.
STORAGE = typer.Option(default_storage(), envvar=STORAGE_ENV, show_default="runs",
                       help="Where runs live: a folder or s3://...")

PRESETS_DEFAULT = TrainConfig.preset
GENERATED = {"preset": preset_help()}  # help made from a registry the setting's owner cannot import
SetList = Optional[List[str]]
ConfigPath = Optional[Path]


def _help_with_default(f: dataclasses.Field, text: str) -> str:
    """The help text with the setting's default, which presets may change."""
    if f.default is dataclasses.MISSING or f.default is None or f.type in ("bool",):
        return text  # no fixed default (None, or computed): the help text says what happens
    default = f.default
    if any(f.name in preset for preset in PRESETS.values()):
        return f"{text} [default: the preset's; {PRESETS_DEFAULT}: {default}]"
    return f"{text} [default: {default}]"


def settings(*keys: str, help: Optional[dict[str, str]] = None) -> Callable:
    """Add a `--flag` for each TrainConfig setting in `keys` to a Typer command, which receives
    them as `settings: dict[key, value or None]`. `help` replaces a setting's help text for this
    command (e.g. `name` is a sweep's name for `tune`)."""
    fields = setting_fields()
    help = help or {}

    def decorate(fn: Callable) -> Callable:
        own = inspect.signature(fn, eval_str=True)
        added = []
        for key in keys:
            f = fields[key]
            tp = typing.get_type_hints(TrainConfig)[key]
            args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
            base = args[0] if len(args) == 1 else str  # int | str: the text, coerced by the config
            flag = "--" + key.replace("_", "-")
            decls = [f"{flag}/--no-{flag[2:]}"] if base is bool else [flag]
            text = help[key] if key in help else _help_with_default(f, GENERATED.get(key, f.metadata["help"]))
            option = typer.Option(None, *decls, help=text, show_default=False)
            added.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=option,
                                           annotation=Optional[base]))

        def command(**kwargs: Any) -> Any:
            given = {key: kwargs.pop(key) for key in keys}
            return fn(settings=given, **kwargs)

        command.__name__, command.__doc__ = fn.__name__, fn.__doc__
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own.parameters.values()
                  if p.name != "settings"]
        command.__signature__ = own.replace(parameters=added + params)
        return command

    return decorate


def say_for(quiet: bool, as_json: bool) -> Callable[[str], None]:
    """Where a command's messages go: nowhere with --quiet, stderr with --json (stdout holds only
    the JSON), else stdout."""
    if as_json:
        return lambda m: typer.echo(m, err=True)
    return (lambda m: None) if quiet else typer.echo


@contextlib.contextmanager
def only_json_on_stdout(as_json: bool):
    """With --json, stdout holds the JSON document alone: whatever else is printed while the block
    runs goes to stderr. (Ray prints its workers' deaths, "(raylet) A worker died ...", to the
    driver's stdout whatever log_to_driver says: `train --json` after a worker failure printed
    that before the JSON.) Yields the stream to print the JSON to. stdout stays on stderr after
    the block, for the rest of the command: Ray's log thread prints until Ray is shut down as the
    command ends (cli.main), and `tune --scaling --json` had a raylet warning after its JSON."""
    out = sys.stdout
    if as_json:
        sys.stdout = sys.stderr
    yield out
