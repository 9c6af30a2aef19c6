"""Ray Tune sweeps on the session's real local Ray cluster: every trial a 2-worker gloo DDP training.

ASHA stops a deliberately bad learning rate early; the best config file gives `train` the best
trial's exact settings; a sweep whose driver was killed resumes; `lr-find` suggests a sane lr."""

from __future__ import annotations

import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, kill_train_workers, run_cli
from raytrain_lm.config.load import build_config
from raytrain_lm.tune.space import parse_space
from raytrain_lm.tune.sweep import run_sweep
from raytrain_lm.tune.sweep_config import SweepSettings, check_settings

# A smaller model and batch than the tiny preset, so a trial is mostly Ray start-up (~15 s here).
SMALL = ["model.n_layer=2", "model.n_embd=64", "batch_size=8", "seq_len=64", "eval_windows=64",
         "warmup_steps=5", "checkpoint_every=20"]
BAD_LR = 0.5  # AdamW at 0.5: the loss goes to ~15 nats/token and stays there


@pytest.fixture(scope="module")
def sweep(ray_address, pydoc_data, tmp_path_factory):
    storage = tmp_path_factory.mktemp("sweeps")
    # under mup at its base width (64): every rule is 1, the trials train as sp would; the sweep
    # writes transfer.yaml for width 128 (muTransfer, test_transfer_yaml_trains_the_wide_model)
    cfg = build_config(flags=dict(workers=2, max_steps=60, log_every=10, data=str(pydoc_data),
                                  storage=str(storage), name="asha"), sets=SMALL + ["model.param=mup"])
    # Grid order is the order given and the cluster holds one trial at a time, so the bad lr runs
    # last: ASHA can only cut a trial at a rung where another has been recorded.
    space = parse_space({"lr": f"3e-3,{BAD_LR}"}, [], None, cfg)
    # ASHA on bits per byte (the other sweeps here use the default, val_loss)
    settings = SweepSettings(search="grid", concurrent=2, grace_steps=20, metric="val_bpb",
                             target_width=128)
    check_settings(cfg, space, settings, eval_every_given=False)
    said, tables = [], []
    with pytest.MonkeyPatch.context() as env:  # each trial tracked in a local MLflow store
        env.setenv("MLFLOW_TRACKING_URI", (storage / "mlruns").as_uri())
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        env.setenv("MLFLOW_EXPERIMENT_NAME", "sweeps")
        summary = run_sweep(cfg, space, settings, say=said.append, live=tables.append,
                            live_interval=1, track=["mlflow"])
    return summary, said, tables, storage / "asha", _cpus_in_use_after_a_while()


def _cpus_in_use_after_a_while(wait: float = 120.0) -> float:
    """The CPUs still held, once none is or after `wait` s (a bound for a leak only: it returns
    as soon as Ray has released them, which takes longer on a loaded machine)."""
    import ray

    deadline = time.time() + wait
    while True:
        in_use = ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)
        if in_use == 0 or time.time() > deadline:
            return in_use
        time.sleep(0.5)


def by_lr(summary) -> dict[float, dict]:
    return {t["params"]["lr"]: t for t in summary["trials"]}


def test_bad_learning_rate_is_stopped_early(sweep):
    summary, *_ = sweep
    trials = by_lr(summary)
    assert set(trials) == {3e-3, BAD_LR}
    bad = trials[BAD_LR]
    others = [t for lr, t in trials.items() if lr != BAD_LR]
    assert bad["status"] == "stopped" and bad["steps"] == 20  # cut at the first rung
    assert all(bad["steps"] < t["steps"] for t in others)
    assert [s for s, _ in bad["val_curve"]] == [20]
    assert any(t["status"] == "done" and t["steps"] == 60 for t in others)
    assert bad["final_val_loss"] > max(t["final_val_loss"] for t in others) + 1.0
    # ranked by final validation loss; the bad one is last
    assert [t["rank"] for t in summary["trials"]] == [1, 2] and summary["trials"][-1] is bad
    assert summary["best"]["final_val_loss"] == min(t["final_val_loss"] for t in summary["trials"])


def test_concurrency_beyond_the_cluster_warns_and_queues(sweep):
    summary, said, tables, *_ = sweep
    # The session cluster has 4 CPUs; a trial needs 2 workers x 1 CPU (+0.01 for the trial itself).
    assert any(m.startswith("warning: --concurrent 2 but the cluster holds 1 trial") for m in said)
    assert tables, "no live table was shown"
    for table in tables:  # never two trials running at once
        rows = table.splitlines()[2:]
        assert sum(r.split()[1] in ("running", "starting") for r in rows) <= 1, table
    assert any("1 queued" in t.splitlines()[0] for t in tables)  # the queue was visible
    last = tables[-1].splitlines()
    assert last[1].split()[:6] == ["trial", "status", "step", "loss", "val", "loss"]
    assert len(last) == 2 + 2


