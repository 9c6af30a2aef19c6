"""A prepared split as fixed-length windows over memory-mapped token shards."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from raytrain_lm.data.manifest import BYTES_COLUMN, load_manifest
from raytrain_lm.data.remote import fetch_shard
from raytrain_lm.data.sampler import SHARD_GROUP
from raytrain_lm.errors import UserError
from raytrain_lm.store.files import REMOTE_SOURCE


class TokenWindows(Dataset):
    """Fixed-length windows over memory-mapped token shards.

    Item i is `seq_len + 1` consecutive tokens (inputs and shifted targets); windows start every
    `seq_len` tokens and never cross a shard boundary. Shards are mapped when first read, so the
    dataset pickles cheaply into DataLoader worker processes. In a node's cache of a dataset on
    shared storage a shard is downloaded when first read, and only the MAX_MAPPED most recently
    read stay mapped (the cache may delete the others to stay within its bound).
    """

    MAX_MAPPED = 2 * SHARD_GROUP  # the groups the sampler reads at once (two where they meet)

    def __init__(self, data_dir: str | Path, split: str, seq_len: int):
        self.data_dir, self.split, self.seq_len = str(data_dir), split, seq_len
        manifest = load_manifest(data_dir)
        self.shards = manifest[split]["shards"]
        self.remote = (Path(data_dir) / REMOTE_SOURCE).is_file()
        counts = [max(0, (s["tokens"] - 1) // seq_len) for s in manifest[split]["shards"]]
        self.shard_windows = counts  # windows of each shard, in order (the sampler's groups)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.offsets[-1] == 0:
            raise UserError(f"the {split} split of {data_dir} is shorter than one window of "
                            f"{seq_len + 1} tokens; lower --seq-len or use a larger corpus")
        self._mapped: OrderedDict[int, pa.RecordBatch] = OrderedDict()  # shard -> batch, LRU order

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self):
        return {**self.__dict__, "_mapped": OrderedDict()}

    def _shard(self, s: int) -> np.ndarray:
        return self._batch(s).column(0).to_numpy(zero_copy_only=True)

    def _batch(self, s: int) -> pa.RecordBatch:
        batch = self._mapped.pop(s, None)
        if batch is None:
            batch = self._map(s)
        self._mapped[s] = batch  # the most recently read last
        if self.remote and len(self._mapped) > self.MAX_MAPPED:
            self._mapped.popitem(last=False)
        return batch

    def _map(self, s: int) -> np.ndarray:
        for attempt in range(3):
            path = (fetch_shard(Path(self.data_dir), self.shards[s]) if self.remote
                    else os.path.join(self.data_dir, self.shards[s]["file"]))
            try:
                source = pa.memory_map(str(path), "r")
            except FileNotFoundError:
                if not self.remote or attempt == 2:
                    raise
                continue  # another worker's cache eviction came between: fetch it again
            return pa.ipc.open_file(source).get_batch(0)
        raise AssertionError("unreachable")

    def window(self, i: int) -> np.ndarray:
        """Window i's tokens (a memory-mapped view)."""
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        start = (i - int(self.offsets[s])) * self.seq_len
        return self._shard(s)[start: start + self.seq_len + 1]

    def target_bytes(self, i: int, byte_lengths: np.ndarray) -> int:
        """The bytes of text window i's targets stand for: their shares of the documents' bytes
        as read where the shards store them (a tokenizer that rewrites text), else
        `byte_lengths[token]` summed (the tokens' own bytes: the same for an exact tokenizer)."""
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        start = (i - int(self.offsets[s])) * self.seq_len
        batch = self._batch(s)
        if batch.num_columns > 1 and batch.schema.names[1] == BYTES_COLUMN:
            shares = batch.column(1).to_numpy(zero_copy_only=True)
            return int(shares[start + 1: start + self.seq_len + 1].sum(dtype=np.int64))
        return int(byte_lengths[self.window(i)[1:]].sum())

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.window(i).astype(np.int64))

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        # One (B, T+1) int64 array per batch: the DataLoader calls this instead of B __getitem__s.
        return torch.from_numpy(np.stack([self.window(i) for i in indices]).astype(np.int64))


def collate_windows(batch):
    """`__getitems__` already returns the stacked batch; split it into inputs and targets, each
    contiguous: pinning keeps a view's strides, and a non-contiguous pinned tensor's
    non_blocking copy to the GPU goes through a pageable staging copy (synchronous)."""
    if isinstance(batch, list):
        batch = torch.stack(batch)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
