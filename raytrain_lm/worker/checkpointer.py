"""A worker's side of this run's checkpoints: find the newest valid one, restore every component
from it, and save a new one with the report that registers it in Ray.

We scan the run's folder rather than trust only `ray.train.get_checkpoint()`: Ray's controller
registers a reported checkpoint when it next polls the workers, so a worker that dies right after
a checkpoint was uploaded would otherwise lose it.

Uploads (`--checkpoint-upload`): training is blocked only while each rank writes its files to a
local folder (a collective); hashing them into the commit record and copying them to the run's
storage is `_upload`, which Ray runs either before `report` returns (sync) or in a background
thread while training goes on (async). `_upload` copies the data files first, then the rank's
record, then (rank 0) meta.json: until the last of them lands the checkpoint is incomplete and
every reader skips it, so a worker that dies mid-upload leaves nothing half-loadable behind.
"""

from __future__ import annotations

import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs
import ray.train
import torch
from ray.train import CheckpointUploadMode

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.data.tokenizer import Tokenizer
from raytrain_lm.store import checkpoint_format as ckpt_io
from raytrain_lm.store.files import STATE, checkpoint_name
from raytrain_lm.store.hf_folder import is_hf_folder
from raytrain_lm.store.release import Release, check_release, read_release
from raytrain_lm.store.row import MetricsRow
from raytrain_lm.store.runs import FoundCheckpoint, latest_checkpoint
from raytrain_lm.worker.drills import UploadHold, fault_drill
from raytrain_lm.worker.hf_load import load_hf_weights
from raytrain_lm.worker.optim import resumed_horizon

# The reports whose rows each checkpoint carries, to be re-sent after a resume: more than can be
# in flight in Ray (a worker holds one uncollected report) when the driver or a worker dies.
RECENT_REPORTS = 8


def upload_mode(cfg: TrainConfig, fs: pafs.FileSystem) -> CheckpointUploadMode:
    """--checkpoint-upload; auto: async where the storage is remote (local copies are quick)."""
    mode = cfg.checkpoint_upload
    if mode == "auto":
        mode = "sync" if isinstance(fs, pafs.LocalFileSystem) else "async"
    return CheckpointUploadMode.ASYNC if mode == "async" else CheckpointUploadMode.SYNC