def test_stopped_trials_release_their_workers(sweep):
    """A trial stopped by ASHA ends with its actor; its Train workers' placement group must not
    stay behind holding CPUs (Ray 2.60 leaves it without a dashboard; tune aborts the run)."""
    *_, cpus_in_use = sweep
    assert cpus_in_use == 0


def test_each_trial_is_an_mlflow_run_grouped_under_the_sweeps_run(sweep):
    """Two trials, two MLflow runs, children of the sweep's run, each with its lr, its rows at
    their steps (the validation rows ASHA saw), and its status; the sweep's tracking.json names
    them for a resume."""
    from mlflow import MlflowClient

    summary, _, _, folder, _ = sweep
    client = MlflowClient((folder.parent / "mlruns").as_uri())
    ids = json.loads((folder / "tracking.json").read_text())
    parent = ids["sweep"]["mlflow"]["run_id"]
    runs = client.search_runs([ids["sweep"]["mlflow"]["experiment_id"]])
    children = {r.info.run_id: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent}
    assert len(runs) == 3 and len(children) == 2
    assert {ids["trials"][t]["mlflow"]["run_id"] for t in ids["trials"]} == set(children)
    trials = by_lr(summary)
    for run in children.values():
        lr = float(run.data.params["lr"])
        assert run.info.run_name == trials[lr]["dir"] and run.info.status == "FINISHED"
        val = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/val_bits_per_byte")}
        assert val == pytest.approx(dict(trials[lr]["val_curve"]))  # what ASHA compared
    assert client.get_run(parent).data.params["search_space"].startswith("lr")


def test_best_config_reproduces_the_best_trial(sweep):
    """`train --config best.yaml` builds its config with build_config; it must equal the config the
    best trial's workers actually trained with (saved in the trial's checkpoint)."""
    summary, _, _, sweep_dir, _ = sweep
    best = summary["best"]
    best_file = sweep_dir / "best.yaml"
    assert summary["best_config"] == str(best_file) and best_file.is_file()
    from_file = build_config(config_file=str(best_file)).to_dict()
    ckpt = sorted((sweep_dir / best["dir"] / "train").glob("checkpoint_0*"))[-1]
    trained = torch.load(ckpt / "state.pt", weights_only=False)["config"]
    assert trained["lr"] == best["params"]["lr"]
    where = ("name", "storage", "address")
    assert {k: v for k, v in from_file.items() if k not in where} == \
           {k: v for k, v in trained.items() if k not in where}
    assert from_file["name"] is None and from_file["storage"] == "runs"


def test_transfer_yaml_trains_the_wide_model(sweep, ray_address, pydoc_data, tmp_path):
    """muTransfer end to end: the sweep of the width-64 proxy under --param mup wrote
    transfer.yaml, the best trial's config at width 128 with the base width kept at 64 and the
    best trial's lr; `train --config transfer.yaml` trains that wide mup model (its saved config
    says so)."""
    import yaml

    summary, _, _, _, _ = sweep
    transfer = yaml.safe_load(open(summary["transfer_config"]))
    best_lr = summary["best"]["params"]["lr"]
    assert transfer["lr"] == best_lr
    assert (transfer["model"]["n_embd"], transfer["model"]["mup_base_width"],
            transfer["model"]["param"]) == (128, 64, "mup")
    trained = run_cli("train", "--config", summary["transfer_config"], "--max-steps", "2",
                      "--workers", "1", "--name", "wide", "--data", str(pydoc_data), "--storage",
                      str(tmp_path), "--address", ray_address, "--json", timeout=300)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    saved = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert (saved["model"]["n_embd"], saved["model"]["mup_base_width"], saved["lr"]) == \
        (128, 64, best_lr)


