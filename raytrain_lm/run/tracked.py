"""A training run as its driver tracks it (`train --track mlflow|wandb`): which trackers (those
asked for, and on --resume those the run already has), the tracking runs opened with the run's
config, each metrics row's values, and at the end the summary, summary.json and the curves'
figure, and the status. The tracking itself: track/tracking.py."""

from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

from raytrain_lm.errors import UserError
from raytrain_lm.store import files
from raytrain_lm.store.row import chart_values
from raytrain_lm.store.storage import RunFolder
from raytrain_lm.track import Tracking, check_trackers, flat_params

FIGURE = "curves.png"  # the figure's name among a tracking run's files
# What draws a run's curves (results/plots.plot_runs: the caller's, a layer above this one)
Figure = Callable[[Sequence[tuple[str, list[dict]]]], bytes]


def saved_records(run: RunFolder) -> dict:
    """The run's tracking.json: {tracker: what continues its tracking run}; {} when none."""
    if not run.exists(files.TRACKING):
        return {}
    try:
        found = run.read_json(files.TRACKING)
    except UserError as e:
        raise UserError(f"cannot continue the run's tracking: {e}") from None
    return found if isinstance(found, dict) else {}


def trackers_of(run: RunFolder, asked: Optional[Sequence[str]], resume: bool) -> list[str]:
    """The trackers of this launch: those asked for and, when resuming, those the run already
    has (its tracking runs continue); each checked (known, its client installed)."""
    saved = list(saved_records(run)) if resume else []
    return check_trackers([*saved, *(asked or [])])


def open_tracking(names: list[str], run: RunFolder, config: dict, say: Callable[[str], None],
                  rows: list[dict]) -> Optional[Tracking]:
    """The run's tracking runs (None without trackers): new ones, or for a resumed run the ones
    tracking.json names; their ids go to tracking.json as soon as they exist. `rows`: what
    metrics.jsonl already holds: the tracking runs of a resumed run have those steps; a run
    tracked only from this resume on gets them first."""
    if not names:
        return None
    records = saved_records(run)
    tracking = Tracking(names, config["name"], flat_params(config), say=say, records=records,
                        last_step=rows[-1]["step"] if rows and records else None,
                        on_records=lambda records: run.write_json(files.TRACKING, records))
    if not records:
        for row in rows:
            tracking.log_row(row, chart_values(row))
    return tracking


def row_values(row: dict, restarts: int, resizes: int) -> dict[str, float]:
    """What a tracking run records of a metrics row: its charted metrics, and the worker
    groups' restarts and resizes so far."""
    return {**chart_values(row), "progress/restarts": float(restarts), "progress/resizes": float(resizes)}


def summary_values(summary: dict) -> dict:
    """summary.json as a tracking run's summary: flat, without the config (its parameters)."""
    return flat_params({k: v for k, v in summary.items() if k != "config"})


def close_tracking(tracking: Optional[Tracking], summary: dict, rows: list[dict], status: str,
                   figure: Optional[Figure]) -> None:
    """The summary, summary.json and the curves' figure, then the status (STATUSES)."""
    if tracking is None:
        return
    kept = {files.SUMMARY: (json.dumps(summary, indent=2) + "\n").encode()}
    if figure is not None and rows:
        try:
            kept[FIGURE] = figure([(summary.get("name") or "run", rows)])
        except Exception as e:  # a figure is a convenience
            tracking.say(f"warning: no curves' figure for the tracking runs: {e}")
    tracking.log_summary(summary_values(summary), kept)
    tracking.close(status)
