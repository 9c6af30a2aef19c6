"""The special tokens a family wraps each pretraining document in, read from its folder.

    begin: the special tokens the tokenizer.json's post-processor puts before a text ("<s> $A",
           "<|begin_of_text|> $A"), else tokenizer_config.json's bos_token where add_bos_token.
    end:   the post-processor's tokens after the text where it has some, else the end-of-text
           token: the first of generation_config.json's eos ids, then tokenizer_config.json's
           eos_token, that the chat template does not write itself. An instruct release's eos
           ends a turn (<|im_end|>, <|eot_id|>: its template writes them); its pretraining
           documents ended with the base model's (<|endoftext|>, <|end_of_text|>).

Llama 3 gets <|begin_of_text|> ... <|end_of_text|>, Llama 2 / Mistral / Nemo <s> ... </s>,
Qwen ... <|endoftext|>. A lone tokenizer.json (no tokenizer_config.json) gets its post-processor's
begin and <|endoftext|> as end where the vocabulary has it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.store.files import MANIFEST, TOKENIZER

TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
MAX_CONFIG_BYTES = 64 << 20  # a tokenizer_config.json with a long chat template is ~100 KB


@dataclass(frozen=True)
class Wrap:
    begin: tuple[int, ...] = ()
    end: tuple[int, ...] = ()



def document_wrap(folder: Optional[Path], tokenizer_json: dict, vocab: dict[str, int],
                  eot: Optional[int]) -> Optional[Wrap]:
    """The wrap of documents for the tokenizer in `folder` (None: a lone tokenizer.json), whose
    parsed content is `tokenizer_json` and whose vocabulary with added tokens is `vocab`. None
    where nothing says how the family wraps documents (GPT-2-style files, our own BPEs): those
    keep <|endoftext|> (`eot`) or a blank line between documents, as their datasets always had.
    A dataset folder gives the wrap its manifest recorded."""
    if folder is not None and (folder / MANIFEST).is_file():
        recorded = (_read(folder, MANIFEST) or {}).get("documents")
        if isinstance(recorded, dict):
            return Wrap(tuple(_ids(recorded.get("begin_ids"), vocab, folder)),
                        tuple(_ids(recorded.get("end_ids"), vocab, folder)))
    before, after = _template(tokenizer_json.get("post_processor"))
    config = _read(folder, TOKENIZER_CONFIG) if folder else None
    if config is None and not before and not after:
        return None
    generation = _read(folder, GENERATION_CONFIG) if folder else None
    where = folder / TOKENIZER_CONFIG if folder else TOKENIZER

    def token_id(token, what: str) -> Optional[int]:
        text = token.get("content") if isinstance(token, dict) else token  # AddedToken as saved
        if text is None:
            return None
        if not isinstance(text, str) or text not in vocab:
            raise UserError(f"{where}: its {what} {text!r} is not a token of its tokenizer.json")
        return vocab[text]

    begin = tuple(vocab[t] for t in before if t in vocab)
    if not begin and config and config.get("add_bos_token"):
        bos = token_id(config.get("bos_token"), "bos_token")
        begin = () if bos is None else (bos,)
    end = tuple(vocab[t] for t in after if t in vocab)
    if not end and config is None:
        end = () if eot is None else (eot,)
    elif not end:
        end = _end_of_text(config, generation or {}, vocab, token_id, where)
    return Wrap(begin, end)


def _ids(ids, vocab: dict[str, int], folder: Path) -> list[int]:
    known = set(vocab.values())
    if not isinstance(ids, list) or any(not isinstance(i, int) or i not in known for i in ids):
        raise UserError(f"{folder / MANIFEST}: its documents' wrap {ids!r} is not a list of token ids")
    return ids


def _end_of_text(config: dict, generation: dict, vocab: dict[str, int], token_id, where) -> tuple:
    names = {i: t for t, i in vocab.items()}
    eos = generation.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(not isinstance(i, int) or isinstance(i, bool) or i not in names for i in ids):
        raise UserError(f"{where.parent / GENERATION_CONFIG}: eos_token_id {eos!r} is not a token id "
                        f"of its tokenizer.json")
    from_config = token_id(config.get("eos_token"), "eos_token")
    candidates = ids + ([from_config] if from_config is not None else [])
    template = config.get("chat_template")
    text = json.dumps(template) if template is not None else ""
    for i in candidates:
        if names[i] not in text:
            return (i,)
    return (candidates[0],) if candidates else ()


def _template(post_processor) -> tuple[list[str], list[str]]:
    """The special tokens a TemplateProcessing post-processor (alone or in a Sequence) puts
    before and after a single text."""
    nodes = [post_processor] if isinstance(post_processor, dict) else []
    nodes += [n for n in (post_processor or {}).get("processors") or [] if isinstance(n, dict)]
    for node in nodes:
        if node.get("type") != "TemplateProcessing":
            continue
        before, after, seen = [], [], False
        for piece in node.get("single") or []:
            if "Sequence" in piece:
                seen = True
            elif "SpecialToken" in piece:
                (after if seen else before).append(piece["SpecialToken"].get("id"))
        return before, after
    return [], []


def _read(folder: Path, name: str) -> Optional[dict]:
    path = folder / name
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES >> 20} MiB")
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path} cannot be read: {e}") from None
    return data
