"""What a run leaves on disk when things go wrong around it: two drivers for one folder, damaged
or torn files, a kill in the middle of a write, a full disk. No Ray: the files, the code that
reads and writes them, and the CLI as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_here
from raytrain_lm.errors import UserError
from raytrain_lm.store.storage import MetricsLog, RunFolder
from test_cli_errors import assert_clean_error


def dead_pid() -> int:
    """The pid of a process of this machine that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------- one driver per run folder

def test_a_second_claim_on_a_run_folder_is_refused_on_s3_too():
    """Object stores have no atomic create: each driver writes its own claim, then looks for
    others'. On moto's server, as on a disk: the second is refused and leaves no claim."""
    from raytrain_lm.store.claims import RunClaim
    from s3_server import moto_s3, s3_keys

    with moto_s3("claims"):
        run = RunFolder("s3://claims/runs", "r")
        with RunClaim(run):
            with pytest.raises(UserError, match=r"'r' in s3://claims/runs is in use by another "
                                                 r"driver \(pid \d+ on "):
                RunClaim(RunFolder("s3://claims/runs", "r")).take()
            assert len([k for k in s3_keys("claims", "runs/r/") if not k.endswith("/")]) == 1
        assert s3_keys("claims", "runs/r") == {}  # the first's claim only, and then nothing
        with RunClaim(run):  # released: free again
            pass


def test_a_dead_or_silent_drivers_claim_does_not_block_the_run(tmp_path):
    """A killed driver's claim (its process gone, on this machine), or one not renewed for
    STALE_S (a driver elsewhere that died), is not a claim: --resume after a crash works."""
    from raytrain_lm.store.claims import RunClaim, live_claims

    run = RunFolder(str(tmp_path), "r")
    run.write_json(".claim-dead.json", {"host": os.uname().nodename, "pid": dead_pid(),
                                        "time": time.time()})
    run.write_json(".claim-old.json", {"host": "elsewhere", "pid": 1,
                                       "time": time.time() - RunClaim.STALE_S - 1})
    run.write_json(".claim-live.json", {"host": "elsewhere", "pid": 1, "time": time.time()})
    assert [c["file"] for c in live_claims(run)] == [".claim-live.json"]
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [".claim-live.json"]  # stale ones gone
    (tmp_path / "r" / ".claim-live.json").unlink()
    with RunClaim(run) as claim:
        assert [c["file"] for c in live_claims(run)] == [claim.file]


def test_a_refused_claim_leaves_no_folder_behind(tmp_path):
    """The claim creates the run's folder (and its storage's); given up, they go again."""
    from raytrain_lm.store.claims import RunClaim

    with RunClaim(RunFolder(str(tmp_path / "a" / "runs"), "r")):
        assert (tmp_path / "a" / "runs" / "r").is_dir()
    assert list(tmp_path.iterdir()) == []


def test_two_trains_of_one_name_at_once_do_not_both_run(tmp_path, pydoc_data):
    """Two real `train --name X`: the first (a subprocess) holds its claim while it reaches for a
    cluster (an address where something listens and never answers, for the 3 s of the
    reachability check); the second, meanwhile, is refused. The second runs in this process with
    its modules imported beforehand: a second interpreter's start-up could outlast those 3 s on
    a loaded machine, and then the first would have let go of its claim already."""
    import socket

    import raytrain_lm.cli.train  # noqa: F401  (imported before the race, not during it)
    import raytrain_lm.run.driver  # noqa: F401

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    args = [sys.executable, str(Path(__file__).resolve().parents[1] / "cli.py"), "train", "--name",
            "x", "--data", str(pydoc_data), "--storage", str(tmp_path / "runs"), "--address",
            f"127.0.0.1:{port}"]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "runs").glob("x/.claim-*")):
            assert time.monotonic() < deadline and first.poll() is None, "the first took no claim"
            time.sleep(0.05)
        second = cli_here(*args[2:])
        assert first.poll() is None, "the first let go of its claim before the second ran"
        assert_clean_error(second, "run 'x' in ")
        assert "is in use by another driver" in second.stderr
    finally:
        first.kill()
        first.communicate()
        listener.close()


