"""`plan --budget` (plan/budget.py): from a compute budget to the compute-optimal model of a
scaling law, its tokens, its batch from a noise scale, and the planner's layouts for it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import cli_here
from raytrain_lm.plan.scaling_law import CHINCHILLA

# Chinchilla itself: 70B parameters on 1.4T tokens, C = 6 N D
CHINCHILLA_FLOPS = 6 * 70e9 * 1.4e12
ARGS = ["plan", "--budget", f"{CHINCHILLA_FLOPS:g}", "--gpus", "64", "--seq-len", "2048",
        "--set", "model.block_size=2048", "--vocab-size", "32000", "--top", "1",
        "--tp", "8", "--pp", "4", "--strategy", "fsdp"]  # one family of layouts: the planner is quick


def plan_json(*more: str) -> dict:
    r = cli_here(*ARGS, *more, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_70b_budget_with_chinchillas_published_law():
    """Approach 3 with the published (rounded) coefficients: N and D are the brute-force minimum
    of the law along C = 6ND (not the paper's 20 tokens per parameter: those rounded
    coefficients put the optimum near 93, the inconsistency Besiroglu et al. 2024 traced to the
    rounding, docs/tuning.md); the model's shape is within 5% of that N, and the planner lays it
    out."""
    out = plan_json()
    b = out["budget"]
    sizes = np.logspace(9, 12, 30001)
    brute = sizes[np.argmin(CHINCHILLA.loss(sizes, CHINCHILLA_FLOPS / 6 / sizes))]
    assert b["n_opt"] == pytest.approx(brute, rel=1e-3)  # the grid's spacing
    assert b["tokens_per_param"] == pytest.approx(b["d_opt"] / b["n_opt"])
    assert b["n_model"] == pytest.approx(b["n_opt"], rel=0.05)
    assert out["layouts"] and out["layouts"][0]["fits"]


def test_a_70b_budget_at_twenty_tokens_per_parameter_is_chinchilla():
    """Hoffmann et al.'s approaches 1 and 2 (N and D grow alike, 20 tokens per parameter): the
    budget of Chinchilla gives Chinchilla, 70B parameters on 1.4T tokens; the text says so."""
    b = plan_json("--tokens-per-param", "20")["budget"]
    assert b["n_opt"] == pytest.approx(70e9, rel=1e-9)
    assert b["d_opt"] == pytest.approx(1.4e12, rel=1e-9)
    assert b["n_model"] == pytest.approx(70e9, rel=0.05)
    text = cli_here(*ARGS, "--tokens-per-param", "20").stdout
    assert "(20.0 tokens per parameter)" in text


def test_the_noise_scale_sets_the_batch_and_the_steps():
    """A measured B_simple of 1400 sequences: a global batch of 1024 (the power of two nearest in
    log), and the steps that spend the budget's tokens at it."""
    b = plan_json("--noise-scale", "1400")["budget"]
    assert b["global_batch"] == 1024
    assert b["steps"] == int(np.ceil(b["tokens"] / (1024 * 2048)))


@pytest.mark.parametrize("args,expected", [
    (["--budget", "-1"], "--budget must be a positive number"),
    (["--budget", "1e21", "--noise-scale", "0"], "--noise-scale must be a positive"),
    (["--budget", "1e21", "--law", "no-such.json"], "--law no-such.json: expected"),
])
def test_plan_budget_refuses_bad_input(args, expected):
    r = cli_here("plan", *args)
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr
