"""Tokenizers: UTF-8 bytes (the default), or a BPE backed by Hugging Face `tokenizers`, either a byte-level one
trained on the corpus or any BPE tokenizer.json a model family ships (GPT-2's format; Qwen's with its NFC
normalizer; Llama 3's and tekken's; the SentencePiece-era Llama 2 / Mistral ones with their Prepend/Replace
normalizer or Metaspace pre-tokenizer and byte fallback).

A tokenizer is described by a small dict (`spec()`) stored in the dataset manifest and in every checkpoint, so
training, resuming and generation can never disagree about what a token means. A BPE's vocabulary lives in a
tokenizer.json beside the manifest (and, byte for byte, in every checkpoint and export); the spec carries its
sha256, and loading refuses a file that differs.

Every token stands for a fixed byte string (a byte-level token's bytes, a SentencePiece piece with "▁" read as
a space, a byte-fallback token's byte). Where the tokenizer encodes the text exactly as given (no normalizer,
no prefix space) those bytes, summed, are the document's bytes; where it rewrites the text first (`exact` is
False) they are not, and the dataset records each token's share of the document's bytes as read instead
(data/prepare.py), so bits per byte stays honest.
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from raytrain_lm.config.checks import MAX_VOCAB
from raytrain_lm.data.vocab import dtype_for_vocab, prefixes_text, raw_byte_shares, token_style, token_table
from raytrain_lm.data.wrap import document_wrap
from raytrain_lm.errors import UserError, last_line
from raytrain_lm.store import untrusted
from raytrain_lm.store.files import TOKENIZER as TOKENIZER_FILE  # in a dataset, checkpoint or export

# The largest tokenizer.json read: 4x the largest released (Gemma 3's, ~33 MB); past it, no tokenizer.
MAX_TOKENIZER_BYTES = 128 << 20

EOT = "<|endoftext|>"  # GPT-2's document separator; id assigned by the trainer (0 for ours)
MIN_BPE_VOCAB = 257  # 256 byte tokens + <|endoftext|>
DEFAULT_BPE_VOCAB = 8192
DEFAULT_SAMPLE_MB = 100.0

# Encoding a probe must give it back (a prefix space aside): catches a tokenizer.json that loses or
# rewrites text (an incomplete byte alphabet, lowercasing, stripping). Runs of spaces/newlines, CRLF,
# NUL, a zero-width space, astral-plane emoji and the literal EOT string (which must stay text, not
# become the token). Unchanged by NFC and NFKC, which rewrite only other text.
_PROBE = ("Hello,  world!\n\n\tTabs\r\nand  runs   of spaces  \n  \u00fcn\u00efc\u00f6d\u00e9 "
          "\u65e5\u672c\u8a9e \U0001F642\u200b\x00 " + EOT + "\n")


class Tokenizer(ABC):
    """What the project needs of a tokenizer. Ids are 0..vocab_size-1; each id stands for a fixed
    byte string (`token_bytes`), so decoding is joining bytes."""

    name: str
    vocab_size: int
    # The token placed between documents, or None when documents are joined by "\n\n" as text.
    eot_id: Optional[int] = None
    # The tokenizer.json that travels with the data, its checkpoints and exports, byte for byte
    # (None: nothing to ship).
    raw: Optional[bytes] = None
    # Whether the tokens' bytes, summed, are the encoded text's own bytes (no normalizer, no
    # prefix space); else a dataset counts each token's share of the bytes as read (raw_bytes).
    exact: bool = True
    # The token ids every document is wrapped in, as the family pretrained on them (read from
    # its folder: data/wrap.py); empty: documents are joined by `separator()` alone.
    doc_begin: tuple[int, ...] = ()
    doc_end: tuple[int, ...] = ()

    @property
    def dtype(self):
        return dtype_for_vocab(self.vocab_size)

    @abstractmethod
    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` decodes to; a special token gives its literal text."""

    @abstractmethod
    def text_byte_lengths(self) -> np.ndarray:
        """int64 array of vocab_size: UTF-8 bytes of *text* each token stands for (0 for special
        tokens). Summed over a split's tokens it gives the split's bytes, for bits per byte."""

    def decode(self, ids) -> str:
        # errors="replace": a sampled sequence can cut a multi-byte character in half.
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def separator(self) -> np.ndarray:
        """Token ids placed between two documents of one stream: the end of one and the start
        of the next where the family wraps its documents, else <|endoftext|> or a blank line."""
        if self.doc_begin or self.doc_end:
            return np.array(self.doc_end + self.doc_begin, dtype=self.dtype)
        if self.eot_id is not None:
            return np.array([self.eot_id], dtype=self.dtype)
        return self.encode("\n\n")

    def encode_counted(self, text: str, continued: bool = False) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(token ids, each token's share of the text's UTF-8 bytes as given, or None where the
        tokenizer is exact and `text_byte_lengths` already says it). `continued`: `text` goes on
        a document after a newline (a later piece of a large file: data/sources.py), so it gets
        the tokens it has inside the whole document."""
        return self.encode(text), None

    @abstractmethod
    def spec(self) -> dict: ...


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: vocab of 256. Documents are joined by "\\n\\n": a 257th id for an
    end-of-text token would double the shards (uint16) and change existing datasets."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def text_byte_lengths(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)

    def spec(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size}


class BPETokenizer(Tokenizer):
    """A BPE read from a tokenizer.json: byte-level (GPT-2's format, Qwen's, Llama 3's, tekken's)
    or SentencePiece-style with byte fallback (Llama 2, Mistral). Normalizers and prefix spaces
    are taken as the family ships them (`exact` says whether there are any). Documents are
    separated by <|endoftext|> when the vocabulary has it, unless a family wrap is set."""

    name = "bpe"

    def __init__(self, path: str | Path, sha256: Optional[str] = None, raw: Optional[bytes] = None):
        """The tokenizer.json at `path` (or its content `raw`, e.g. shipped to a Ray task on
        another node; `path` then only names it in messages)."""
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        if raw is None:
            if not self.path.is_file():
                raise UserError(f"tokenizer file not found: {self.path}")
            # The file a path names (a user's own symlink is followed; a folder's tokenizer.json
            # is checked to be its own: make_tokenizer), a regular file of a bounded size.
            raw = untrusted.read_bytes(self.path.resolve() if self.path.is_symlink() else self.path,
                                       MAX_TOKENIZER_BYTES)
        self.raw = raw
        self.sha256 = hashlib.sha256(raw).hexdigest()
        if sha256 is not None and self.sha256 != sha256:
            raise UserError(f"{self.path} does not match the sha256 its dataset or checkpoint "
                            f"recorded (the file was changed or replaced)")
        try:
            config = json.loads(raw)
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
            self._tok = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # json, UTF-8 and the Rust parser's own exception
            raise UserError(f"{self.path} is not a valid tokenizer.json: {last_line(e)}") from None
        style = token_style(config, self.path)
        # tokenizers matches special tokens' text inside ordinary input by default, so a document
        # quoting "<|endoftext|>" would get a document break in the middle. Only the dataset
        # writer may place that token. (A runtime flag: tokenizer.json does not store it.)
        self._tok.encode_special_tokens = True
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise UserError(f"{self.path} has an empty vocabulary: no token to write text with")
        if max(vocab.values()) >= MAX_VOCAB:  # before tables sized by the largest id are made
            raise UserError(f"{self.path} has a token id of {max(vocab.values()):,}; ids must be "
                            f"below {MAX_VOCAB:,} (the most tokens a vocabulary may have)")
        self.vocab_size = max(vocab.values()) + 1
        self.eot_id = vocab.get(EOT)
        model = config.get("model") or {}
        unk = model.get("unk_token")
        self.unk_id = vocab.get(unk) if isinstance(unk, str) else None
        self.prefixed = prefixes_text(config)  # Llama 2's Prepend, Metaspace, add_prefix_space
        self.exact = style == "byte-level" and not config.get("normalizer") and not self.prefixed
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        # special tokens (and the unknown one) stand for their literal text on display, and for
        # no bytes of the corpus
        self._bytes, self._lengths = token_table(vocab, self.vocab_size, special | {self.unk_id}, style,
                                                 bool(model.get("byte_fallback")))
        # Can every text be written? Only with all 256 byte tokens (a byte-level vocabulary's
        # alphabet, a SentencePiece model's byte fallback). Without them a character outside
        # the vocabulary becomes <unk>, which `encode_counted` refuses where the corpus has one.
        present = {b for i, b in enumerate(self._bytes) if self._lengths[i] == 1}
        self.complete = (style == "byte-level" or bool(model.get("byte_fallback"))) and \
            all(bytes([b]) in present for b in range(256))
        if self.complete:
            back = self.decode(self.encode(_PROBE))
            if back != _PROBE and not (self.prefixed and back == " " + _PROBE):
                raise UserError(f"{self.path} does not give text back (encoded then decoded, a "
                                f"probe of spaces, tabs, CRLF and non-Latin text changes beyond a "
                                f"prefix space), so it would train on other text than the corpus")
        elif self.unk_id is None:
            raise UserError(f"{self.path}: its vocabulary lacks some of the 256 byte tokens and it "
                            f"has no unknown token, so text outside its vocabulary would vanish unseen")

    def encode(self, text: str) -> np.ndarray:
        # A batch of one: the fast path computes no offsets (25-35% faster here than the
        # tokenizer's encode()) and, with one text, runs on one thread.
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast: no offsets computed; Rust threads (RAYON_NUM_THREADS) across texts
        encs = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype=self.dtype) for e in encs]

    def encode_counted(self, text: str, continued: bool = False) -> tuple[np.ndarray, Optional[np.ndarray]]:
        if self.exact and self.complete:
            return self.encode(text), None
        # A tokenizer that puts a space before the text would put one where a piece of a large
        # file starts, inside a document: encode the piece after the newline it follows, and
        # keep the tokens of the piece (the newline is a token of its own: files are cut only
        # between a newline and a printable ASCII character).
        lead = "\n" if continued and self.prefixed else ""
        enc = self._tok.encode_batch([lead + text], add_special_tokens=False)[0]
        ids, offsets = enc.ids, enc.offsets  # each access builds a new list: once
        if lead:  # the newline's tokens end within it
            first = next((k for k, (_, e) in enumerate(offsets) if e > len(lead)), len(ids))
            ids, offsets = ids[first:], offsets[first:]
        ends = [e - len(lead) for _, e in offsets]
        ids = np.array(ids, dtype=self.dtype)
        if self.unk_id is not None and not self.complete and (ids == self.unk_id).any():
            at = int(np.argmax(ids == self.unk_id))
            e = ends[at]
            s = max(0, e - 1) if at == 0 else ends[at - 1]
            raise UserError(f"{self.path} cannot encode this corpus: {text[s:e]!r} becomes its "
                            f"unknown token (it has no byte fallback or byte tokens); use a "
                            f"tokenizer that can write every character, or --tokenizer bpe")
        if self.exact:
            return ids, None
        return ids, raw_byte_shares(text, ends)

    def vocabulary(self) -> dict[str, int]:
        """Every token's text -> its id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        # Our own table, not tokenizers' decode(): that one skips special tokens by default and
        # cannot decode one token of a multi-byte character on its own (streaming needs that).
        return self._bytes[token_id]

    def decode(self, ids) -> str:
        if self.exact:
            return super().decode(ids)
        # the family's own decoder: it strips the prefix space its pre-tokenizer added and
        # joins byte-fallback bytes (a normalized text comes back normalized)
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def text_byte_lengths(self) -> np.ndarray:
        return self._lengths

    def spec(self) -> dict:
        """What a checkpoint records of its tokenizer: the file's hash, and the family's wrap of a
        document (so `generate` starts one as the model saw them: <s>, <|begin_of_text|>)."""
        wrap = {"documents": {"begin_ids": list(self.doc_begin), "end_ids": list(self.doc_end)}}
        return {"type": self.name, "vocab_size": self.vocab_size, "file": TOKENIZER_FILE,
                "sha256": self.sha256, "eot_id": self.eot_id,
                **(wrap if self.doc_begin or self.doc_end else {})}


