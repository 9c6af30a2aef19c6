"""A prepared split as fixed-length windows over memory-mapped token shards."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from raytrain_lm.data.manifest import load_manifest
from raytrain_lm.errors import UserError


class TokenWindows(Dataset):
    """Fixed-length windows over memory-mapped token shards.

    Item i is `seq_len + 1` consecutive tokens (inputs and shifted targets); windows start every
    `seq_len` tokens and never cross a shard boundary. Shards are mapped lazily so the dataset
    pickles cheaply into DataLoader worker processes.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int):
        self.data_dir, self.split, self.seq_len = str(data_dir), split, seq_len
        manifest = load_manifest(data_dir)
        self.shard_files = [s["file"] for s in manifest[split]["shards"]]
        counts = [max(0, (s["tokens"] - 1) // seq_len) for s in manifest[split]["shards"]]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.offsets[-1] == 0:
            raise UserError(f"the {split} split of {data_dir} is shorter than one window of "
                            f"{seq_len + 1} tokens; lower --seq-len or use a larger corpus")
        self._arrays: Optional[list[np.ndarray]] = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None}

    def _shards(self) -> list[np.ndarray]:
        if self._arrays is None:
            arrays = []
            for f in self.shard_files:
                source = pa.memory_map(os.path.join(self.data_dir, f), "r")
                batch = pa.ipc.open_file(source).get_batch(0)
                arrays.append(batch.column(0).to_numpy(zero_copy_only=True))
            self._arrays = arrays
        return self._arrays

    def window(self, i: int) -> np.ndarray:
        """Window i's tokens (a memory-mapped view)."""
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        start = (i - int(self.offsets[s])) * self.seq_len
        return self._shards()[s][start: start + self.seq_len + 1]

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.window(i).astype(np.int64))

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        # One (B, T+1) int64 array per batch: the DataLoader calls this instead of B __getitem__s.
        return torch.from_numpy(np.stack([self.window(i) for i in indices]).astype(np.int64))


def collate_windows(batch):
    """`__getitems__` already returns the stacked batch; split it into inputs and targets."""
    if isinstance(batch, list):
        batch = torch.stack(batch)
    return batch[:, :-1], batch[:, 1:]
