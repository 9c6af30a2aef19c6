"""`prepare --tokenizer FOLDER` on the tokenizers the families ship (tests/hub_tokenizers.py: made by
transformers' own classes and converters): Qwen's NFC byte-level BPE, Llama 2's and Mistral's
SentencePiece BPEs with byte fallback, Llama 3's and Mistral-Nemo's byte-level ones. Each dataset
holds exactly what transformers encodes for each document, wrapped in the family's own special
tokens, and counts bits per byte on the documents' bytes as read."""

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from conftest import cli_here
from hub_tokenizers import DOC_WRAP, FAMILIES, copy_family, corpus_documents, family_folder, write_corpus
from raytrain_lm.data.prepare import prepare_dataset
from raytrain_lm.data.tokenizer import make_tokenizer
from raytrain_lm.data.wrap import document_wrap
from raytrain_lm.errors import UserError

# Text a normalizer rewrites (a decomposed accent: NFC composes it, 3 bytes -> 2), text beyond
# the vocabulary (byte fallback / byte tokens), runs of spaces and a leading newline.
ODD = "Caf\u0065\u0301 \u00e9t\u00e9  \u65e5\u672c\u8a9e \U0001F642\n\n\tx = 1\r\n"
VAL_EVERY = 2


def documents() -> list[str]:
    return corpus_documents(6) + [ODD]


def reference(name: str):
    """transformers' tokenizer of the folder's tokenizer.json as the file says it (AutoTokenizer
    would rebuild Llama 2's pipeline in transformers 5 from its class, not the file)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(family_folder(name) / "tokenizer.json"))


def shards(folder, split: str, column: str) -> np.ndarray:
    manifest = json.loads((folder / "manifest.json").read_text())
    parts = []
    for s in manifest[split]["shards"]:
        with pa.memory_map(str(folder / s["file"])) as src:
            parts.append(pa.ipc.open_file(src).read_all().column(column).to_numpy())
    return np.concatenate(parts)


def stream(folder, column: str = "tokens") -> np.ndarray:
    """The token stream as written, before blocks went to train or val (block k to val when
    k % val_every == 1)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    size = manifest["split"]["block_tokens"]
    split = {s: shards(folder, s, column) for s in ("train", "val")}
    out, at = [], {"train": 0, "val": 0}
    for k in range(sum(math.ceil(len(v) / size) for v in split.values())):
        s = "val" if k % VAL_EVERY == 1 else "train"
        out.append(split[s][at[s]: at[s] + size])
        at[s] += size
    return np.concatenate(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), documents())


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_prepares_documents_as_transformers_encodes_them(name, corpus, tmp_path):
    """The dataset's token stream is, document by document, the family's begin tokens,
    transformers' encoding of the document and its end tokens (Llama 3 <|begin_of_text|> ...
    <|end_of_text|>, Llama 2 / Mistral / Nemo <s> ... </s>, Qwen ... <|endoftext|>; the instruct
    folders' eos, which ends a chat turn, is not a document's end); the manifest says the wrap
    and counts exactly the documents' bytes; the tokenizer's decode gives transformers' text."""
    ref = reference(name)
    out = tmp_path / "data"
    manifest = prepare_dataset(str(corpus), out, tokenizer=str(family_folder(name)), block_tokens=128,
                               val_every=VAL_EVERY, cpus=1)
    begin, end = ([ref.convert_tokens_to_ids(t) for t in side] for side in DOC_WRAP[name])
    expected = []
    for doc in documents():
        expected += begin + ref.encode(doc, add_special_tokens=False) + end
    assert stream(out).tolist() == expected
    assert manifest["documents"] == {"begin": list(DOC_WRAP[name][0]), "begin_ids": begin,
                                     "end": list(DOC_WRAP[name][1]), "end_ids": end}
    raw = sum(len(d.encode("utf-8")) for d in documents())
    assert manifest["train"]["bytes"] + manifest["val"]["bytes"] == raw
    tok = make_tokenizer(str(out))  # the dataset's own folder: its tokenizer and recorded wrap
    assert (tok.doc_begin, tok.doc_end) == (tuple(begin), tuple(end))
    for doc in documents():
        ids = ref.encode(doc, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids)


