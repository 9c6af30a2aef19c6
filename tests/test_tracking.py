"""--track mlflow|wandb without Ray: metrics rows fed through the driver's own Follower and
run/tracked.py (what `train` runs), sent by the real MLflow client to a local store and by the
real W&B client in offline mode, and read back with their own readers (MlflowClient; W&B's record
schema over its offline run file). The same with a real run killed and resumed, and a Tune sweep,
on Ray: tests/test_resume.py, tests/test_tune.py."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_here
from raytrain_lm.cli.train import curves
from raytrain_lm.config.load import build_config
from raytrain_lm.run.follower import Follower
from raytrain_lm.run.tracked import close_tracking, open_tracking, trackers_of
from raytrain_lm.store.storage import RunFolder
from raytrain_lm.track import flat_params

STEPS = (5, 10, 15, 20)


def rows_of(steps, first_loss: float = 5.0) -> list[dict]:
    """Metrics rows as a worker sends them (the keys Meter.row and the loop fill)."""
    out = []
    for i, step in enumerate(steps):
        row = {"step": step, "loss": first_loss - 0.1 * step, "lr": 1e-3 * (i + 1), "grad_norm": 0.5,
               "tokens_per_second": 1000.0 + i, "mfu": None, "peak_mem_gb": 0.3, "tokens": step * 512,
               "workers": 2, "step_losses": [first_loss - 0.1 * step], "elapsed": float(step),
               "train_start_unix": 1.8e9}
        if step % 10 == 0:
            row.update(val_loss=row["loss"] + 0.1, val_ppl=2.0, val_bpb=3.0)
        out.append(row)
    return out


class NoTensorBoard:
    def add(self, row) -> None:
        pass


def drive(storage: Path, name: str, rows: list[dict], track: list[str], resume: bool = False,
          status: str = "completed", said: list | None = None) -> dict:
    """What run/driver._launch does with a run's rows, without Ray: the Follower takes each row
    (metrics.jsonl, the tracking runs), then the summary and the tracking runs' end."""
    said = [] if said is None else said
    cfg = build_config(flags=dict(storage=str(storage), name=name, max_steps=STEPS[-1]))
    run = RunFolder(str(storage), name)
    trackers = trackers_of(run, track, resume)
    follower = Follower(cfg, run, time.time(), {}, resume, said.append, None)
    follower.tracking = open_tracking(trackers, run, cfg.to_dict(), said.append, follower.log.rows)
    for row in rows:
        follower.take(dict(row), NoTensorBoard())
    final = follower.write_summary(status)
    close_tracking(follower.tracking, final, follower.log.rows, status, curves)
    return final


def jsonl_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tests")
    from mlflow import MlflowClient

    return MlflowClient()


@pytest.mark.slow
def test_mlflow_run_holds_every_row_and_a_resume_continues_it(tmp_path, mlflow_store):
    """Parameters = the flat config; every row's loss at its step equals metrics.jsonl's; the
    summary, summary.json and the curves' figure; FINISHED. A resumed driver (rows resent from
    a checkpoint at step 10, as an exact resume recomputes them, then new ones) continues the same
    MLflow run: one run, each step once, still equal to metrics.jsonl. A run tracked only from
    a resume on gets the steps it had before first."""
    drive(tmp_path, "r", rows_of(STEPS[:3]), ["mlflow"], status="failed")
    record = json.loads((tmp_path / "r" / "tracking.json").read_text())["mlflow"]
    client = mlflow_store
    run = client.get_run(record["run_id"])
    assert run.info.status == "FAILED" and run.info.run_name == "r"
    config = build_config(flags=dict(storage=str(tmp_path), name="r", max_steps=STEPS[-1])).to_dict()
    assert run.data.params == {k: str(v) for k, v in flat_params(config).items()}

    summary = drive(tmp_path, "r", rows_of(STEPS[1:]), [], resume=True)  # tracking.json: continue it
    runs = client.search_runs([record["experiment_id"]])
    assert [r.info.run_id for r in runs] == [record["run_id"]]
    history = client.get_metric_history(record["run_id"], "loss/train")
    assert sorted(m.step for m in history) == list(STEPS)  # each step once
    assert {m.step: m.value for m in history} == pytest.approx(jsonl_losses(tmp_path / "r"))
    val = {m.step: m.value for m in client.get_metric_history(record["run_id"], "loss/val")}
    assert val == pytest.approx({10: 4.1, 20: 3.1})
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["summary/final_val_loss"] == pytest.approx(summary["final_val_loss"])
    assert run.data.tags["summary.status"] == "completed"
    assert {a.path for a in client.list_artifacts(record["run_id"])} == {"summary.json", "curves.png"}
    kept = Path(client.download_artifacts(record["run_id"], "summary.json", str(tmp_path)))
    assert json.loads(kept.read_text())["steps"] == STEPS[-1]

    # tracked only from a resume on: the steps metrics.jsonl already had come first
    drive(tmp_path, "late", rows_of(STEPS[:3]), [], status="failed")
    drive(tmp_path, "late", rows_of(STEPS[1:]), ["mlflow"], resume=True)
    late = json.loads((tmp_path / "late" / "tracking.json").read_text())["mlflow"]["run_id"]
    history = client.get_metric_history(late, "loss/train")
    assert sorted(m.step for m in history) == list(STEPS)
    assert {m.step: m.value for m in history} == pytest.approx(jsonl_losses(tmp_path / "late"))


