"""Sampling text from a checkpoint, token by token with a KV cache, streaming text as it comes."""

from __future__ import annotations

import codecs
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from raytrain_lm.config.checks import check_sampling
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.data.spec import tokenizer_from_spec
from raytrain_lm.errors import UserError
from raytrain_lm.models import decoder_class
from raytrain_lm.models.decoder import Decoder
from raytrain_lm.store.checkpoint_format import load_checkpoint


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown --device {name!r}; use auto, cpu or cuda[:N]") from None


def load_model(folder: Path, device: torch.device, meta: Optional[dict] = None):
    """(model in eval mode on `device`, tokenizer, the checkpoint's TrainConfig). `meta`: as for
    load_checkpoint."""
    state = load_checkpoint(folder, map_location="cpu", meta=meta)
    cfg = TrainConfig.from_dict(state["config"])
    model = decoder_class(cfg.model).from_state_dict(cfg.model, state["model"])
    # a BPE's tokenizer.json travels in the checkpoint (its sha256 checked against the spec)
    return model.to(device).eval(), tokenizer_from_spec(state["tokenizer"], folder), cfg


@torch.no_grad()
def sample(
    model: Decoder,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: Optional[int] = 40,
    seed: int = 0,
    on_token: Optional[Callable[[int], None]] = None,
    vocab_size: Optional[int] = None,
) -> list[int]:
    """Exactly `max_new_tokens` new token ids after `prompt_ids`, all below `vocab_size` (the
    tokenizer's: the model's vocabulary may be padded beyond it, ids nothing can decode).

    One forward pass of the whole prompt fills the KV cache; every new token then costs one
    single-position pass. When the context reaches the model's block size, the cache is rebuilt
    from the last three quarters of it (a sliding window, paid for once every block/4 tokens).
    Temperature 0 is greedy. The same seed gives the same tokens on the same device.
    """
    check_sampling(max_new_tokens, temperature, top_k)
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    block = model.cfg.block_size
    keep = max(1, block * 3 // 4)
    ids = list(prompt_ids)

    def refill():
        cache = model.new_cache()
        ctx = torch.tensor([ids[-keep:]], dtype=torch.long, device=device)
        logits, _ = model(ctx, cache=cache)
        return cache, logits

    cache, logits = refill()
    out: list[int] = []
    for i in range(max_new_tokens):
        logits_last = logits[0, -1, :vocab_size].float()
        if temperature == 0:
            nxt = int(torch.argmax(logits_last))
        else:
            logits_last = logits_last / temperature
            if top_k is not None and top_k < logits_last.numel():
                kth = torch.topk(logits_last, top_k).values[-1]
                logits_last = logits_last.masked_fill(logits_last < kth, float("-inf"))
            probs = torch.softmax(logits_last, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(nxt)
        out.append(nxt)
        if on_token:
            on_token(nxt)
        if i == max_new_tokens - 1:
            break
        if cache.length >= block:
            cache, logits = refill()
        else:
            logits, _ = model(torch.tensor([[nxt]], dtype=torch.long, device=device), cache=cache)
    return out


def start_ids(tok, prompt: str) -> list[int]:
    """The tokens sampling continues: the prompt's, as a document the model trained on begins
    (the family's <s> or <|begin_of_text|> before it, as its tokenizer adds one). An empty prompt
    starts a new document: the family's start token, else after <|endoftext|> where the
    tokenizer has one, else after a newline (the byte tokenizer has no start token)."""
    ids = [*tok.doc_begin, *(int(i) for i in tok.encode(prompt))]
    if ids:
        return ids
    return [tok.eot_id] if tok.eot_id is not None else [int(i) for i in tok.encode("\n")]


def generate_text(
    folder: Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: Optional[int] = 40,
    seed: int = 0,
    device: str = "auto",
    on_text: Optional[Callable[[str], None]] = None,
    meta: Optional[dict] = None,
) -> dict:
    """Sample from the checkpoint in `folder`; `on_text` receives decoded text as it is produced.
    Returns the text, its token ids and the speed."""
    check_sampling(max_new_tokens, temperature, top_k)
    dev = pick_device(device)
    model, tok, _ = load_model(folder, dev, meta)
    prompt_ids = start_ids(tok, prompt)
    if max(prompt_ids) >= min(model.cfg.vocab_size, tok.vocab_size):
        raise UserError("the prompt holds tokens outside this model's vocabulary")
    # A token is a byte string that can end inside a character (every byte-level tokenizer):
    # decode incrementally so the stream never shows half a character.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces: list[str] = []

    def emit(token: int) -> None:
        text = decoder.decode(tok.token_bytes(token))
        if text:
            pieces.append(text)
            if on_text:
                on_text(text)

    t0 = time.perf_counter()
    ids = sample(model, prompt_ids, max_new_tokens, temperature, top_k, seed,
                 on_token=emit, vocab_size=tok.vocab_size)
    seconds = time.perf_counter() - t0
    tail = decoder.decode(b"", final=True)
    if tail:
        pieces.append(tail)
        if on_text:
            on_text(tail)
    return {"prompt": prompt, "text": "".join(pieces), "token_ids": ids, "tokens": len(ids),
            "seconds": seconds, "tokens_per_second": len(ids) / seconds if seconds > 0 else None,
            "device": str(dev), "seed": seed, "temperature": temperature, "top_k": top_k}
