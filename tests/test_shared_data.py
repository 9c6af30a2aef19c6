"""Datasets on shared storage, against a real S3-compatible server (moto, on 127.0.0.1): written
straight there, remote manifest, a node's verified cache that fetches only the shards read and
stays within its bound, corruption refused. No Ray here."""

import os

import boto3
import pytest

from raytrain_lm.data.manifest import load_manifest
from raytrain_lm.data.prepare import prepare_dataset
from raytrain_lm.data.remote import cache_dir_for, open_remote
from raytrain_lm.data.resolve import resolve_dataset
from raytrain_lm.data.windows import TokenWindows
from raytrain_lm.errors import UserError
from s3_server import moto_s3, s3_keys

BUCKET = "rtl-data"
URI = f"s3://{BUCKET}/data/pydoc"


@pytest.fixture(scope="module")
def s3():
    with moto_s3(BUCKET) as env:
        yield env


@pytest.fixture(scope="module")
def uploaded(s3):
    return prepare_dataset("pydoc", URI)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYTRAIN_LM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_prepare_uploads_shards_and_manifest(uploaded):
    keys = [k for k in s3_keys(BUCKET, "data/pydoc/") if not k.endswith("/")]  # not dir markers
    shards = [s["file"] for split in ("train", "val") for s in uploaded[split]["shards"]]
    assert set(keys) == {f"data/pydoc/{f}" for f in shards + ["manifest.json"]}
    assert load_manifest(URI) == uploaded  # read back through pyarrow's S3 filesystem


