"""`plan --budget` (plan/budget.py): from a compute budget to the compute-optimal model of a
scaling law, its tokens, its batch from a noise scale, and the planner's layouts for it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import cli_here
from raytrain_lm.errors import UserError
from raytrain_lm.plan.budget import parse_budget
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
    (["--budget", "lots"], "--budget must be a positive number of FLOPs (e.g. 5.8e23) or of GPU-hours"),
    (["--budget", "0gpu-h"], "--budget must be a positive number of FLOPs (e.g. 5.8e23) or of GPU-hours"),
])
def test_plan_budget_refuses_bad_input(args, expected):
    r = cli_here("plan", *args)
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("text,expected", [
    ("5.88e23", (5.88e23, False)), ("1e6gpu-h", (1e6, True)), ("2.5E5 GPU-hours", (2.5e5, True)),
    ("300gpuh", (300.0, True)), ("1 gpu-hour", (1.0, True)),
])
def test_parse_budget_reads_flops_and_gpu_hours(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["", "gpu-h", "1e6 gpus", "-3gpu-h", "inf", "nan", "1e6 h"])
def test_parse_budget_refuses_what_is_neither(text):
    with pytest.raises(UserError, match="--budget must be a positive number"):
        parse_budget(text)


def test_a_gpu_hours_budget_is_spent_at_the_planners_rate_for_its_model():
    """--budget 1e6gpu-h on H100s: the FLOPs are the hours at the 6N FLOPs per second of the
    fastest layout the planner finds for the compute-optimal model of those FLOPs (a fixed point,
    not the first guess of the iteration): the same budget given in FLOPs plans the same model,
    whose first layout's step time gives that rate."""
    hours = 1e6
    b = plan_json("--gpu", "h100-sxm", "--budget", f"{hours:g}gpu-h")["budget"]  # the last --budget wins
    assert b["gpu_hours"] == hours and b["flops"] == pytest.approx(hours * 3600 * b["flops_per_gpu_s"])
    again = plan_json("--gpu", "h100-sxm", "--budget", repr(b["flops"]))
    assert (again["budget"]["n_layer"], again["budget"]["n_embd"]) == (b["n_layer"], b["n_embd"])
    best = again["layouts"][0]
    tokens_per_step = again["global_batch"] * again["seq_len"]
    rate = 6 * b["n_model"] * tokens_per_step / (best["seconds"]["step"] * 64)
    assert b["flops_per_gpu_s"] == pytest.approx(rate, rel=1e-9)
    assert b["mfu"] == pytest.approx(best["mfu"], rel=1e-9)
