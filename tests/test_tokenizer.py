"""Tokenizers: exact round trips, streaming decode, specs and hashes, clear errors."""

import codecs
import json
import random

import numpy as np
import pytest

from raytrain_lm.data.spec import tokenizer_from_spec
from raytrain_lm.data.tokenizer import (
    EOT,
    BPETokenizer,
    ByteTokenizer,
    dtype_for_vocab,
    make_tokenizer,
    train_bpe,
)
from raytrain_lm.errors import UserError

EDGE_CASES = [
    "", " ", "\n", "\n\n\n", "  leading and trailing  ", "\t\ttabs\t", "a  b   c    d",
    "line\r\nwindows\r\n", "\x00\x01\x7f", "caf\u00e9 na\u00efve \u00fcber", "\u65e5\u672c\u8a9e\u306e\u6587",
    "\U0001F642\U0001F468\u200d\U0001F469\u200d\U0001F467 emoji ZWJ", "e\u0301 combining",
    "\u200b zero width \ufeff BOM", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 rtl",
    "    def f(x):\n        return x  \n\n\n", "x" * 5000, " " * 300 + "\n" * 50,
    "<|endoftext|>", "a<|endoftext|>b <|endoftext|>\n", "\U0010FFFF\U000E0001",
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Random strings over every plane, whitespace heavy (no lone surrogates: not UTF-8 text)."""
    rng = random.Random(seed)
    pools = [" \t\n\r\x0b\x0c\x85\xa0\u3000", "abcXYZ019_.,;:'\"()[]{}<>|", "\u00e9\u00df\u0416\u03a9",
             "\u4e2d\u6587\u304b\u306a", "\U0001F600\U0001F9E0\U00020000"]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(0, 80)):
            if rng.random() < 0.1:
                cp = rng.randint(0, 0x10FFFF)
                if 0xD800 <= cp <= 0xDFFF:
                    continue
                chars.append(chr(cp))
            else:
                chars.append(rng.choice(rng.choice(pools)))
        out.append("".join(chars))
    return out


def test_bpe_round_trips_every_pydoc_document(bpe_pydoc, pydoc_docs):
    ok = sum(bpe_pydoc.decode(bpe_pydoc.encode(d)) == d for d in pydoc_docs)
    print(f"\npydoc round trips: {ok}/{len(pydoc_docs)} documents, vocab {bpe_pydoc.vocab_size}")
    assert ok == len(pydoc_docs) == 79
    # all at once too (what the dataset holds, separators aside)
    joined = "".join(pydoc_docs)
    assert bpe_pydoc.decode(bpe_pydoc.encode(joined)) == joined


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_round_trip_edge_cases_and_random_unicode(kind, bpe_pydoc):
    tok = ByteTokenizer() if kind == "byte" else bpe_pydoc
    texts = EDGE_CASES + random_texts(2000)
    bad = [t for t in texts if tok.decode(tok.encode(t)) != t]
    assert not bad, bad[:3]
    # batch encoding gives the same ids as one at a time
    for a, b in zip(tok.encode_batch(texts[:200]), (tok.encode(t) for t in texts[:200])):
        assert np.array_equal(a, b)


def test_literal_eot_text_is_not_the_eot_token(bpe_pydoc):
    """A document quoting "<|endoftext|>" must not get a document break: only the dataset writer
    places the token."""
    ids = bpe_pydoc.encode("say <|endoftext|> here").tolist()
    assert bpe_pydoc.eot_id == 0 and bpe_pydoc.eot_id not in ids
    assert bpe_pydoc.decode([bpe_pydoc.eot_id]) == EOT  # shown as its text
    assert bpe_pydoc.text_byte_lengths()[bpe_pydoc.eot_id] == 0  # but no bytes of the corpus


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_token_by_token_streaming_decode(kind, bpe_pydoc):
    """generate.py streams token by token; tokens can end inside a character."""
    tok = ByteTokenizer() if kind == "byte" else bpe_pydoc
    for text in EDGE_CASES + random_texts(200, seed=1):
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out = "".join(dec.decode(tok.token_bytes(int(i))) for i in tok.encode(text))
        assert out + dec.decode(b"", final=True) == text


def test_byte_lengths_sum_to_utf8_bytes(bpe_pydoc, pydoc_docs):
    lengths = bpe_pydoc.text_byte_lengths()
    for d in pydoc_docs[:20] + EDGE_CASES:
        assert lengths[bpe_pydoc.encode(d)].sum() == len(d.encode("utf-8"))


def test_dtype_by_vocab_size():
    assert dtype_for_vocab(256) is np.uint8
    assert dtype_for_vocab(257) is np.uint16 and dtype_for_vocab(65536) is np.uint16
    assert dtype_for_vocab(65537) is np.uint32 and dtype_for_vocab(200_000) is np.uint32
    assert ByteTokenizer().dtype is np.uint8
    from raytrain_lm.run.preflight import padded_vocab

    assert padded_vocab(256) == 256 and padded_vocab(257) == 320 and padded_vocab(50257) == 50304


def test_spec_and_hash_checked_on_load(bpe_pydoc, tmp_path):
    spec = bpe_pydoc.spec()
    assert spec == {"type": "bpe", "vocab_size": 2048, "file": "tokenizer.json",
                    "sha256": bpe_pydoc.sha256, "eot_id": 0}
    (tmp_path / "tokenizer.json").write_bytes(bpe_pydoc.raw)
    tok = tokenizer_from_spec(spec, tmp_path)
    assert tok.encode("hello world").tolist() == bpe_pydoc.encode("hello world").tolist()
    assert tokenizer_from_spec({"type": "byte", "vocab_size": 256}).vocab_size == 256


def one_line_user_error(fn, *match):
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for m in match:
        assert m in msg, msg
    return msg


def test_clear_errors(bpe_pydoc, tmp_path, pydoc_docs):
    msgs = [one_line_user_error(lambda: train_bpe(pydoc_docs, 256), "at least 257", "got 256")]
    spec = bpe_pydoc.spec()
    # missing file
    msgs.append(one_line_user_error(lambda: tokenizer_from_spec(spec, tmp_path), "no tokenizer.json"))
    # a changed file (same JSON, one merge dropped): the hash says so
    cfg = json.loads(bpe_pydoc.raw)
    cfg["model"]["merges"] = cfg["model"]["merges"][:-1]
    (tmp_path / "tokenizer.json").write_text(json.dumps(cfg))
    msgs.append(one_line_user_error(lambda: tokenizer_from_spec(spec, tmp_path), "sha256"))
    # a corrupt file given by path
    (tmp_path / "bad.json").write_text('{"model": {"type": "BPE", "vocab": ')
    msgs.append(one_line_user_error(lambda: BPETokenizer(tmp_path / "bad.json"),
                                    "not a valid tokenizer.json"))
    (tmp_path / "bad2.json").write_bytes(b"\xff\xfe garbage")
    msgs.append(one_line_user_error(lambda: BPETokenizer(tmp_path / "bad2.json"),
                                    "not a valid tokenizer.json"))
    msgs.append(one_line_user_error(lambda: make_tokenizer(str(tmp_path / "nope.json")),
                                    "byte, bpe or a tokenizer.json"))
    msgs.append(one_line_user_error(lambda: BPETokenizer(tmp_path / "nope.json"), "not found"))
    msgs.append(one_line_user_error(lambda: tokenizer_from_spec({"type": "wordpiece"}), "unknown"))
    print("\n" + "\n".join(msgs))


def test_tokenizers_that_rewrite_text_are_taken_and_lossy_ones_refused(tmp_path):
    """A normalizer (NFKC), a prefix space and a Metaspace BPE without byte fallback are taken
    (`exact` False: their datasets count bytes as read); a WordPiece (tokens are not byte strings),
    a byte-level BPE that lowercases (text does not come back) and one with no way to write an
    unknown character are refused, each with its reason."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = ["Hello world, caf\u00e9 \u65e5\u672c"] * 50
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    t.save(str(tmp_path / "metaspace.json"))
    metaspace = BPETokenizer(tmp_path / "metaspace.json")
    assert not metaspace.exact and not metaspace.complete
    ids, shares = metaspace.encode_counted(corpus[0])
    assert shares.sum() == len(corpus[0].encode())
    one_line_user_error(lambda: metaspace.encode_counted("caf\u00e9 \u00df"), "cannot encode",
                        "'\u00df'", "byte fallback")

    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFKC()
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.save(str(tmp_path / "nfkc.json"))
    nfkc = BPETokenizer(tmp_path / "nfkc.json")
    assert not nfkc.exact and nfkc.decode(nfkc.encode("\ufb01")) == "fi"  # what NFKC does
    ids, shares = nfkc.encode_counted("\ufb01 x")
    assert shares.sum() == len("\ufb01 x".encode())  # the ligature's 3 bytes as read, not "fi"'s 2

    cfg = json.loads((tmp_path / "nfkc.json").read_text())
    cfg["normalizer"] = None
    cfg["pre_tokenizer"]["add_prefix_space"] = True
    (tmp_path / "prefix.json").write_text(json.dumps(cfg))
    assert not BPETokenizer(tmp_path / "prefix.json").exact

    cfg["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "lower.json").write_text(json.dumps(cfg))
    one_line_user_error(lambda: BPETokenizer(tmp_path / "lower.json"), "does not give text back")

    cfg = json.loads((tmp_path / "metaspace.json").read_text())
    cfg["model"]["unk_token"] = None
    (tmp_path / "no-unk.json").write_text(json.dumps(cfg))
    one_line_user_error(lambda: BPETokenizer(tmp_path / "no-unk.json"), "would vanish")

    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=100, special_tokens=["[UNK]"]))
    t.save(str(tmp_path / "wordpiece.json"))
    one_line_user_error(lambda: BPETokenizer(tmp_path / "wordpiece.json"), "WordPiece", "not BPE")


