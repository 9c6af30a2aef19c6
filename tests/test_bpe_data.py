"""Datasets with a BPE tokenizer: every document round-trips, <|endoftext|> between documents,
byte counts per split (for bits per byte), the tokenizer file checked with the dataset, clear
errors; and the corpus plan that lets tasks tokenize a large file in pieces."""

import json

import numpy as np
import pyarrow as pa
import pytest

from conftest import NO_RAY, cli_here
from raytrain_lm.data.manifest import dataset_tokenizer, load_manifest
from raytrain_lm.data.prepare import prepare_dataset
from raytrain_lm.data.sources import Unit, plan_units, read_unit, sample_units
from raytrain_lm.data.tokenizer import EOT
from raytrain_lm.errors import UserError


def split_tokens(folder, manifest, split):
    arrays = []
    for shard in manifest[split]["shards"]:
        with pa.memory_map(str(folder / shard["file"]), "r") as src:
            arrays.append(pa.ipc.open_file(src).get_batch(0).column(0).to_numpy())
    return np.concatenate(arrays)


def whole_stream(folder, manifest):
    """The token stream as it was before blocks were routed to train and val."""
    train, val = split_tokens(folder, manifest, "train"), split_tokens(folder, manifest, "val")
    bt, every = manifest["split"]["block_tokens"], manifest["split"]["val_every"]
    out, t, v, k = [], 0, 0, 0
    while t < len(train) or v < len(val):
        if k % every == 1:
            out.append(val[v:v + bt])
            v += bt
        else:
            out.append(train[t:t + bt])
            t += bt
        k += 1
    return np.concatenate(out)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_dataset_holds_exactly_the_corpus(kind, tmp_path, pydoc_docs):
    m = prepare_dataset("pydoc", tmp_path / "ds", tokenizer=kind,
                        vocab_size=2048 if kind == "bpe" else None, block_tokens=1024)
    tok = dataset_tokenizer(tmp_path / "ds")
    stream = whole_stream(tmp_path / "ds", m)
    corpus_bytes = sum(len(d.encode("utf-8")) for d in pydoc_docs)
    if kind == "byte":
        # "\n\n" between documents, as before; tokens are bytes, separators included
        assert m["separator"] == "\n\n" and m["dtype"] == "uint8"
        assert tok.decode(stream) == "\n\n".join(pydoc_docs)
        for split in ("train", "val"):
            assert m[split]["bytes"] == m[split]["tokens"]
        assert m["train"]["bytes"] + m["val"]["bytes"] == corpus_bytes + 2 * (len(pydoc_docs) - 1)
        assert not (tmp_path / "ds" / "tokenizer.json").exists()
    else:
        # one <|endoftext|> between documents; it stands for no bytes of text
        assert m["separator"] == "eot" and m["dtype"] == "uint16" and m["vocab_size"] == 2048
        assert (stream == tok.eot_id).sum() == len(pydoc_docs) - 1
        assert tok.decode(stream) == EOT.join(pydoc_docs)
        assert m["train"]["bytes"] + m["val"]["bytes"] == corpus_bytes
        assert m["tokenizer"]["sha256"] == tok.sha256
        assert (tmp_path / "ds" / "tokenizer.json").read_bytes() == tok.raw
    for split in ("train", "val"):
        assert sum(s["bytes"] for s in m[split]["shards"]) == m[split]["bytes"]


def test_a_large_text_file_is_cut_only_where_its_tokens_do_not_change(tmp_path, bpe_pydoc, pydoc_docs):
    """A large .txt is one document read in pieces by different tasks; the pieces' tokens are
    exactly the whole file's."""
    text = "\n".join(pydoc_docs[:30]) + "\n\u00e9\u00e9 \U0001F642 end"
    (tmp_path / "corpus.txt").write_text(text)
    units = plan_units([str(tmp_path / "corpus.txt")], piece_bytes=2000)
    assert len(units) > 20 and [u.opens_document for u in units] == [True] + [False] * (len(units) - 1)
    pieces = [t for u in units for t in read_unit(u)]
    assert "".join(pieces) == text
    ids = np.concatenate([bpe_pydoc.encode(p) for p in pieces])
    assert np.array_equal(ids, bpe_pydoc.encode(text))


def test_text_without_newlines_is_cut_at_character_boundaries(tmp_path, monkeypatch):
    from raytrain_lm.data import sources

    monkeypatch.setattr(sources, "SEARCH_LIMIT", 3000)  # how far a cut is looked for
    text = "\u00e9\U0001F642" * 3000  # no safe cut anywhere: characters are never split
    (tmp_path / "one-line.txt").write_text(text)
    units = plan_units([str(tmp_path / "one-line.txt")], piece_bytes=1000)
    assert len(units) > 10 and "".join(t for u in units for t in read_unit(u)) == text