# ---------------------------------------------------------------- damaged and torn files

def _write_run(storage: Path, name: str, summary, metrics: str) -> None:
    (storage / name).mkdir(parents=True)
    if summary is not None:
        (storage / name / "summary.json").write_text(summary)
    (storage / name / "metrics.jsonl").write_text(metrics)


ROW = '{"step": %d, "loss": 2.5, "lr": 0.001, "tokens_per_second": 1000.0, "val_loss": 2.4, "val_ppl": 11.0}\n'


def test_one_damaged_summary_does_not_break_runs_for_the_others(tmp_path):
    good = json.dumps({"status": "completed", "steps": 20, "max_steps": 20, "final_val_loss": 2.4,
                       "finished": "2026-12-01T10:00:00+00:00"})
    _write_run(tmp_path, "good", good, ROW % 10 + ROW % 20)
    _write_run(tmp_path, "torn-summary", good[:40], ROW % 10)
    _write_run(tmp_path, "odd-types", json.dumps({"status": "completed", "steps": "many",
                                                  "finished": 5}), ROW % 10)
    _write_run(tmp_path, "no-summary", None, ROW % 10 + '{"step": 20, "lo')  # killed mid-append
    result = cli_here("runs", "--storage", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()[1:]}
    assert lines == {"good": "completed", "torn-summary": "damaged", "odd-types": "damaged",
                     "no-summary": "unfinished"}
    listed = json.loads(cli_here("runs", "--storage", str(tmp_path), "--json").stdout)
    [torn] = [r for r in listed if r["name"] == "torn-summary"]
    assert torn["error"].startswith(f"{tmp_path}/torn-summary/summary.json is damaged")


