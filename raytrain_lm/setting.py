"""`setting()`: a config field with its help text beside it. Every owner of settings declares its
fields with it (config/ for the run, config/layout.py for the layout, config/schedule.py for the
learning-rate schedule, each models/<family>/ for its model fields), and `--help` of every command
reads the text from there. A leaf: config/ and models/ both stand on it."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def setting(default: Any = dataclasses.MISSING, *, help: str, factory: Any = dataclasses.MISSING):
    """A dataclass field with `default` (or a `factory` making it) and its `--help` text."""
    return field(default=default, default_factory=factory, metadata={"help": help})


def listing(items, last: str = "or") -> str:
    """"a, b or c": a registry's entries in help text (each entry's own words beside its name)."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def named(entries: dict[str, str]) -> list[str]:
    """Each `name (what it is)`, or the name alone where it says nothing more."""
    return [f"{name} ({text})" if text else name for name, text in entries.items()]
