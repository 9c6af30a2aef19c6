"""The command line: `python cli.py` and `raytrain-lm` are this app. It parses, calls the library
and prints; no logic lives only here. One module per command group:

    data.py      prepare
    train.py     train, plan
    results.py   runs, report, generate, export, evaluate
    tune.py      tune, lr-find
    cluster.py   cluster (local-up/-down, up/down/status/dashboard), submit, jobs
"""

from __future__ import annotations

import sys

import typer

from raytrain_lm.cli import data, train, results, tune, cluster  # isort: skip  (in --help's order)
from raytrain_lm.cli.app import app, command
from raytrain_lm.cluster.connect import quiet_ray_logging
from raytrain_lm.console import paint
from raytrain_lm.errors import RunFailed, UserError


def main() -> None:
    """The one place that turns errors into what the user sees: a UserError or bad usage is one
    line and exit code 2; a run that failed (RunFailed) is its one line and exit code 1;
    anything unexpected is one line and exit code 1, with the traceback only under --verbose."""
    verbose = "--verbose" in sys.argv or "-v" in sys.argv
    if not verbose:
        quiet_ray_logging()

    def err(m: str) -> None:
        typer.echo(paint("error:", "red", sys.stderr) + " " + m, err=True)

    try:
        code = command()(standalone_mode=False)
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
    except RunFailed as e:
        if verbose:
            raise
        err(str(e))
        sys.exit(1)
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # `... | head`: the reader left; not an error
        sys.stderr.close()
        sys.exit(0)
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # Exception, and what libraries derive from BaseException
        # (torch's CheckpointException): one line, not a traceback
        if verbose:
            raise
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        err(f"unexpected {type(e).__name__}{': ' + first if first else ''} "
            f"(rerun with --verbose for the traceback)")
        sys.exit(1)
    if not verbose:
        _disconnect_ray()
    sys.exit(code if isinstance(code, int) else 0)


def _disconnect_ray() -> None:
    """Leave Ray now rather than from its exit hook, which first sleeps half a second so the
    workers' last log lines can print (they are not shown without --verbose)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
