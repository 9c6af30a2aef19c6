"""Which windows each rank reads, in which order, and where a run is in that order (saved in every
checkpoint, so a resumed run reads exactly the batches it would have)."""

from __future__ import annotations

from torch.utils.data import DistributedSampler

from raytrain_lm.errors import UserError


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler (ranks get disjoint slices of one seeded permutation per epoch) that
    can start part-way into an epoch, so a resumed run sees exactly the batches it would have."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=True)
        self.start_index = 0

    def set_start(self, index: int) -> None:
        self.start_index = index

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.start_index:])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class BatchStream:
    """An endless stream of batches over epochs, whose position (epoch, batch) can be saved."""

    def __init__(self, loader, sampler: ResumableDistributedSampler, batch_size: int):
        self.loader, self.sampler, self.batch_size = loader, sampler, batch_size
        self.batches_per_epoch = sampler.num_samples // batch_size
        if self.batches_per_epoch == 0:
            raise UserError(f"the training split has fewer than batch_size={batch_size} windows per "
                            f"worker; lower --batch-size or --seq-len, or use a larger corpus")
        self.epoch, self.batch_in_epoch = 0, 0
        self._it = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
        self._it = None

    def next(self):
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch, self._it = self.epoch + 1, 0, None
        if self._it is None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.set_start(self.batch_in_epoch * self.batch_size)
            self._it = iter(self.loader)
        batch = next(self._it)
        self.batch_in_epoch += 1
        return batch
