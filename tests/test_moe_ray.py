"""The one Ray run of expert parallelism: --ep 2 on two Ray Train workers, one of them killed,
trains the one-worker mixture of experts and resumes exactly (the layouts' arithmetic:
test_moe_parallel.py, on the harness)."""

from __future__ import annotations

import pytest

from local_mode import run_local
from raytrain_lm.run.driver import run_training
from test_moe_parallel import LAYOUTS, STEPS, assert_trains_the_one_worker_model, moe_config


def test_a_killed_ep_run_on_ray_trains_the_one_worker_model_and_resumes_exactly(
        ray_address, pydoc_data, tmp_path, monkeypatch):
    """The ep2 layout (ZeRO-1) on two Ray Train workers, rank 1 killed after step 8, the user
    told, and the group restarted from step 5's checkpoint: the steps it trains twice (6 and 7)
    give the same loss and gradient norm bit for bit, and every step equals the one-worker run's
    (on the harness) within 1e-5, with the same tokens per expert."""
    one = []
    run_local(moe_config(pydoc_data, tmp_path, "one", *LAYOUTS["one"]), on_metrics=one.append)
    # Every row its own report (a step takes longer than log_seconds). Step 7's row is in flight
    # in Ray (a worker holds it until the controller's poll) when the drill kills rank 1 after
    # step 8: whether it reaches the driver first was a race. So the run is held before step 8
    # until this driver has it (the hold drill); the kill comes after.
    run_dir = tmp_path / "ep2-killed"
    monkeypatch.setenv("RAYTRAIN_LM_FAIL_AT", "1:8")
    monkeypatch.setenv("RAYTRAIN_LM_HOLD_AT", "8")
    rows = []

    def on_metrics(row: dict) -> None:
        rows.append(row)
        if row.get("step") == 7:
            (run_dir / "hold-8.release").touch()

    cfg = moe_config(pydoc_data, tmp_path, "ep2-killed", *LAYOUTS["ep2"], max_failures=1,
                     checkpoint_every=5, log_seconds=1e-3)
    messages = []
    summary = run_training(cfg, say=messages.append, on_metrics=on_metrics)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 5
    assert any(m.startswith("worker failure") for m in messages), messages  # the user is told
    rows = [r for r in rows if "step" in r]
    before = {r["step"]: r for r in rows if r.get("resumed_from_step") is None}
    after = {r["step"]: r for r in rows if r.get("resumed_from_step") == 5}
    assert sorted(after) == list(range(6, STEPS + 1)) and {6, 7} <= set(before)
    for step in set(before) & set(after):
        assert after[step]["step_losses"] == before[step]["step_losses"], step
        assert after[step]["grad_norm"] == before[step]["grad_norm"], step
    assert_trains_the_one_worker_model(rows, one)
    assert pytest.approx(one[-1]["loss"], rel=1e-5) == after[STEPS]["loss"]
