"""`export --format hf`: a Hugging Face model folder that transformers' Auto classes (and vLLM,
lm-evaluation-harness) load without this project, written at any size.

    config.json, generation_config.json    the family's adapter's config, the tokenizer's bos/eos
    model.safetensors                      or, past --max-shard-size, model-0000k-of-0000n
    model.safetensors.index.json             shards and the index naming each tensor's file
    tokenizer.json, tokenizer_config.json  the dataset's tokenizer, byte for byte

A run started from a Hugging Face folder (--init-from) exports the release, continued: the
release files its checkpoints carry (store/release.py) are written as they shipped
(tokenizer_config.json with its chat_template, generation_config.json with its eos list and
sampling defaults, special_tokens_map.json, chat_template.jinja), config.json is the release's
with only the weights' dtype changed (the model is the folder's, checked field by field), and
the vocabulary keeps every row of the release's embedding (Qwen pads it past its tokenizer).

The weights stream: the model's tensors are planned first on the meta device (each one's
Hugging Face name, shape and shard, from the family's adapter, models/hf.py), then read
from the checkpoint one at a time (store/checkpoint_format.read_model_tensor gathers a tensor
from every rank's dcp/ chunks), converted, cast to --dtype and written into its shard
(store/safetensors_io.SafetensorsWriter). Peak memory is a few of the largest tensors, whatever
the model's size. The folder appears complete or not at all (staged beside --out, then renamed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.data.spec import tokenizer_from_spec
from raytrain_lm.data.tokenizer import EOT, Tokenizer
from raytrain_lm.data.vocab import byte_tokenizer_json
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model, hf_adapter, hf_importer
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.hf import VOCAB_ROWS
from raytrain_lm.results.export import (
    DEFAULT_MAX_SHARD,
    EXPORT_SOURCE,
    check_dtype_name,
    check_out,
    parse_size,
    umask,
)
from raytrain_lm.store.files import STATE, TOKENIZER
from raytrain_lm.store.hf_folder import HF_CONFIG, HF_INDEX, HF_WEIGHTS, differing_fields
from raytrain_lm.store.release import Release, check_release, parse, write_beside
from raytrain_lm.store.safetensors_io import SafetensorsWriter
from raytrain_lm.store.storage import staged_folder

HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_GENERATION_CONFIG = "generation_config.json"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
# The end-of-text and beginning-of-text tokens of the tokenizers people start from, by their text:
# GPT-2 and Qwen (<|endoftext|>), Llama 3 (<|end_of_text|>, <|begin_of_text|>), Llama 2 and Mistral.
EOS_NAMES = (EOT, "<|end_of_text|>", "</s>")
BOS_NAMES = ("<|begin_of_text|>", "<s>")

Reader = Callable[[str], torch.Tensor]  # our tensor's name -> the tensor, whole


def check_dtype(dtype: str) -> torch.dtype:
    return DTYPES[check_dtype_name(dtype)]


def special_tokens(tok: Tokenizer) -> tuple[Optional[int], Optional[int]]:
    """(bos id, eos id) of the dataset's tokenizer, from its tokenizer.json: eos is its
    end-of-text token (<|endoftext|>, <|end_of_text|> or </s>); bos the special token its
    post-processor puts before a text (Llama's <|begin_of_text|> or <s>), else the eos, as GPT-2
    and Qwen have it. The byte tokenizer has neither."""
    if tok.raw is None:
        return None, None
    config = json.loads(tok.raw)
    specials = {t["content"]: t["id"] for t in config.get("added_tokens") or [] if t.get("special")}
    eos = tok.eot_id if tok.eot_id is not None else next(
        (specials[n] for n in EOS_NAMES if n in specials), None)
    first = _template_first_token(config.get("post_processor"))
    bos = specials.get(first) if first else next((specials[n] for n in BOS_NAMES if n in specials), None)
    return (bos if bos is not None else eos), eos


def _template_first_token(node: Any) -> Optional[str]:
    """The special token a TemplateProcessing post-processor puts first in a single text."""
    if not isinstance(node, dict):
        return None
    if node.get("type") == "TemplateProcessing":
        first = (node.get("single") or [{}])[0]
        return first.get("SpecialToken", {}).get("id") if isinstance(first, dict) else None
    for child in node.get("processors") or []:
        found = _template_first_token(child)
        if found:
            return found
    return None


# ---------------------------------------------------------------- planning and writing


Entry = tuple[str, torch.dtype, tuple[int, ...]]  # a tensor of a shard: name, dtype, shape


Source = tuple[str, Optional[int]]  # our tensor, and which of its experts (hf_stack) or None


def plan(m: ModelConfig, vocab_size: int, dtype: torch.dtype) -> list[tuple[Optional[Source], Entry]]:
    """Every tensor of the folder in the order written, from the model built on the meta device:
    (our tensor it comes from, with the expert where the folder holds one matrix per expert, or
    None for the format's zeros; its entry). Each folder tensor once: a tied head is the
    embedding's (hf_name), the vocabulary rows cut to the tokenizer's."""
    adapter = hf_adapter(m)
    with torch.device("meta"):
        model = build_model(m)
    out, planned = [], set()
    for name, p in model.named_parameters():  # a tied parameter once, under its first name
        stack = adapter.hf_stack(name, m)  # a mixture of experts: one matrix per expert
        if stack is not None:
            out += [((name, j), (hf, dtype, tuple(p.shape[1:]))) for j, hf in enumerate(stack)]
            continue
        hf = adapter.hf_name(name, m)
        if hf is None or hf in planned:
            continue
        planned.add(hf)
        t = adapter.to_hf_tensor(name, p[:vocab_size] if name in VOCAB_ROWS else p, m)
        out.append(((name, None), (hf, dtype, tuple(t.shape))))
    out += [(None, (hf, dtype, tuple(shape))) for hf, shape in adapter.hf_zeros(m).items()]
    return out


def split(entries: list[Entry], max_shard: int) -> list[list[Entry]]:
    """Shards in order: each closed before the tensor that would take it past `max_shard` bytes
    (a tensor larger than that is a shard alone), as transformers splits."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = _nbytes(entry)
        if shards[-1] and size + n > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def write_hf(out: Path, read: Reader, m: ModelConfig, tok: Tokenizer, dtype: str = "bf16",
             max_shard_size: str | int = DEFAULT_MAX_SHARD, force: bool = False,
             say: Optional[Callable[[str], None]] = None,
             release: Optional[Release] = None) -> dict[str, Any]:
    """Write `out` as a Hugging Face model folder of the model `m` whose tensors `read` gives by
    our names; returns config.json's content. The vocabulary is the tokenizer's (the model's
    padding rows are dropped), so every id of the exported model is a token and the real tokens'
    logits are unchanged; with the `release` the run started from, the release's (its
    config.json, every row, its tokenizer and generation files: `release_config`)."""
    if m.param != "sp":  # the attention's 1/d is no field of any Hugging Face config
        raise UserError(f"a model trained with --param {m.param} computes its attention with a "
                        f"scale Hugging Face's classes do not hold: export it with --format native")
    check_out(out, force)
    torch_dtype = check_dtype(dtype)
    max_shard = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    if m.vocab_size < tok.vocab_size:
        raise UserError(f"the model has {m.vocab_size} token embeddings but its tokenizer "
                        f"{tok.vocab_size} tokens")
    adapter = hf_adapter(m)
    vocab = tok.vocab_size
    bos, eos = special_tokens(tok)
    # first: hf_config refuses a model its class cannot hold, before any tensor is named
    config = {**adapter.hf_config(m, vocab, eos), "bos_token_id": bos, "eos_token_id": eos,
              "dtype": str(torch_dtype).removeprefix("torch.")}
    if release and HF_CONFIG in release:
        config, vocab = release_config(release, m, torch_dtype), m.vocab_size
    tensors = plan(m, vocab, torch_dtype)
    shards = split([entry for _, entry in tensors], max_shard)
    files = [HF_WEIGHTS] if len(shards) == 1 else [SHARD_NAME.format(i + 1, len(shards))
                                                      for i in range(len(shards))]
    with staged_folder(out) as tmp:
        writers = iter(zip(files, shards))
        writer, held = None, (None, None)  # the last tensor read: a stack's experts follow one another
        for source, (hf, _, shape) in tensors:
            if writer is None or writer.done:
                if writer is not None:
                    writer.close()
                file, entries = next(writers)
                # format=pt: transformers refuses a file without it; source: ours (--force)
                writer = SafetensorsWriter(Path(tmp, file), entries,
                                           metadata={"format": "pt", "source": EXPORT_SOURCE})
                if say:
                    say(f"[export] {file}: {len(entries)} tensors, "
                        f"{sum(map(_nbytes, entries)) / 1e9:.2f} GB")
            if source is None:
                t = torch.zeros(shape, dtype=torch_dtype)
            elif source[1] is not None:  # expert j of a stack, read once for all its experts
                if held[0] != source[0]:
                    held = (None, None)
                    held = (source[0], read(source[0]))
                t = held[1][source[1]]
            else:
                name = source[0]
                t = read(name)  # whole, in the checkpoint's dtype: the one tensor held
                t = adapter.to_hf_tensor(name, t[:vocab] if name in VOCAB_ROWS else t, m)
            writer.write(hf, t.to(torch_dtype))
            del t
        writer.close()
        for file in files:
            Path(tmp, file).chmod(0o666 & ~umask())
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(_nbytes(e) for _, e in tensors),
                                  "total_parameters": sum(math.prod(e[2]) for _, e in tensors)},
                     "weight_map": {e[0]: f for f, entries in zip(files, shards) for e in entries}}
            Path(tmp, HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_tokenizer_files(Path(tmp), config, tok, m.block_size, bos, eos)
        write_beside(Path(tmp), release)
    return {**config, "files": files}


def release_config(release: Release, m: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The release's config.json, every field as it shipped but the weights' dtype (torch_dtype
    and/or dtype, whichever it spells): the run's model is the release's (train --init-from
    makes it so), checked here again field by field so that the file describes the weights."""
    config = parse(release[HF_CONFIG], f"the release's {HF_CONFIG}")
    where = f"the {HF_CONFIG} the run started from"
    diff = differing_fields(hf_importer(config.get("model_type"), where).model_fields(config, where), m)
    if diff:
        raise UserError(f"the checkpoint's model is not the one of the release it started from "
                        f"({', '.join(diff)}: the release's vs the model's), so the release's "
                        f"config.json would not describe its weights")
    name = str(dtype).removeprefix("torch.")
    spelled = [k for k in ("torch_dtype", "dtype") if k in config] or ["dtype"]
    return {**config, **{k: name for k in spelled}}


def _nbytes(entry: Entry) -> int:
    _, dtype, shape = entry
    return math.prod(shape) * dtype.itemsize


def _write_tokenizer_files(tmp: Path, config: dict, tok: Tokenizer, block_size: int,
                           bos: Optional[int], eos: Optional[int]) -> None:
    (tmp / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    # config.json's ids: the tokenizer's, or a release's own (replaced by its own file if it has one)
    (tmp / HF_GENERATION_CONFIG).write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")},
        indent=2) + "\n")
    # PreTrainedTokenizerFast (transformers' tokenizer.json-as-is class): without a
    # tokenizer_config.json AutoTokenizer would pick GPT2Tokenizer from config.json, which
    # rebuilds the pipeline from vocab and merges with its own pre-tokenizer settings.
    # clean_up_tokenization_spaces=False: True rewrites " ." to "." on decode.
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
                  "clean_up_tokenization_spaces": False, "add_prefix_space": False}
    if bos is not None:
        tok_config["bos_token"] = tok.token_bytes(bos).decode("utf-8")
    if eos is not None:
        tok_config["eos_token"] = tok.token_bytes(eos).decode("utf-8")
    (tmp / HF_TOKENIZER_CONFIG).write_text(json.dumps(tok_config, indent=2) + "\n")
    # a BPE: the dataset's file itself; bytes: an equivalent tokenizer.json (id i = byte i)
    (tmp / TOKENIZER).write_bytes(tok.raw if tok.raw is not None else byte_tokenizer_json().encode())


# ---------------------------------------------------------------- sources


def export_hf(state_dict: dict, cfg: ModelConfig, tok: Tokenizer, out: Path, force: bool = False,
              dtype: str = "bf16", max_shard_size: str | int = DEFAULT_MAX_SHARD,
              release: Optional[Release] = None) -> dict[str, Any]:
    """A model in memory (its state dict, under our names) as a Hugging Face folder."""
    return write_hf(out, state_dict.__getitem__, cfg, tok, dtype, max_shard_size, force,
                    release=release)


def export_checkpoint_hf(folder: Path, out: Path, force: bool = False, meta: Optional[dict] = None,
                         dtype: str = "bf16", max_shard_size: str | int = DEFAULT_MAX_SHARD,
                         say: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """`export --format hf`: a checkpoint folder -> a Hugging Face model folder, reading the
    checkpoint one tensor at a time (a checkpoint of an earlier format: whole, as it was saved)."""
    from raytrain_lm.store import checkpoint_format as ckpt_io

    check_out(out, force)
    check_dtype(dtype)
    meta = meta or ckpt_io.read_meta(folder)
    specs = ckpt_io.model_tensor_specs(folder, meta)
    state = ckpt_io.load_checkpoint(folder, meta=meta) if specs is None \
        else ckpt_io.safe_load(folder / STATE)  # the training state without the model
    cfg = TrainConfig.from_dict(state["config"])
    tok = tokenizer_from_spec(state["tokenizer"], folder)
    if specs is None:
        read: Reader = state["model"].__getitem__
    else:
        def read(name: str) -> torch.Tensor:
            if name not in specs:
                raise UserError(f"{folder} holds no {name}: not a checkpoint of this model")
            return ckpt_io.read_model_tensor(folder, name, *specs[name])
    release = check_release(state.get("release"), str(folder))
    config = write_hf(out, read, cfg.model, tok, dtype, max_shard_size, force, say, release)
    return {**config, "step": state["step"]}
