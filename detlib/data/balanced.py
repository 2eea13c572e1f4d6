"""Class-balanced sampling of a skewed training set: the LVIS repeat factors for detection (`--sampler repeat_factor`),
equal draws per class for classification (`--sampler class_balanced`), and the class frequencies an epoch of them gives.

Repeat factor sampling (Gupta et al., LVIS, 2019, appendix B.2; detectron2's `RepeatFactorTrainingSampler`): with f_c
the fraction of training images that contain class c and T the threshold, r_c = max(1, sqrt(T / f_c)) and an image's
r is the largest r_c of its classes (1 for an image without a box). An epoch draws image i floor(r_i) times and once
more with probability r_i - floor(r_i), a new draw each epoch (stochastic rounding: the fractions are met over the
epochs). The images of a class with f_c < T are then drawn sqrt(T / f_c) times as often (or more, for those that hold
a rarer class): about sqrt(T * f_c) * N draws an epoch instead of f_c * N; the epoch grows by the repeats.

The epoch has a fixed length: the schedule counts steps per epoch and every process must get as many batches, so the
number of draws may not change from epoch to epoch as independent roundings would make it. The extra draws are made by
systematic sampling in a shuffled order (one uniform offset laid over the cumulated fractions): each image gets its
extra draw with probability exactly r - floor(r), and their number is floor(F) or floor(F) + 1 (F the sum of the
fractions); an epoch is floor(sum r) draws, the one surplus extra dropped (the last in the shuffled order) when there is
one: the images' mean draws over the epochs are their r less, together, the fraction of sum r that the epoch rounds off
(under one draw an epoch). The fractions are counted in integer units of 2^-24, so the length does not depend on the
order of a float sum.
Image i's k-th draw of an epoch is the key i + k * N (N images): the data set reads image key % N and gives each copy
its own augmentation (`CocoDetection`).

Class-balanced sampling (classification): an epoch of N draws (the training set's size) gives each of the K classes
floor(N / K) of them (N mod K classes, drawn each epoch, one more); a class's draws walk through a shuffle of its
images, again with a new shuffle when they run out, so each image of a class is drawn floor or ceil of (its class's
draws / its images) times: the minority's images repeat, the majority's are a different subset each epoch. The k-th
pass through a class's images draws the keys i + k * N, so each repeat of an image has its own augmentation
(`ImageFolderDataset`).

Both are functions of (seed, epoch) alone (`detlib.data.sampler.epoch_generator`): every process draws the same epoch,
accelerate deals its batches to the processes, and a mid-epoch resume replays it (`skip_first_batches`), as for the
aspect-grouped batches (`detlib.data.sampler`).
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections import Counter
from typing import Iterator, Sequence

import numpy as np
import torch

from ..files import atomic_write
from ..logtext import COUNT_ITEMS, EXTREMES, short_name
from .sampler import epoch_generator

logger = logging.getLogger(__name__)

FRACTION_UNITS = 2 ** 24  # a repeat factor's fraction is counted in these units (exact integer sums)
FREQUENCIES_FILE = "class_frequencies.csv"  # per class, without and with the sampler, in the run's output folder


def repeat_factors(image_classes: Sequence[Sequence[int]], threshold: float) -> np.ndarray:
    """The LVIS repeat factor of each image (module docstring).

    Args:
        image_classes: per image, the class labels of its boxes (repeats allowed; empty for an image without one).
        threshold: T > 0, the image frequency below which a class is repeated.
    Returns:
        [N] float64, each >= 1.
    Raises:
        ValueError: a threshold that is not a positive number.
    """
    if not threshold > 0 or not math.isfinite(threshold):
        raise ValueError(f"the repeat threshold must be a positive number, got {threshold}")
    sets = [set(map(int, c)) for c in image_classes]
    images = Counter(c for s in sets for c in s)
    per_class = {c: max(1.0, math.sqrt(threshold * len(sets) / k)) for c, k in images.items()}  # sqrt(T / f_c)
    return np.array([max((per_class[c] for c in s), default=1.0) for s in sets], dtype=np.float64)


class RepeatFactorSampler(torch.utils.data.Sampler):
    """An epoch of floor(sum r) draw keys: image i floor(r_i) or floor(r_i) + 1 times (module docstring), shuffled.

    Args:
        factors: [N] the repeat factor of each image (`repeat_factors`), each >= 1.
        seed: with the epoch (`set_epoch`), the epoch's draws and order.
    Yields:
        keys: image i's k-th draw is i + k * N.
    Raises:
        ValueError: no image, or a factor below 1 or not finite.
    """

    def __init__(self, factors: Sequence[float], seed: int = 0):
        factors = np.asarray(factors, dtype=np.float64)
        if not len(factors) or not np.all(np.isfinite(factors)) or factors.min() < 1:
            raise ValueError(f"need at least one repeat factor, all finite and >= 1, got {factors[:5]}")
        units = np.round(factors * FRACTION_UNITS).astype(np.int64)
        self.whole, self.units = units // FRACTION_UNITS, units % FRACTION_UNITS
        self.n, self.seed, self.epoch = len(factors), int(seed), 0
        self.length = int(self.whole.sum() + self.units.sum() // FRACTION_UNITS)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def draws_per_image(self, g: torch.Generator | None = None) -> np.ndarray:
        """[N] int64: how often each image is drawn in this epoch (summing to `len(self)`)."""
        g = g or epoch_generator(self.seed, self.epoch)
        order = torch.randperm(self.n, generator=g).numpy()
        offset = int(torch.randint(FRACTION_UNITS, (1,), generator=g))
        edges = (np.concatenate([[0], np.cumsum(self.units[order])]) + offset) // FRACTION_UNITS
        extra = np.zeros(self.n, dtype=np.int64)
        extra[order] = np.diff(edges)  # 1 where a multiple of a unit falls in the image's stretch of the fractions
        if self.whole.sum() + extra.sum() > self.length:
            extra[order[np.flatnonzero(extra[order])[-1]]] = 0
        return self.whole + extra

    def __iter__(self) -> Iterator[int]:
        g = epoch_generator(self.seed, self.epoch)
        counts = self.draws_per_image(g)
        images = np.repeat(np.arange(self.n), counts)
        copies = np.arange(len(images)) - np.repeat(np.cumsum(counts) - counts, counts)  # 0, 1, ... per image
        keys = images + copies * self.n
        return iter(keys[torch.randperm(len(keys), generator=g).numpy()].tolist())

    def __len__(self) -> int:
        return self.length


class ClassBalancedSampler(torch.utils.data.Sampler):
    """An epoch of N keys (N images; image i's k-th draw is i + k * N), floor(N / K) or one more of each of the K classes
    (module docstring), shuffled.

    Args:
        labels: [N] the class of each image; the classes are the distinct labels.
        seed: with the epoch (`set_epoch`), the epoch's draws and order.
    Raises:
        ValueError: no image.
    """

    def __init__(self, labels: Sequence[int], seed: int = 0):
        labels = np.asarray(labels, dtype=np.int64)
        if not len(labels):
            raise ValueError("need at least one image to sample")
        self.members = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        self.n, self.seed, self.epoch = len(labels), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        g = epoch_generator(self.seed, self.epoch)
        k = len(self.members)
        quota = np.full(k, self.n // k)
        quota[torch.randperm(k, generator=g).numpy()[: self.n % k]] += 1
        draws = []
        for members, q in zip(self.members, quota):
            passes = -(-q // len(members))  # walks through shuffles of the class's images
            walk = np.concatenate([members[torch.randperm(len(members), generator=g).numpy()] + p * self.n
                                   for p in range(passes)])
            draws.append(walk[:q])
        draws = np.concatenate(draws)
        return iter(draws[torch.randperm(len(draws), generator=g).numpy()].tolist())

    def __len__(self) -> int:
        return self.n


def class_frequencies(image_classes: Sequence[Sequence[int]], draws: Sequence[int], names: Sequence[str]) -> list[dict]:
    """Per class, its images and instances (boxes; an image is its one instance in classification) in the training set
    and in `draws` (an epoch's keys or indices, key % N being the image), and their shares of the images / draws.

    Args:
        image_classes: per image, the class labels (0..K-1) of its instances.
        draws: the epoch's draw keys.
        names: the K class names.
    Returns:
        [K] {"class", "images", "instances", "share", "images_drawn", "instances_drawn", "share_drawn"}.
    """
    n, k = len(image_classes), len(names)
    per_image = np.zeros((n, k), dtype=np.int64)
    for i, labels in enumerate(image_classes):
        np.add.at(per_image[i], np.asarray(labels, dtype=np.int64), 1)
    times = np.bincount(np.asarray(draws, dtype=np.int64) % n, minlength=n)
    has = per_image > 0
    return [{"class": names[c], "images": int(has[:, c].sum()), "instances": int(per_image[:, c].sum()),
             "share": float(has[:, c].sum() / max(n, 1)), "images_drawn": int(times @ has[:, c]),
             "instances_drawn": int(times @ per_image[:, c]),
             "share_drawn": float(times @ has[:, c] / max(len(draws), 1))} for c in range(k)]


def frequency_line(rows: list[dict]) -> str:
    """One log line of `class_frequencies`: each class's share of the images, without -> with the sampler (up to
    COUNT_ITEMS classes; beyond, the rarest and the most frequent), and the most / least frequent ratio of both."""
    present = [r for r in rows if r["images"]]
    shown = present if len(present) <= COUNT_ITEMS else (
        sorted(present, key=lambda r: r["share"])[:EXTREMES] + sorted(present, key=lambda r: -r["share"])[:EXTREMES])
    shares = ", ".join(f"{short_name(r['class'])} {r['share']:.1%} -> {r['share_drawn']:.1%}" for r in shown)

    def ratio(key: str) -> str:
        values = [r[key] for r in present]
        return f"{max(values) / min(values):.1f}x" if values and min(values) > 0 else "-"

    return (f"share of the images per class, without -> with it: {shares}"
            + (f" (the {EXTREMES} rarest and most frequent of {len(present)})" if len(shown) < len(present) else "")
            + f"; most / least frequent class {ratio('share')} -> {ratio('share_drawn')}")


def log_class_frequencies(image_classes: Sequence[Sequence[int]], sampler: torch.utils.data.Sampler,
                          names: Sequence[str], option: str, output_dir: str | None,
                          is_main: bool = True) -> list[dict]:
    """Log what one epoch (epoch 0) of `sampler` does to the class frequencies (`frequency_line`) under `option` (the
    flags that chose it), and write the whole table to `output_dir/class_frequencies.csv` (main process). Returns
    `class_frequencies`' rows."""
    epoch = getattr(sampler, "epoch", 0)
    sampler.set_epoch(0)
    draws = list(sampler)
    sampler.set_epoch(epoch)
    rows = class_frequencies(image_classes, draws, names)
    path = os.path.join(output_dir, FREQUENCIES_FILE) if output_dir else None
    if path and is_main:
        with atomic_write(path, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    logger.info("%s: an epoch draws %d images (%d without it); %s%s", option, len(draws), len(image_classes),
                frequency_line(rows), f"; per class: {path}" if path else "")
    return rows


def training_sampler(kind: str, image_classes: Sequence[Sequence[int]], names: Sequence[str], seed: int,
                     output_dir: str | None, is_main: bool = True, repeat_threshold: float = 0.1):
    """--sampler `kind`'s sampler of a training set whose image i holds the classes `image_classes[i]` (0-based,
    named `names`): None for shuffle (the loader shuffles), a RepeatFactorSampler at `repeat_threshold` or a
    ClassBalancedSampler of the images' first class, its class frequencies logged (`log_class_frequencies`)."""
    if kind == "shuffle":
        return None
    if kind == "repeat_factor":
        sampler = RepeatFactorSampler(repeat_factors(image_classes, repeat_threshold), seed)
        option = f"--sampler repeat_factor --repeat_threshold {repeat_threshold:g}"
    else:
        sampler, option = ClassBalancedSampler([c[0] for c in image_classes], seed), f"--sampler {kind}"
    log_class_frequencies(image_classes, sampler, names, option, output_dir, is_main)
    return sampler