# ---------------------------------------------------------------- training


def train_bpe(documents: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE on `documents` (any iterable, streamed) in GPT-2's tokenizer.json
    format. What the dataset is tokenized with is exactly the JSON that ships with it (`raw`).

    min_frequency=2: a pair seen once is noise, not a token worth a vocabulary slot. The vocabulary
    may come out smaller than `vocab_size` when the corpus runs out of pairs; the spec records the
    real size. Training is deterministic (the same sample gives the same file at any thread count)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_bpe_vocab(vocab_size)
    tok = HFTokenizer(models.BPE())
    # add_prefix_space=False: the default (True) puts a space before every text, which then
    # comes back on decoding. use_regex=True: GPT-2's split, so merges never cross word classes.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        # all 256 bytes, seen in the sample or not: nothing is ever out of vocabulary
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOT])
    tok.train_from_iterator(documents, trainer)
    if tok.get_vocab_size() < MIN_BPE_VOCAB:
        raise UserError("the BPE training corpus is empty")
    return BPETokenizer(TOKENIZER_FILE, raw=tok.to_str(pretty=True).encode("utf-8"))


def check_bpe_vocab(vocab_size: int) -> None:
    if vocab_size < MIN_BPE_VOCAB:
        raise UserError(f"--vocab-size must be at least {MIN_BPE_VOCAB} for a BPE tokenizer (256 "
                        f"bytes + {EOT}), got {vocab_size}")
    if vocab_size > MAX_VOCAB:  # tokenizers' trainer aborts the process on sizes beyond u32
        raise UserError(f"--vocab-size must be at most {MAX_VOCAB:,}, got {vocab_size:,}")


