"""Batch samplers: aspect-ratio grouping of training batches, and the evaluation's batches of one padded shape.

Training: batches whose images are all landscape or all portrait.

With the longer side resized to 600 px, a batch that mixes a 600x450 landscape and a 450x600 portrait image is
padded to 608x608, so about a third of each image's canvas is padding; grouped, the batch pads to 608x480.
torchvision's references (`GroupedBatchSampler`) and detectron2 (`AspectRatioGroupedDataset`) group for the
same reason. Here:

* group = 0 for landscape or square images (w >= h), 1 for portrait, from the json's sizes (no pixels read);
* each epoch shuffles all indices with a generator seeded by (seed, epoch) (or takes the draws of a class-balanced
  sampler, `detlib.data.balanced`, as they come), then deals them into per-group buckets in that order and emits a
  bucket as a batch whenever it is full; the incomplete buckets left at the end are emitted last, mixed, as full
  batches (and a last partial one unless `drop_last`);
* the number of batches is floor(draws / batch size) (ceil without `drop_last`) however the draws fall into the
  groups (`__len__`), so the schedule's steps per epoch do not change from epoch to epoch;
* accelerate's `prepare` deals the batches round-robin to the processes (`BatchSamplerShard`) and calls
  `sampler.set_epoch` (our `SeededShuffle`, or the balanced sampler), and `skip_first_batches` replays the same
  order, so a mid-epoch resume sees exactly the batches of the uninterrupted run.

Evaluation and prediction (`EvaluationBatchSampler`): each batch holds images of one padded input shape, so that no
image is padded beyond its own shape and its detections are those of the image evaluated by itself (docs/evaluation.md,
"Batches and padding").
"""

from __future__ import annotations

import math
from typing import Hashable, Iterator, Sequence

import torch


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The random stream of one epoch of a training sampler: a function of (seed, epoch) alone, so every process draws
    the same epoch and a resumed run draws it again."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))  # distinct streams per (seed, epoch)


class SeededShuffle(torch.utils.data.Sampler):
    """A permutation of range(n) that is a function of (seed, epoch) alone; `set_epoch` picks the epoch."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = int(n), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n, generator=epoch_generator(self.seed, self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


class GroupedBatchSampler(torch.utils.data.BatchSampler):
    """Batches of `batch_size` data set indices from one aspect group each (see the module docstring).

    Args:
        group_ids: [N] the group of each data set index (e.g. `aspect_groups(sizes)`).
        batch_size: images per batch (per device).
        seed: seeds the per-epoch shuffle.
        drop_last: leave out the last incomplete batch.
        sampler: the epoch's draws instead of a shuffle of every index once: a sampler with `set_epoch` and a length
            that is the same every epoch (`detlib.data.balanced`); a draw k is data set index k % N.
    Raises:
        ValueError: for a batch size below 1 or no index at all.
    """

    def __init__(self, group_ids: Sequence[int], batch_size: int, seed: int = 0, drop_last: bool = True,
                 sampler: torch.utils.data.Sampler | None = None):
        if batch_size < 1 or not len(group_ids):
            raise ValueError(f"need a batch size >= 1 and at least one index, got {batch_size} and {len(group_ids)}")
        self.group_ids = [int(g) for g in group_ids]
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.sampler = sampler or SeededShuffle(len(self.group_ids), seed)  # accelerate calls sampler.set_epoch

    def __iter__(self) -> Iterator[list[int]]:
        buckets: dict[int, list[int]] = {}
        for index in self.sampler:
            bucket = buckets.setdefault(self.group_ids[index % len(self.group_ids)], [])
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
        # full batches per group plus the mixed leftovers' batches: floor (or ceil) of draws / batch size whatever the
        # groups, so an epoch whose draws differ but not their number keeps its length
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)


def aspect_groups(sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Group of each image from its (H, W) in pixels: 0 landscape or square (w >= h), 1 portrait."""
    return [0 if w >= h else 1 for h, w in sizes]


class EvaluationBatchSampler(torch.utils.data.Sampler):
    """This process's evaluation batches: each of images of one shape, each image in one batch of one process.

    The indices of each shape, in index order, are cut into batches of `batch_size`; the shapes come in the order of
    their first index. Batch b of that list goes to process b % `num_processes`, and every process gets as many
    batches: the ones with fewer end with empty batches (no image, no compute), so that the collective calls of an
    evaluation loop (the preemption check) meet. A DataLoader built on it must not be sharded again
    (`accelerator.prepare` would deal its batches out a second time): its batches are already this process's.

    Args:
        shapes: [N] the padded input shape (H, W) of each data set index (`transforms.padded_input_shape`), or any
            hashable key: images of equal keys may share a batch.
        batch_size: the most images per batch.
        num_processes, process_index: the process group and this process's rank in it.
    Raises:
        ValueError: a batch size below 1, or a process index outside 0..num_processes-1.
    """

    def __init__(self, shapes: Sequence[Hashable], batch_size: int, num_processes: int = 1, process_index: int = 0):
        if batch_size < 1 or not 0 <= process_index < num_processes:
            raise ValueError(f"need a batch size >= 1 and 0 <= process_index < num_processes, got {batch_size}, "
                             f"{process_index} and {num_processes}")
        groups: dict[Hashable, list[int]] = {}
        for index, shape in enumerate(shapes):
            groups.setdefault(shape, []).append(index)
        batches = [g[i:i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
        per_process = -(-len(batches) // num_processes)
        mine = batches[process_index::num_processes]
        self.batches = mine + [[] for _ in range(per_process - len(mine))]

    def __iter__(self) -> Iterator[list[int]]:
        return iter([b[:] for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)
