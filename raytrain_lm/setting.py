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
