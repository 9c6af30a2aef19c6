"""What a user does with a finished run: runs, report, TensorBoard, generate, export.

One real 2-worker training run (tiny preset, 120 steps on the pydoc corpus) is shared by every
test here; the commands run through the CLI's own entry point, cli.main(), in this process
(conftest.cli_here), and the colour test in a subprocess on a terminal.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, cli_here

STEPS = 120


@pytest.fixture(scope="module")
def trained(tiny_run):
    """The session's shared 120-step tiny run: (storage, run folder)."""
    return tiny_run


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def clean_error(result, expected):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ runs


def test_runs_lists_the_run(trained):
    storage, run_dir = trained
    (storage / "not-a-run").mkdir()  # a stray folder is not listed
    res = cli_here("runs", "--storage", str(storage), "--json")
    assert res.returncode == 0, res.stderr
    listed = json.loads(res.stdout)
    assert [r["name"] for r in listed] == ["looked-at"]
    r = listed[0]
    assert r["status"] == "completed" and r["steps"] == STEPS and r["checkpoints"] == 2
    assert r["final_val_loss"] == pytest.approx(metrics(run_dir)[-1]["val_loss"])

    table = cli_here("runs", "--storage", str(storage))
    assert table.returncode == 0
    line = next(ln for ln in table.stdout.splitlines() if ln.startswith("looked-at"))
    assert "completed" in line and f"{STEPS}/{STEPS}" in line and f"{r['final_val_loss']:.4f}" in line
    assert "\033[" not in table.stdout  # no colour codes into a pipe
    assert cli_here("runs", "--storage", str(storage), "-q").stdout.split() == ["looked-at"]
    # Without --storage, the same default as `train`: RAYTRAIN_LM_STORAGE (a cluster's shared one)
    assert cli_here("runs", "-q", env={"RAYTRAIN_LM_STORAGE": str(storage)}).stdout.split() == ["looked-at"]


