"""What a tokenizer.json says about bytes: the byte each token stands for (GPT-2's byte alphabet, or
SentencePiece pieces with "▁" for a space and <0xNN> byte fallback), whether its pipeline puts a
space before the text, and each token's share of a text's bytes as read (for bits per byte where a
normalizer rewrote the text)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from raytrain_lm.errors import UserError


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which ByteLevel pre-tokenizers and tokenizer.json
    vocabularies are written in: printable Latin-1 bytes map to themselves, the other 68 bytes
    to U+0100 onwards."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def raw_byte_shares(text: str, ends: list[int]) -> np.ndarray:
    """Each token's share of `text`'s UTF-8 bytes, given where (in characters of `text` as read)
    each token's text ends: token i counts the bytes from the furthest end before it to its own,
    the last one up to the end of the text. The shares add up to len(text.encode()) exactly,
    whatever a normalizer did (several byte-fallback tokens of one character: the first counts
    it; a character a normalizer dropped: the next token counts it)."""
    if not ends:
        return np.zeros(0, dtype=np.int64)
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (cps >= 0x80) + (cps >= 0x800) + (cps >= 0x10000)
    at = np.concatenate([[0], np.cumsum(widths, dtype=np.int64)])  # byte offset of each char
    reach = np.maximum.accumulate(at[np.asarray(ends, dtype=np.int64)])
    reach[-1] = at[-1]
    return np.diff(np.concatenate([[0], reach]))


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_decoder() -> Callable[[str], Optional[bytes]]:
    table = {c: b for b, c in bytes_to_unicode().items()}

    def byte_of(token: str) -> Optional[bytes]:
        if any(c not in table for c in token):
            return None  # an added token that is not byte-level
        return bytes(table[c] for c in token)
    return byte_of


def piece_decoder(byte_fallback: bool) -> Callable[[str], Optional[bytes]]:
    """SentencePiece pieces: "▁" is a space, "<0xNN>" the byte NN where the model falls back to
    bytes."""

    def byte_of(token: str) -> Optional[bytes]:
        m = _BYTE_TOKEN.fullmatch(token) if byte_fallback else None
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")
    return byte_of


def pipeline_nodes(node) -> list[dict]:
    """A normalizer/pre-tokenizer/decoder and the ones a Sequence of them holds."""
    if not isinstance(node, dict):
        return []
    found = [node]
    for key in ("normalizers", "pretokenizers", "decoders", "processors"):
        for n in node.get(key) or []:
            found += pipeline_nodes(n)
    return found


def adds_prefix_space(pre_tokenizer) -> bool:
    return any(n.get("add_prefix_space") or
               (n.get("type") == "Metaspace" and n.get("prepend_scheme", "always") != "never")
               for n in pipeline_nodes(pre_tokenizer))


def token_style(config: dict, path: Path) -> str:
    """How the vocabulary writes bytes: "byte-level" (GPT-2's byte alphabet) or "pieces"
    (SentencePiece's "▁" pieces, with or without byte fallback). Refuses what is neither, with
    the reason: every token must stand for a fixed byte string (bits per byte, streaming)."""
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{path}: its model is {model.get('type')!r}, not BPE; the tokenizers "
                        f"taken are BPEs (byte-level, or SentencePiece-style with byte fallback)")
    types = {n.get("type") for key in ("pre_tokenizer", "decoder") for n in pipeline_nodes(config.get(key))}
    if "ByteLevel" in types:
        return "byte-level"
    if types & {"Metaspace", "ByteFallback"} or any(
            n.get("type") in ("Prepend", "Replace") for n in pipeline_nodes(config.get("normalizer"))):
        return "pieces"
    raise UserError(f"{path}: neither a byte-level BPE (ByteLevel pre-tokenizer or decoder) nor a "
                    f"SentencePiece-style one (Metaspace, byte fallback), so its tokens are not "
                    f"known byte strings")


def prefixes_text(config: dict) -> bool:
    """Whether the tokenizer puts a space before the text it encodes: a Prepend normalizer
    (Llama 2), a Metaspace pre-tokenizer that prepends (Mistral v0.3), add_prefix_space."""
    return adds_prefix_space(config.get("pre_tokenizer")) or any(
        n.get("type") == "Prepend" for n in pipeline_nodes(config.get("normalizer")))


def token_table(vocab: dict[str, int], size: int, literal: set, style: str,
                byte_fallback: bool) -> tuple[list[bytes], np.ndarray]:
    """(the bytes each id stands for, how many of them are text: 0 for the ids in `literal` and
    added tokens that are not byte strings, which stand for their literal text on display)."""
    byte_of = byte_level_decoder() if style == "byte-level" else piece_decoder(byte_fallback)
    table: list[bytes] = [b""] * size
    lengths = np.zeros(size, dtype=np.int64)
    for token, i in vocab.items():
        text_bytes = None if i in literal else byte_of(token)
        if text_bytes is None:
            table[i] = token.encode("utf-8")
        else:
            table[i] = text_bytes
            lengths[i] = len(text_bytes)
    return table, lengths


def dtype_for_vocab(vocab_size: int):
    """The smallest unsigned dtype that holds every token id (shards are stored in it)."""
    if vocab_size <= 1 << 8:
        return np.uint8
    if vocab_size <= 1 << 16:
        return np.uint16
    if vocab_size <= 1 << 32:
        return np.uint32
    raise UserError(f"a vocabulary of {vocab_size} tokens does not fit in uint32")


def byte_tokenizer_json() -> str:
    """A tokenizer.json equivalent to ByteTokenizer, for exports: id i is byte i. A BPE with an
    empty merge list over GPT-2's byte alphabet splits every text into single bytes; use_regex=False
    since there is nothing to keep merges from crossing."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str(pretty=True)
