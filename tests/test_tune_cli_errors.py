"""Bad input to `tune`, `lr-find` and `train --scale-lr`: one line on stderr, exit code 2, nothing
written. RAY_ADDRESS points at a closed port, so a check that let the input through would fail
loudly ("no Ray cluster answers") instead of quietly starting a cluster."""

import pytest

from conftest import cli_here
from test_cli_errors import assert_clean_error

NO_RAY = {"RAY_ADDRESS": "127.0.0.1:1"}


@pytest.mark.parametrize("args,expected", [
    ([], "no Ray cluster answers"),  # no space given is fine: the default one; then Ray
    (["--lr", "fast"], "lr must be float"),
    (["--lr", "1e-2:1e-4"], "LOW must be below HIGH"),
    (["--lr", "1e-3", "--grace-steps", "500", "--max-steps", "100"],
     "--grace-steps (500) is larger than --max-steps (100)"),
    (["--search", "grid", "--lr", "1e-4:1e-2"], "grid search needs lists of values"),
    (["--space", "workers=1,2"], "workers cannot be tuned"),
    (["--n-embd", "100,130"], "must be divisible by model.n_head"),
    (["--lr", "1e-3", "--eval-every", "7", "--grace-steps", "20"], "must be a multiple of --eval-every"),
    (["--lr", "1e-3", "--concurrent", "0"], "--concurrent must be at least 1"),
    (["--lr", "1e-3", "--metric", "loss"], "--metric must be one of val_loss, val_bpb"),
    (["--lr", "1e-3,3e-3", "--warmup", "0,10"], "--trials 8 random samples of a space of 4 points"),
    (["--space-file", "no/such.yaml"], "config file not found"),
    (["--lr", "1e-3:1e-2", "--target-width", "256"], "only under --param mup"),
    (["--param", "mup", "--n-embd", "64:128", "--target-width", "256"], "do not search model.n_embd"),
    (["--param", "mup", "--lr", "1e-3:1e-2", "--target-width", "130"], "must be divisible by model.n_head"),
    (["--param", "mup", "--lr", "1e-3:1e-2", "--target-width", "256"], "no Ray cluster answers"),
    (["--resume"], "--resume needs --name"),
    (["--resume", "--name", "nosuch"], "cannot resume: no sweep named 'nosuch'"),
])
def test_tune_rejects_bad_input(tmp_path, args, expected):
    result = cli_here("tune", "--storage", str(tmp_path / "runs"), *args, env=NO_RAY)
    assert_clean_error(result, expected)
    assert not (tmp_path / "runs").exists()


def test_tune_refuses_an_invalid_space_file(tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("lr: {normal: [0, 1]}\n")
    result = cli_here("tune", "--space-file", str(f), "--storage", str(tmp_path / "runs"), env=NO_RAY)
    assert_clean_error(result, "expected one of loguniform, uniform, randint, choice, grid")


@pytest.mark.parametrize("command,args,expected", [
    ("lr-find", ["--lr-min", "1", "--lr-max", "0.1"], "--lr-min (1) must be below --lr-max (0.1)"),
    ("lr-find", ["--steps", "5"], "--steps must be at least 20"),
    ("train", ["--scale-lr", "cubic"], "--scale-lr must be one of none, linear, sqrt"),
])
def test_lr_commands_reject_bad_input(tmp_path, command, args, expected):
    result = cli_here(command, "--storage", str(tmp_path / "runs"), *args, env=NO_RAY)
    assert_clean_error(result, expected)
    assert not (tmp_path / "runs").exists()
