"""Which windows each rank reads, in which order, and where a run is in that order.

The order is global: every epoch is one seeded permutation of all the training windows, and every
optimizer step takes the next `global batch` of it (micro-batch x accumulation x data-parallel
ranks). Within a step's windows, data-parallel rank r reads the r-th contiguous part, one
micro-batch after another. The position saved in a checkpoint is (epoch, windows consumed in the
epoch): it means the same at any number of workers, so a run resumed at another size reads on
from exactly where it stopped, and a run resumed at the same size reads exactly the batches it
would have. Windows left over at the end of an epoch (fewer than a global batch) are skipped.

A dataset of more than SHARD_GROUP shards is shuffled in groups, so that a node never needs all of
it at once: the epoch's order is a seeded permutation of the shards, cut into groups of
SHARD_GROUP, each group's windows shuffled together. Consecutive steps then read the shards of
one group (two where groups meet), and a node fetches and keeps only those (data/remote.py),
however large the dataset. It is still one global order, a function of the shard sizes, the seed
and the epoch alone, so every property above holds. Datasets of at most SHARD_GROUP shards
(16M tokens each by default) keep a full permutation of all their windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from raytrain_lm.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    """How a step's windows are laid out over ranks and micro-steps."""

    micro_batch: int  # windows per rank per micro-step
    accum: int  # micro-steps per optimizer step
    dp_rank: int
    dp_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum * self.dp_size

    def micro_slices(self, step_start: int) -> Iterator[tuple[int, int]]:
        """(start, end) positions in the epoch's permutation of this rank's micro-batches of the
        step whose windows start at `step_start`."""
        part = step_start + self.dp_rank * self.micro_batch * self.accum
        for m in range(self.accum):
            yield part + m * self.micro_batch, part + (m + 1) * self.micro_batch


SHARD_GROUP = 8  # shards whose windows are shuffled together (see the module's docstring)


def epoch_order(windows: int | Sequence[int], seed: int, epoch: int,
                group: int = SHARD_GROUP) -> torch.Tensor:
    """The permutation of an epoch: the same on every rank and every run with this seed.
    `windows`: the number of windows, or each shard's (windows are numbered shard by shard)."""
    counts = [windows] if isinstance(windows, int) else list(windows)
    gen = torch.Generator().manual_seed(seed + epoch)
    if len(counts) <= group:
        return torch.randperm(sum(counts), generator=gen)
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    shards = torch.randperm(len(counts), generator=gen).tolist()
    parts = []
    for k in range(0, len(shards), group):
        members = torch.cat([torch.arange(starts[s], starts[s] + counts[s]) for s in shards[k:k + group]])
        parts.append(members[torch.randperm(len(members), generator=gen)])
    return torch.cat(parts)


class _RankBatches:
    """This rank's micro-batches (lists of window indices) from one position to the epoch's end:
    a DataLoader's batch_sampler."""

    def __init__(self, order: torch.Tensor, start: int, plan: BatchPlan):
        self.order, self.start, self.plan = order, start, plan
        self.steps = (len(order) - start) // plan.global_batch

    def __len__(self) -> int:
        return self.steps * self.plan.accum

    def __iter__(self):
        for s in range(self.steps):
            for a, b in self.plan.micro_slices(self.start + s * self.plan.global_batch):
                yield self.order[a:b].tolist()


class BatchStream:
    """An endless stream of this rank's micro-batches over epochs; its position is global."""

    def __init__(self, windows: int | Sequence[int], plan: BatchPlan, seed: int, make_loader,
                 log=None):
        """`windows`: how many there are, or each shard's count (see epoch_order).
        `make_loader(batch_sampler)`: a DataLoader over the windows with that batch sampler.
        `log`: a drills.WindowLog that is told the windows of every micro-batch (None: off)."""
        self.windows = windows
        num_windows = windows if isinstance(windows, int) else sum(windows)
        if num_windows < plan.global_batch:
            raise UserError(f"the training split has {num_windows} windows, fewer than one global "
                            f"batch ({plan.micro_batch} x {plan.accum} x {plan.dp_size} workers); "
                            f"lower --batch-size, --grad-accum or --seq-len, or use a larger corpus")
        self.num_windows, self.plan, self.seed, self.make_loader = num_windows, plan, seed, make_loader
        self.log = log
        self.epoch, self.consumed = 0, 0  # windows of this epoch taken by the steps so far
        self._micro = 0  # micro-batches of the current step already read
        self._it = self._order = None

    def state_dict(self) -> dict:
        """The position, at a step boundary."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed, self._micro, self._it = state["epoch"], state["consumed"], 0, None

    def next(self):
        """The next micro-batch; the position moves on by a global batch after the last one of a
        step."""
        if self._it is None:
            if self.consumed + self.plan.global_batch > self.num_windows:  # the epoch is spent
                self.epoch, self.consumed = self.epoch + 1, 0
            self._order = epoch_order(self.windows, self.seed, self.epoch)
            self._it = iter(self.make_loader(_RankBatches(self._order, self.consumed, self.plan)))
        batch = next(self._it)
        if self.log is not None:
            a, b = list(self.plan.micro_slices(self.consumed))[self._micro]
            self.log.add(self.epoch, self.consumed, self._order[a:b].tolist())
        self._micro += 1
        if self._micro == self.plan.accum:
            self._micro = 0
            self.consumed += self.plan.global_batch
            if self.consumed + self.plan.global_batch > self.num_windows:
                self._it = None  # the next step starts the next epoch
        return batch


def eval_batches(num_windows: int, micro_batch: int, dp_rank: int,
                 dp_size: int) -> list[tuple[list[int], int]]:
    """This rank's batches of the validation windows 0..num_windows-1 (window i belongs to rank
    i % dp_size), each `micro_batch` windows long with the number of real windows it starts with.
    Every rank gets the same number of batches of the same size, so collectives (FSDP's gathers,
    a pipeline's microbatches) stay in step: the rest of a batch is window 0 again, to be ignored."""
    mine = list(range(dp_rank, num_windows, dp_size))
    per_rank = -(-num_windows // dp_size)  # ceil(n / dp)
    most = -(-per_rank // micro_batch)  # ceil(per_rank / micro)
    batches = []
    for i in range(most):
        real = mine[i * micro_batch:(i + 1) * micro_batch]
        batches.append((real + [0] * (micro_batch - len(real)), len(real)))
    return batches
