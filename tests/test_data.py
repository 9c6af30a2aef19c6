import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import NO_RAY, cli_here
from raytrain_lm.data.manifest import load_manifest
from raytrain_lm.data.prepare import prepare_dataset
from raytrain_lm.data.sampler import BatchPlan, BatchStream, eval_batches
from raytrain_lm.data.tokenizer import ByteTokenizer
from raytrain_lm.data.windows import TokenWindows, collate_windows
from raytrain_lm.errors import UserError

TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓\n" * 400  # ~23 KB


def tokens_of(data_dir, split):
    m = load_manifest(data_dir)
    arrays = []
    for shard in m[split]["shards"]:
        with pa.memory_map(str(data_dir / shard["file"])) as src:
            arrays.append(pa.ipc.open_file(src).read_all().column("tokens").to_numpy())
    return np.concatenate(arrays)


def corpus_bytes(data_dir) -> bytes:
    """The dataset's tokens in corpus order: block k of the token stream went to validation when
    k % val_every == 1, to train otherwise; put the blocks back in that order."""
    split = load_manifest(data_dir)["split"]
    size, every = split["block_tokens"], split["val_every"]
    blocks = {s: [a[i: i + size] for i in range(0, len(a), size)]
              for s, a in (("train", tokens_of(data_dir, "train")), ("val", tokens_of(data_dir, "val")))}
    taken = {"train": 0, "val": 0}
    out = []
    for k in range(len(blocks["train"]) + len(blocks["val"])):
        s = "val" if k % every == 1 else "train"
        out.append(blocks[s][taken[s]])
        taken[s] += 1
    return np.concatenate(out).astype(np.uint8).tobytes()


def check_dataset(out, expected_text):
    m = load_manifest(out, verify=True)
    assert m["tokenizer"] == {"type": "byte", "vocab_size": 256} and m["vocab_size"] == 256
    train, val = tokens_of(out, "train"), tokens_of(out, "val")
    assert m["train"]["tokens"] == len(train) and m["val"]["tokens"] == len(val) and len(val) > 0
    # Every token lands in exactly one split, in order: the blocks put back are the corpus.
    assert corpus_bytes(out) == expected_text.encode()
    return m


def test_prepare_txt_and_md_folder(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text(TEXT)
    (src / "b.md").write_text("# Title\n" + TEXT)
    (src / "ignored.bin").write_bytes(b"\x00\x01")
    check_dataset(prepare_dataset(str(src), tmp_path / "out") and tmp_path / "out",
                  TEXT + "\n\n" + "# Title\n" + TEXT)


def test_a_large_file_is_one_document(tmp_path):
    """A file larger than the reader's chunks comes out byte for byte: no separator inside it."""
    f = tmp_path / "big.txt"
    f.write_text("".join(f"{i:07d} Ünïcödé line of a large corpus ✓\n" for i in range(66_000)))
    assert f.stat().st_size > 3_000_000
    check_dataset(prepare_dataset(str(f), tmp_path / "out") and tmp_path / "out", f.read_text())


def test_prepare_several_inputs_in_the_order_given(tmp_path):
    """`--input` repeated: files and folders, one corpus in the order given; the default --out
    is named after the first."""
    (tmp_path / "intro.md").write_text("# Intro\n" + TEXT)
    (tmp_path / "chapters").mkdir()
    (tmp_path / "chapters" / "1.txt").write_text(TEXT[:9000])
    (tmp_path / "chapters" / "2.txt").write_text(TEXT[9000:])
    (tmp_path / "notes.jsonl").write_text(json.dumps({"text": "a note"}) + "\n")
    result = cli_here("prepare", "--input", "intro.md", "--input", "chapters", "--input",
                      "notes.jsonl", "--json", cwd=tmp_path, env=NO_RAY)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["source"] == ["intro.md", "chapters", "notes.jsonl"]
    check_dataset(tmp_path / "data" / "intro", "\n\n".join(
        ["# Intro\n" + TEXT, TEXT[:9000], TEXT[9000:], "a note"]))


def test_prepare_jsonl(tmp_path):
    f = tmp_path / "docs.jsonl"
    docs = [TEXT[: 5000 + i] for i in range(5)]
    f.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    check_dataset(prepare_dataset(str(f), tmp_path / "out") and tmp_path / "out", "\n\n".join(docs))


def test_prepare_parquet_with_custom_column(tmp_path):
    f = tmp_path / "docs.parquet"
    docs = [TEXT[: 6000 + i] for i in range(4)]
    pq.write_table(pa.table({"body": docs}), f)
    with pytest.raises(UserError, match="no column 'text'"):
        prepare_dataset(str(f), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    prepare_dataset(str(f), tmp_path / "out", text_field="body")
    check_dataset(tmp_path / "out", "\n\n".join(docs))


def test_prepare_a_dictionary_encoded_text_column(tmp_path):
    """What pandas writes for a categorical column (dictionary<values=string>) is text: read as
    the plain column is, repeated documents and all."""
    f = tmp_path / "docs.parquet"
    docs = [TEXT[: 6000 + i % 2] for i in range(4)]
    pq.write_table(pa.table({"text": pa.array(docs).dictionary_encode()}), f)
    assert pa.types.is_dictionary(pq.read_schema(f).field("text").type)
    prepare_dataset(str(f), tmp_path / "out")
    check_dataset(tmp_path / "out", "\n\n".join(docs))


def test_prepare_builtin_corpora(tmp_path):
    from pydoc_data.topics import topics

    m = prepare_dataset("pydoc", tmp_path / "pydoc")
    assert m["source"] == "pydoc"
    assert m["train"]["tokens"] + m["val"]["tokens"] >= sum(len(t.encode()) for t in topics.values())
    m = prepare_dataset("stdlib", tmp_path / "stdlib", shard_tokens=1 << 23)
    assert m["train"]["tokens"] > 10_000_000 and len(m["train"]["shards"]) > 1


def test_failed_prepare_leaves_nothing(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"text": TEXT}) + "\n" + "{not json\n")
    with pytest.raises(UserError, match="docs.jsonl:2"):
        prepare_dataset(str(f), tmp_path / "out")
    assert list(tmp_path.iterdir()) == [f]  # no dataset, no temporary folder