class Checkpointer:
    def __init__(self, cfg: TrainConfig, rank: int, world: int, tokenizer: Tokenizer,
                 fail_at: Optional[str] = None, run_name: str = "", hold_at: Optional[str] = None):
        """`fail_at`, `run_name`: the fault drill (drills.py), for a death during an upload;
        `hold_at`: the hold drill, for its upload holds."""
        self.storage = ray.train.get_context().get_storage()
        self.fs, self.run_path = self.storage.storage_filesystem, self.storage.experiment_fs_path
        self.cfg, self.rank, self.world, self.tokenizer = cfg, rank, world, tokenizer
        self.mode = upload_mode(cfg, self.fs)
        self.fail_at, self.run_name = fail_at, run_name
        self.upload_hold = UploadHold(hold_at)
        self.waited: Optional[float] = None  # seconds training stood still for the last checkpoint
        # the rows of the last reports, which each checkpoint carries
        self.recent: deque[list[MetricsRow]] = deque(maxlen=RECENT_REPORTS)
        self.resent: Optional[list[MetricsRow]] = None  # rows to send again with the first report
        self.resumed_from: Optional[int] = None
        # what the release the run started from ships beside its weights (store/release.py), kept
        # in every checkpoint's state for export: --init-from's folder or checkpoint, or the
        # checkpoint resumed from
        self.release: Optional[Release] = None

    def find_latest(self) -> Optional[FoundCheckpoint]:
        say = (lambda m: print(f"[checkpoint] {m}", flush=True)) if self.rank == 0 else None
        return latest_checkpoint(self.fs, self.run_path, say=say)

    def restore(self, found: FoundCheckpoint, state: dict, step_fn, stream) -> tuple[int, int]:
        """Everything but the RNG states (restored last: see restore_rng) from `found`, at this
        run's layout whatever the saving run's; returns (step, tokens seen)."""
        # The schedule keeps the learning rates used up to this checkpoint: decided here, from the
        # checkpoint actually resumed from (an older one when the newest is incomplete).
        resumed_horizon(TrainConfig.from_dict(state["config"]), self.cfg, state["step"])
        ckpt_io.load_state(found.path, step_fn)  # its parts and optimizers
        step_fn.load_scaler_state(state["scaler"])  # none saved: fp16 starts here, a fresh scale
        stream.load_state_dict(state["data"])
        self.resumed_from = state["step"]
        self.release = state.get("release")
        # The last rows reported before this checkpoint, itself included: the driver may not have
        # received them (its own death or a worker's, while they were in flight in Ray), so they
        # go to it again with the first report.
        self.resent = state.get("recent_metrics") or None
        if self.resent:
            self.recent.append(list(self.resent))
        found.cleanup()
        return state["step"], state["tokens"]

    def report(self, rows: list[MetricsRow], save: bool, step_fn=None, stream=None) -> None:
        """`ray.train.report` (a barrier: every rank calls it) of the last of `rows`, the others
        (made since the previous report, in order) carried in it, with a checkpoint if `save`."""
        *earlier, row = rows
        step = row["step"]
        self.upload_hold.reporting(step)
        for r in rows:
            r["resumed_from_step"] = self.resumed_from
        if self.waited is not None:  # the previous checkpoint's, measured after its report
            row["checkpoint_wait_s"], self.waited = self.waited, None
        self.recent.append([*map(dict, earlier),
                            {**row, "checkpoint": checkpoint_name(step)} if save else dict(row)])
        if earlier:
            row["earlier_rows"] = earlier
        if self.resent is not None:
            row["resumed_rows"], self.resent = self.resent, None
        if not save:  # async: a report queues behind an upload in flight instead of waiting
            ray.train.report(row, checkpoint_upload_mode=self.mode)
            return
        state = None
        if self.rank == 0:
            state = {"scaler": step_fn.scaler_state(), "step": step, "tokens": row["tokens"],
                     "data": stream.state_dict(), "world_size": self.world,
                     "val_loss": row.get("val_loss"),
                     "recent_metrics": [r for sent in self.recent for r in sent],
                     "config": self.cfg.to_dict(), "tokenizer": self.tokenizer.spec(),
                     **({"release": self.release} if self.release else {})}
        started = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix="raytrain-lm-ckpt-")  # Ray deletes it once uploaded
        ckpt_io.save_checkpoint(Path(tmp), self.rank, step_fn, state=state,
                                tokenizer_raw=self.tokenizer.raw if self.rank == 0 else None,
                                commit=False)
        ray.train.report(row, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=checkpoint_name(step), checkpoint_upload_mode=self.mode,
                         checkpoint_upload_fn=lambda ckpt, name: self._upload(ckpt, name, state, step),
                         delete_local_checkpoint_after_upload=True)
        self.waited = time.perf_counter() - started

    def _upload(self, checkpoint, dir_name: str, state: Optional[dict], step: int):
        """Commit records, then every file into the run's storage, records last (see above)."""
        self.upload_hold.before_upload(step, self.rank)
        local = Path(checkpoint.path)
        files = ckpt_io.commit_checkpoint(local, self.rank, state)
        dest = self.storage.build_checkpoint_path_from_name(dir_name)
        self.fs.create_dir(dest, recursive=True)
        for i, path in enumerate(files):
            if i == len(files) // 2:
                fault_drill(self.fail_at, step, self.rank, self.run_name, phase="upload")
            rel = path.relative_to(local).as_posix()
            if "/" in rel:
                self.fs.create_dir(f"{dest}/{rel.rsplit('/', 1)[0]}", recursive=True)
            pafs.copy_files(str(path), f"{dest}/{rel}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self.fs)
        return ray.train.Checkpoint(dest, filesystem=self.fs)

    def report_stop(self, step: int, why: str, earlier: list[MetricsRow]) -> None:
        """The run's loss (or gradient norm) became non-finite: the last report, with no
        checkpoint (a non-finite one is never saved, so none of the good ones is rotated out),
        carrying the rows made since the previous report. The driver ends the run with `why` and
        the last good checkpoint's name."""
        ray.train.report({"step": step, "event": "nonfinite", "error": why,
                          **({"earlier_rows": earlier} if earlier else {})},
                         checkpoint_upload_mode=self.mode)

    def report_final_rows(self, train_start_unix: float) -> None:
        """After resuming from the final checkpoint (the run stopped after writing it, before Ray
        took its report) nothing is left to train, but the driver and Tune still need its rows."""
        if self.resent is not None:
            ray.train.report({**self.resent[-1], "resumed_from_step": self.resumed_from,
                              "train_start_unix": train_start_unix, "resumed_rows": self.resent[:-1]})


def load_init_from(path: str, step_fn, rank: int = 0) -> Optional[Release]:
    """--init-from: the weights of a checkpoint of ours, or of a Hugging Face folder (each rank
    reading only the slices it keeps: hf_load.py), into this rank's parts; the optimizer starts
    fresh. Returns, on rank 0, the release files the folder ships, or those the checkpoint's run
    carried from its own (store/release.py); None elsewhere and for a run from random weights."""
    release = None
    if rank == 0:
        release = read_release(path) if is_hf_folder(path) else check_release(
            ckpt_io.safe_load(Path(path) / STATE).get("release"), path)
    if is_hf_folder(path):
        say = (lambda m: print(m, flush=True)) if rank == 0 else None
        stats = load_hf_weights(path, step_fn.parts, step_fn.cfg.model, say=say)
        if say:
            say(f"[init-from] {path}: {stats.tensors} tensors, {stats.bytes_read / 2**30:.2f} GiB "
                f"read by rank 0 in {stats.seconds:.1f} s")
    else:
        ckpt_io.load_weights(Path(path), ckpt_io.read_meta(Path(path)), step_fn)
    return release


def restore_rng(rng: Optional[dict], seed: int, stream: int) -> None:
    """This rank's saved RNG states. A fresh start, or a rank the saving run did not have (resumed
    on more workers), gets a dropout stream of its own: seed + `stream`, the rank's place among
    the data-parallel ranks and pipeline stages (the tensor-parallel ranks of a group share a
    stream: their replicated activations must draw the same dropout masks)."""
    if rng is not None:
        ckpt_io.set_rng_state(rng)
    else:
        torch.manual_seed(seed + stream)