def test_gpt2_format_tokenizer_json_by_path(tmp_path, pydoc_docs):
    """A tokenizer.json made elsewhere (here: built like GPT-2's, with its ByteLevel
    post-processor and EOT as the last id) is checked, copied byte for byte, and used as is."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    t.train_from_iterator(pydoc_docs, trainers.BpeTrainer(
        vocab_size=999, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.add_special_tokens([AddedToken(EOT, special=True)])  # id 999, GPT-2's position (last)
    t.save(str(tmp_path / "gpt2-like.json"))
    tok = make_tokenizer(str(tmp_path / "gpt2-like.json"))
    assert tok.raw == (tmp_path / "gpt2-like.json").read_bytes()
    assert tok.vocab_size == 1000 and tok.eot_id == 999 and tok.dtype is np.uint16
    for d in pydoc_docs:
        assert tok.decode(tok.encode(d)) == d
    one_line_user_error(lambda: make_tokenizer(str(tmp_path / "gpt2-like.json"), vocab_size=500),
                        "--vocab-size")


def test_byte_round_trip_of_any_text():
    tok = ByteTokenizer()
    for text in ["", "hello", "naïve café — 東京 🙂\n\ttabs", "def f(x):\n    return x ** 2\n"]:
        ids = tok.encode(text)
        assert ids.max(initial=0) < tok.vocab_size
        assert tok.decode(ids) == text


def test_spec_round_trip():
    tok = ByteTokenizer()
    again = tokenizer_from_spec(tok.spec())
    assert again.vocab_size == 256 and again.decode(tok.encode("abc")) == "abc"


def test_a_spec_cannot_name_another_file(bpe_pydoc, tmp_path):
    spec = {**bpe_pydoc.spec(), "file": "../../etc/passwd"}
    one_line_user_error(lambda: tokenizer_from_spec(spec, tmp_path), "does not name tokenizer.json")
