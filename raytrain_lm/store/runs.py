"""Finding what training left behind: the runs in a storage and their checkpoints. Everything that
looks for a run or a checkpoint asks here: a worker resuming, `--init-from`, `generate`, `export`,
`runs` and `report`.

Two checkpoints have a name:
- the latest: the newest `checkpoint_*` folder that is complete (every rank's commit record
  present, every file matching its checksum); incomplete ones are skipped for the one before;
- the best: `best_checkpoint/`, the copy of the checkpoint with the lowest validation loss that
  the driver keeps (callbacks.KeepBest). Every checkpoint step is a validation step.

A reference to a model is a run name (looked up in `--storage`), a run folder, or a checkpoint
folder. Runs on s3:// or gs:// work too: a checkpoint is copied into a temporary folder to load.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow.fs as pafs

from raytrain_lm.errors import UserError
from raytrain_lm.store import files, summary
from raytrain_lm.store.storage import RunFolder, resolve_storage


def is_run(fs: pafs.FileSystem, path: str) -> bool:
    """A folder is a run if the driver wrote its files there."""
    return any(fs.get_file_info(f"{path}/{f}").type == pafs.FileType.File
               for f in (files.SUMMARY, files.METRICS))


def summary_of(run: RunFolder) -> dict[str, Any]:
    """summary.json of a finished run; for a run without one (still training, or its driver was
    killed) the same keys as far as metrics.jsonl tells them. A run whose files are damaged has
    status "damaged" and the reason as "error", so that listing the others goes on."""
    try:
        if run.exists(files.SUMMARY):
            found = run.read_json(files.SUMMARY)
            _check_summary(found, run.display_path(files.SUMMARY))
            found["name"] = run.name  # the folder is what the user names it by, even if renamed
            return found
        rows = run.read_jsonl(files.METRICS)
        return {"name": run.name, "status": "unfinished", **summary.from_metrics(rows),
                "finished": _mtime(run, files.METRICS)}
    except (UserError, KeyError, TypeError) as e:  # KeyError, TypeError: rows without our keys
        why = str(e) if isinstance(e, UserError) else f"{files.METRICS} lacks {e}"
        return {"name": run.name, "status": "damaged", "error": why,
                "finished": _mtime(run, files.SUMMARY) or _mtime(run, files.METRICS)}


# What `runs` and `report` format from a summary.json, and the types they format it as.
_SUMMARY_TYPES = {"status": str, "finished": str, "steps": int, "max_steps": int,
                  "final_val_loss": (int, float), "final_val_bpb": (int, float),
                  "tokens_per_second": (int, float)}


def _check_summary(found: Any, where: str) -> None:
    if not isinstance(found, dict):
        raise UserError(f"{where} is damaged: not a JSON object")
    for key, kind in _SUMMARY_TYPES.items():
        value = found.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise UserError(f"{where} is damaged: {key} is {value!r}")


def _mtime(run: RunFolder, rel: str) -> Optional[str]:
    info = run.fs.get_file_info(f"{run.path}/{rel}")
    return info.mtime.isoformat(timespec="seconds") if info.type != pafs.FileType.NotFound else None


def list_runs(storage: str) -> list[dict[str, Any]]:
    """One summary per run in `storage`, oldest first."""
    fs, root, _ = resolve_storage(storage)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return []
    out = []
    for info in fs.get_file_info(pafs.FileSelector(root)):
        if info.type == pafs.FileType.Directory and is_run(fs, info.path):
            run = RunFolder(storage, info.base_name)
            out.append({**summary_of(run), "run_dir": run.display_path(),
                        "checkpoints": len(checkpoint_folders(run.fs, run.path))})
    return sorted(out, key=lambda s: (s.get("finished") or "", s["name"]))


def open_run(ref: str, storage: str) -> RunFolder:
    """A run by its folder path, or by name in `storage`."""
    path = Path(ref).expanduser()
    if path.is_dir() and is_run(pafs.LocalFileSystem(), str(path.resolve())):
        return RunFolder(str(path.resolve().parent), path.resolve().name)
    name = ref.rstrip("/")
    if name and "/" not in name:
        run = RunFolder(storage, name)
        if is_run(run.fs, run.path):
            return run
    raise UserError(f"no run {ref!r} in {storage} (list them with `python cli.py runs --storage {storage}`)")


def checkpoint_folders(fs: pafs.FileSystem, run_path: str) -> list[tuple[int, str]]:
    """(step, path) of a run's checkpoint_* folders, oldest first."""
    out = []
    for info in fs.get_file_info(pafs.FileSelector(run_path, allow_not_found=True)):
        step = files.checkpoint_step(info.base_name)
        if info.type == pafs.FileType.Directory and step is not None:
            out.append((step, info.path))
    return sorted(out)


