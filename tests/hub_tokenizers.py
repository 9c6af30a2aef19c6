"""Tokenizer folders shaped like the Hub's releases, made the way their producers made them.

Each family's tokenizer.json comes from transformers' own code for that family, fed a small
vocabulary trained here on CPython's documentation (no download):

- qwen2 / qwen2-instruct: a byte-level BPE (Qwen's split regex) handed to `Qwen2Tokenizer`, which
  sets the NFC normalizer every Qwen2/2.5/3 tokenizer.json ships; <|endoftext|>, <|im_start|>,
  <|im_end|> added after the vocabulary; no bos. The instruct folder's eos is <|im_end|>.
- llama2: a SentencePiece BPE (byte_fallback) trained with the `sentencepiece` package and
  converted by transformers' `LlamaConverter` in its legacy form (normalizer Prepend("▁") +
  Replace(" ", "▁"), no pre-tokenizer, decoder Replace/ByteFallback/Fuse/Strip), with the
  "<s> $A" post-processor: Llama 2, Mistral v0.1, TinyLlama.
- mistral: the same SentencePiece model loaded by transformers' `LlamaTokenizer` (Metaspace
  pre-tokenizer, no normalizer), add_bos_token: the non-legacy conversion (Mistral v0.3, Mixtral).
- llama3 / llama3-instruct: the byte-level ranks through transformers' `TikTokenConverter`
  (Llama 3's own conversion path), <|begin_of_text|> <|end_of_text|> and the reserved/chat
  tokens after the vocabulary, "<|begin_of_text|> $A" post-processor. The instruct folder has
  Llama 3.1's eos <|eot_id|> and generation_config eos list [end_of_text, eom_id, eot_id].
- nemo: a tekken.json written from the ranks and converted by transformers' `MistralConverter`
  (Mistral-Nemo's path): control tokens first (<unk> <s> </s> [INST] ...), byte-level, no
  normalizer, "<s> $A".

`tokenizer_config.json` is what `save_pretrained` writes (bos/eos/pad, the chat_template where the
release has one, in the file as 4.x wrote it), with what 4.x also wrote and the releases carry
(added_tokens_decoder, add_bos_token/add_eos_token: `_as_shipped`); generation_config.json is
written as the releases ship it. Folders are built once per process (`family_folder`) and copied
per test (`copy_family`).

API (for other tests):
    FAMILIES                         the names below
    family_folder(name) -> Path      a cached, read-only-by-convention folder
    copy_family(name, dest) -> Path  a private copy under `dest`
    corpus_documents(n) -> list[str] the first n pydoc topics (the text the vocabularies saw)
    write_corpus(folder, docs)       a .jsonl corpus of `docs`, one document a line
    DOC_WRAP[name]                   (begin tokens, end tokens) a document is wrapped in
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

FAMILIES = ("qwen2", "qwen2-instruct", "llama2", "mistral", "llama3", "llama3-instruct", "nemo")

# What each family's pretraining documents look like: (tokens before, tokens after).
DOC_WRAP = {
    "qwen2": ((), ("<|endoftext|>",)),
    "qwen2-instruct": ((), ("<|endoftext|>",)),
    "llama2": (("<s>",), ("</s>",)),
    "mistral": (("<s>",), ("</s>",)),
    "llama3": (("<|begin_of_text|>",), ("<|end_of_text|>",)),
    "llama3-instruct": (("<|begin_of_text|>",), ("<|end_of_text|>",)),
    "nemo": (("<s>",), ("</s>",)),
}

BYTE_LEVEL_VOCAB = 600  # merges learnt on top of the 256 bytes: enough for real multi-byte tokens
SP_VOCAB = 700

QWEN_CHAT = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_CHAT = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")
MISTRAL_CHAT = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- else %}{{- message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                  r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus_documents(n: int = 40) -> list[str]:
    """The first `n` pydoc topics, in the built-in corpus's order."""
    from raytrain_lm.data.sources import _pydoc_topics

    return _pydoc_topics()[:n]


def write_corpus(folder: Path, docs: list[str]) -> Path:
    """`docs` as a .jsonl corpus (one document a line) in `folder`; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "docs.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return folder


@lru_cache(maxsize=None)
def _root() -> Path:
    return Path(tempfile.mkdtemp(prefix="hub-tokenizers-"))


@lru_cache(maxsize=None)
def family_folder(name: str) -> Path:
    """The folder of family `name` (built once per process; copy it before changing it)."""
    if name not in FAMILIES:
        raise KeyError(name)
    folder = _root() / name
    _BUILDERS[name](folder)
    return folder


def copy_family(name: str, dest: Path) -> Path:
    """A private copy of family `name`'s folder at `dest`."""
    shutil.copytree(family_folder(name), dest)
    return dest


