"""Elastic runs without Ray: `--workers MIN-MAX`, the sizes a run takes and the global batch each
keeps, the window log's reading of restarts, the driver's account of worker groups, and the order
in which a checkpoint is committed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
import torch

from conftest import cli_here
from raytrain_lm.config.load import build_config
from raytrain_lm.config.sizes import fit_to_world, global_batch, parse_workers, worker_counts
from raytrain_lm.data.sampler import BatchPlan, BatchStream, epoch_order
from raytrain_lm.errors import UserError
from raytrain_lm.run.groups import WorkerGroups
from raytrain_lm.worker.drills import WindowLog, read_window_log
from test_cli_errors import assert_clean_error


@pytest.mark.parametrize("text,expected", [("4", (4, 4)), ("2-8", (2, 8)), (" 1-3 ", (1, 3))])
def test_workers_is_a_number_or_a_range(text, expected):
    assert parse_workers(text) == expected


@pytest.mark.parametrize("value,expected", [
    ("3-2", "3-2: MIN (3) is larger than MAX (2)"),
    ("0-4", "0-4: MIN must be at least 1"),
    ("2-x", "'2-x' is neither a number of workers nor a range MIN-MAX"),
    ("2-", "'2-' is neither"),
])
def test_bad_worker_ranges_are_one_line(tmp_path, value, expected):
    result = cli_here("train", "--workers", value, "--storage", str(tmp_path / "runs"))
    assert_clean_error(result, f"Invalid value for '--workers': {expected}")
    assert not (tmp_path / "runs").exists()


def test_a_range_must_start_at_a_size_that_keeps_the_batch(tmp_path):
    """3 data-parallel ranks cannot share 128 sequences; with --tp 2 both ends are multiples of 2."""
    assert_clean_error(cli_here("train", "--workers", "3-8", "--storage", str(tmp_path)),
                       "--workers 3-8: 3 data-parallel ranks cannot split the global batch of 128 "
                       "sequences")
    assert_clean_error(cli_here("train", "--workers", "3-8", "--tp", "2", "--storage", str(tmp_path)),
                       "both ends must be multiples of --tp x --pp = 2")


def sized(flags, sets=()):
    return build_config(flags=flags, sets=list(sets))


def test_a_range_with_context_parallelism_names_cp_in_its_unit():
    """The unit both ends must be multiples of is Layout's, cp included, and so is its text
    (`check_elastic` once said "--tp x --pp = 4" for --tp 2 --cp 2)."""
    with pytest.raises(UserError, match=r"both ends must be multiples of --tp x --pp x --cp = 4"):
        sized(dict(workers=8, min_workers=2, tp=2, cp=2))


def test_every_size_keeps_the_global_batch_in_micro_batches_that_fit():
    cfg = sized(dict(workers=8, min_workers=2, batch_size=16))  # 128 sequences per step
    assert worker_counts(cfg) == [2, 4, 8]  # 3, 5, 6, 7 ranks cannot split 128 evenly
    for world in (2, 4, 8):
        f = fit_to_world(cfg, world)
        assert f.batch_size * f.grad_accum * world == 128 and f.batch_size <= 16
        assert (f.workers, f.min_workers) == (world, None)
        assert global_batch(f) == 128  # a fitted config is a fixed run of the same batch
    assert fit_to_world(cfg, 3) is None
    odd = sized(dict(workers=3, min_workers=1, batch_size=8))  # 24 per step
    assert [(fit_to_world(odd, w).batch_size, fit_to_world(odd, w).grad_accum) for w in (1, 2, 3)] \
        == [(8, 3), (6, 2), (8, 1)]  # 2 ranks: 12 each, in 2 micro-batches of 6
    fixed = sized(dict(workers=2, batch_size=16, grad_accum=2))
    assert worker_counts(fixed) == [2] and fit_to_world(fixed, 2).to_dict() == fixed.to_dict()


def test_tensor_and_pipeline_groups_resize_by_data_parallel_ranks():
    cfg = sized(dict(workers=8, min_workers=4, tp=2, batch_size=8))  # dp 4 at MAX: 32 sequences
    assert worker_counts(cfg) == [4, 8] and fit_to_world(cfg, 6) is None  # dp 3: 32 / 3
    pp = sized(dict(workers=8, min_workers=2, pp=2, batch_size=8, microbatches=4))
    f = fit_to_world(pp, 2)  # dp 1 takes all 32 sequences: 16 microbatches of 2, as at dp 4
    assert (f.batch_size, f.microbatches, f.grad_accum) == (32, 16, 1)


def test_the_same_windows_make_a_step_at_every_size():
    """What keeps the data exact across a resize: at any size a step's ranks read, between them,
    the same block of the epoch's order (data/sampler.py counts the position globally)."""
    cfg = sized(dict(workers=3, min_workers=1, batch_size=8))
    order = epoch_order(500, 7, 0)
    for start in (0, 24, 48):
        steps = []
        for world in worker_counts(cfg):
            f = fit_to_world(cfg, world)
            read = [i for r in range(world) for a, b in
                    BatchPlan(f.batch_size, f.grad_accum, r, world).micro_slices(start)
                    for i in order[a:b].tolist()]
            steps.append(read)
        assert all(sorted(s) == sorted(order[start:start + 24].tolist()) for s in steps)
        assert all(len(s) == len(set(s)) == 24 for s in steps)


