"""The planner's fitted constants (calibration.json, written by `bench/planner_validation.py --fit`):
each with its value and the published rows it was fitted on, so that `plan` can say beside an
estimate what was fitted and on how many rows. Everything else the planner uses is a count, a
datasheet figure or a published measurement (gpu_kinds.json, kernels.py, network.py)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

PATH = Path(__file__).with_name("calibration.json")


@lru_cache(maxsize=1)
def constants() -> dict[str, dict]:
    return json.loads(PATH.read_text())["constants"]


def constant(name: str) -> float:
    return float(constants()[name]["value"])


def clock_key(kind: str) -> str:
    return f"clock_factor:{kind}"


def clock_factor(kind: str) -> float:
    """A power-capped kind's sustained matmul rate relative to its chip's MAMF (1 for the others)."""
    entry = constants().get(clock_key(kind))
    return float(entry["value"]) if entry else 1.0


def used_by(kind: str, memory: bool = True, eta: str = "eta") -> list[str]:
    """The constants an estimate on `kind` depends on (`eta`: its software generation's kernel
    efficiency, frameworks.Framework.efficiency)."""
    names = [eta, "f_half"] + ([clock_key(kind)] if clock_key(kind) in constants() else [])
    return names + (["allocator"] if memory else [])


def describe(kind: str, memory: bool = True, eta: str = "eta") -> str:
    """One line: each fitted constant behind an estimate, its value and its rows."""
    parts = []
    for name in used_by(kind, memory, eta):
        c = constants()[name]
        rows = len(c["rows"])
        how = "pinned by" if c.get("pinned") else "fitted on"
        parts.append(f"{c['label']} {c['value']:.3g} ({how} {rows} published row{'s' if rows != 1 else ''})")
    return "; ".join(parts)


def write(values: dict[str, tuple[float, list[str]]], about: str) -> None:
    """Replace fitted values (name -> (value, row names)), keeping the rest."""
    data = json.loads(PATH.read_text())
    for name, (value, rows) in values.items():
        data["constants"][name].update(value=round(value, 4), rows=rows)
    data["fitted_by"] = about
    PATH.write_text(json.dumps(data, indent=1) + "\n")
    constants.cache_clear()