def test_unreadable_and_existing(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8 \xc3")
    with pytest.raises(UserError, match="cannot read corpus file"):
        prepare_dataset(str(bad), tmp_path / "out")
    good = tmp_path / "good.txt"
    good.write_text(TEXT)
    prepare_dataset(str(good), tmp_path / "out")
    with pytest.raises(UserError, match="already exists"):
        prepare_dataset(str(good), tmp_path / "out")
    prepare_dataset(str(good), tmp_path / "out", force=True)


def test_windows_are_memory_mapped_slices(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    prepare_dataset(str(f), tmp_path / "d")
    ds = TokenWindows(tmp_path / "d", "train", seq_len=64)
    train = tokens_of(tmp_path / "d", "train")
    assert len(ds) == (len(train) - 1) // 64
    assert torch.equal(ds[3], torch.from_numpy(train[3 * 64: 4 * 64 + 1].astype(np.int64)))
    x, y = collate_windows(ds.__getitems__([0, 1]))
    assert x.shape == y.shape == (2, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert ByteTokenizer().decode(ds[0]) == TEXT.encode()[:65].decode()


def index_stream(windows, plan: BatchPlan, seed: int = 7) -> BatchStream:
    """A BatchStream over a dataset whose window i is the number i, through a real DataLoader.
    `windows`: how many, or each shard's count (more than SHARD_GROUP shards: grouped order)."""
    data = torch.arange(windows if isinstance(windows, int) else sum(windows))
    return BatchStream(windows, plan, seed, lambda batches: DataLoader(data, batch_sampler=batches))


SHARDED = [20] * 30  # 30 shards of 20 windows: shuffled in groups of SHARD_GROUP shards


def read_steps(stream: BatchStream, steps: int) -> list[list[int]]:
    """The windows a stream's rank reads in each of `steps` steps."""
    return [[i for _ in range(stream.plan.accum) for i in stream.next().tolist()] for _ in range(steps)]


@pytest.mark.parametrize("windows", [101, [11] * 9 + [2]])
def test_ranks_take_disjoint_parts_of_each_step_and_the_epoch_once(windows):
    n, dp = 101, 3
    plans = [BatchPlan(micro_batch=4, accum=2, dp_rank=r, dp_size=dp) for r in range(dp)]
    steps = n // plans[0].global_batch  # 4 steps of 24 windows; 5 left over
    seen = [read_steps(index_stream(windows, p), steps + 1) for p in plans]
    epoch0 = [i for r in range(dp) for step in seen[r][:steps] for i in step]
    assert len(epoch0) == len(set(epoch0)) == steps * 24  # each window of the epoch once
    for s in range(steps):
        assert not set(seen[0][s]) & set(seen[1][s])
    # the next step starts epoch 1: a new order
    assert index_stream(n, plans[0]).state_dict() == {"epoch": 0, "consumed": 0}
    assert seen[0][steps] != seen[0][0]


@pytest.mark.parametrize("windows", [240, [20] * 12])  # all shuffled together; in groups
def test_the_position_means_the_same_at_another_worker_count(windows):
    """2 workers for 3 steps, then 3 workers (the same global batch): every window of the epoch
    is read exactly once across the change."""
    n = 240
    before = [index_stream(windows, BatchPlan(12, 1, r, 2)) for r in range(2)]
    read = [i for s in before for step in read_steps(s, 3) for i in step]
    state = before[0].state_dict()
    assert state == {"epoch": 0, "consumed": 72} == before[1].state_dict()
    after = [index_stream(windows, BatchPlan(8, 1, r, 3)) for r in range(3)]
    for s in after:
        s.load_state_dict(state)
    read += [i for s in after for step in read_steps(s, 7) for i in step]
    assert sorted(read) == list(range(n))


@pytest.mark.parametrize("windows", [200, [10] * 20])
def test_accumulation_reads_the_same_windows_per_rank(windows):
    """--grad-accum 2 --batch-size 8 gives each rank the windows of --batch-size 16 per step."""
    for rank in range(2):
        one = read_steps(index_stream(windows, BatchPlan(16, 1, rank, 2)), 4)
        two = read_steps(index_stream(windows, BatchPlan(8, 2, rank, 2)), 4)
        assert one == two


def test_a_few_shards_keep_the_full_permutation():
    """Up to SHARD_GROUP shards the order is a permutation of all windows, as it always was."""
    from raytrain_lm.data.sampler import SHARD_GROUP, epoch_order

    counts = [37, 5, 90][:SHARD_GROUP]
    assert torch.equal(epoch_order(counts, 11, 2),
                       torch.randperm(132, generator=torch.Generator().manual_seed(13)))


def test_many_shards_are_read_a_group_at_a_time():
    """More than SHARD_GROUP shards: each step's windows come from at most two groups of shards
    (so a node needs only those), each epoch still reads every window once, in a new order."""
    from raytrain_lm.data.sampler import SHARD_GROUP, epoch_order

    order = epoch_order(SHARDED, 7, 0)
    assert sorted(order.tolist()) == list(range(600)) and not torch.equal(order, epoch_order(SHARDED, 7, 1))
    shard_of = lambda i: i // 20  # noqa: E731
    group = 20 * SHARD_GROUP  # windows in a full group
    for k in range(0, 600, group):  # a group's windows are consecutive in the order
        assert len({shard_of(i) for i in order[k:k + group].tolist()}) <= SHARD_GROUP
    plans = [BatchPlan(6, 2, r, 2) for r in range(2)]  # global batch 24
    streams = [index_stream(SHARDED, p) for p in plans]
    for _ in range(600 // 24):
        step = [i for s in streams for i in read_steps(s, 1)[0]]
        assert len({shard_of(i) for i in step}) <= 2 * SHARD_GROUP


def test_a_resumed_stream_reads_the_batches_it_would_have(pydoc_data):
    plan = BatchPlan(16, 1, dp_rank=1, dp_size=2)
    ds = TokenWindows(pydoc_data, "train", seq_len=128)

    def stream():
        return BatchStream(len(ds), plan, 3, lambda batches: DataLoader(
            ds, batch_sampler=batches, collate_fn=collate_windows))

    n = len(ds) // plan.global_batch + 5  # cross an epoch boundary
    full = stream()
    reference = [full.next()[0] for _ in range(n + 3)]
    first = stream()
    for _ in range(n):
        first.next()
    state = first.state_dict()
    assert state["epoch"] == 1
    resumed = stream()
    resumed.load_state_dict(state)
    for i in range(3):
        assert torch.equal(resumed.next()[0], reference[n + i])


@pytest.mark.parametrize("windows", [96, 101])  # 4 steps of 24 an epoch: none left over, 5
def test_a_stream_resumed_at_any_step_of_an_epoch_reads_what_it_would_have(windows):
    """Resumed after every step of two epochs (with one step left in the epoch, with none), on
    each of 2 ranks: the next steps read the windows the unbroken stream reads. The epoch ends
    when less than a global batch is left, not when exactly one is."""
    plans = [BatchPlan(6, 2, r, 2) for r in range(2)]  # a global batch of 24
    for plan in plans:
        unbroken = read_steps(index_stream(windows, plan), 10)
        for steps in range(1, 8):
            first = index_stream(windows, plan)
            read_steps(first, steps)
            resumed = index_stream(windows, plan)
            resumed.load_state_dict(first.state_dict())
            assert read_steps(resumed, 2) == unbroken[steps:steps + 2], (plan.dp_rank, steps)


def test_too_few_windows_for_one_global_batch():
    with pytest.raises(UserError, match="fewer than one global batch"):
        index_stream(20, BatchPlan(8, 1, 0, 3))


@pytest.mark.parametrize("windows,micro", [(23, 16), (183, 16), (5, 2), (1, 4)])
def test_validation_windows_are_the_same_at_any_worker_count(windows, micro):
    """Every window once whatever the worker count, and every rank runs as many batches of the
    same size (the rest of a batch is window 0, to be ignored), so FSDP's collectives and a
    pipeline's microbatches stay in step."""
    for dp in (1, 2, 3, 8):
        per_rank = [eval_batches(windows, micro, r, dp) for r in range(dp)]
        assert len({len(b) for b in per_rank}) == 1
        assert all(len(idx) == micro and 0 <= real <= micro for b in per_rank for idx, real in b)
        counted = [i for b in per_rank for idx, real in b for i in idx[:real]]
        assert sorted(counted) == list(range(windows))


def test_validation_counts_the_bytes_of_real_windows_only(trained_here):
    """val_bpb's byte count (Validation.text_bytes, summed over the data-parallel ranks) is that
    of exactly the windows evaluated, whatever the worker count: the padding windows that fill a
    rank's last batch (their targets ignored by the loss) count no bytes. A BPE dataset, so that
    windows differ in bytes."""
    from raytrain_lm.data.loaders import Validation

    run = trained_here["bpe"]
    lengths = run.tok.text_byte_lengths()
    ds = TokenWindows(run.data, "val", run.cfg.seq_len)
    n = min(len(ds), run.cfg.eval_windows)
    expected = sum(int(lengths[ds.window(i)[1:]].sum()) for i in range(n))
    assert expected != n * run.cfg.seq_len  # BPE tokens stand for varying numbers of bytes
    padded = False
    for dp in (1, 2, 3, 5):
        ranks = [Validation(run.cfg, r, dp, lengths) for r in range(dp)]
        padded |= any(real < run.cfg.batch_size for v in ranks for real in v.real)
        assert sum(v.text_bytes for v in ranks) == expected, dp
    assert padded  # the case that matters was exercised


def test_not_a_dataset(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_manifest(tmp_path / "missing")
    with pytest.raises(UserError, match="not a prepared dataset"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(UserError, match="not a valid dataset"):
        load_manifest(tmp_path)


def test_masking_the_padding_targets_leaves_the_inputs_alone():
    """Inputs and targets are two slices of one tensor; masking the padding rows' targets in place
    made their inputs -100, which the embedding refused (IndexError) on CPU workers."""
    from raytrain_lm.data.loaders import Validation
    from raytrain_lm.data.windows import collate_windows

    x, y = collate_windows(torch.arange(12).reshape(3, 4))
    before = x.clone()
    masked = Validation.targets(y, real=1)
    assert torch.equal(x, before)
    assert masked[0].tolist() == [1, 2, 3] and (masked[1:] == Validation.IGNORE).all()
    assert Validation.targets(y, real=3) is y  # a full batch is left as it is


def test_a_batch_is_contiguous_before_the_loader_pins_it():
    """Inputs and targets leave the collate function contiguous: pinning keeps a view's strides,
    and a strided pinned tensor's non_blocking copy to the GPU is staged through pageable memory
    (synchronous)."""
    from raytrain_lm.data.windows import collate_windows

    batch = torch.arange(12).reshape(3, 4)
    x, y = collate_windows(batch)
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x, batch[:, :-1]) and torch.equal(y, batch[:, 1:])


def test_tokenizing_here_in_threads_keeps_the_units_order():
    """Without Ray, `prepare` tokenizes `--cpus` units at once in threads of its process (a BPE
    releases the GIL: 1.76x one thread on 2 cores, bench/prepare.py) and takes them in order."""
    import threading
    import time

    from raytrain_lm.data.sources import plan_units
    from raytrain_lm.data.tokenize import tokenize_here

    class Recording(ByteTokenizer):
        def __init__(self):
            self.threads = set()

        def encode(self, text):
            self.threads.add(threading.get_ident())
            time.sleep(0.002)  # busy long enough that the pool starts its second thread
            return super().encode(text)

    units = plan_units(["pydoc"], "text", 1 << 14)
    one = [(ids.tobytes(), opens) for ids, _, opens in tokenize_here(units, ByteTokenizer())]
    tok = Recording()
    two = [(ids.tobytes(), opens) for ids, _, opens in tokenize_here(units, tok, threads=2)]
    assert len(units) > 4 and two == one
    assert len(tok.threads) == 2 and threading.get_ident() not in tok.threads
