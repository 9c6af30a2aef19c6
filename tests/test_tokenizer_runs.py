"""Runs and tokenizers: val_bpb in every run, the gpt2 preset on an 8k BPE, `prepare` on Ray
giving the same shards at any CPU count, and weights never continued on another tokenizer's data."""

import hashlib
import json
import math
import shutil
import time

import pytest

from conftest import cli_here, run_cli


def test_a_byte_runs_val_bpb_is_its_val_loss_over_ln2(tiny_run):
    """Byte tokens are bytes: bits per byte is the loss in nats / ln 2 (to 1e-9)."""
    storage, run = tiny_run
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("val_loss") is not None]
    assert len(evals) == 2
    for r in evals:
        assert abs(r["val_bpb"] - r["val_loss"] / math.log(2)) < 1e-9
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val_bpb"] == evals[-1]["val_bpb"]
    listed = cli_here("runs", "--storage", str(storage))
    assert "val bpb" in listed.stdout.splitlines()[0] and f"{evals[-1]['val_bpb']:.4f}" in listed.stdout
    report = cli_here("report", "looked-at", "--storage", str(storage), "--out", str(storage / "r.png"))
    assert "val bits/byte" in report.stdout


def corpus(root):
    """A few MB of mixed inputs: text files (one large), .jsonl and Parquet."""
    from pydoc_data.topics import topics

    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [topics[k] for k in sorted(topics)]
    root.mkdir()
    (root / "a-large.txt").write_text("\n".join(docs) * 3)
    (root / "b.md").write_text(docs[0])
    (root / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:40]))
    pq.write_table(pa.table({"text": docs[40:]}), root / "d.parquet", row_group_size=5)
    return root


def test_ray_results_come_in_order_with_a_bounded_number_held(ray_address):
    """The loop both Ray sides of `prepare` take results through: the first of 6 calls is the
    slowest, the others come back first and wait for it, and no more than 2 x at_once calls are
    out (running or held) at any time: the memory bound on tokens held by the driver."""
    import ray

    from raytrain_lm.data.tokenize import results_in_order

    @ray.remote(num_cpus=0)
    def after(i: int, seconds: float) -> int:
        time.sleep(seconds)
        return i

    delays = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    submitted: list[int] = []

    def submit(i):
        submitted.append(i)
        return after.remote(i, delays[i])

    seen = [(value, len(submitted)) for value in results_in_order(submit, len(delays), at_once=2)]
    assert [value for value, _ in seen] == list(range(6))
    # value k is yielded with at most k + 4 submitted (without the bound the slow first call
    # would find all 6 out)
    assert all(out <= k + 4 for k, (_, out) in enumerate(seen)), seen


def test_prepare_on_ray_gives_the_same_shards_at_any_cpu_count(ray_address, tmp_path):
    """In this process (one thread, and two), on 1 Ray CPU and on 2 (and through the command
    line): byte-identical shards, tokenizer and manifest, with units of 64 KiB so that tasks
    and threads finish out of order."""
    from raytrain_lm.data.prepare import prepare_dataset

    src = str(corpus(tmp_path / "corpus"))
    runs = {"here": dict(use_ray=False, cpus=1), "here-2": dict(use_ray=False, cpus=2),
            "ray-1": dict(use_ray=True, cpus=1), "ray-2": dict(use_ray=True, cpus=2)}
    manifests = {name: prepare_dataset(src, tmp_path / name, tokenizer="bpe", vocab_size=2000,
                                       shard_tokens=100_000, piece_bytes=1 << 16, **kw)
                 for name, kw in runs.items()}
    res = run_cli("prepare", "--input", src, "--tokenizer", "bpe", "--vocab-size", "2000",
                  "--shard-tokens", "100000", "--ray", "--address", ray_address, "--cpus", "2",
                  "--out", str(tmp_path / "cli"), "-q")
    assert res.returncode == 0, res.stderr
    assert not res.stderr  # nothing of Ray's on a quiet run
    for m in manifests.values():
        m.pop("created")
    assert manifests["here"] == manifests["here-2"] == manifests["ray-1"] == manifests["ray-2"]
    m = manifests["here"]
    assert len(m["train"]["shards"]) > 3 and m["tokenizer"]["type"] == "bpe"
    files = [s["file"] for s in m["train"]["shards"] + m["val"]["shards"]] + ["tokenizer.json"]
    for f in files:
        digests = {hashlib.sha256((tmp_path / name / f).read_bytes()).hexdigest()
                   for name in [*runs, "cli"]}
        assert len(digests) == 1, f


