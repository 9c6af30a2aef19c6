"""`--init-from` a Hugging Face folder: each rank reads only the slices it keeps.

What a rank keeps is what its parts hold: a whole tensor where it is replicated (DDP, a
pipeline stage's own layers), the rows or columns of its shard where FSDP or tensor parallelism
splits it (a DTensor's local block, at the global offset DTensor itself computes:
parallel/init.local_region). The folder is read shard file by shard file, mapped: each of this
rank's blocks is a view of the file in its dtype (store/safetensors_io.MappedFile), copied into
the parameter's local storage (converted on the way), and its pages released from the process
once copied. So a rank holds its share of the model plus one block in flight, never the whole
model, and reads only its blocks' pages: the ranks of a node together read the folder once (a
replicated layout: once per replica, which holds it whole anyway).

Names go through the family's adapter (models/hf.py: `hf_name`, one tensor at a time); a tensor
the adapter calls not `sliceable` (a layout change, `from_hf_tensor`) is read whole, converted,
then cut to this rank's block. A tied head (tie_word_embeddings, as Llama 3.2 1B/3B) is one
parameter with the embedding, read once; a pipeline's last stage reads the embedding into its
copy.

torch.distributed.checkpoint's HuggingFaceStorageReader (what torchtitan loads Hub folders with)
does the same slicing with `safe_open(...).get_slice` under dcp.load's global plan. Reading here
keeps to the files the index names and the headers the driver checked (store/hf_folder.py), lets
one tensor of the folder fill two of ours (a pipeline's tied pair), converts while it copies
(get_slice returns a copy in the file's dtype first), and releases each tensor's pages (a mapped
file's touched pages count in a worker's resident memory until unmapped).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from raytrain_lm.errors import UserError
from raytrain_lm.models import hf_importer
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.parallel.init import local_region
from raytrain_lm.store import hf_folder
from raytrain_lm.store.safetensors_io import TORCH_DTYPES, MappedFile, block_of


@dataclass
class LoadStats:
    """What a rank read: bytes from the files, tensors filled, files opened, seconds."""

    bytes_read: int = 0
    tensors: int = 0
    files: int = 0
    seconds: float = 0.0


def _experts_held(t: torch.Tensor, stack: list[str]) -> list[tuple[int, str]]:
    """(expert, the folder's tensor) of the experts this rank holds of `t` (rows of dim 0: a
    shard by expert, under expert parallelism or FSDP; whole matrices each)."""
    local, offset = local_region(t)
    if any(offset[1:]) or tuple(local.shape[1:]) != tuple(t.shape[1:]):
        raise RuntimeError(f"experts split other than by expert: {tuple(local.shape)} at {offset}")
    return [(e, stack[e]) for e in range(offset[0], offset[0] + local.shape[0])]


def _checked(infos: dict, source: str, name: str, where: str):
    """The header of the folder's tensor `source` (filling our `name`): present, floating point."""
    if source not in infos:
        raise UserError(f"{where}: its weights lack {source} (the model's {name})")
    info = infos[source]
    if not TORCH_DTYPES.get(info.dtype, torch.int8).is_floating_point:
        raise UserError(f"{where}: {source} in {info.file} holds {info.dtype}, not floating point")
    return info


def _targets(parts) -> dict[str, torch.Tensor]:
    """This rank's tensors to fill by our names, each tensor once (a head tied to the
    embedding within a part is the embedding)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for part in parts:
        for name, t in part.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                out[name] = t
    return out


@torch.no_grad()
def load_hf_weights(folder: str | Path, parts, m: ModelConfig,
                    say: Optional[Callable[[str], None]] = None) -> LoadStats:
    """The folder's weights into this rank's `parts` (modules of the model `m`, sharded or not),
    in place; the folder was checked before launch (run/preflight.py), and what a rank reads is
    checked again here: each tensor present, of the model's shape, in a floating-point dtype."""
    started = time.perf_counter()
    folder = Path(folder)
    where = f"--init-from {folder}"
    adapter = hf_importer(hf_folder.read_config(folder).get("model_type"), where)
    infos = hf_folder.tensors(folder)  # the headers only
    by_file: dict[str, list] = defaultdict(list)
    for name, t in _targets(parts).items():
        stack = adapter.hf_stack(name, m)  # a mixture of experts' per-expert matrices
        if stack is not None:
            for expert, source in _experts_held(t, stack):
                info = _checked(infos, source, name, where)
                if tuple(info.shape) != tuple(t.shape[1:]):
                    raise UserError(f"{where}: {source} in {info.file} has shape {list(info.shape)}, "
                                    f"an expert of the model's {name} is {list(t.shape[1:])}")
                by_file[info.file].append((name, info, t, True, expert))
            continue
        source = adapter.hf_name(name, m)  # a tied head: the embedding's
        info = _checked(infos, source, name, where)
        sliceable = adapter.sliceable(name, m)
        if sliceable and tuple(info.shape) != tuple(t.shape):
            raise UserError(f"{where}: {source} in {info.file} has shape {list(info.shape)}, "
                            f"the model's {name} is {list(t.shape)}")
        by_file[info.file].append((name, info, t, sliceable, None))
    stats = LoadStats()
    files = hf_folder.weight_files(folder)
    for i, (file, items) in enumerate(sorted(by_file.items())):
        with MappedFile(files[file]) as mapped:
            for name, info, t, sliceable, expert in items:
                stats.bytes_read += _fill(mapped, info, name, t, sliceable, expert, adapter, m, where)
                mapped.release(info)  # its pages leave this process once copied
                stats.tensors += 1
        stats.files += 1
        if say:
            say(f"[init-from] {file}: {len(items)} tensors ({i + 1}/{len(by_file)} files)")
    stats.seconds = time.perf_counter() - started
    return stats


def _fill(mapped: MappedFile, info, name: str, t: torch.Tensor, sliceable: bool,
          expert: Optional[int], adapter, m: ModelConfig, where: str) -> int:
    """Copy this rank's block of the folder's tensor `info` into our tensor `t` (into expert
    `expert`'s matrix of it, for a stack of experts); returns the bytes of the file it read. (A
    function of its own: no view of the mapping outlives it.)"""
    local, offset = local_region(t)
    if expert is not None:  # one of this rank's experts: a whole matrix of theirs
        local, offset = local[expert - offset[0]], offset[1:]
    whole = mapped.tensor(info)
    if sliceable:  # this rank's block of ours is the same block of theirs
        block = block_of(whole, offset, tuple(local.shape))
        read = block.numel() * block.element_size()
    else:  # read whole, convert, keep this rank's block
        converted = adapter.from_hf_tensor(name, whole.clone(), m)
        if tuple(converted.shape) != tuple(t.shape):
            raise UserError(f"{where}: {info.file}'s {list(info.shape)} tensor does not fill the "
                            f"model's {name} {list(t.shape)}")
        block, read = block_of(converted, offset, tuple(local.shape)), info.nbytes
    # to the device in the file's dtype, converted there: a blocking copy_ from the host into
    # another dtype on a GPU converts on the host first (a second, wider copy of the block)
    local.copy_(block.to(local.device))
    return read