def test_the_window_log_keeps_the_last_group_to_run_each_step(tmp_path):
    """Two ranks read 3 steps; the group dies and a 1-rank group redoes step 3 from a
    checkpoint at step 2: the log keeps the first group's steps 1-2 and the second's step 3."""
    def read(world, group, steps):
        for rank in range(world):
            log = WindowLog(str(tmp_path), rank, world, group)
            stream = BatchStream(100, BatchPlan(4 // world, 1, rank, world), seed=3,
                                 make_loader=lambda batches: iter(batches), log=log)
            stream.load_state_dict({"epoch": 0, "consumed": steps[0] * 4})
            for _ in steps:
                stream.next()
    read(2, 1, [0, 1, 2])
    read(1, 2, [2])
    kept = read_window_log(tmp_path)
    order = epoch_order(100, 3, 0).tolist()
    assert sorted(kept) == [(0, 0), (0, 4), (0, 8)]
    assert [kept[(0, s)]["world"] for s in (0, 4, 8)] == [2, 2, 1]
    assert all(sorted(kept[(0, s)]["windows"]) == sorted(order[s:s + 4]) for s in (0, 4, 8))


def test_a_stream_without_a_log_never_touches_one(monkeypatch):
    """Off (the default), the window log costs nothing: no step of any epoch writes to one."""
    def touched(*args, **kwargs):
        raise AssertionError("a stream without a window log wrote to one")

    monkeypatch.setattr(WindowLog, "__init__", touched)
    monkeypatch.setattr(WindowLog, "add", touched)
    stream = BatchStream(40, BatchPlan(2, 1, 0, 1), 1, lambda batches: iter(batches))
    assert all(len(stream.next()) == 2 for _ in range(45))  # past the end of an epoch of 40
    assert stream.epoch == 2


def test_worker_groups_count_restarts_and_say_why_a_size_changed():
    groups = WorkerGroups()
    assert groups.row({"train_start_unix": 1.0, "workers": 2, "step": 10}) is None
    groups.row({"train_start_unix": 1.0, "workers": 2, "step": 20})
    assert groups.row({"train_start_unix": 2.0, "workers": 3, "resumed_from_step": 20}) == \
        "resized from 2 to 3 workers at step 20: the cluster grew"
    groups.failure("worker process of rank 2 died")
    groups.row({"train_start_unix": 3.0, "workers": 2, "resumed_from_step": 30})
    groups.row({"train_start_unix": 3.0, "workers": 2, "step": 37, "preemption": {"nodes": ["n1"]}})
    groups.row({"train_start_unix": 4.0, "workers": 1, "resumed_from_step": 37})
    groups.failure("rank 0: boom")
    groups.row({"train_start_unix": 5.0, "workers": 1, "resumed_from_step": 37})  # same size
    assert groups.restarts == 4
    early = WorkerGroups()  # the first group died before its first report: still a restart
    early.failure("worker process of rank 1 died")
    early.row({"train_start_unix": 9.0, "workers": 2, "resumed_from_step": 5})
    assert early.restarts == 1 and early.resizes == []
    assert groups.resizes == [
        {"step": 20, "from": 2, "to": 3, "why": "the cluster grew"},
        {"step": 30, "from": 3, "to": 2, "why": "worker failure (worker process of rank 2 died)"},
        {"step": 37, "from": 2, "to": 1, "why": "preemption of 1 node"}]


def test_a_preemption_told_on_a_groups_first_row_is_why_the_next_group_is_smaller():
    """A notice that comes with the first row a group reports (its first row is the step of the
    just-in-time checkpoint) is still the reason of the resize that follows: it was taken, then
    cleared as the reason of that first group's own start."""
    groups = WorkerGroups()
    groups.row({"train_start_unix": 1.0, "workers": 2, "step": 5, "preemption": {"nodes": ["n1"]}})
    assert groups.row({"train_start_unix": 2.0, "workers": 1, "resumed_from_step": 5}) == \
        "resized from 2 to 1 workers at step 5: preemption of 1 node"


def test_a_checkpoint_is_committed_data_first_record_then_meta(tmp_path):
    """The order uploads copy a rank's files in: a copy cut short has no record and is skipped."""
    from raytrain_lm.models.gpt.gpt import GPT
    from raytrain_lm.store.checkpoint_format import commit_checkpoint, read_meta, save_checkpoint
    from raytrain_lm.worker.optim import build_optimizer

    cfg = build_config(sets=["model.n_layer=1", "model.n_embd=32", "model.n_head=2"])
    cfg.model.vocab_size = 256
    model = GPT(cfg.model)
    state = {"scaler": {}, "step": 3, "tokens": 96, "data": {"epoch": 0, "consumed": 48},
             "world_size": 1, "val_loss": None, "recent_metrics": [], "config": cfg.to_dict(),
             "tokenizer": {"type": "byte", "vocab_size": 256}}
    parallel = SimpleNamespace(parts=[model], optimizers=[build_optimizer(model, cfg, torch.device("cpu"))])
    save_checkpoint(tmp_path, 0, parallel, state, commit=False)
    with pytest.raises(UserError, match="not a complete checkpoint"):
        read_meta(tmp_path)
    order = [p.relative_to(tmp_path).as_posix() for p in commit_checkpoint(tmp_path, 0, state)]
    assert order[-2:] == ["rank0.json", "meta.json"]
    assert set(order[:-2]) == set(json.loads((tmp_path / "rank0.json").read_text()))
    assert read_meta(tmp_path)["step"] == 3


def test_uploads_are_async_where_storage_is_remote():
    from ray.train import CheckpointUploadMode

    from raytrain_lm.worker.checkpointer import upload_mode

    s3 = pafs.S3FileSystem(endpoint_override="127.0.0.1:1", scheme="http")
    auto = sized({})
    assert upload_mode(auto, pafs.LocalFileSystem()) == CheckpointUploadMode.SYNC
    assert upload_mode(auto, s3) == CheckpointUploadMode.ASYNC
    assert upload_mode(sized({"checkpoint_upload": "sync"}), s3) == CheckpointUploadMode.SYNC
    assert upload_mode(sized({"checkpoint_upload": "async"}), pafs.LocalFileSystem()) == \
        CheckpointUploadMode.ASYNC
    with pytest.raises(UserError, match="--checkpoint-upload must be one of auto, sync, async"):
        sized({"checkpoint_upload": "later"})


def test_the_progress_line_and_the_table_show_the_size_and_the_resizes():
    from raytrain_lm.results.tables import progress_line, results_table

    row = {"step": 40, "workers": 3, "loss": 2.5, "lr": 1e-3, "tokens_per_second": 5e3,
           "data_wait_frac": 0.0, "peak_mem_gb": 0.1, "step_time": 0.1}
    assert progress_line(row, 100).startswith("step  40/100 | 3 workers | loss 2.5000")
    table = results_table({"resizes": [{"step": 20, "from": 2, "to": 3, "why": "the cluster grew"},
                                       {"step": 30, "from": 3, "to": 2, "why": "preemption of 1 node"}]})
    assert "2 -> 3 at step 20 (the cluster grew); 3 -> 2 at step 30 (preemption of 1 node)" in table
    assert "resizes" in results_table({"resizes": []}) and "none" in results_table({"resizes": []})
