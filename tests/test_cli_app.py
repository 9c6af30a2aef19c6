"""The CLI's manners: help with examples, one-line errors, tracebacks only on request, Ray's
notices kept off the terminal. No Ray cluster is started here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import cli_here, run_cli

COMMANDS = ["prepare", "train", "runs", "report", "generate", "export"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(command):
    res = cli_here(command, "--help")  # the top-level help below runs in a process of its own
    assert res.returncode == 0, res.stderr
    assert "Examples:" in res.stdout and f"python cli.py {command}" in res.stdout
    assert "\033[" not in res.stdout


def test_top_level_help_lists_every_command():
    res = run_cli("--help")
    assert res.returncode == 0
    for command in COMMANDS:
        assert f"  {command} " in res.stdout


@pytest.mark.parametrize("args,expected", [
    (["train", "--bogus"], "No such option: --bogus"),
    (["train", "--workers", "two"], "Invalid value for '--workers'"),
    (["generate"], "Missing argument 'RUN|CHECKPOINT'"),
    (["nonsense"], "No such command 'nonsense'"),
])
def test_bad_usage_is_one_line_with_exit_code_2(args, expected):
    res = cli_here(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], res.stderr
    assert "--help" in lines[0]


# A command that fails the way a bug would, registered on the real app and run through the real
# cli.main(): what the user sees of an unexpected exception.
BOOM = """
import sys, typer
from raytrain_lm.cli import app, main

@app.command()
def boom():  # no --verbose of its own: every command takes the error boundary's
    raise RuntimeError("kaboom\\nsecond line")

sys.argv = ["cli.py", "boom", *sys.argv[1:]]
main()
"""


def _boom(*args):
    return subprocess.run([sys.executable, "-c", BOOM, *args],
                          capture_output=True, text=True, timeout=60)


def test_unexpected_error_is_one_line_without_verbose():
    res = _boom()
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: unexpected RuntimeError: kaboom "
                                  "(rerun with --verbose for the traceback)")


def test_unexpected_error_shows_the_traceback_with_verbose():
    res = _boom("--verbose")
    assert res.returncode == 1
    assert "Traceback (most recent call last)" in res.stderr and "RuntimeError: kaboom" in res.stderr


def leaf_paths() -> list[tuple[str, ...]]:
    """Every command that runs something, as typed after cli.py (groups' commands too), walked
    from the app itself: a command added later is in the list."""
    from raytrain_lm.cli import command

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        return [p for name, sub in subs.items() for p in walk(sub, (*path, name))] if subs else [path]
    return walk(command(), ())


@pytest.mark.parametrize("path", leaf_paths(), ids=" ".join)
def test_every_command_accepts_verbose(path):
    """Any command can print "rerun with --verbose" (the error boundary's line for an unexpected
    error), so every command takes --verbose and -v."""
    for flag in ("--verbose", "-v"):
        res = cli_here(*path, flag, "--help")
        assert res.returncode == 0, res.stderr
        assert "-v, --verbose" in res.stdout


RAY_NOTICES = """
import sys
from ray._private.authentication import authentication_token_setup as a
a._warn_token_auth_enabled()
a._warn_token_auth_disabled()
print("--- quiet from here ---", file=sys.stderr, flush=True)
from raytrain_lm.cluster.connect import quiet_ray_logging
quiet_ray_logging()
a._warn_token_auth_enabled()
a._warn_token_auth_disabled()
"""


def test_rays_token_auth_notice_is_dropped_but_not_the_security_warning():
    """Ray's own warnings in a fresh process (its logging set up as Ray sets it), before and after
    quiet_ray_logging: one process, one import of Ray."""
    stderr = subprocess.run([sys.executable, "-c", RAY_NOTICES], capture_output=True, text=True,
                            timeout=60).stderr
    loud, quiet = stderr.split("--- quiet from here ---")
    assert "Token authentication is enabled" in loud  # Ray does print it
    assert "Token authentication is enabled" not in quiet
    assert "Token authentication is disabled" in quiet  # a real warning still gets through


def test_help_and_security_doc_say_a_task_folder_is_code():
    """--include-path runs the folder's code (lm-eval's `!function`, unsandboxed Jinja): `evaluate
    --help` and docs/security.md say so where a user decides to pass one."""
    from conftest import ROOT

    res = cli_here("evaluate", "--help", env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.returncode == 0
    text = " ".join(res.stdout.replace("│", " ").split())
    assert "A task folder is code, like a script you run" in text, text
    security = " ".join((ROOT / "docs" / "security.md").read_text().split())
    assert "| a task folder (`evaluate --include-path`) | run any code as you" in security


def test_json_output_keeps_stdout_to_the_document_after_its_block(capsys):
    """With --json, what prints after the JSON document's block (Ray's log thread, until Ray is
    shut down: a raylet warning followed `tune --scaling --json`'s document) goes to stderr."""
    import json as json_module

    from raytrain_lm.cli.options import only_json_on_stdout

    saved = sys.stdout
    try:
        with only_json_on_stdout(True) as out:
            print("during the run")
            print(json_module.dumps({"a": 1}), file=out)
        print("(raylet) WARNING: a late log line")
    finally:
        sys.stdout = saved
    captured = capsys.readouterr()
    assert json_module.loads(captured.out) == {"a": 1}
    assert "during the run" in captured.err and "late log line" in captured.err


def registry_names() -> dict[str, tuple[str, ...]]:
    """An option's name -> the registry entries its help must name, read from the registries."""
    from raytrain_lm.config.layout import AC_MODES, PP_SCHEDULES, STRATEGIES
    from raytrain_lm.config.presets import PRESETS
    from raytrain_lm.config.schedule import LR_SCHEDULES
    from raytrain_lm.models import FAMILIES

    return {"arch": tuple(FAMILIES), "strategy": tuple(STRATEGIES), "pp_schedule": PP_SCHEDULES,
            "activation_checkpointing": AC_MODES, "schedule": LR_SCHEDULES, "preset": tuple(PRESETS)}


def test_every_family_and_strategy_is_in_the_help_of_each_command_that_takes_it():
    """Generated from the registries (FAMILIES, STRATEGIES, PRESETS, the pipeline and learning-rate
    schedules, the checkpointing modes): every command's option that takes one of them names
    each entry in its help; `train`'s own help names every family, and an --init-from that names
    Hugging Face releases names every family's."""
    import typer.main

    from raytrain_lm.cli.app import app, leaf_commands
    from raytrain_lm.models import FAMILIES

    names = registry_names()
    releases = [r for f in FAMILIES.values() for r in f.hf_releases]
    checked, missing = set(), []
    for cmd in leaf_commands(typer.main.get_command(app)):
        for p in cmd.params:
            help_text = getattr(p, "help", None) or ""
            wanted = names.get(p.name, ())
            if p.name == "init_from" and any(r in help_text for r in releases):
                wanted = releases
            missing += [f"{cmd.name} --{p.name}: {n}" for n in wanted if n not in help_text]
            if wanted:
                checked.add((cmd.name, p.name))
    train = typer.main.get_command(app).commands["train"]
    missing += [f"train: {f.title}" for f in FAMILIES.values() if f.title not in train.help]
    assert missing == []
    assert {("train", "arch"), ("plan", "arch"), ("train", "strategy"), ("plan", "strategy"),
            ("train", "init_from"), ("train", "pp_schedule"), ("train", "preset"),
            ("plan", "preset"), ("tune", "preset")} <= checked
