"""The per-worker data: this rank's training micro-batches (a global order, data/sampler.py) and
its share of the fixed validation windows, moved to the worker's device by Ray Train."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.data.sampler import BatchPlan, BatchStream, eval_batches
from raytrain_lm.data.windows import TokenWindows, collate_windows


def _loader(cfg: TrainConfig, dataset: TokenWindows, batch_sampler):
    import ray.train.torch

    # Its own generator: creating a loader iterator draws a seed, which must not come from the
    # global RNG, or a resumed run's dropout masks would differ from an uninterrupted run's.
    loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_windows,
                        pin_memory=cfg.use_gpu, generator=torch.Generator().manual_seed(cfg.seed))
    # The order is ours (no DistributedSampler); Ray adds the move to the worker's device.
    return ray.train.torch.prepare_data_loader(loader, add_dist_sampler=False)


def train_stream(cfg: TrainConfig, dp_rank: int, dp_size: int, log=None) -> BatchStream:
    """The endless, resumable stream of this rank's training micro-batches (`log`: see
    drills.WindowLog)."""
    dataset = TokenWindows(cfg.data, "train", cfg.seq_len)
    plan = BatchPlan(cfg.batch_size, cfg.grad_accum, dp_rank, dp_size)
    return BatchStream(dataset.shard_windows, plan, cfg.seed,
                       lambda batches: _loader(cfg, dataset, batches), log=log)


class Validation:
    """The validation set: the first `eval_windows` windows of the split (all if 0), the same
    windows whatever the number of workers, shared out among the data-parallel ranks. Batches
    are full size; the padding windows' targets are IGNORE (cross-entropy skips them).

    For bits per byte it also counts, once, the bytes of text that this rank's real windows'
    targets stand for (`byte_lengths[token]`: 1 per byte token; a BPE token's length, 0 for
    <|endoftext|>; where the tokenizer rewrites text, the shares of the documents' bytes as read
    that the shards store, TokenWindows.target_bytes); padding windows count for nothing, as
    their targets are ignored. Summed over the data-parallel ranks these are the bytes of exactly
    the targets evaluated, so val_bpb is the loss of exactly the evaluated text per byte of it,
    not a split-wide approximation."""

    IGNORE = -100  # F.cross_entropy's ignore_index

    def __init__(self, cfg: TrainConfig, dp_rank: int, dp_size: int, byte_lengths: np.ndarray):
        self.cfg = cfg
        self.dataset = TokenWindows(cfg.data, "val", cfg.seq_len)
        self.num_windows = min(len(self.dataset), cfg.eval_windows or len(self.dataset))
        batches = eval_batches(self.num_windows, cfg.batch_size, dp_rank, dp_size)
        self.real = [n for _, n in batches]
        self.indices = [idx for idx, _ in batches]
        mine = [i for idx, real in batches for i in idx[:real]]  # not the padding
        self.text_bytes = sum(self.dataset.target_bytes(i, byte_lengths) for i in mine)

    def __iter__(self):
        """(inputs, targets) of this rank's batches."""
        for (x, y), real in zip(_loader(self.cfg, self.dataset, self.indices), self.real):
            yield x, self.targets(y, real)

    @classmethod
    def targets(cls, y: torch.Tensor, real: int) -> torch.Tensor:
        """`y` with the targets of the padding rows (after the first `real`) ignored. A copy: the
        targets share their storage with the inputs (collate_windows slices one tensor), and
        masking them in place turned the padding rows' inputs into -100 (an IndexError in the
        embedding) wherever the batch is not moved to another device, as on CPU workers."""
        if real == len(y):
            return y
        y = y.clone()
        y[real:] = cls.IGNORE
        return y