# ---------------------------------------------------------------- choosing and loading


def check_choice(kind: str, vocab_size: Optional[int], sample_mb: float) -> None:
    """`--tokenizer`, `--vocab-size` and `--tokenizer-sample-mb` before anything is read."""
    if kind == "byte":
        if vocab_size not in (None, 256):
            raise UserError(f"the byte tokenizer has a vocabulary of 256, not {vocab_size}; "
                            f"for another size use --tokenizer bpe")
    elif kind == "bpe":
        check_bpe_vocab(vocab_size or DEFAULT_BPE_VOCAB)
        if not 0 < sample_mb < math.inf:
            raise UserError(f"--tokenizer-sample-mb must be positive and finite, got {sample_mb:g}")
    else:
        if vocab_size is not None:
            raise UserError("--vocab-size is for a trained BPE; a tokenizer.json has its own")
        path = Path(kind)
        if not path.is_file() and not (path / TOKENIZER_FILE).is_file():
            raise UserError(f"--tokenizer must be byte, bpe or a tokenizer.json file; {kind} is none")


def make_tokenizer(kind: str, sample: Optional[Callable[[], Iterable[str]]] = None, *,
                   vocab_size: Optional[int] = None) -> Tokenizer:
    """The tokenizer of a new dataset, from `--tokenizer`:
    - "byte": UTF-8 bytes;
    - "bpe": a byte-level BPE of `vocab_size` trained on the texts of `sample()` (called only
      then: reading a sample of a large corpus takes a while);
    - a path to a tokenizer.json (or a folder holding one: a release, dataset, checkpoint or
      export): checked, and used byte for byte; documents wrapped as the folder says (data/wrap.py).
    The caller writes `raw` (None for bytes) into the dataset as tokenizer.json."""
    check_choice(kind, vocab_size, DEFAULT_SAMPLE_MB)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return train_bpe(sample(), vocab_size or DEFAULT_BPE_VOCAB)
    path = Path(kind)
    folder = path if path.is_dir() else None
    if folder is not None:  # the folder's own tokenizer.json: no symlink out of it
        path = untrusted.inside(folder, TOKENIZER_FILE, f"--tokenizer {kind}")
    tok = BPETokenizer(path)
    wrap = document_wrap(folder, json.loads(tok.raw), tok.vocabulary(), tok.eot_id)
    if wrap is not None:
        tok.doc_begin, tok.doc_end = wrap.begin, wrap.end
    return tok


# ---------------------------------------------------------------- Hugging Face interop


def bits_per_byte(loss_nats_per_token: float, tokens: float, nbytes: float) -> float:
    """Loss in bits per UTF-8 byte of text: comparable across tokenizers (a loss per token is
    not). `tokens` targets stood for `nbytes` bytes of text; for the byte tokenizer they are
    equal, so the ratio is exactly 1.0 and this is loss / ln 2 exactly."""
    return loss_nats_per_token * (tokens / nbytes) / math.log(2)