# ---------------------------------------------------------------- vocabularies trained here


@lru_cache(maxsize=None)
def _byte_level_ranks(pattern: str) -> dict[bytes, int]:
    """tiktoken-style ranks: the 256 bytes, then each merge's result in the order it was learnt
    (a byte-level BPE trained with `tokenizers` on the pydoc slice, split by `pattern`)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from raytrain_lm.data.vocab import bytes_to_unicode

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=BYTE_LEVEL_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_documents(), trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    decode = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in merges:
        token = bytes(decode[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


@lru_cache(maxsize=None)
def _sentencepiece_model() -> bytes:
    """A SentencePiece BPE trained like Llama 2's: byte_fallback, digits split, unk/bos/eos at 0/1/2,
    no normalization rule beyond the dummy prefix and whitespace escaping."""
    import sentencepiece as spm

    out = io.BytesIO()
    lines = [line for d in corpus_documents() for line in d.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe", vocab_size=SP_VOCAB,
        byte_fallback=True, character_coverage=1.0, split_digits=True,
        allow_whitespace_only_pieces=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2, num_threads=1)
    return out.getvalue()


# ---------------------------------------------------------------- families


def _as_shipped(folder: Path, **fields) -> None:
    """tokenizer_config.json as the releases carry it: transformers 4.x's save_pretrained wrote
    `added_tokens_decoder` (every added token, from tokenizer.json's added_tokens) and the
    family's add_bos_token/add_eos_token; 5.x writes neither. `fields`: the release's own."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):  # from_pretrained's options, written back by 5.x
        config.pop(key, None)
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    config["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in added}
    config.update(fields)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _write_generation_config(folder: Path, **fields) -> None:
    (folder / "generation_config.json").write_text(
        json.dumps({**fields, "transformers_version": "4.45.0"}, indent=2) + "\n")


def _qwen2(folder: Path, instruct: bool = False) -> None:
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    from raytrain_lm.data.vocab import bytes_to_unicode

    ranks = _byte_level_ranks(QWEN_PATTERN)
    table = bytes_to_unicode()
    text = {t: "".join(table[b] for b in t) for t in ranks}
    vocab = {text[t]: r for t, r in ranks.items()}
    merges = []
    for t, r in ranks.items():  # each merged token from its first split (the order they were learnt)
        if len(t) > 1:
            left, right = next((t[:i], t[i:]) for i in range(1, len(t))
                               if t[:i] in ranks and t[i:] in ranks and max(ranks[t[:i]], ranks[t[i:]]) < r)
            merges.append((text[left], text[right]))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, errors="replace", model_max_length=32768,
                         clean_up_tokenization_spaces=False, split_special_tokens=False)
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]})
    tok.chat_template = QWEN_CHAT
    if instruct:
        tok.eos_token = "<|im_end|>"
    tok.save_pretrained(folder, save_jinja_files=False)
    _as_shipped(folder)
    ids = tok.convert_tokens_to_ids
    if instruct:
        _write_generation_config(folder, bos_token_id=ids("<|endoftext|>"), pad_token_id=ids("<|endoftext|>"),
                                 do_sample=True, eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
                                 repetition_penalty=1.05, temperature=0.7, top_p=0.8, top_k=20)
    else:
        _write_generation_config(folder, bos_token_id=ids("<|endoftext|>"), do_sample=False,
                                 eos_token_id=ids("<|endoftext|>"), max_new_tokens=2048)


class _SpmOriginal:
    """What transformers' LlamaConverter reads of a slow Llama tokenizer: its vocab file, the
    legacy flag and the names of ids 0-2."""

    def __init__(self, vocab_file: str):
        import sentencepiece as spm

        self.vocab_file, self.legacy, self.add_prefix_space = vocab_file, True, True
        self._sp = spm.SentencePieceProcessor(model_file=vocab_file)

    def convert_ids_to_tokens(self, i: int) -> str:
        return self._sp.id_to_piece(i)