@pytest.mark.slow
def test_gpt2_preset_on_an_8k_bpe_of_the_stdlib_trains_on_2_workers(tmp_path):
    """The gpt2 preset (12 layers, 768 wide: 92M parameters with an 8k vocabulary) for 4 steps
    on 2 gloo ranks of the local harness (local_mode.py: the arithmetic, not Ray). Shrunk to fit this 2-core
    machine: seq_len 64, batch 2, 8 validation windows. The BPE is trained on the first 6 MB of the
    standard library's sources, one document
    per file (all 30 MB took 12-30 s to prepare here; this, 7 s)."""
    from local_mode import run_local
    from raytrain_lm.config.load import build_config
    from raytrain_lm.data.prepare import prepare_dataset
    from raytrain_lm.data.sources import _read_stdlib_file, _stdlib_files

    corpus, size = tmp_path / "stdlib-6mb.jsonl", 0
    with corpus.open("w") as out:
        for text in filter(None, map(_read_stdlib_file, _stdlib_files())):
            out.write(json.dumps({"text": text}) + "\n")
            size += len(text.encode())
            if size > 6e6:
                break
    data = tmp_path / "stdlib-bpe8k"
    m = prepare_dataset(str(corpus), data, tokenizer="bpe", vocab_size=8192,
                        use_ray=False)  # prepare on Ray: the test above
    assert m["vocab_size"] == 8192 and m["dtype"] == "uint16"
    assert m["train"]["bytes"] / m["train"]["tokens"] > 3  # ~3.6 bytes of Python per token
    cfg = build_config(preset="gpt2", flags=dict(
        workers=2, max_steps=4, batch_size=2, seq_len=64, log_every=2, eval_every=4,
        checkpoint_every=0, data=str(data), storage=str(tmp_path / "runs"), name="gpt2-bpe"),
        sets=["eval_windows=8", "warmup_steps=5", "lr=3e-4"])
    rows = []
    summary = run_local(cfg, on_metrics=rows.append)
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert summary["config"]["model"]["vocab_size"] == 8192 and 90e6 < summary["num_parameters"] < 95e6
    assert rows[-1]["loss"] < rows[0]["loss"] and math.log(8192) > rows[-1]["val_loss"]
    assert 0 < summary["final_val_bpb"] < summary["final_val_loss"] / math.log(2)  # > 1 byte/token
    ckpt = tmp_path / "runs" / "gpt2-bpe" / "checkpoint_00000004"
    assert (ckpt / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    res = cli_here("generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "8", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["token_ids"]) == 8 and max(out["token_ids"]) < 8192


# ---------------------------------------------------------------- no Ray: refused before it starts


def other_bpe_dataset(trained_here, tmp_path, pydoc_docs):
    """Half the pydoc topics under a 1000-token BPE of their own: the same model shape as
    trained_here["bpe"], other token ids."""
    from raytrain_lm.data.prepare import prepare_dataset

    (tmp_path / "half.txt").write_text("\n".join(pydoc_docs[::2]))
    m = prepare_dataset(str(tmp_path / "half.txt"), tmp_path / "other", tokenizer="bpe",
                        vocab_size=1000, block_tokens=1024)
    assert m["vocab_size"] == 1000
    assert m["tokenizer"]["sha256"] != trained_here["bpe"].manifest["tokenizer"]["sha256"]
    return tmp_path / "other"


def small_flags(run):
    m = run.cfg.model
    return ["--seq-len", "64", "--set", f"model.n_layer={m.n_layer}", "--set", f"model.n_head={m.n_head}",
            "--set", f"model.n_embd={m.n_embd}", "--set", f"model.block_size={m.block_size}",
            "--set", f"model.bias={m.bias}"]


def test_init_from_with_another_tokenizers_data_is_refused(trained_here, tmp_path, pydoc_docs):
    bpe = trained_here["bpe"]
    other = other_bpe_dataset(trained_here, tmp_path, pydoc_docs)
    storage = tmp_path / "runs"
    for ckpt, data, told in [(bpe.ckpt, other, "a BPE of 1000 tokens"),
                             (trained_here["byte"].ckpt, bpe.data, "the byte tokenizer")]:
        res = cli_here("train", "--data", str(data), "--init-from", str(ckpt), "--storage", str(storage),
                      *small_flags(bpe))
        assert res.returncode == 2, res.stderr
        assert res.stderr.startswith("error: checkpoint ") and res.stderr.count("\n") == 1, res.stderr
        assert f"was trained with {told}" in res.stderr and "uses a BPE of 1000 tokens" in res.stderr
    assert not storage.exists()
    # the same tokenizer's data: past the check (stops later, at the unreachable address)
    res = cli_here("train", "--data", str(bpe.data), "--init-from", str(bpe.ckpt), "--storage",
                  str(storage), "--address", "127.0.0.1:1", *small_flags(bpe))
    assert res.returncode == 2 and "tokenizer" not in res.stderr, res.stderr


def test_resume_with_another_tokenizers_data_is_refused(trained_here, tmp_path, pydoc_docs):
    """A run whose checkpoints hold BPE weights cannot --resume on data of another tokenizer."""
    bpe = trained_here["bpe"]
    other = other_bpe_dataset(trained_here, tmp_path, pydoc_docs)
    run = tmp_path / "runs" / "bpe-run"
    shutil.copytree(bpe.ckpt, run / f"checkpoint_{bpe.steps:08d}")
    cfg = bpe.cfg.to_dict() | {"name": "bpe-run", "storage": str(tmp_path / "runs")}
    (run / "config.json").write_text(json.dumps(cfg))
    res = cli_here("train", "--storage", str(tmp_path / "runs"), "--name", "bpe-run", "--resume",
                  "--data", str(other))
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "error: run 'bpe-run' was trained with a BPE of 1000 tokens" in res.stderr
    assert sorted(p.name for p in run.iterdir()) == [f"checkpoint_{bpe.steps:08d}", "config.json"]
