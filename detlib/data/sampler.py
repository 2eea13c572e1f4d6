"""Aspect-ratio grouping: training batches whose images are all landscape or all portrait.

With the longer side resized to 600 px, a batch that mixes a 600x450 landscape and a 450x600 portrait image is
padded to 608x608, so about a third of each image's canvas is padding; grouped, the batch pads to 608x480.
torchvision's references (`GroupedBatchSampler`) and detectron2 (`AspectRatioGroupedDataset`) group for the
same reason. Here:

* group = 0 for landscape or square images (w >= h), 1 for portrait, from the json's sizes (no pixels read);
* each epoch shuffles all indices with a generator seeded by (seed, epoch), then deals them into per-group
  buckets in that order and emits a bucket as a batch whenever it is full; the incomplete buckets left at the
  end are emitted last, mixed, as full batches (and a last partial one unless `drop_last`);
* the number of batches is fixed by the group sizes alone (`__len__`), so the schedule's steps per epoch do not
  change from epoch to epoch;
* accelerate's `prepare` deals the batches round-robin to the processes (`BatchSamplerShard`) and calls
  `sampler.set_epoch` (our `SeededShuffle`), and `skip_first_batches` replays the same order, so a mid-epoch
  resume sees exactly the batches of the uninterrupted run.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch


class SeededShuffle(torch.utils.data.Sampler):
    """A permutation of range(n) that is a function of (seed, epoch) alone; `set_epoch` picks the epoch."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = int(n), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)  # distinct streams per (seed, epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class GroupedBatchSampler(torch.utils.data.BatchSampler):
    """Batches of `batch_size` data set indices from one aspect group each (see the module docstring).

    Args:
        group_ids: [N] the group of each data set index (e.g. `aspect_groups(sizes)`).
        batch_size: images per batch (per device).
        seed: seeds the per-epoch shuffle.
        drop_last: leave out the last incomplete batch.
    Raises:
        ValueError: for a batch size below 1 or no index at all.
    """

    def __init__(self, group_ids: Sequence[int], batch_size: int, seed: int = 0, drop_last: bool = True):
        if batch_size < 1 or not len(group_ids):
            raise ValueError(f"need a batch size >= 1 and at least one index, got {batch_size} and {len(group_ids)}")
        self.group_ids = [int(g) for g in group_ids]
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.sampler = SeededShuffle(len(self.group_ids), seed)  # accelerate calls sampler.set_epoch

    def __iter__(self) -> Iterator[list[int]]:
        buckets: dict[int, list[int]] = {}
        for index in self.sampler:
            bucket = buckets.setdefault(self.group_ids[index], [])
            bucket.append(index)
            if len(bucket) == self.batch_size:
                yield bucket[:]
                bucket.clear()
        rest = [i for g in sorted(buckets) for i in buckets[g]]
        for start in range(0, len(rest), self.batch_size):
            batch = rest[start:start + self.batch_size]
            if len(batch) == self.batch_size or not self.drop_last:
                yield batch

    def __len__(self) -> int:
        counts: dict[int, int] = {}
        for g in self.group_ids:
            counts[g] = counts.get(g, 0) + 1
        full = sum(c // self.batch_size for c in counts.values())
        rest = sum(c % self.batch_size for c in counts.values())
        return full + (rest // self.batch_size if self.drop_last else math.ceil(rest / self.batch_size))


def aspect_groups(sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Group of each image from its (H, W) in pixels: 0 landscape or square (w >= h), 1 portrait."""
    return [0 if w >= h else 1 for h, w in sizes]
