"""A Hugging Face model folder on disk (config.json, model.safetensors or shards named by
model.safetensors.index.json), read by its own names and without trusting it: a family's adapter
(models/<family>/hf_*.py) maps the names to its own and says which tensors and shapes it expects.
No torch: the driver checks a folder with this before anything is launched, and the workers
read the slices they keep of the weight files it lists (store/safetensors_io.py).

- config.json, the index: JSON objects of a bounded size (UTF-8, nested as JSON allows);
- the weight files: model.safetensors, or the files the index's weight_map names: plain names
  inside the folder, regular files, no symlink (untrusted.py);
- each file's safetensors header (8 bytes of length, then JSON): every tensor's dtype, shape and
  byte range, the range inside the file and as long as the shape says, read without a tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from raytrain_lm.errors import UserError, brief
from raytrain_lm.models import FAMILIES, hf_importer
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.store import untrusted
from raytrain_lm.store.files import META
from raytrain_lm.store.release import parse as json_object

HF_CONFIG, HF_WEIGHTS, HF_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_JSON_BYTES = 1 << 20  # config.json: a few KB
MAX_INDEX_BYTES = 16 << 20  # an index: ~100 KB for a 70B model
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a header
# safetensors' dtypes and their sizes in bytes
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what weights may be (loaded into fp32 or bf16)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its file's header describes it: `offset` is where its bytes start in the
    file (row-major, little-endian, as safetensors stores every tensor)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def is_hf_folder(path: str | Path) -> bool:
    """A model folder with a config.json and safetensors weights that is not a checkpoint of ours
    (its family's adapter then says whether this project computes it)."""
    p = Path(path)
    return ((p / HF_CONFIG).is_file() and not (p / META).is_file()
            and ((p / HF_WEIGHTS).is_file() or (p / HF_INDEX).is_file()))


def read_json(folder: Path, name: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON object file of the folder (config.json, the index), checked as above."""
    path = untrusted.inside(Path(folder), name, str(folder))
    try:
        text = untrusted.read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} cannot be read: not UTF-8 text") from None
    return json_object(text, path)


def read_config(folder: str | Path) -> dict[str, Any]:
    return read_json(Path(folder), HF_CONFIG)


def _has_index(folder: Path) -> bool:
    return os.path.lexists(folder / HF_INDEX)


def weight_map(folder: Path) -> dict[str, str]:
    """The index's tensor name -> file name, checked to be a mapping of names to names."""
    found = read_json(folder, HF_INDEX, MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(found, dict) or not found or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        raise UserError(f"{folder}/{HF_INDEX} has no weight_map of tensor names to file names")
    return found


def weight_files(folder: str | Path) -> dict[str, Path]:
    """The folder's weight files by name, each a regular file inside it: model.safetensors, or
    every file its index's weight_map names."""
    folder = Path(folder)
    if not _has_index(folder):
        return {HF_WEIGHTS: _weight_file(folder, HF_WEIGHTS, str(folder))}
    return {name: _weight_file(folder, name, f"{folder}/{HF_INDEX}")
            for name in sorted(set(weight_map(folder).values()))}


def _weight_file(folder: Path, name: str, where: str) -> Path:
    path = untrusted.inside(folder, name, where)  # inside, no symlink
    if not os.path.lexists(path):
        raise UserError(f"{where} names {name}, which is not in {folder} (a download cut short?)")
    untrusted.size_of(path)  # a regular file
    return path


def folder_model(path: str | Path) -> Optional[tuple[str, dict[str, Any]]]:
    """For --init-from: (how to name the folder, the ModelConfig fields its config.json fixes),
    or None where `path` is not a Hugging Face folder. A family must import its model_type
    (else one line: the model types that are)."""
    if not is_hf_folder(path):
        return None
    where = f"--init-from {path}"
    config = read_config(path)
    return where, hf_importer(config.get("model_type"), where).model_fields(config, where)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, from its header alone (no tensor read), checked:
    known dtypes, whole non-negative shapes, byte ranges inside the file that match them and do
    not overlap."""
    size = untrusted.size_of(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise UserError(f"{path} is not a safetensors file (a header of {n:,} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise UserError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a safetensors file (its header is not a JSON object)")
    out, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info, (begin, end) = _tensor(path, name, entry, 8 + n)
        if end > size - 8 - n:
            raise UserError(f"{path}: tensor {name} lies past the end of the file (cut short?)")
        out[name] = info
        ranges.append((begin, end, name))
    ranges.sort()
    for (_, end, first), (begin, _, second) in zip(ranges, ranges[1:]):
        if begin < end:
            raise UserError(f"{path}: tensors {first} and {second} overlap")
    return out


def _tensor(path: Path, name: str, entry: Any, data_start: int) -> tuple[TensorInfo, tuple[int, int]]:
    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    dtype = entry.get("dtype") if isinstance(entry, dict) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if (not isinstance(dtype, str) or dtype not in DTYPE_BYTES  # a list or an object is no name
            or not isinstance(shape, list) or not all(map(whole, shape))
            or not isinstance(offsets, list) or len(offsets) != 2 or not all(map(whole, offsets))):
        raise UserError(f"{path}: the header's entry for {brief(name)} is damaged: {brief(entry)}")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise UserError(f"{path}: tensor {name}'s bytes do not match its shape {shape} in {dtype}")
    return TensorInfo(path.name, dtype, tuple(shape), data_start + begin), (begin, end)


def tensors(folder: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the folder's weight files, from their headers; with an index, each where
    the index says it is, and none in two files."""
    folder = Path(folder)
    files = weight_files(folder)
    out: dict[str, TensorInfo] = {}
    for name, path in files.items():
        for tensor, info in read_header(path).items():
            if tensor in out:
                raise UserError(f"{folder}: tensor {tensor} is in both {out[tensor].file} and {name}")
            out[tensor] = info
    if _has_index(folder):
        for tensor, name in weight_map(folder).items():
            if tensor not in out or out[tensor].file != name:
                raise UserError(f"{folder}/{HF_INDEX} says {brief(tensor)} is in {name}, but it is not")
    return out


def check_tensors(folder: str | Path, shapes: dict[str, tuple[int, ...]], optional: set[str],
                  ignored: tuple[str, ...], where: str) -> None:
    """The folder's weight files hold exactly the tensors `shapes` names (those of `optional` may
    be left out; names ending in one of `ignored` are no weight), each of its shape in a float
    dtype: from the headers, before anything is launched, not when every rank has read them."""
    found = {name: info for name, info in tensors(folder).items() if not name.endswith(ignored)}
    missing = sorted(set(shapes) - set(found) - optional)
    extra = sorted(set(found) - set(shapes))
    if missing or extra:
        which = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, not a weight of that model"
        more = len(missing) + len(extra) - 1
        raise UserError(f"{where}: its weights do not fit its {HF_CONFIG}: it {which}"
                        f"{f' (and {more} more names differ)' if more else ''}")
    for name, info in found.items():
        if info.shape != shapes[name]:
            raise UserError(f"{where}: {name} in {info.file} has shape {list(info.shape)}, its "
                            f"{HF_CONFIG} says {list(shapes[name])}")
        if info.dtype not in FLOAT_DTYPES:
            raise UserError(f"{where}: {name} in {info.file} holds {info.dtype}, not floating point")


def check_folder(path: str | Path, where: str) -> dict[str, Any]:
    """A Hugging Face folder read whole by another program (evaluate's lm-eval), checked as
    --init-from checks one before that program opens it: config.json a bounded JSON object, every
    weight file inside the folder with a sound header; where a family here imports its
    model_type, the model its config.json describes (the family's refusals, each field's type)
    and exactly its tensors, each of its shape (check_tensors). A folder of another model_type
    (a GPT-2 export: GPT2LMHeadModel) gets the checks of its files. The model is checked within
    every bound (config/checks.check_model) before its tensors are listed: a 300-byte config.json
    can ask for 10^9 experts. Returns config.json."""
    from raytrain_lm.config.checks import check_model

    config = read_config(path)
    adapter = None
    if any(config.get("model_type") in f.hf_model_types for f in FAMILIES.values()):
        adapter = hf_importer(config.get("model_type"), where)
        m = ModelConfig(**adapter.model_fields(config, where))
        try:
            check_model(m)
        except UserError as e:
            raise UserError(f"{where}: its config.json: {e}") from None
    tensors(path)  # every file the folder names: inside it, regular, headers sound
    if adapter is not None:
        shapes, optional = adapter.expected_tensors(config, m, where)
        check_tensors(path, shapes, optional, adapter.IGNORED_SUFFIXES, where)
    return config


def differing_fields(fields: dict[str, Any], m: ModelConfig) -> list[str]:
    """The fields a folder's config.json fixes (a family's model_fields) that `m` computes
    otherwise, as "key: folder's vs m's": kv heads as given or n_head, the head size as given or
    width / heads, the ffn size by its rule."""
    effective = {"n_kv_head": m.kv_heads, "ffn_dim": m.hidden_dim,
                 "head_size": None if m.head_dim * m.n_head == m.n_embd else m.head_dim}
    ours = {k: effective.get(k, getattr(m, k, None)) for k in fields}
    return [f"{k}: {fields[k]} vs {ours[k]}" for k in fields if fields[k] != ours[k]]