def _llama2(folder: Path) -> None:
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import LlamaConverter, SentencePieceExtractor

    folder.mkdir(parents=True)
    model = folder / "tokenizer.model"
    model.write_bytes(_sentencepiece_model())
    class Extractor(SentencePieceExtractor):
        # transformers 5.24's SpmConverter calls extract(vocab_scores), which this version's
        # extractor reads as a model type: ask for its BPE vocab and merges as it means to
        def extract(self, vocab_scores=None, **kwargs):
            found = super().extract(None)
            return found["vocab"], found["merges"]

    class Converter(LlamaConverter):
        SpmExtractor = Extractor

    backend = Converter(_SpmOriginal(str(model))).converted()
    tok = LlamaTokenizer(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                         unk_token="<unk>", add_bos_token=True, add_eos_token=False, legacy=True,
                         pad_token=None, clean_up_tokenization_spaces=False)
    tok.save_pretrained(folder, save_jinja_files=False)
    _as_shipped(folder, add_bos_token=True, add_eos_token=False, legacy=True)
    _write_generation_config(folder, bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=True,
                             temperature=0.6, top_p=0.9, max_length=4096)


def _mistral(folder: Path) -> None:
    from transformers import LlamaTokenizer

    src = Path(tempfile.mkdtemp(prefix="spm-", dir=_root()))
    (src / "tokenizer.model").write_bytes(_sentencepiece_model())
    tok = LlamaTokenizer.from_pretrained(src, add_bos_token=True, add_eos_token=False, legacy=False)
    tok.chat_template = MISTRAL_CHAT
    tok.save_pretrained(folder, save_jinja_files=False)
    _as_shipped(folder, add_bos_token=True, add_eos_token=False, legacy=False)
    (folder / "tokenizer.model").write_bytes(_sentencepiece_model())
    _write_generation_config(folder, bos_token_id=1, eos_token_id=2)


def _llama3(folder: Path, instruct: bool = False) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _byte_level_ranks(LLAMA3_PATTERN)
    n = len(ranks)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]

    class Converter(TikTokenConverter):  # our ranks, not a tiktoken file (which needs `tiktoken`)
        @staticmethod
        def load_tiktoken_bpe(url):
            return ranks

    backend = Converter(vocab_file="tokenizer.model", pattern=LLAMA3_PATTERN,
                        extra_special_tokens=specials).converted()
    eos = "<|eot_id|>" if instruct else "<|end_of_text|>"
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token=eos,
                                  add_bos_token=True, add_eos_token=False, model_max_length=131072,
                                  clean_up_tokenization_spaces=True,
                                  model_input_names=["input_ids", "attention_mask"])
    if instruct:
        tok.chat_template = LLAMA3_CHAT
    tok.save_pretrained(folder, save_jinja_files=False)
    _as_shipped(folder)
    ids = {s: n + i for i, s in enumerate(specials)}
    if instruct:
        _write_generation_config(folder, bos_token_id=ids["<|begin_of_text|>"], do_sample=True,
                                 eos_token_id=[ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]],
                                 temperature=0.6, top_p=0.9)
    else:
        _write_generation_config(folder, bos_token_id=ids["<|begin_of_text|>"], do_sample=True,
                                 eos_token_id=ids["<|end_of_text|>"], temperature=0.6, top_p=0.9)


def _nemo(folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.mistral.tokenizer import MistralConverter

    ranks = _byte_level_ranks(LLAMA3_PATTERN)
    controls = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "<pad>", "[PREFIX]", "[MIDDLE]",
                "[SUFFIX]"]
    n_special = 20  # the rest are <SPECIAL_i> fillers, as in the release's 1000
    tekken = {
        "config": {"pattern": LLAMA3_PATTERN, "num_vocab_tokens": len(ranks),
                   "default_vocab_size": len(ranks) + n_special,
                   "default_num_special_tokens": n_special, "version": "v3"},
        "vocab": [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
                  for t, r in sorted(ranks.items(), key=lambda kv: kv[1])],
        "special_tokens": [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(controls)],
    }
    src = Path(tempfile.mkdtemp(prefix="tekken-", dir=_root())) / "tekken.json"
    src.write_text(json.dumps(tekken))
    backend = MistralConverter(str(src)).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", add_bos_token=True, add_eos_token=False,
                                  model_max_length=1024000, clean_up_tokenization_spaces=False)
    tok.save_pretrained(folder, save_jinja_files=False)
    _as_shipped(folder, add_bos_token=True, add_eos_token=False)
    _write_generation_config(folder, bos_token_id=1, eos_token_id=2)


_BUILDERS = {
    "qwen2": _qwen2,
    "qwen2-instruct": lambda f: _qwen2(f, instruct=True),
    "llama2": _llama2,
    "mistral": _mistral,
    "llama3": _llama3,
    "llama3-instruct": lambda f: _llama3(f, instruct=True),
    "nemo": _nemo,
}
