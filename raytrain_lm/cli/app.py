"""The Typer application every command module registers itself on."""

import typer

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


def examples(*lines: str) -> str:
    """A command's epilog: its examples, one per paragraph (Typer joins single newlines)."""
    return "Examples:\n\n" + "\n\n".join(f"  {line}" for line in lines)


def command():
    """The app as click runs it, every command accepting `--verbose` / `-v`: main's error
    boundary reads it from the arguments (full tracebacks; Ray's logs kept) and tells the user
    to rerun with it after any unexpected error, whatever the command. A command that declares
    its own (train, prepare, tune, lr-find) also receives it; the others take it without a
    parameter of their own (the boundary's flag alone)."""
    import copy

    import typer.main

    group = typer.main.get_command(app)
    declared = next(p for p in group.commands["train"].params if p.name == "verbose")
    for cmd in leaf_commands(group):
        if not any("--verbose" in p.opts for p in cmd.params):
            flag = copy.copy(declared)
            flag.expose_value = False
            cmd.params.append(flag)
    return group


def leaf_commands(group) -> list:
    """Every command under `group` that runs something (its subgroups' commands too)."""
    subs = getattr(group, "commands", None)
    if not subs:
        return [group]
    return [leaf for sub in subs.values() for leaf in leaf_commands(sub)]