def wandb_records(run_file: Path) -> list:
    """The records of a W&B offline run file (`run-<id>.wandb`), parsed with W&B's own record
    schema (wandb_internal_pb2.Record). The file is W&B's transaction log: a 7-byte header, then
    LevelDB-log framing (32 KiB blocks; each chunk: CRC32, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):  # the end, or still being written
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or the last chunk of a record
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
    return records


def wandb_run(folder: Path, wait: float = 120.0) -> dict:
    """What an offline run folder holds: run id, group, config, history {step: {key: value}},
    summary, exit code. W&B's service may still be writing the file when `finish()` has
    returned: read until it ends with the run's exit record (`wait`: a bound for a run that never
    ends; a loaded machine's service takes longer)."""
    deadline = time.time() + wait
    while (out := _wandb_run(folder))["exit_code"] is None and time.time() < deadline:
        time.sleep(0.2)
    return out


def _wandb_run(folder: Path) -> dict:
    out = {"history": {}, "summary": {}, "config": {}, "exit_code": None, "artifacts": 0}
    for r in wandb_records(next(folder.glob("run-*.wandb"))):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, group=r.run.run_group, name=r.run.display_name)
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out["history"][items["_step"]] = items
        elif kind == "summary":
            out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in r.summary.update})
        elif kind == "artifact":
            out["artifacts"] += 1
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


@pytest.mark.slow
def test_wandb_offline_run_holds_every_row_and_a_resume_continues_it(tmp_path, monkeypatch):
    """The same through W&B offline: config, each row's loss at its step, the summary, one
    artifact, the exit code; the resumed driver writes a second offline folder of the same run
    id (which `wandb sync` uploads into one run) with the steps the first did not have."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "tests")
    drive(tmp_path, "w", rows_of(STEPS[:3]), ["wandb"], status="failed")
    summary = drive(tmp_path, "w", rows_of(STEPS[1:]), [], resume=True)
    first, second = (wandb_run(f) for f in sorted((tmp_path / "wandb").glob("offline-run-*")))
    record = json.loads((tmp_path / "w" / "tracking.json").read_text())["wandb"]
    assert first["id"] == second["id"] == record["id"] and record["project"] == "tests"
    assert first["name"] == "w" and first["exit_code"] == 1 and second["exit_code"] == 0
    assert first["config"]["max_steps"] == STEPS[-1] and first["config"]["model.n_layer"] == 4
    logged = {step: h["loss/train"] for part in (first, second) for step, h in part["history"].items()}
    assert sorted(second["history"]) == [STEPS[-1]]  # 10 and 15 were the first driver's
    assert logged == pytest.approx(jsonl_losses(tmp_path / "w"))
    assert second["summary"]["final_val_loss"] == pytest.approx(summary["final_val_loss"])
    assert second["summary"]["status"] == "completed" and second["artifacts"] == 1


def test_an_unreachable_tracking_server_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    """The warning names the server without the user, password or token its URI holds."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:hunter2@127.0.0.1:1/?token=s3cr3t")  # nothing listens
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    said: list[str] = []
    summary = drive(tmp_path, "u", rows_of(STEPS), ["mlflow"], said=said)
    assert summary["status"] == "completed"
    assert len(said) == 1 and said[0].startswith("warning: mlflow tracking stopped "
                                                 "(http://***@127.0.0.1:1/?token=***"), said
    assert not any(secret in said[0] for secret in ("alice", "hunter2", "s3cr3t"))
    assert "every row is in metrics.jsonl" in said[0]
    assert sorted(jsonl_losses(tmp_path / "u")) == list(STEPS)
    assert not (tmp_path / "u" / "tracking.json").exists()


def test_credentials_in_the_tracking_uri_are_not_stored(tmp_path, monkeypatch):
    """tracking.json, which continues the MLflow run on --resume, keeps where it went without the
    URI's user and password (MLflow's file store takes a URI with user information too)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://alice:hunter2@localhost{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tests")
    said: list[str] = []
    drive(tmp_path, "c", rows_of(STEPS[:1]), ["mlflow"], said=said)
    record = json.loads((tmp_path / "c" / "tracking.json").read_text())
    assert record["mlflow"]["tracking_uri"] == f"file://***@localhost{tmp_path / 'mlruns'}", record
    assert not said and "hunter2" not in (tmp_path / "c" / "tracking.json").read_text()


def test_track_without_its_client_installed_names_the_extra(tmp_path, monkeypatch):
    """Refused before anything starts, in one line that says what to install (the package kept
    from being imported the way Python provides: None in sys.modules)."""
    monkeypatch.setitem(sys.modules, "mlflow", None)
    res = cli_here("train", "--track", "mlflow", "--storage", str(tmp_path))
    assert res.returncode == 2 and res.stderr.strip() == (
        "error: --track mlflow needs the mlflow client, which is not installed: "
        "pip install 'raytrain-lm[track]'")
    assert list(tmp_path.iterdir()) == []