@pytest.mark.parametrize("name", ["qwen2", "llama2", "mistral"])
def test_bits_per_byte_counts_the_documents_bytes_as_read(name, corpus, tmp_path):
    """Where the tokenizer rewrites the text (Qwen's NFC composes the decomposed accent; Llama 2's
    Prepend and Mistral's Metaspace add a space before each document) the tokens' own bytes are
    not the document's: each shard stores every token's share of the bytes as read (wrap tokens
    none), they add up to the documents' bytes, and validation's byte count (val_bpb's
    denominator) is that column over exactly the targets it evaluates."""
    from raytrain_lm.config.load import build_config
    from raytrain_lm.data.loaders import Validation
    from raytrain_lm.data.windows import TokenWindows

    out = tmp_path / "data"
    prepare_dataset(str(corpus), out, tokenizer=str(family_folder(name)), block_tokens=128,
                    val_every=VAL_EVERY, cpus=1)
    tok = make_tokenizer(str(out))
    ids, shares = stream(out), stream(out, "bytes")
    raw = sum(len(d.encode("utf-8")) for d in documents())
    assert int(shares.sum()) == raw
    assert int(tok.text_byte_lengths()[ids].sum()) != raw  # the tokens' own bytes: not the text's
    wraps = np.isin(ids, tok.doc_begin + tok.doc_end)
    assert wraps.sum() == 2 * len(documents()) - (name == "qwen2") * len(documents())
    assert not shares[wraps].any()

    cfg = build_config(flags=dict(data=str(out), storage=str(tmp_path / "runs"), name="v", workers=1),
                       sets=["seq_len=32", "batch_size=4", "eval_windows=0"])
    val = shards(out, "val", "bytes")
    windows = TokenWindows(str(out), "val", 32)
    # shards here are one per split: window i's targets are tokens 32 i + 1 ... 32 i + 32
    expected = sum(int(val[32 * i + 1: 32 * i + 33].sum()) for i in range(len(windows)))
    assert Validation(cfg, 0, 1, tok.text_byte_lengths()).text_bytes == expected
    assert sum(Validation(cfg, r, 2, tok.text_byte_lengths()).text_bytes for r in range(2)) == expected


@pytest.mark.parametrize("name", ["llama2", "mistral"])
def test_a_large_file_read_in_pieces_gives_the_whole_documents_tokens(name, tmp_path):
    """A text file larger than a unit is one document read in pieces cut after a newline; a
    tokenizer that puts a space before the text it encodes (Llama 2's Prepend, Mistral's
    Metaspace) must not put one where a piece starts inside the document: the stream is the
    whole file's encoding, wrapped once, and its bytes are the file's."""
    text = "\n".join(corpus_documents(4))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "book.txt").write_text(text)
    manifest = prepare_dataset(str(tmp_path / "in"), tmp_path / "data", tokenizer=str(family_folder(name)),
                               block_tokens=128, val_every=VAL_EVERY, cpus=1, piece_bytes=2048)
    assert len(text.encode()) > 4 * 2048  # several pieces
    ref = reference(name)
    begin, end = ([ref.convert_tokens_to_ids(t) for t in side] for side in DOC_WRAP[name])
    assert stream(tmp_path / "data").tolist() == begin + ref.encode(text, add_special_tokens=False) + end
    assert manifest["train"]["bytes"] + manifest["val"]["bytes"] == len(text.encode())