def test_results_plot_and_trial_folders(sweep):
    summary, _, _, sweep_dir, _ = sweep
    png = (sweep_dir / "val_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    saved = json.loads((sweep_dir / "results.json").read_text())
    assert [t["trial"] for t in saved["trials"]] == [t["trial"] for t in summary["trials"]]
    assert (sweep_dir / "sweep.json").is_file()
    for t in summary["trials"]:  # each trial's Train run (checkpoints) lives in its trial folder
        last = f"checkpoint_{t['steps']:08d}"
        assert (sweep_dir / t["dir"] / "train" / last / "state.pt").is_file()
    assert "val loss" in summary["table"].splitlines()[0] and "val bpb" in summary["table"].splitlines()[0]
    # ranked by val_bpb, the metric ASHA compared; a byte dataset's is its val_loss / ln 2
    assert saved["metric"] == "val_bpb" and all(t["metric"] == "val_bpb" for t in saved["trials"])
    done = [t for t in summary["trials"] if t["final_val_bpb"] is not None]
    assert [t["final_val_bpb"] for t in done] == sorted(t["final_val_bpb"] for t in done)
    for t in done:
        assert abs(t["final_val_bpb"] - t["final_val_loss"] / math.log(2)) < 1e-9


def _experiment_state(sweep_dir: Path) -> dict[str, str]:
    """trial id -> Tune status, from the newest experiment state snapshot."""
    files = sorted(glob.glob(str(sweep_dir / "experiment_state-*.json")))
    if not files:
        return {}
    try:
        data = json.loads(Path(files[-1]).read_text())
    except (OSError, json.JSONDecodeError):  # caught mid-write
        return {}
    return {json.loads(t)["trial_id"]: json.loads(t)["status"] for t, _ in data["trial_data"]}


def test_sweep_resumes_after_its_driver_dies(ray_address, pydoc_data, tmp_path):
    steps = 60
    storage = tmp_path / "sweeps"
    sweep_dir = storage / "resumable"
    args = ["tune", "--lr", "3e-3,1e-2", "--search", "grid", "--workers", "2", "--max-steps", str(steps),
            "--grace-steps", str(steps), "--eval-every", "20", "--data", str(pydoc_data),
            "--storage", str(storage), "--name", "resumable", "--address", ray_address, "--quiet"]
    for s in SMALL:
        args += ["--set", s]
    # Every trial is held before step 21 (the hold drill: after its step-20 checkpoint) until
    # this test releases it: the first one held runs on to the end, the other stays there, so
    # the driver dies with one trial finished and one in the middle, however fast the machine.
    driver = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), *args], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RAYTRAIN_LM_HOLD_AT": "21"})
    # Kill the driver once the first trial is finished (in the saved state) and the second is
    # held, with Ray Train's record of its step-20 checkpoint (in its run's snapshot).
    deadline = time.time() + 240  # only how long to wait for a sweep that went wrong
    first = second = None
    while time.time() < deadline and driver.poll() is None:
        held = sorted(p.parent.parent.name.removeprefix("trial_")
                      for p in sweep_dir.glob("trial_*/train/hold-21.waiting"))
        if held and first is None:
            first = held[0]
            (sweep_dir / f"trial_{first}" / "train" / "hold-21.release").touch()
        second = next((t for t in held if t != first), None)
        snapshot = sweep_dir / f"trial_{second}" / "train" / "checkpoint_manager_snapshot.json"
        if second and _experiment_state(sweep_dir).get(first) == "TERMINATED" and \
                snapshot.is_file() and "checkpoint_00000020" in snapshot.read_text():
            break
        time.sleep(0.5)
    else:
        driver.kill()
        pytest.fail(f"the sweep never got there: {driver.communicate()[0]}")
    first_rows = (sweep_dir / f"trial_{first}" / "result.json").read_text().splitlines()
    os.kill(driver.pid, signal.SIGKILL)
    # The held trial's workers die with it (as when the head node is lost).
    assert kill_train_workers() >= 2
    driver.wait()

    result = run_cli("tune", "--name", "resumable", "--storage", str(storage), "--resume",
                     "--address", ray_address, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming sweep resumable" in result.stdout
    summary = json.loads((sweep_dir / "results.json").read_text())
    assert sorted(t["status"] for t in summary["trials"]) == ["done", "done"], \
        [(t["trial"], t["steps"], (sweep_dir / t["dir"] / "result.json").read_text()[-3000:])
         for t in summary["trials"]]
    assert all(t["steps"] == steps for t in summary["trials"])
    # The finished trial was kept as it was, not trained again ...
    assert (sweep_dir / f"trial_{first}" / "result.json").read_text().splitlines() == first_rows
    # ... and the interrupted one continued from its checkpoint instead of starting over.
    results = (sweep_dir / f"trial_{second}" / "result.json").read_text()
    rows = [json.loads(line) for line in results.splitlines()]
    resumed = {r.get("resumed_from_step") for r in rows} - {None}
    assert resumed == {20}, [r["step"] for r in rows]
    assert (sweep_dir / "best.yaml").is_file()


def test_lr_find_suggests_a_sane_lr(ray_address, pydoc_data, tmp_path):
    # The tiny preset's model; a smaller batch keeps the 80 steps short.
    result = run_cli("lr-find", "--steps", "80", "--workers", "2", "--data", str(pydoc_data),
                     "--storage", str(tmp_path), "--name", "lrf", "--address", ray_address,
                     "--json", "--set", "batch_size=8", "--set", "seq_len=64", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(result.stdout)
    run = tmp_path / "lrf"
    png = (run / "lr_find.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    saved = json.loads((run / "lr_find.json").read_text())
    assert saved["suggested_lr"] == found["suggested_lr"]
    assert len(saved["lrs"]) == 80 and saved["lrs"][0] == pytest.approx(1e-5)
    assert saved["lrs"][-1] == pytest.approx(1.0)
    # The tiny preset trains well at 3e-3 on this corpus (and diverges at 0.5, see above): a sane
    # suggestion lands within about a decade of that, far from both ends of the 1e-5..1 ramp.
    assert 2e-4 <= found["suggested_lr"] <= 1e-2
    assert found["suggested_lr"] < found["min_loss_lr"]
    assert math.isfinite(found["min_smoothed_loss"]) and found["min_smoothed_loss"] < saved["losses"][0]
