"""muTransfer end to end on the session's Ray cluster: `tune --param mup --target-width` sweeps a
narrow proxy and writes transfer.yaml, and `train --config transfer.yaml` trains the wide model
from it. As small as Ray allows: two one-worker trials and one run of a few steps each."""

from __future__ import annotations

import json

import yaml

from conftest import run_cli

PROXY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "batch_size=2", "seq_len=16",
         "eval_windows=4", "warmup_steps=1", "checkpoint_every=0"]


def test_tune_writes_transfer_yaml_and_train_runs_the_wide_model_from_it(ray_address, pydoc_data,
                                                                         tmp_path):
    """The proxy (width 32) is swept over two learning rates; transfer.yaml is the best trial's
    config at width 64 with the base width kept at 32, the lr the best trial's; `train --config`
    runs it as a width-64 mup model at that lr (the run's own saved config says so)."""
    common = ["--data", str(pydoc_data), "--storage", str(tmp_path), "--address", ray_address,
              "--workers", "1", "--json"]
    sets = [arg for s in PROXY for arg in ("--set", s)]
    tuned = run_cli("tune", "--param", "mup", "--lr", "1e-3,3e-3", "--search", "grid",
                    "--target-width", "64", "--max-steps", "4", "--name", "proxy", *common, *sets,
                    timeout=300)
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    summary = json.loads(tuned.stdout)
    assert len(summary["trials"]) == 2
    transfer = yaml.safe_load(open(summary["transfer_config"]))
    best_lr = summary["best"]["params"]["lr"]
    assert transfer["lr"] == best_lr
    assert (transfer["model"]["n_embd"], transfer["model"]["mup_base_width"],
            transfer["model"]["param"]) == (64, 32, "mup")
    trained = run_cli("train", "--config", summary["transfer_config"], "--max-steps", "2",
                      "--name", "wide", *common, timeout=300)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    saved = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert (saved["model"]["n_embd"], saved["model"]["mup_base_width"], saved["lr"]) == \
        (64, 32, best_lr)