def test_a_tokenizer_that_cannot_encode_the_corpus_is_refused(tmp_path, corpus):
    """A SentencePiece model trained without byte fallback (converted by transformers'
    LlamaConverter, as an older release would be) encodes text made of its characters, and is
    refused, exit 2, one line naming the character, nothing written, on a corpus with one it lacks
    (a newline: it was trained on lines)."""
    import io

    import sentencepiece as spm
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import LlamaConverter, SentencePieceExtractor

    from hub_tokenizers import _SpmOriginal

    model = io.BytesIO()
    lines = [line for d in corpus_documents(12) for line in d.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, model_type="bpe",
                                   vocab_size=300, byte_fallback=False, character_coverage=1.0,
                                   normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, minloglevel=2)
    folder = tmp_path / "old-llama"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(model.getvalue())

    class Extractor(SentencePieceExtractor):  # as in hub_tokenizers._llama2
        def extract(self, vocab_scores=None, **kwargs):
            found = super().extract(None)
            return found["vocab"], found["merges"]

    class Converter(LlamaConverter):
        SpmExtractor = Extractor

    backend = Converter(_SpmOriginal(str(folder / "tokenizer.model"))).converted()
    LlamaTokenizer(tokenizer_object=backend, add_bos_token=True, legacy=True).save_pretrained(folder)

    fits = write_corpus(tmp_path / "fits", lines)  # a newline is not among its characters either
    ok = cli_here("prepare", "--input", str(fits), "--tokenizer", str(folder), "--out",
                  str(tmp_path / "ok"), "--no-ray")
    assert ok.returncode == 0, ok.stderr
    assert "each document: <s> ... </s>" in ok.stdout  # the wrap read from the folder, said
    bad = cli_here("prepare", "--input", str(corpus), "--tokenizer", str(folder), "--out",
                   str(tmp_path / "bad"), "--no-ray")
    assert bad.returncode == 2, bad.stderr
    said = bad.stderr.strip().splitlines()
    assert len(said) == 1 and "cannot encode this corpus: '\\n' becomes its unknown token" in said[0]
    assert not (tmp_path / "bad").exists()


def test_document_wrap_without_a_tokenizer_config_and_with_a_broken_one(tmp_path):
    """A lone Llama 3 tokenizer.json: its post-processor's <|begin_of_text|>, no end (nothing says
    it). A GPT-2-style file (no template): no wrap, <|endoftext|> between documents as before.
    A generation_config.json eos id that is not a token: refused, naming the file."""
    from tokenizers import Tokenizer

    llama3 = family_folder("llama3") / "tokenizer.json"
    tok = make_tokenizer(str(llama3))
    assert (tok.doc_begin, tok.doc_end) == ((tok.vocabulary()["<|begin_of_text|>"],), ())
    gpt2 = json.loads(llama3.read_text())
    gpt2["post_processor"] = None
    assert document_wrap(None, gpt2, Tokenizer.from_str(json.dumps(gpt2)).get_vocab(True), 5) is None

    folder = copy_family("qwen2-instruct", tmp_path / "q")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [10 ** 6]}))
    with pytest.raises(UserError, match="generation_config.json: eos_token_id"):
        make_tokenizer(str(folder))


@pytest.mark.slow  # the local harness: one rank trains, validates and checkpoints
def test_a_run_trains_on_a_llama2_dataset_and_counts_bits_per_byte_as_read(tmp_path):
    """A dataset prepared with Llama 2's tokenizer folder (SentencePiece, Prepend/Replace
    normalizer, byte fallback, <s> ... </s>) trains: its loss falls, and each validation's val_bpb
    is its val_loss per byte of the documents as read, the bytes summed from the shards' column
    here over every validation window (to 1e-9), not the tokens' own bytes (which count the
    space the normalizer puts before each document)."""
    from conftest import small_config
    from local_mode import run_local

    data = tmp_path / "data"
    corpus = write_corpus(tmp_path / "corpus", corpus_documents(12))
    prepare_dataset(str(corpus), data, tokenizer=str(family_folder("llama2")), cpus=1,
                    block_tokens=256, val_every=4)
    val, ids = shards(data, "val", "bytes"), shards(data, "val", "tokens")
    n = (len(ids) - 1) // 64  # one shard: every window of the split
    nbytes = sum(int(val[64 * i + 1: 64 * i + 65].sum()) for i in range(n))
    lengths = make_tokenizer(str(data)).text_byte_lengths()
    own = sum(int(lengths[ids[64 * i + 1: 64 * i + 65]].sum()) for i in range(n))
    assert own != nbytes  # a document starts in the validation split: the case that matters
    rows = []
    summary = run_local(small_config(data, tmp_path / "runs", "llama2", workers=1, max_steps=8,
                                     log_every=4, eval_every=4, checkpoint_every=8,
                                     sets=["model.n_layer=2", "model.n_embd=64", "model.n_head=2",
                                           "batch_size=8", "seq_len=64", "eval_windows=0"]),
                        on_metrics=rows.append)
    assert summary["status"] == "completed"
    evals = [r for r in rows if r.get("val_loss") is not None]
    assert len(evals) == 2 and rows[-1]["loss"] < rows[0]["loss"]
    for r in evals:
        expected = r["val_loss"] * (n * 64) / nbytes / math.log(2)
        assert abs(r["val_bpb"] - expected) < 1e-9 * expected


