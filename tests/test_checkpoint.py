"""The checkpoint format in one process (no Ray): what a loader trusts and what it refuses."""

from __future__ import annotations

import io
import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from conftest import cli_here
from raytrain_lm.config.load import build_config
from raytrain_lm.errors import UserError
from raytrain_lm.models.gpt.gpt import GPT
from raytrain_lm.store.checkpoint_format import load_checkpoint, load_state, save_checkpoint
from raytrain_lm.store.digest import sha256_file
from raytrain_lm.worker.checkpointer import restore_rng
from raytrain_lm.worker.optim import build_optimizer
from test_cli_errors import assert_clean_error


def write_checkpoint(folder):
    cfg = build_config(sets=["model.n_layer=1", "model.n_embd=32", "model.n_head=2"])
    cfg.model.vocab_size = 256
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    state = {"scaler": {}, "step": 3, "tokens": 96, "data": {"epoch": 0, "consumed": 48},
             "world_size": 1, "val_loss": 4.0, "recent_metrics": [], "config": cfg.to_dict(),
             "tokenizer": {"type": "byte", "vocab_size": 256}}
    save_checkpoint(folder, 0, SimpleNamespace(parts=[model], optimizers=[opt]), state=state)
    return model


class Payload:
    """What a malicious checkpoint could hold: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    write_checkpoint(folder)
    marker = tmp_path / "pwned"
    state = torch.load(folder / "state.pt", weights_only=True)
    state["config"] = Payload(marker)
    torch.save(state, folder / "state.pt")
    # Whoever made it could also make its commit record match: the checksums pass.
    record = json.loads((folder / "rank0.json").read_text())
    record["state.pt"] = sha256_file(folder / "state.pt")
    (folder / "rank0.json").write_text(json.dumps(record))
    for command in (["generate", str(folder), "-n", "3", "-q"], ["export", str(folder), "--out", str(tmp_path / "x")]):
        assert_clean_error(cli_here(*command), "refusing to load")
    assert not marker.exists()  # the payload never ran
    assert not (tmp_path / "x").exists()


class _DottedLookup:
    """Unpickled as `torch.distributed.checkpoint.metadata` + `os.system`: a module the dcp
    metadata legitimately names, and a dotted name that pickle protocol 4 resolves through that
    module's own `import os`."""

    def __init__(self, command):
        self.command = command


class _CraftingPickler(pickle._Pickler):
    dispatch = pickle._Pickler.dispatch.copy()

    def _save_dotted_lookup(self, obj):
        self.save("torch.distributed.checkpoint.metadata")
        self.save("os.system")
        self.write(pickle.STACK_GLOBAL)
        self.save((obj.command,))
        self.write(pickle.REDUCE)

    dispatch[_DottedLookup] = _save_dotted_lookup


def _plant_in_dcp_metadata(folder, marker):
    """Rewrite dcp/.metadata so that loading it runs `touch marker` and otherwise loads as
    before (the payload's return value, 0, lands in an attribute nothing reads), then recompute the
    commit record as an attacker would."""
    path = folder / "dcp" / ".metadata"
    with path.open("rb") as f:
        metadata = pickle.load(f)
    metadata.__dict__["note"] = _DottedLookup(f"touch {marker}")
    buf = io.BytesIO()
    _CraftingPickler(buf, protocol=4).dump(metadata)
    path.write_bytes(buf.getvalue())
    record = json.loads((folder / "rank0.json").read_text())
    record["dcp/.metadata"] = sha256_file(path)
    (folder / "rank0.json").write_text(json.dumps(record))


def test_a_dcp_metadata_that_would_run_code_is_refused_by_every_loader(tmp_path):
    """export, generate (one process: the whole state gathered) and --resume/--init-from (this
    rank's shards loaded into a model) all read dcp/.metadata first."""
    folder = tmp_path / "ckpt"
    model = write_checkpoint(folder)
    marker = tmp_path / "pwned"
    _plant_in_dcp_metadata(folder, marker)
    for command in (["generate", str(folder), "-n", "3", "-q"], ["export", str(folder), "--out", str(tmp_path / "x")]):
        assert_clean_error(cli_here(*command), "refusing to load")
    with pytest.raises(UserError, match="refusing to load"):
        load_state(folder, SimpleNamespace(parts=[model], optimizers=[build_optimizer(
            model, build_config(), torch.device("cpu"))]), optimizer=False)
    assert not marker.exists()  # the payload never ran
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_loads_as_tensors_and_plain_data(tmp_path):
    model = write_checkpoint(tmp_path / "ckpt")
    state = load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    rng = torch.load(tmp_path / "ckpt" / "rng-rank0.pt", weights_only=True)  # numpy's state too
    assert {"python", "numpy", "torch"} <= rng.keys()


def test_each_rank_draws_its_own_dropout_masks_after_any_restore():
    """A rank the saving run did not have (resumed on more workers) gets its own stream, as at a
    fresh start; without one it would draw rank 0's masks."""
    draws = []
    for rank in range(3):
        torch.manual_seed(1337)  # every rank builds the model from the same seed
        restore_rng(None, 1337, rank)
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    torch.manual_seed(5)
    saved = torch.get_rng_state()
    restore_rng({"python": __import__("random").getstate(), "torch": saved,
                 "numpy": _numpy_state()}, 1337, 2)
    assert torch.equal(torch.get_rng_state(), saved)  # a saved state wins


