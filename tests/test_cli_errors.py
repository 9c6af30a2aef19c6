"""Every bad input: one line on stderr, exit code 2, no traceback, nothing written."""

import json
import os

import pytest

from conftest import NO_RAY, cli_here, run_cli


def assert_clean_error(result, expected: str):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("args,expected", [
    (["--workers", "-3"], "--workers must be at least 1"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--set", "model.n_layers=3"], "unknown key 'model.n_layers'"),
    (["--set", "lr=fast"], "lr must be float"),
    (["--seq-len", "4096"], "larger than the model's context"),
    (["--data", "no/such/dir"], "dataset not found"),
])
def test_train_rejects_bad_flags(tmp_path, args, expected):
    result = cli_here("train", "--storage", str(tmp_path / "runs"), *args)
    assert_clean_error(result, expected)
    assert not (tmp_path / "runs").exists()


def test_data_that_is_not_a_dataset(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = cli_here("train", "--data", str(tmp_path), "--storage", str(tmp_path / "runs"))
    assert_clean_error(result, "is not a prepared dataset")


def test_vocab_that_does_not_fit(tmp_path, pydoc_data):
    result = cli_here("train", "--data", str(pydoc_data), "--set", "model.vocab_size=100",
                     "--storage", str(tmp_path / "runs"))
    assert_clean_error(result, "vocabulary of 256 tokens but the model's vocab_size is 100")
    assert not (tmp_path / "runs").exists()


def test_unreadable_corpus(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa")
    result = cli_here("prepare", "--input", str(bad), "--out", str(tmp_path / "out"), env=NO_RAY)
    assert_clean_error(result, "cannot read corpus file")
    assert not (tmp_path / "out").exists()
    result = cli_here("prepare", "--input", str(tmp_path / "missing.txt"),
                      "--out", str(tmp_path / "o"), env=NO_RAY)
    assert_clean_error(result, "corpus not found")


@pytest.mark.parametrize("how", ["flag", "RAY_ADDRESS"])
def test_unreachable_address_fails_fast(tmp_path, pydoc_data, how):
    """Refused before Ray Train is imported (it was, first: 1.2 s of a 1.6 s refusal), whether
    the address comes from --address or RAY_ADDRESS."""
    import subprocess
    import sys

    from conftest import ROOT

    flag = ["--address", "127.0.0.1:1"] if how == "flag" else []
    result = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "cli.py"), "train",
                             "--data", str(pydoc_data), *flag, "--storage", str(tmp_path / "runs")],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    errors = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2 and errors == [
        "error: no Ray cluster answers at 127.0.0.1:1; start one with `python cli.py cluster "
        "local-up` or check the address"], result.stderr[-2000:]
    assert "raytrain_lm.run.driver" in imported and not {"ray.train", "torch"} & imported
    assert not (tmp_path / "runs").exists()


def test_use_gpu_without_gpus(tmp_path, pydoc_data, ray_address):
    result = run_cli("train", "--data", str(pydoc_data), "--use-gpu", "--address", ray_address,
                     "--storage", str(tmp_path / "runs"), timeout=120)
    assert_clean_error(result, "needs 2 GPUs but the cluster has 0")
    assert not (tmp_path / "runs").exists()


def test_prepare_json_output_parses(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("a few words of text. " * 2000)
    result = cli_here("prepare", "--input", str(f), "--out", str(tmp_path / "d"), "--json",
                      env=NO_RAY)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["vocab_size"] == 256


BAD_NAMES = ["../../escape", "a/b", "/abs", ".hidden", "..", "x" * 129, "two words", "a;b", ""]


@pytest.mark.parametrize("command,name", [(["train"], name) for name in BAD_NAMES] + [
    (command, name) for command in (["lr-find"], ["tune", "--lr", "1e-4:1e-2"])
    for name in ("../../escape", "")])
def test_names_that_are_not_one_plain_folder_are_refused(tmp_path, pydoc_data, command, name):
    """A run or sweep name cannot lead out of --storage; refused before anything is written
    (RAY_ADDRESS is a closed port: input let through fails as "no Ray cluster answers")."""
    storage = tmp_path / "a" / "b" / "runs"
    result = cli_here(*command, "--name", name, "--data", str(pydoc_data), "--storage",
                      str(storage), env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert_clean_error(result, f"--name {name!r} is not a valid name: use letters, digits")
    assert list(tmp_path.iterdir()) == []


def test_tune_resume_refuses_a_name_out_of_storage(tmp_path):
    result = cli_here("tune", "--resume", "--name", "../elsewhere", "--storage", str(tmp_path / "runs"),
                     env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert_clean_error(result, "--name '../elsewhere' is not a valid name")


@pytest.mark.parametrize("command", ["train", "tune"])
def test_cli_here_never_connects_to_ray(tmp_path, monkeypatch, command):
    """conftest.cli_here stops every in-process call at the connection, whichever way a module
    holds `connect_ray` (tune/sweep.py and run/driver.py import it by name): else, in the whole
    suite, where this process holds the session cluster, a call would train on it for minutes.
    `ray.init` is a fuse here, so a broken guard fails at once instead of starting a Ray."""
    import ray

    import raytrain_lm.run.driver  # noqa: F401  (bind connect_ray before the call, as in the suite)
    import raytrain_lm.tune.sweep  # noqa: F401

    def fuse(*args, **kwargs):
        raise RuntimeError("fuse: a test reached ray.init")

    monkeypatch.setattr(ray, "init", fuse)
    result = cli_here(command, "--storage", str(tmp_path / "runs"), env={"RAY_ADDRESS": "local"})
    assert result.returncode == 1 and "would connect to Ray" in result.stderr, result.stderr


def test_names_of_letters_digits_dots_dashes_underscores_are_fine():
    from raytrain_lm.config.load import build_config

    for name in ["run-1.v2_final", "A" * 128, "0"]:
        assert build_config(flags=dict(name=name)).name == name


def test_a_manifest_cannot_name_a_shard_outside_its_folder(tmp_path):
    """A crafted manifest.json listing "../evil.arrow" (which exists) is not a dataset."""
    from raytrain_lm.data.prepare import prepare_dataset

    data = tmp_path / "data"
    manifest = prepare_dataset("pydoc", data)
    shard = manifest["val"]["shards"][0]
    (data / shard["file"]).rename(tmp_path / "evil.arrow")
    shard["file"] = "../evil.arrow"
    (data / "manifest.json").write_text(json.dumps(manifest))
    result = cli_here("train", "--data", str(data), "--storage", str(tmp_path / "runs"),
                     env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert_clean_error(result, "is not a valid dataset: shard file name '../evil.arrow' is not a "
                               "plain file name")
    assert not (tmp_path / "runs").exists()


BAD_PATHS = [  # (command line, expected); {tmp}: a folder holding afile (a file), folder/, runs/r1
    ("prepare --out {tmp}/afile/sub", "cannot create {tmp}/afile/sub: {tmp}/afile is a file, not a folder"),
    ("prepare --out /proc/raytrain-lm-x", "cannot create /proc/raytrain-lm-x: No such file or directory"),
    ("train --storage {tmp}/afile --name r", "cannot create {tmp}/afile/r: {tmp}/afile is a file"),
    ("train --storage {tmp}/afile/runs --name r", "cannot create {tmp}/afile/runs/r: {tmp}/afile is a file"),
    ("train --storage /proc/runs --name r", "cannot create /proc/runs/r: No such file or directory"),
    ("lr-find --storage {tmp}/afile/runs --name r", "cannot create {tmp}/afile/runs/r: {tmp}/afile is a file"),
    ("tune --lr 1e-4:1e-2 --storage {tmp}/afile --name s", "cannot create {tmp}/afile/s: {tmp}/afile is a file"),
    ("train --config {tmp}/folder", "config file {tmp}/folder is a folder, not a file"),
    ("train --config {tmp}/mem.json", "cannot read config file {tmp}/mem.json: Input/output error"),
    ("train --data {tmp}/afile", "dataset {tmp}/afile is a file"),
    ("report r1 --storage {tmp}/runs --out {tmp}/afile/r.png", "cannot write {tmp}/afile/r.png: {tmp}/afile is a file"),
    ("report r1 --storage {tmp}/runs --out {tmp}/folder", "cannot write {tmp}/folder: Is a directory"),
    ("report r1 --storage {tmp}/runs --out /proc/r.png", "cannot write /proc/r.png: No such file or directory"),
]


@pytest.mark.parametrize("command,expected", BAD_PATHS)
def test_paths_that_cannot_be_created_read_or_written(tmp_path, pydoc_data, command, expected):
    """A path that is no place for what goes there is the user's mistake: one line naming it and
    why, exit code 2, nothing written (tests run as root: files as parents and /proc stand in
    for permissions)."""
    (tmp_path / "afile").write_text("a file")
    (tmp_path / "folder").mkdir()
    (tmp_path / "mem.json").symlink_to("/proc/self/mem")  # a file that cannot be read
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 3 - s / 100, "lr": 1e-3, "tokens_per_second": 1e3}) + "\n"
        for s in (10, 20, 30)))
    before = sorted(tmp_path.rglob("*"))
    args = command.format(tmp=tmp_path).split()
    if args[0] in ("train", "lr-find", "tune") and "--data" not in args:
        args += ["--data", str(pydoc_data)]
    result = cli_here(*args, env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert_clean_error(result, expected.format(tmp=tmp_path))
    assert sorted(tmp_path.rglob("*")) == before


def test_run_folder_writes_that_fail_say_which_path(tmp_path):
    """Every file the driver, tune and lr-find keep in a run's folder goes through RunFolder."""
    from raytrain_lm.errors import UserError
    from raytrain_lm.store.storage import RunFolder

    (tmp_path / "afile").write_text("a file")
    with pytest.raises(UserError, match=f"cannot write {tmp_path}/afile/r/summary.json: "
                                        f"{tmp_path}/afile is a file, not a folder"):
        RunFolder(str(tmp_path / "afile"), "r").write_json("summary.json", {})


@pytest.mark.parametrize("command,expected", [
    ("train --storage /proc/runs --name r", "cannot create /proc/runs/r"),
    ("export missing --storage {tmp} --out {tmp}/out", "no run 'missing'"),
    ("generate missing --storage {tmp}", "no run 'missing'"),
    ("generate missing --storage {tmp} --temperature -1", "--temperature must be >= 0"),
])
def test_a_bad_input_is_refused_before_the_heavy_imports(tmp_path, command, expected):
    """Ray Train, torch and TensorBoard take ~2-3 s to import here: a mistyped path is refused
    before any of them is (it once took 3.4 s for `train`, 4.2 s for `export` and 3.8 s for `generate`)."""
    import subprocess
    import sys

    from conftest import ROOT

    args = command.format(tmp=tmp_path).split()
    result = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "cli.py"), *args],
                            capture_output=True, text=True, timeout=120)
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    errors = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2 and len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
    assert "raytrain_lm.cli" in imported  # the probe sees our modules
    assert not {"ray.train", "torch", "tensorboard"} & imported
