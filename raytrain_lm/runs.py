"""Finding what training left behind: the runs in a storage, their checkpoints, and which
checkpoint a command should use (`runs`, `report`, `generate`, `export` all go through here).

A reference to a model is a run name (looked up in `--storage`), a run folder, or a checkpoint
folder. Runs on s3:// or gs:// work too: a checkpoint is copied into a temporary folder to load.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow.fs as pafs

from raytrain_lm.errors import UserError
from raytrain_lm.storage import MetricsLog, RunFolder, resolve_storage

CHECKPOINT_PREFIX = "checkpoint_"


def _is_run(fs: pafs.FileSystem, path: str) -> bool:
    """A folder is a run if the driver wrote its files there."""
    return any(fs.get_file_info(f"{path}/{f}").type == pafs.FileType.File
               for f in ("summary.json", MetricsLog.FILE))


def _mtime(fs: pafs.FileSystem, path: str) -> Optional[_dt.datetime]:
    info = fs.get_file_info(path)
    return info.mtime if info.type != pafs.FileType.NotFound else None


def summary_of(run: RunFolder) -> dict[str, Any]:
    """summary.json of a finished run; for a run without one (still training, or its driver was
    killed) the same keys as far as metrics.jsonl tells them."""
    if run.exists("summary.json"):
        summary = run.read_json("summary.json")
        summary["name"] = run.name  # the folder is what the user names it by, even if renamed
        return summary
    rows = run.read_jsonl(MetricsLog.FILE)
    last = rows[-1] if rows else {}
    evals = [r for r in rows if r.get("val_loss") is not None]
    steady = rows[1:] if len(rows) > 2 else rows
    when = _mtime(run.fs, f"{run.path}/{MetricsLog.FILE}")
    return {
        "name": run.name, "status": "unfinished", "steps": last.get("step", 0),
        "tokens": last.get("tokens", 0), "final_train_loss": last.get("loss"),
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "val_perplexity": evals[-1]["val_ppl"] if evals else None,
        "best_val_loss": min(r["val_loss"] for r in evals) if evals else None,
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in steady) if steady else None,
        "num_parameters": last.get("num_parameters"),
        "finished": when.isoformat(timespec="seconds") if when else None,
    }


def list_runs(storage: str) -> list[dict[str, Any]]:
    """One summary per run in `storage`, oldest first."""
    fs, root, _ = resolve_storage(storage)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return []
    out = []
    for info in fs.get_file_info(pafs.FileSelector(root)):
        if info.type == pafs.FileType.Directory and _is_run(fs, info.path):
            run = RunFolder(storage, info.base_name)
            out.append({**summary_of(run), "run_dir": run.display_path(),
                        "checkpoints": len(checkpoints(run))})
    return sorted(out, key=lambda s: (s.get("finished") or "", s["name"]))


def open_run(ref: str, storage: str) -> RunFolder:
    """A run by its folder path, or by name in `storage`."""
    path = Path(ref).expanduser()
    if path.is_dir() and _is_run(pafs.LocalFileSystem(), str(path.resolve())):
        return RunFolder(str(path.resolve().parent), path.resolve().name)
    name = ref.rstrip("/")
    if name and "/" not in name:
        run = RunFolder(storage, name)
        if _is_run(run.fs, run.path):
            return run
    raise UserError(f"no run {ref!r} in {storage} (list them with `python cli.py runs --storage {storage}`)")


def checkpoints(run: RunFolder) -> list[tuple[int, str]]:
    """(step, path) of the run's checkpoint folders, oldest first."""
    out = []
    for info in run.fs.get_file_info(pafs.FileSelector(run.path)):
        name = info.base_name
        if info.type == pafs.FileType.Directory and name.startswith(CHECKPOINT_PREFIX):
            try:
                out.append((int(name[len(CHECKPOINT_PREFIX):]), info.path))
            except ValueError:
                continue
    return sorted(out)


@dataclass
class Chosen:
    """The checkpoint a command will use, and why."""

    path: Path  # a local folder (a temporary copy for remote runs)
    step: int
    source: str  # where it came from, for messages
    meta: dict  # its meta.json, checked against every file's checksum
    val_loss: Optional[float] = None


def _local_copy(fs: pafs.FileSystem, path: str) -> Path:
    if isinstance(fs, pafs.LocalFileSystem):
        return Path(path)
    tmp = Path(tempfile.mkdtemp(prefix="raytrain-lm-ckpt-"))
    pafs.copy_files(path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return tmp


def choose_checkpoint(ref: str, storage: str, best: bool = False) -> Chosen:
    """The checkpoint to load for `ref`: a checkpoint folder as given, else the run's latest
    complete checkpoint, or with `best` the one with the lowest validation loss at its step."""
    from raytrain_lm.checkpoint import read_meta  # torch: not for `runs`, which lists only

    path = Path(ref)
    if path.is_dir() and (path / "meta.json").is_file():
        if best:
            raise UserError("--best chooses among a run's checkpoints; give the run, not a checkpoint")
        meta = read_meta(path)
        return Chosen(path, meta["step"], str(path), meta)
    run = open_run(ref, storage)
    found = checkpoints(run)
    if not found:
        raise UserError(f"run {run.name!r} has no checkpoints (it stopped before its first one)")
    if best:
        val_at = {r["step"]: r["val_loss"] for r in run.read_jsonl(MetricsLog.FILE)
                  if r.get("val_loss") is not None}
        scored = [(val_at[step], step, p) for step, p in found if step in val_at]
        if not scored:
            raise UserError(f"run {run.name!r} has no checkpoint taken at a validation step; "
                            f"use the latest (drop --best)")
        # Lowest loss; on a tie the later step.
        candidates = [(step, p, loss) for loss, step, p in sorted(scored, key=lambda t: (t[0], -t[1]))]
    else:
        candidates = [(step, p, None) for step, p in reversed(found)]
    problems = []
    for step, p, loss in candidates:
        local = _local_copy(run.fs, p)
        try:
            meta = read_meta(local)  # complete and not corrupted, else fall back to an older one
        except UserError as e:
            problems.append(str(e))
            continue
        return Chosen(local, step, f"{run.display_path()}/{p.rsplit('/', 1)[-1]}", meta, loss)
    raise UserError(f"no valid checkpoint in run {run.name!r}: " + "; ".join(problems))
