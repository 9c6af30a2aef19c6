"""safetensors files read a slice at a time and written a tensor at a time: what loading a model
of any size into sharded ranks, and exporting one from a sharded checkpoint, need.

Reading (`MappedFile`): the file is mapped and each tensor seen as a tensor over the mapping
(no copy, at the byte offset its header gives: store/hf_folder.py checked the header), so a
rank's block of it is a view, which the caller copies into its parameter, converting the dtype
on the way: the only bytes read are the pages of that block, straight from the page cache. A
touched page counts in the process's resident memory while it is mapped, so `release` drops a
tensor's pages once it is copied: a reader holds at most one tensor's block of the file.
(Positioned reads into a buffer were 3-5 x slower here: every buffer is fresh memory the kernel
zeroes before the read fills it, then the conversion reads it again.)

Writing: the header first (every tensor's name, dtype, shape and byte range, planned before any
tensor exists), then each tensor's bytes as it comes, so a file of any size is written holding
one tensor. The format: 8 bytes of header length (little-endian), the JSON header padded with
spaces to a multiple of 8, the tensors' bytes back to back in the header's order.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path
from typing import Optional

import torch

from raytrain_lm.errors import UserError
from raytrain_lm.store.hf_folder import DTYPE_BYTES, TensorInfo

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}


class MappedFile:
    """A safetensors file mapped read-only for its tensors' bytes (copy-on-write, never written:
    torch views need a writable buffer). Use as a context manager; no view may outlive it.

    A page of the mapping past the file's current end is no memory: touching it kills the process
    with SIGBUS, no message. So each tensor is viewed only after the file is seen (fstat of the
    mapped file) to still hold all of its bytes: a file cut short since its header was checked
    (a copy or a download still writing it, a file replaced in place) is named in one line. (A
    file cut while a tensor is being copied can still end in SIGBUS: the check is per tensor.)"""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = open(path, "rb")
        try:
            self._check(0)
            self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_COPY)
        except BaseException:
            self.file.close()
            raise

    def _check(self, end: int) -> None:
        """The file still holds its bytes up to `end` (and some bytes at all: a header)."""
        size = os.fstat(self.file.fileno()).st_size
        if size < max(end, 1):
            raise UserError(f"{self.path} changed while it was read: it is {size:,} bytes now, its "
                            f"header puts a tensor's bytes up to byte {end:,} (a copy or a download "
                            f"still writing it?); read it again once it is whole")

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """The whole tensor, a view of the mapping in the file's dtype (nothing read yet), once
        the file is seen to hold it."""
        if not info.nbytes:
            return torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype])
        self._check(info.offset + info.nbytes)
        flat = torch.frombuffer(self.map, dtype=TORCH_DTYPES[info.dtype],
                                count=math.prod(info.shape), offset=info.offset)
        return flat.view(info.shape)

    def release(self, info: TensorInfo) -> None:
        """Drop the tensor's pages from this process (the page cache keeps them)."""
        page = mmap.PAGESIZE
        first = info.offset // page * page
        if info.nbytes:
            self.map.madvise(mmap.MADV_DONTNEED, first, info.offset + info.nbytes - first)

    def __enter__(self) -> "MappedFile":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.map.close()
        except BufferError:  # a view still held by an error on its way up: unmapped with it
            pass
        self.file.close()


def block_of(t: torch.Tensor, start: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    """The block `start` .. `start + size` of `t` (a view)."""
    return t[tuple(slice(a, a + n) for a, n in zip(start, size))]


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