def test_prepare_on_ray_wraps_and_counts_as_threads_do(ray_address, tmp_path):
    """Ray tasks rebuild the tokenizer from what they are sent: a Llama 2 folder's dataset made by
    2 Ray tasks at a time (documents wrapped in <s> ... </s>, a file read in pieces, the bytes
    column) is byte for byte the one made in this process."""
    text = "\n".join(corpus_documents(4))
    src = write_corpus(tmp_path / "in", documents())
    (src / "book.txt").write_text(text)
    made = {}
    for name, kw in {"here": dict(use_ray=False, cpus=1), "ray": dict(use_ray=True, cpus=2)}.items():
        made[name] = prepare_dataset(str(src), tmp_path / name, tokenizer=str(family_folder("llama2")),
                                     block_tokens=128, val_every=VAL_EVERY, piece_bytes=2048, **kw)
        made[name].pop("created")
    assert made["here"] == made["ray"] and made["ray"]["documents"]["begin"] == ["<s>"]
    for s in made["here"]["train"]["shards"] + made["here"]["val"]["shards"]:
        assert (tmp_path / "here" / s["file"]).read_bytes() == (tmp_path / "ray" / s["file"]).read_bytes()


@pytest.mark.parametrize("name", ["llama2", "llama3", "qwen2"])
def test_a_checkpoint_keeps_the_familys_wrap_and_generate_starts_a_document_with_it(
        name, corpus, tmp_path):
    """The dataset's tokenizer (dataset_tokenizer) has the family's wrap, a checkpoint's spec
    records it, and the checkpoint's tokenizer has it again: `generate` puts <s> (Llama 2) or
    <|begin_of_text|> (Llama 3) before the prompt, as every document the model saw began, and
    starts from it alone when the prompt is empty (Qwen: after <|endoftext|>). A dataset
    prepared before its spec carried the wrap (only the manifest's "documents") gives the same,
    and resumes a checkpoint that records it (the same vocabulary)."""
    from raytrain_lm.data.manifest import dataset_tokenizer
    from raytrain_lm.data.spec import tokenizer_from_spec
    from raytrain_lm.results.generate import start_ids
    from raytrain_lm.run.preflight import check_same_tokenizer

    ref = reference(name)
    out = tmp_path / "data"
    prepare_dataset(str(corpus), out, tokenizer=str(family_folder(name)), block_tokens=128,
                    val_every=VAL_EVERY, cpus=1)
    begin = [ref.convert_tokens_to_ids(t) for t in DOC_WRAP[name][0]]
    spec = dataset_tokenizer(out).spec()  # what the checkpointer records
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    tok = tokenizer_from_spec(json.loads(json.dumps(spec)), ckpt)
    prompt = "def main():"
    assert start_ids(tok, prompt) == begin + ref.encode(prompt, add_special_tokens=False)
    assert start_ids(tok, "") == (begin or [ref.convert_tokens_to_ids("<|endoftext|>")])
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"].pop("documents", None)  # as the previous prepare wrote it
    manifest_path.write_text(json.dumps(manifest))
    assert dataset_tokenizer(out).spec() == spec
    check_same_tokenizer(spec, manifest, "run 'r'", str(out))  # no UserError
