"""Tokenizers. Byte-level is the default: no vocabulary file, every text round-trips exactly.

A tokenizer is described by a small dict (`spec()`) stored in the dataset manifest and in every
checkpoint, so training, resuming and generation can never disagree about what a token means.
"""

from __future__ import annotations

import numpy as np

from raytrain_lm.errors import UserError


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab of 256."""

    name = "byte"
    vocab_size = 256
    dtype = np.uint8  # smallest dtype that holds every token id

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        # errors="replace": a sampled sequence can cut a multi-byte character in half.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def spec(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size}


def tokenizer_from_spec(spec: dict) -> ByteTokenizer:
    if spec.get("type") == "byte":
        return ByteTokenizer()
    raise UserError(f"unknown tokenizer {spec.get('type')!r} in dataset or checkpoint")