def _numpy_state():
    from raytrain_lm.store.checkpoint_format import rng_state

    return rng_state()["numpy"]


def test_the_best_checkpoint_shares_the_files_of_a_local_checkpoint(tmp_path):
    """best_checkpoint/ on a local disk links the checkpoint's files instead of copying them (a
    copy doubled the disk and the time of every improving evaluation: 3.4 GB more per report for
    a gpt2-medium run), and stays whole when Ray later deletes the checkpoint."""
    import shutil

    from ray.train import Checkpoint

    from raytrain_lm.ray_compat.callbacks import KeepBest

    src = tmp_path / "checkpoint_00000010"
    (src / "dcp").mkdir(parents=True)
    (src / "dcp" / "__0_0.distcp").write_bytes(b"w" * 1000)
    (src / "meta.json").write_text('{"step": 10}')
    KeepBest().after_report(None, [{"val_loss": 2.0}], Checkpoint(str(src)))
    best = tmp_path / "best_checkpoint"
    for rel in ("dcp/__0_0.distcp", "meta.json"):
        assert (best / rel).stat().st_ino == (src / rel).stat().st_ino  # the same file, not a copy
    shutil.rmtree(src)  # Ray's retention deletes it
    assert (best / "dcp" / "__0_0.distcp").read_bytes() == b"w" * 1000
    assert json.loads((best / "meta.json").read_text()) == {"step": 10}


def test_the_best_checkpoint_on_s3_is_a_copy_written_meta_last(tmp_path):
    """S3 cannot rename a folder, so best_checkpoint/ never appeared there (`--best` failed,
    `--init-from RUN` silently took the latest). On moto's server: kept, found by --best, and
    replaced whole when beaten (no file of the old one left to make it invalid)."""
    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    from raytrain_lm.ray_compat.callbacks import KeepBest
    from raytrain_lm.store.runs import find_checkpoint
    from s3_server import moto_s3, s3_keys

    with moto_s3("best"):
        fs = pafs.S3FileSystem(endpoint_override=__import__("os").environ["AWS_ENDPOINT_URL"],
                               scheme="http", region="us-east-1")
        fs.open_output_stream("best/runs/r/metrics.jsonl").close()  # a run
        keep = KeepBest()
        for step, loss in ((3, 2.0), (5, 1.5)):
            local = tmp_path / f"checkpoint_{step:08d}"
            write_checkpoint(local)
            meta = json.loads((local / "meta.json").read_text())
            (local / "meta.json").write_text(json.dumps({**meta, "step": step}))
            if step == 5:  # a checkpoint of another layout: other files than the one it replaces
                (local / "rng-rank0.pt").rename(local / "rng-rank0-moved.pt")
                record = json.loads((local / "rank0.json").read_text())
                record["rng-rank0-moved.pt"] = record.pop("rng-rank0.pt")
                (local / "rank0.json").write_text(json.dumps(record))
            pafs.copy_files(str(local), f"best/runs/r/{local.name}",
                            source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
            keep.after_report(None, [{"val_loss": loss}],
                              Checkpoint(f"best/runs/r/{local.name}", filesystem=fs))
            found = find_checkpoint("r", "s3://best/runs", best=True)
            try:
                assert found.step == step and found.source == "s3://best/runs/r/best_checkpoint"
            finally:
                found.cleanup()
        best = {k.rsplit("best_checkpoint/", 1)[1] for k in s3_keys("best", "runs/r/best_checkpoint/")}
        assert "rng-rank0-moved.pt" in best and "rng-rank0.pt" not in best


def test_the_cuda_rng_state_restored_is_this_workers_device_whatever_the_gpus_seen():
    """A worker saves its own device's CUDA state; a checkpoint that saved one per visible GPU
    (a list) gives this device its entry, or nothing where the saving worker saw fewer GPUs
    (resumed on larger nodes) instead of an IndexError that failed every restart."""
    from raytrain_lm.store.checkpoint_format import cuda_state_for

    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    assert torch.equal(cuda_state_for(states[5], 3), states[5])  # this format: one state
    assert torch.equal(cuda_state_for(states, 3), states[3])  # one per GPU of an 8-GPU node
    assert cuda_state_for(states[:1], 3) is None  # saved on 1-GPU nodes, resumed on 8


def test_a_damaged_newest_checkpoint_gives_way_to_the_one_before_with_a_line(tmp_path):
    """An edited meta.json (its step a string) in the newest checkpoint is a torn checkpoint to
    every reader: `generate` takes the one before and says why in one line, and the driver's
    look at a resumed run (resume_step's newest_checkpoint_meta) finds the same one."""
    import crafted
    from raytrain_lm.store.runs import newest_checkpoint_meta
    from raytrain_lm.store.storage import RunFolder

    crafted.damaged_newest(tmp_path)
    r = cli_here("generate", "r", "--storage", str(tmp_path / "runs"), "-n", "2")
    assert r.returncode == 0, r.stderr
    warning, found = r.stderr.strip().splitlines()[:2]
    assert warning.startswith("warning: skipping checkpoint_00000006: ") and \
        warning.endswith("checkpoint_00000006/meta.json is corrupted: step 'six'")
    assert "checkpoint_00000003 (step 3" in found
    assert newest_checkpoint_meta(RunFolder(str(tmp_path / "runs"), "r"))[0] == 3