def test_a_node_caches_a_verified_copy_of_what_it_reads_once(uploaded, cache):
    local = open_remote(URI)
    assert local == str(cache_dir_for(URI)) and local.startswith(str(cache))
    shard = os.path.join(local, uploaded["train"]["shards"][0]["file"])
    assert not os.path.exists(shard)  # nothing read yet: nothing downloaded
    windows = TokenWindows(local, "train", 128)
    assert len(windows) == sum(max(0, (s["tokens"] - 1) // 128) for s in uploaded["train"]["shards"])
    windows[0]
    assert os.path.isfile(shard)
    ino = os.stat(shard).st_ino
    assert resolve_dataset(URI) == local  # the resolver the workers call: the cache, not a download
    TokenWindows(local, "train", 128)[1]
    assert os.stat(shard).st_ino == ino


def test_a_corrupted_shard_is_refused(uploaded, cache, tmp_path):
    uri = f"s3://{BUCKET}/data/corrupt"
    for key in [k for k in s3_keys(BUCKET, "data/pydoc/") if not k.endswith("/")]:
        boto3.client("s3").copy_object(Bucket=BUCKET, Key=key.replace("data/pydoc/", "data/corrupt/"),
                                       CopySource={"Bucket": BUCKET, "Key": key})
    victim = f"data/corrupt/{uploaded['val']['shards'][0]['file']}"
    body = boto3.client("s3").get_object(Bucket=BUCKET, Key=victim)["Body"].read()
    boto3.client("s3").put_object(Bucket=BUCKET, Key=victim, Body=body[:-8] + b"garbage!")
    windows = TokenWindows(open_remote(uri), "val", 128)
    with pytest.raises(UserError, match="does not match the sha256 in its manifest"):
        windows[0]
    assert not list(cache_dir_for(uri).glob("*.arrow*"))  # nothing half-downloaded is left


def test_a_crafted_manifest_cannot_write_outside_the_cache(uploaded, cache):
    """A remote manifest naming "../evil.arrow" is refused before anything is downloaded."""
    import json

    uri = f"s3://{BUCKET}/data/crafted"
    manifest = json.loads(json.dumps(uploaded))
    shard = manifest["train"]["shards"][0]
    body = boto3.client("s3").get_object(Bucket=BUCKET, Key=f"data/pydoc/{shard['file']}")["Body"].read()
    boto3.client("s3").put_object(Bucket=BUCKET, Key="data/evil.arrow", Body=body)
    shard["file"] = "../evil.arrow"
    boto3.client("s3").put_object(Bucket=BUCKET, Key="data/crafted/manifest.json",
                                  Body=json.dumps(manifest).encode())
    with pytest.raises(UserError, match="shard file name '../evil.arrow' is not a plain file name"):
        open_remote(uri)
    assert not cache.exists()  # nothing written on this node, in the cache or beside it


def test_missing_and_existing_remote_datasets(uploaded):
    with pytest.raises(UserError, match=f"dataset not found: s3://{BUCKET}/data/nothing"):
        load_manifest(f"s3://{BUCKET}/data/nothing")
    with pytest.raises(UserError, match="already exists; pass --force"):
        prepare_dataset("pydoc", URI)


def test_local_datasets_resolve_in_place_or_explain(tmp_path):
    builtin = tmp_path / "data" / "pydoc"  # the built-in corpus, missing on this "node"
    assert resolve_dataset(str(builtin)) == str(builtin)
    assert load_manifest(builtin)["source"] == "pydoc"
    with pytest.raises(UserError, match="is not on node .*--data s3://BUCKET/data/NAME"):
        resolve_dataset(str(tmp_path / "data" / "mine"))


def test_a_bpe_dataset_written_straight_to_s3_and_fetched_with_its_tokenizer(s3, cache, tmp_path):
    """`prepare --out s3://...` writes the shards, tokenizer.json and (last) the manifest there;
    a node's cached copy has the same tokenizer file, checked against the manifest."""
    uri = f"s3://{BUCKET}/data/bpe"
    m = prepare_dataset("pydoc", uri, tokenizer="bpe", vocab_size=512)
    keys = {k.rsplit("/", 1)[-1] for k in s3_keys(BUCKET, "data/bpe/") if not k.endswith("/")}
    assert keys == {s["file"] for s in m["train"]["shards"] + m["val"]["shards"]} | \
        {"tokenizer.json", "manifest.json"}
    local = open_remote(uri)
    from raytrain_lm.data.manifest import dataset_tokenizer

    assert dataset_tokenizer(local).sha256 == m["tokenizer"]["sha256"]
    # a damaged tokenizer.json on the storage is refused like a damaged shard
    boto3.client("s3").put_object(Bucket=BUCKET, Key="data/bpe/tokenizer.json", Body=b"{}")
    import shutil

    shutil.rmtree(local)
    with pytest.raises(UserError, match="tokenizer.json does not match the sha256"):
        open_remote(uri)
    # overwriting (--force) replaces the whole dataset: no file of the old one is left over
    prepare_dataset("pydoc", uri, force=True)
    keys = {k.rsplit("/", 1)[-1] for k in s3_keys(BUCKET, "data/bpe/") if not k.endswith("/")}
    assert "tokenizer.json" not in keys and load_manifest(uri)["tokenizer"]["type"] == "byte"


def test_a_dataset_larger_than_the_cache_trains_a_group_of_shards_at_a_time(s3, cache, monkeypatch):
    """Many shards, a cache bound of a few: the sampler's order reads a group of shards at a
    time, the node fetches only what it reads, and the least recently read go."""
    import torch
    from torch.utils.data import DataLoader

    from raytrain_lm.data.sampler import SHARD_GROUP, BatchPlan, BatchStream
    from raytrain_lm.data.windows import collate_windows

    uri = f"s3://{BUCKET}/data/many"
    m = prepare_dataset("pydoc", uri, shard_tokens=8192)  # ~55 train shards of 8 KiB
    shards = m["train"]["shards"]
    assert len(shards) > 4 * SHARD_GROUP
    monkeypatch.setenv("RAYTRAIN_LM_CACHE_GB", str(2.5 * SHARD_GROUP * 8300 / 1e9))  # ~2.5 groups
    local = open_remote(uri)
    ds = TokenWindows(local, "train", 128)
    plan = BatchPlan(8, 1, 0, 2)
    stream = BatchStream(ds.shard_windows, plan, 5, lambda b: DataLoader(
        ds, batch_sampler=b, collate_fn=collate_windows))
    seen_files = set()
    for _ in range(len(ds) // plan.global_batch):
        stream.next()
        present = {p.name for p in (cache / "datasets").glob("*/train-*.arrow")}
        seen_files |= present
        assert len(present) <= 2.5 * SHARD_GROUP + 1  # within the bound (the newest is kept)
    assert len(seen_files) > 2 * SHARD_GROUP  # it did read on through many groups
    assert len(ds._mapped) <= ds.MAX_MAPPED
    x, y = stream.next()  # the next epoch starts: shards come back, verified again
    assert x.shape == (8, 128) and torch.equal(x[:, 1:], y[:, :-1])


def test_prepare_reads_its_inputs_from_s3(s3, tmp_path):
    """`--input s3://...` (a folder of files there): the same dataset as from local copies."""
    import json

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("alpha beta\n" * 3000)
    (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 50}) + "\n"
                                                     for i in range(200)))
    for f in ("a.txt", "b.jsonl"):
        boto3.client("s3").upload_file(str(tmp_path / "in" / f), BUCKET, f"raw/in/{f}")
    remote = prepare_dataset(f"s3://{BUCKET}/raw/in", tmp_path / "from-s3", tokenizer="bpe",
                             vocab_size=300, block_tokens=256, piece_bytes=4096)
    local = prepare_dataset(str(tmp_path / "in"), tmp_path / "from-disk", tokenizer="bpe",
                            vocab_size=300, block_tokens=256, piece_bytes=4096)
    assert remote["train"]["shards"] == local["train"]["shards"]
    assert remote["source"] == f"s3://{BUCKET}/raw/in"