def peek_checkpoint_meta(fs: pafs.FileSystem, path: str) -> Optional[dict]:
    """A checkpoint's meta.json, checked (commit.check_meta) but without checking its files
    (cheap on object stores); None if it has none, or a damaged one."""
    from raytrain_lm.store.commit import MAX_META_BYTES, peek_meta

    try:
        if fs.get_file_info(f"{path}/{files.META}").size > MAX_META_BYTES:
            return None
        with fs.open_input_stream(f"{path}/{files.META}") as f:
            return peek_meta(f.read(MAX_META_BYTES))
    except (OSError, TypeError):  # TypeError: no size (not a file)
        return None


def newest_checkpoint_meta(run: RunFolder) -> tuple[Optional[int], Optional[dict]]:
    """(step, meta.json) of the run's newest checkpoint with a valid meta.json ((None, None): no
    checkpoint)."""
    for step, path in reversed(checkpoint_folders(run.fs, run.path)):
        meta = peek_checkpoint_meta(run.fs, path)
        if meta is not None:
            return step, meta
    return None, None


def best_val_loss(run: RunFolder) -> Optional[float]:
    """The validation loss of the run's best_checkpoint/ (None: it has none)."""
    meta = peek_checkpoint_meta(run.fs, f"{run.path}/{files.BEST_DIR}")
    if meta is None:
        return None
    if meta.get("val_loss") is None:  # written before checkpoints recorded it: from the metrics
        return next((r["val_loss"] for r in run.read_jsonl(files.METRICS)
                     if r["step"] == meta["step"] and r.get("val_loss") is not None), None)
    return meta["val_loss"]


@dataclass
class FoundCheckpoint:
    """A checkpoint checked against its commit records, as a local folder."""

    path: Path  # a local folder (a temporary copy for remote runs, until cleanup())
    step: int
    source: str  # where it came from, for messages
    meta: dict  # its meta.json
    _tmp: Optional[str] = None

    @property
    def val_loss(self) -> Optional[float]:
        return self.meta.get("val_loss")

    def cleanup(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _checked(fs: pafs.FileSystem, path: str, source: str) -> FoundCheckpoint:
    """The checkpoint at `path`, copied locally first when remote; UserError if incomplete."""
    from raytrain_lm.store.commit import read_meta

    tmp = None
    if isinstance(fs, pafs.LocalFileSystem):
        local = Path(path)
    else:
        tmp = tempfile.mkdtemp(prefix="raytrain-lm-ckpt-")
        pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        local = Path(tmp)
    try:
        meta = read_meta(local)
    except UserError:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return FoundCheckpoint(local, int(meta["step"]), source, meta, tmp)


def latest_checkpoint(fs: pafs.FileSystem, run_path: str, display: str = "",
                      say=None) -> Optional[FoundCheckpoint]:
    """The newest complete checkpoint of the run at `run_path`; None when it has none at all.
    Incomplete ones are skipped (each reported through `say`); if every one is, UserError."""
    problems = []
    for step, path in reversed(checkpoint_folders(fs, run_path)):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        try:
            return _checked(fs, path, f"{display or run_path}/{name}")
        except UserError as e:
            problems.append(str(e))
            if say:
                say(f"skipping {name}: {e}")
    if problems:
        raise UserError(f"no valid checkpoint in {display or run_path}: " + "; ".join(problems))
    return None


def best_checkpoint(run: RunFolder) -> Optional[FoundCheckpoint]:
    """`best_checkpoint/` of the run, or None when the run has none."""
    if not run.exists(files.BEST_DIR):
        return None
    return _checked(run.fs, f"{run.path}/{files.BEST_DIR}", run.display_path(files.BEST_DIR))


def find_checkpoint(ref: str, storage: str, best: bool = False,
                    best_else_latest: bool = False, say=None) -> FoundCheckpoint:
    """The checkpoint a command loads for `ref`: a checkpoint folder as given; else the run's
    latest, or with `best` its best; `best_else_latest` (--init-from) takes the best if the run
    has one. `say`: a line for each newer checkpoint skipped as invalid."""
    path = Path(ref).expanduser()
    if path.is_dir() and (path / files.META).is_file():
        if best:
            raise UserError("--best chooses among a run's checkpoints; give the run, not a checkpoint")
        return _checked(pafs.LocalFileSystem(), str(path.resolve()), str(path))
    if path.is_dir() and (path / files.STATE).is_file():
        raise UserError(f"{ref} is not a complete checkpoint (no {files.META})")
    run = open_run(ref, storage)
    if best or best_else_latest:
        found = best_checkpoint(run)
        if found is not None:
            return found
        if best:
            raise UserError(f"run {run.name!r} has no {files.BEST_DIR}/ (no checkpoint with a "
                            f"validation loss yet); use the latest (drop --best)")
    found = latest_checkpoint(run.fs, run.path, run.display_path(), say=say)
    if found is None:
        raise UserError(f"run {run.name!r} has no checkpoints (it stopped before its first one)")
    return found

