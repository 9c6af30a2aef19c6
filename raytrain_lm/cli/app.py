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