def test_jsonl_pieces_hold_whole_lines(tmp_path):
    docs = [f"document {i} " + "y" * (i % 50) for i in range(400)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    units = plan_units([str(tmp_path / "d.jsonl")], piece_bytes=1000)
    assert len(units) > 10 and [t for u in units for t in read_unit(u)] == docs
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + "{\n")
    with pytest.raises(UserError, match=r"bad.jsonl \(line at byte \d+\): expected a JSON object"):
        [t for u in plan_units([str(tmp_path / "bad.jsonl")], piece_bytes=1000) for t in read_unit(u)]


def test_text_file_corpus_is_one_document_per_file(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("alpha\n" * 5000)
    (tmp_path / "c" / "b.txt").write_text("beta\n" * 5000)
    m = prepare_dataset(str(tmp_path / "c"), tmp_path / "ds", tokenizer="bpe", vocab_size=300,
                        block_tokens=256, val_every=4)
    tok = dataset_tokenizer(tmp_path / "ds")
    assert tok.decode(whole_stream(tmp_path / "ds", m)) == "alpha\n" * 5000 + EOT + "beta\n" * 5000


def test_the_training_sample_is_capped_and_spread():
    units = [Unit("text", f"f{i}", 0, 100, nbytes=100) for i in range(1000)]  # 100 kB
    sample = sample_units(units, 10_000)
    assert 95 <= len(sample) <= 101
    assert int(sample[0].path[1:]) < 100 and int(sample[-1].path[1:]) > 800  # not the first ones
    assert sample_units(units, 10**9) == units
    assert sample_units(units[:1], 10) == units[:1]  # a unit larger than the sample, not nothing


def test_tokenizer_file_checked_with_the_dataset(tmp_path):
    prepare_dataset("pydoc", tmp_path / "ds", tokenizer="bpe", vocab_size=500, block_tokens=1024)
    load_manifest(tmp_path / "ds", verify=True)
    f = tmp_path / "ds" / "tokenizer.json"
    cfg = json.loads(f.read_text())
    cfg["model"]["merges"] = cfg["model"]["merges"][:-1]
    f.write_text(json.dumps(cfg))
    load_manifest(tmp_path / "ds")  # cheap check: the file is there
    with pytest.raises(UserError, match="damaged tokenizer file tokenizer.json"):
        load_manifest(tmp_path / "ds", verify=True)
    with pytest.raises(UserError, match="sha256"):
        dataset_tokenizer(tmp_path / "ds")
    f.unlink()
    with pytest.raises(UserError, match="missing or damaged tokenizer file tokenizer.json"):
        load_manifest(tmp_path / "ds")


def test_prepare_with_an_existing_tokenizer_json(tmp_path, bpe_pydoc):
    """--tokenizer PATH: a tokenizer.json made elsewhere is used and stored byte for byte (a
    dataset, checkpoint or export folder holding one works too)."""
    (tmp_path / "mine.json").write_bytes(bpe_pydoc.raw)
    m = prepare_dataset("pydoc", tmp_path / "ds", tokenizer=str(tmp_path / "mine.json"))
    assert (tmp_path / "ds" / "tokenizer.json").read_bytes() == bpe_pydoc.raw
    assert m["tokenizer"]["sha256"] == bpe_pydoc.sha256 and m["vocab_size"] == 2048
    again = prepare_dataset("pydoc", tmp_path / "ds2", tokenizer=str(tmp_path / "ds"))
    assert again["train"]["shards"] == m["train"]["shards"]


@pytest.mark.parametrize("args, message", [
    (["--tokenizer", "bpe", "--vocab-size", "256"], "--vocab-size must be at least 257"),
    (["--tokenizer", "bpe", "--vocab-size", "5000000000"], "--vocab-size must be at most 1,048,576"),
    (["--tokenizer", "byte", "--vocab-size", "512"], "the byte tokenizer has a vocabulary of 256"),
    (["--tokenizer", "missing.json"], "--tokenizer must be byte, bpe or a tokenizer.json file"),
    (["--tokenizer", "corrupt.json"], "corrupt.json is not a valid tokenizer.json"),
    (["--tokenizer", "bpe", "--tokenizer-sample-mb", "0"], "--tokenizer-sample-mb must be positive"),
    (["--shard-tokens", "1"], "--shard-tokens must be at least 2"),
])
def test_bad_tokenizer_inputs_are_one_line_and_write_nothing(tmp_path, args, message):
    (tmp_path / "corrupt.json").write_text('{"model": {"type": "BPE", "vocab": ')
    before = sorted(p.name for p in tmp_path.iterdir())
    result = cli_here("prepare", "--out", "ds", *args, cwd=tmp_path, env=NO_RAY)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_prepare_bpe_from_the_command_line(tmp_path):
    result = cli_here("prepare", "--tokenizer", "bpe", "--vocab-size", "1000", "--shard-tokens",
                      "50000", "--out", "ds", "--json", cwd=tmp_path, env=NO_RAY)
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout)
    assert m["tokenizer"]["type"] == "bpe" and m["vocab_size"] == 1000
    assert len(m["train"]["shards"]) > 1 and all(s["tokens"] <= 50000 for s in m["train"]["shards"])
    load_manifest(tmp_path / "ds", verify=True)
