"""The per-worker data loaders: this rank's windows of a split, moved to the worker's device."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from raytrain_lm.config import TrainConfig
from raytrain_lm.data.sampler import BatchStream, ResumableDistributedSampler
from raytrain_lm.data.windows import TokenWindows, collate_windows


def split_loader(cfg: TrainConfig, split: str, rank: int, world: int, shuffle: bool):
    """(loader, sampler) over this rank's windows of `split`."""
    import ray.train.torch

    dataset = TokenWindows(cfg.data, split, cfg.seq_len)
    sampler = ResumableDistributedSampler(dataset, num_replicas=world, rank=rank, seed=cfg.seed,
                                          shuffle=shuffle)
    # Its own generator: creating a loader iterator must not draw from the global RNG, or a
    # resumed run's dropout masks would differ from an uninterrupted run's.
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=collate_windows, pin_memory=cfg.use_gpu,
                        generator=torch.Generator().manual_seed(cfg.seed))
    # The sampler is already a DistributedSampler, so Ray only adds the move to the device.
    return ray.train.torch.prepare_data_loader(loader), sampler


def train_stream(cfg: TrainConfig, rank: int, world: int) -> BatchStream:
    """The endless, resumable stream of this rank's training batches."""
    loader, sampler = split_loader(cfg, "train", rank, world, shuffle=True)
    return BatchStream(loader, sampler, cfg.batch_size)


def val_loader(cfg: TrainConfig, rank: int, world: int):
    return split_loader(cfg, "val", rank, world, shuffle=False)[0]