def test_a_torn_last_line_of_the_metrics_is_left_out_and_the_next_row_starts_a_line(tmp_path):
    """A kill in the middle of an append leaves a last line without its end: `report` reads the
    rows before it, and a resumed run's next row must not be glued to it."""
    _write_run(tmp_path, "r", None, ROW % 10 + ROW % 20 + '{"step": 30, "lo')
    result = cli_here("report", "r", "--storage", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["runs"][0]["steps"] == 20
    log = MetricsLog(RunFolder(str(tmp_path), "r"))
    assert [r["step"] for r in log.rows] == [10, 20]
    log.add(json.loads(ROW % 30))
    assert [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()] == \
        [10, 20, 30]


def test_a_resumed_runs_damaged_summary_counts_nothing_rather_than_stopping_it(tmp_path):
    from raytrain_lm.run.driver import previous_summary

    _write_run(tmp_path, "r", '{"restarts": 2, "resi', ROW % 10)
    assert previous_summary(RunFolder(str(tmp_path), "r")) == {}
    (tmp_path / "r" / "summary.json").write_text('{"restarts": 2}')
    assert previous_summary(RunFolder(str(tmp_path), "r")) == {"restarts": 2}


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    """meta.json with world_size 0 skipped every checksum, and a truncated shard then ended the
    command with torch's 77-line CheckpointException. Now it is skipped for the previous one."""
    from test_checkpoint import write_checkpoint

    run = tmp_path / "runs" / "r"
    for step in (3, 6):
        write_checkpoint(run / f"checkpoint_{step:08d}")
        meta = json.loads((run / f"checkpoint_{step:08d}" / "meta.json").read_text())
        (run / f"checkpoint_{step:08d}" / "meta.json").write_text(json.dumps({**meta, "step": step}))
    (run / "metrics.jsonl").write_text(ROW % 6)
    newest = run / "checkpoint_00000006"
    (newest / "meta.json").write_text(json.dumps({**json.loads((newest / "meta.json").read_text()),
                                                  "world_size": 0}))
    shard = next((newest / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    result = cli_here("generate", "r", "--storage", str(tmp_path / "runs"), "-n", "3", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == 3


# ---------------------------------------------------------------- leftovers

def test_a_killed_prepares_staging_folder_is_cleaned_by_the_next_one(tmp_path):
    """staged_folder writes `.NAME.tmp-PID-...` beside its target; a kill leaves it forever. The
    next write of the same target removes those of dead processes of this machine, no other."""
    host = os.uname().nodename
    (tmp_path / "c.txt").write_text("some words of text. " * 1000)
    dead = tmp_path / f".ds.tmp-{dead_pid()}-0123abcd-{host}"
    before_hosts = tmp_path / f".ds.tmp-{dead_pid()}-0123abcd"  # made before tags named the host
    live = tmp_path / f".ds.tmp-{os.getpid()}-0123abcd-{host}"
    elsewhere = tmp_path / f".ds.tmp-{dead_pid()}-0123abcd-another-host"
    other_name = tmp_path / f".dsx.tmp-{dead_pid()}-0123abcd-{host}"
    for folder in (dead, before_hosts, live, elsewhere, other_name):
        (folder / "half").mkdir(parents=True)
    result = cli_here("prepare", "--input", str(tmp_path / "c.txt"), "--out", str(tmp_path / "ds"),
                     "--no-ray", "-q")
    assert result.returncode == 0, result.stderr
    assert not dead.exists() and not before_hosts.exists()
    assert live.exists() and elsewhere.exists() and other_name.exists()


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MB tmpfs: a real disk that fills up (mounting needs root; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_run_stopped_by_a_full_disk_says_failed_in_its_summary(full_disk):
    """summary.json is written whole and moved into place, which needs room for a second copy:
    on a full disk it stayed "running" while the run exited. It is overwritten in place instead
    (its blocks are there already), and no half-written temporary file is left."""
    from raytrain_lm.config.load import build_config
    from raytrain_lm.run.follower import Follower

    cfg = build_config(flags={"name": "r", "storage": str(full_disk)})
    run = RunFolder(str(full_disk), "r")
    follower = Follower(cfg, run, time.time(), {}, False, lambda m: None, None)
    follower.write_summary("running")
    filler = full_disk / "filler"
    with pytest.raises(OSError):
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
    with pytest.raises(UserError, match="No space left on device"):
        follower.log.add(json.loads(ROW % 10))  # the metrics can no longer be kept
    summary = follower.write_summary("failed", error="cannot write metrics.jsonl: No space left on device")
    assert json.loads((full_disk / "r" / "summary.json").read_text()) == json.loads(json.dumps(
        summary, default=str))
    assert json.loads((full_disk / "r" / "summary.json").read_text())["status"] == "failed"
    assert sorted(p.name for p in (full_disk / "r").iterdir()) == ["metrics.jsonl", "summary.json"]


def test_a_resumed_sweep_trusts_only_its_own_users_pickles(tmp_path):
    """`tune --resume` unpickles Tune's state: on a disk only files of this user's that nobody
    else may write; on S3, where the writer cannot be known, with a warning saying who is trusted."""
    from raytrain_lm.tune.sweep import check_sweep_state
    from s3_server import moto_s3

    sweep = tmp_path / "s"
    (sweep / "trial_1").mkdir(parents=True)
    for rel in ("tuner.pkl", "experiment_state-2026.json", "trial_1/params.pkl"):
        (sweep / rel).write_bytes(b"x")
    check_sweep_state(RunFolder(str(tmp_path), "s"), print)  # all this user's: resumed
    os.chmod(sweep / "trial_1" / "params.pkl", 0o666)
    with pytest.raises(UserError, match=r"trial_1/params.pkl was written by another user or "
                                         r"others may write it"):
        check_sweep_state(RunFolder(str(tmp_path), "s"), print)
    said = []
    with moto_s3("sweeps"):
        check_sweep_state(RunFolder("s3://sweeps/runs", "s"), said.append)
    assert said == ["warning: resuming unpickles Tune's state in s3://sweeps/runs/s: whoever can "
                    "write there can run code here"]