def test_runs_colours_only_on_a_terminal(trained):
    import os
    import pty
    import subprocess

    storage, _ = trained
    outputs = {}
    for label, extra_env in (("tty", {}), ("no_color", {"NO_COLOR": "1"})):
        primary, secondary = pty.openpty()
        proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "runs", "--storage", str(storage)],
                              stdout=secondary, stderr=subprocess.PIPE, cwd=ROOT, timeout=60,
                              env={**os.environ, "TERM": "xterm", **extra_env})
        os.close(secondary)
        chunks = []
        while True:
            try:
                data = os.read(primary, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        os.close(primary)
        assert proc.returncode == 0, proc.stderr
        outputs[label] = b"".join(chunks).decode()
    assert "\033[32mcompleted" in outputs["tty"]
    assert "\033[" not in outputs["no_color"] and "completed" in outputs["no_color"]


def test_runs_of_an_empty_or_missing_storage(tmp_path):
    res = cli_here("runs", "--storage", str(tmp_path / "nothing"), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == []


# ------------------------------------------------------------------ TensorBoard


def test_tensorboard_event_files_hold_the_curves(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = trained
    assert list(run_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    rows = metrics(run_dir)
    train = acc.Scalars("loss/train")
    assert [e.step for e in train] == [r["step"] for r in rows]
    assert [e.value for e in train] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    val = acc.Scalars("loss/val")
    assert [e.step for e in val] == [60, 120]
    assert [e.value for e in val] == pytest.approx([r["val_loss"] for r in rows if "val_loss" in r], rel=1e-6)
    assert {"optim/lr", "perf/tokens_per_second", "perf/data_wait_frac"} <= set(acc.Tags()["scalars"])


def test_tensorboard_drops_points_of_an_abandoned_attempt(tmp_path):
    """After a restart from a checkpoint, steps come again; TensorBoard must show the new values."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raytrain_lm.run.tensorboard import TensorBoardLog
    from raytrain_lm.store.storage import RunFolder

    tb = TensorBoardLog(RunFolder(str(tmp_path), "r"), say=lambda m: None)
    for step in (10, 20, 30):
        tb.add({"step": step, "loss": 5.0})
    time.sleep(1.1)  # event file names carry the second they were opened
    for step in (20, 30, 40):  # restarted from the checkpoint at step 10
        tb.add({"step": step, "loss": 2.0})
    tb.close()
    acc = EventAccumulator(str(tmp_path / "r"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(10, 5.0), (20, 2.0), (30, 2.0), (40, 2.0)]


# ------------------------------------------------------------------ report


def _png(path):
    import matplotlib.image as mpimg

    img = mpimg.imread(path)[..., :3]
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 1000
    return img


def _pixels_of(img, rgb, tol=0.08):
    return np.all(np.abs(img - np.array(rgb)) < tol, axis=-1)


C0, C1 = (0x1F / 255, 0x77 / 255, 0xB4 / 255), (0xFF / 255, 0x7F / 255, 0x0E / 255)  # matplotlib blue, orange


def test_report_writes_a_png_of_the_real_curves(trained):
    storage, run_dir = trained
    res = cli_here("report", "looked-at", "--storage", str(storage))
    assert res.returncode == 0, res.stderr
    assert "looked-at" in res.stdout and "val loss" in res.stdout
    plot = res.stdout.strip().splitlines()[-1].removeprefix("plot: ")
    assert plot == str(run_dir / "report.png")
    img = _png(plot)
    blue = _pixels_of(img, C0)
    assert blue.sum() > 2000  # curves drawn, not an empty frame
    # One panel per quantity side by side: loss, throughput, learning rate, and the gradient
    # noise scale where the rows have it (a data-parallel run: this one).
    panels = 4 if any(r.get("noise_scale") is not None for r in metrics(run_dir)) else 3
    assert panels == 4
    third = img.shape[1] // panels  # one panel's width
    # The loss panel is the leftmost: its curve falls from the top left to the bottom right.
    rows_, cols = np.nonzero(blue[:, :third])
    left, right = cols.min(), cols.max()
    span = right - left
    assert span > third * 0.6
    # The curve's top at the left and its bottom at the right (the legend's sample line, drawn in
    # the same colour wherever matplotlib finds room, sits above the curve: not its bottom).
    start = rows_[cols < left + span * 0.1].min()
    end = rows_[cols > right - span * 0.1].max()
    assert end - start > img.shape[0] * 0.25, (start, end)  # image rows grow downwards
    # The learning-rate panel (the third) rises in warmup then decays: its top is not at an end.
    r3, c3 = np.nonzero(blue[:, 2 * third:3 * third])
    top_col = c3[r3 == r3.min()].mean()
    assert c3.min() + 0.05 * (c3.max() - c3.min()) < top_col < c3.max() - 0.3 * (c3.max() - c3.min())


def test_report_compare_overlays_runs_and_json_parses(trained, tmp_path):
    storage, run_dir = trained
    other = storage / "other"
    other.mkdir(exist_ok=True)
    shutil.copy(run_dir / "summary.json", other / "summary.json")
    # A second run whose curve is the first one's, shifted: the overlay must draw it in its own colour.
    (other / "metrics.jsonl").write_text("".join(
        json.dumps({**r, "loss": r["loss"] + 0.5}) + "\n" for r in metrics(run_dir)))
    out = tmp_path / "cmp.png"
    res = cli_here("report", "looked-at", "--compare", "other", "--storage", str(storage),
                  "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["plot"] == str(out) and [r["name"] for r in rep["runs"]] == ["looked-at", "other"]
    img = _png(out)
    assert _pixels_of(img, C0).sum() > 1000 and _pixels_of(img, C1).sum() > 1000
    table = cli_here("report", "looked-at", "--compare", "other", "--storage", str(storage), "--out",
                     str(out), "--force")  # its own figure of a moment ago: replaced
    assert table.returncode == 0, table.stderr
    header = table.stdout.splitlines()[0].split()
    assert header == ["run", "looked-at", "other"]
    shutil.rmtree(other)


def test_report_out_replaces_only_a_figure_of_its_own(tmp_path):
    """--out: a new file is written; an existing figure that report wrote is replaced with --force
    only (the same rule as export's and prepare's); anything else is refused (test_bad_inputs)."""
    from raytrain_lm.results.figure_file import is_report_figure
    from test_bad_inputs import _run

    _run(tmp_path)
    out = tmp_path / "fig.png"
    report = ("report", "r", "--storage", str(tmp_path / "runs"), "--out", str(out), "-q")
    assert cli_here(*report).returncode == 0 and is_report_figure(out)
    out.write_bytes(out.read_bytes()[:-12] + b"\0" * 12)  # still ours (the mark is at the start)
    clean_error(cli_here(*report), f"{out} exists (a figure of report's); pass --force to replace it")
    assert out.read_bytes().endswith(b"\0" * 12)
    assert cli_here(*report, "--force").returncode == 0
    assert is_report_figure(out) and not out.read_bytes().endswith(b"\0" * 12)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".fig")] == []  # no staged file left


# ------------------------------------------------------------------ generate


COMMON_WORDS = {"the", "of", "to", "a", "and", "is", "in", "for", "that", "be", "an", "it", "as",
                "or", "not", "with", "this", "by", "on", "if", "from", "are", "can", "which", "will"}


def looks_like_the_corpus(text: str) -> bool:
    """English prose of the kind the pydoc topics hold: printable ASCII, words separated by spaces
    at a plausible rate, and common English words among them. A byte-level model that has learnt
    nothing emits mostly non-printable bytes and fails every part of this."""
    if not text:
        return False
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text) / len(text)
    spaces = text.count(" ") / len(text)
    words = re.findall(r"[A-Za-z]+", text)
    common = {w.lower() for w in words} & COMMON_WORDS
    return printable > 0.97 and 0.08 < spaces < 0.35 and len(words) > 20 and len(common) >= 4


def generate_json(storage, *args):
    res = cli_here("generate", "looked-at", "--storage", str(storage), "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_generate_exact_count_and_deterministic_for_a_seed(trained):
    storage, _ = trained
    a = generate_json(storage, "--prompt", "The ", "--max-new-tokens", "300", "--seed", "3")
    b = generate_json(storage, "--prompt", "The ", "--max-new-tokens", "300", "--seed", "3")
    c = generate_json(storage, "--prompt", "The ", "--max-new-tokens", "300", "--seed", "4")
    assert a["tokens"] == len(a["token_ids"]) == 300
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert c["token_ids"] != a["token_ids"]
    assert a["step"] == STEPS and a["checkpoint"].endswith(f"checkpoint_{STEPS:08d}")
    assert bytes(a["token_ids"]).decode("utf-8", errors="replace") == a["text"]


def test_generate_streams_the_same_text(trained):
    storage, _ = trained
    j = generate_json(storage, "--prompt", "import ", "-n", "80", "--seed", "1")
    plain = cli_here("generate", "looked-at", "--storage", str(storage), "--prompt", "import ",
                    "-n", "80", "--seed", "1")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == "import " + j["text"] + "\n"
    assert "checkpoint" in plain.stderr and "80 tokens in" in plain.stderr
    quiet = cli_here("generate", "looked-at", "--storage", str(storage), "--prompt", "import ",
                    "-n", "80", "--seed", "1", "-q")
    assert quiet.stdout == j["text"] + "\n" and quiet.stderr == ""


def test_generated_text_looks_like_the_corpus_and_untrained_text_does_not(trained):
    """After 120 steps (val loss ~2.4 nats/byte) most samples read like the docs' prose; a model
    of the same shape that has learnt nothing never passes the same criterion."""
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.models.gpt.gpt import GPT
    from raytrain_lm.results.generate import generate_text, sample

    folder = trained[1] / f"checkpoint_{STEPS:08d}"
    seeds = range(5)
    trained_texts = [generate_text(folder, "The ", 300, temperature=0.6, top_k=40, seed=s,
                                   device="cpu")["text"] for s in seeds]
    passed = [t for t in trained_texts if looks_like_the_corpus(t)]
    assert len(passed) >= 4, trained_texts

    cfg = TrainConfig.from_dict(json.loads((folder / "meta.json").read_text())["config"])
    torch.manual_seed(0)
    untrained = GPT(cfg.model).eval()
    for s in seeds:
        ids = sample(untrained, list(b"The "), 300, temperature=0.6, top_k=40, seed=s)
        assert not looks_like_the_corpus(bytes(ids).decode("utf-8", errors="replace"))


def test_kv_cache_sampling_matches_full_forward(trained):
    from pathlib import Path

    from raytrain_lm.results.generate import load_model, sample

    model, _, _ = load_model(Path(trained[1] / f"checkpoint_{STEPS:08d}"), torch.device("cpu"))
    prompt = list(b"The list ")
    fast = sample(model, prompt, 60, temperature=0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(60):  # no cache: the whole sequence every step
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    assert fast == ids[len(prompt):]
    # Past the model's context (256) the window slides; the count stays exact.
    assert len(sample(model, prompt, 400, temperature=1.0, top_k=None, seed=5)) == 400


def test_generate_best_takes_the_lowest_validation_loss(trained):
    storage, run_dir = trained
    rows = metrics(run_dir)
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert set(val) == {60, 120}
    best = generate_json(storage, "--best", "-n", "5")
    assert best["step"] == min(val, key=val.get)
    assert best["checkpoint"].endswith("best_checkpoint")
    # --best is best_checkpoint/ (kept by the driver), whatever the latest checkpoint is: in a copy
    # of the run whose best_checkpoint/ holds step 60, --best answers step 60.
    copy = storage / "best-is-60"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "best_checkpoint")
    shutil.copytree(copy / "checkpoint_00000060", copy / "best_checkpoint")
    res = cli_here("generate", "best-is-60", "--storage", str(storage), "--best", "-n", "5", "--json")
    assert json.loads(res.stdout)["step"] == 60
    shutil.rmtree(copy)


def test_generate_from_a_checkpoint_folder(trained):
    _, run_dir = trained
    res = cli_here("generate", str(run_dir / "checkpoint_00000060"), "-n", "7", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["step"] == 60 and out["tokens"] == 7


@pytest.mark.parametrize("args,expected", [
    (["no-such-run"], "no run 'no-such-run'"),
    (["looked-at", "--temperature", "-1"], "--temperature must be >= 0"),
    (["looked-at", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["looked-at", "--top-k", "-2"], "--top-k must be at least 1"),
    (["looked-at", "--device", "cuda:0"], "no CUDA GPU is visible"),
])
def test_generate_rejects_bad_input(trained, args, expected):
    if any(a.startswith("cuda") for a in args) and torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    storage, _ = trained
    clean_error(cli_here("generate", *args, "--storage", str(storage)), expected)


# ------------------------------------------------------------------ export


def test_export_round_trips_the_weights_bit_exactly(trained, tmp_path):
    storage, run_dir = trained
    out = tmp_path / "export"
    res = cli_here("export", "looked-at", "--storage", str(storage), "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["step"] == STEPS

    # docs/results.md's plain-PyTorch loading code, verbatim in spirit:
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    # The tied output projection is stored once: the file holds the embedding, not a second copy.
    assert config["tied"] == {"lm_head.weight": "wte.weight"} and "lm_head.weight" not in weights
    for name, source in config["tied"].items():
        weights[name] = weights[source]

    from raytrain_lm.store.checkpoint_format import load_checkpoint

    state = load_checkpoint(run_dir / f"checkpoint_{STEPS:08d}")["model"]
    assert set(weights) == set(state)
    for name, tensor in state.items():
        assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), name

    from raytrain_lm.models.family import ModelConfig
    from raytrain_lm.models.gpt.gpt import GPT

    model = GPT(ModelConfig(**config["model"]))
    model.load_state_dict(weights)  # strict: every name present, none extra
    ref = GPT(ModelConfig(**config["model"]))
    ref.load_state_dict(state)
    x = torch.tensor([list(b"The list type")])
    assert torch.equal(model.eval()(x)[0], ref.eval()(x)[0])

    # Into an existing folder only with --force; nothing else is touched.
    again = cli_here("export", "looked-at", "--storage", str(storage), "--out", str(out))
    clean_error(again, "exists and is not empty")
    best = cli_here("export", "looked-at", "--storage", str(storage), "--out", str(out), "--force", "--best")
    assert best.returncode == 0, best.stderr
    assert "exported step" in best.stdout


@pytest.mark.parametrize("out,expected", [
    ("{tmp}/afile/export", "cannot create {tmp}/afile/export: {tmp}/afile is a file, not a folder"),
    ("/proc/raytrain-lm-export", "cannot create /proc/raytrain-lm-export: No such file or directory"),
])
def test_export_to_a_place_that_cannot_hold_it(trained, tmp_path, out, expected):
    storage, _ = trained
    (tmp_path / "afile").write_text("a file")
    res = cli_here("export", "looked-at", "--storage", str(storage), "--out", out.format(tmp=tmp_path))
    clean_error(res, expected.format(tmp=tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_export_needs_out_and_a_run(tmp_path):
    res = cli_here("export", "missing", "--storage", str(tmp_path))
    assert res.returncode == 2 and res.stderr.startswith("error: Missing option '--out'")
    clean_error(cli_here("export", "missing", "--storage", str(tmp_path), "--out", str(tmp_path / "o")),
                "no run 'missing'")
    assert not (tmp_path / "o").exists()
