"""safetensors files read a slice at a time and written a tensor at a time: what loading a model
of any size into sharded ranks, and exporting one from a sharded checkpoint, need.

Reading: a block of a tensor (the rows, or rows x columns, a rank keeps) from the byte ranges
its header gives (store/hf_folder.py checked the header), with plain positioned reads of those
bytes only, into a tensor in the file's dtype. No mmap: a mapped file's touched pages count in the reader's
resident memory until it is unmapped, and the bytes a rank keeps are all it should hold.

Writing: the header first (every tensor's name, dtype, shape and byte range, planned before any
tensor exists), then each tensor's bytes as it comes, so a file of any size is written holding
one tensor. The format: 8 bytes of header length (little-endian), the JSON header padded with
spaces to a multiple of 8, the tensors' bytes back to back in the header's order.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch

from raytrain_lm.store.hf_folder import DTYPE_BYTES, TensorInfo

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
CHUNK_BYTES = 64 << 20  # a block of columns is read this many bytes of whole rows at a time


def _pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill the contiguous tensor `out` with the file's bytes from `offset`."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"file ends {len(view) - done} bytes short of its header's ranges")
        done += n


def read_block(fd: int, info: TensorInfo, start: tuple[int, ...], size: tuple[int, ...],
               chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, int]:
    """(the block `start` .. `start + size` of the tensor `info` describes, in the file's dtype;
    the bytes read for it) from the open file `fd`. Rows (dim 0) are contiguous in the file: a
    block of whole rows is one read; a block of some columns of a matrix one read per row,
    each row's columns being contiguous; any other block (a slice past dim 1) reads whole rows
    a chunk at a time and keeps its part (the transient is at most `chunk_bytes`, or one row)."""
    dtype = TORCH_DTYPES[info.dtype]
    out = torch.empty(size, dtype=dtype)
    if not info.shape:
        _pread_into(fd, out, info.offset)
        return out, out.nbytes
    row_shape = info.shape[1:]
    row_bytes = math.prod(row_shape) * DTYPE_BYTES[info.dtype]
    first = info.offset + start[0] * row_bytes
    if tuple(start[1:]) == (0,) * len(row_shape) and tuple(size[1:]) == row_shape:
        _pread_into(fd, out, first)
        return out, out.nbytes
    inner = row_shape[1:]
    if tuple(start[2:]) == (0,) * len(inner) and tuple(size[2:]) == inner:
        column_bytes = math.prod(inner) * DTYPE_BYTES[info.dtype]
        for r in range(size[0]):
            _pread_into(fd, out[r], first + r * row_bytes + start[1] * column_bytes)
        return out, out.nbytes
    rows = max(1, chunk_bytes // max(row_bytes, 1))
    for r in range(0, size[0], rows):
        n = min(rows, size[0] - r)
        chunk = torch.empty((n, *row_shape), dtype=dtype)
        _pread_into(fd, chunk, first + r * row_bytes)
        for dim in range(1, len(row_shape) + 1):
            chunk = chunk.narrow(dim, start[dim], size[dim])
        out[r:r + n].copy_(chunk)
    return out, size[0] * row_bytes


class SafetensorsWriter:
    """One safetensors file written tensor by tensor: `entries` ((name, dtype, shape) in file
    order) fix the header; `write` then takes each tensor in that order."""

    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: Optional[dict[str, str]] = None):
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, dtype, shape in entries:
            n = math.prod(shape) * DTYPE_BYTES[SAFETENSORS_DTYPES[dtype]]
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path, self.expected = Path(path), list(entries)
        self.file = open(path, "wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, dtype, shape = self.expected.pop(0)
        if (name, tensor.dtype, tuple(tensor.shape)) != (want, dtype, tuple(shape)):
            raise RuntimeError(f"{self.path.name}: got {name} {tensor.dtype} {tuple(tensor.shape)}, "
                               f"the header planned {want} {dtype} {tuple(shape)}")
        data = tensor.detach().to("cpu").contiguous()
        if data.numel():
            self.file.write(memoryview(data.view(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        self.file.close()
        if self.expected:
            raise RuntimeError(f"{self.path.name}: {len(self.expected)} planned tensors not written")

    @property
    def done(self) -> bool:
        return not self.expected
