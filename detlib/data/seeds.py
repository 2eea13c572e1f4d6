"""The random draws of one training sample: a function of (seed, epoch, key) alone, the one rule of every training data
set (`CocoDetection`, `TrainingTiles`, `ImageFolderDataset`). They then do not depend on the number of DataLoader
workers or processes, and a run resumed mid-epoch sees exactly the augmentations the uninterrupted run saw. (The
epoch's order is the samplers' stream, `detlib.data.sampler.epoch_generator`.)

Light on purpose (torch only): the ImageFolder scan imports it, and check_dataset.py and predict read that scan.
"""

from __future__ import annotations

import contextlib
import random

import torch

# A sample's seed is ((seed * P1 + epoch) * P2 + key): two primes above any epoch or key count, so distinct
# (seed, epoch, key) give distinct seeds and neighbouring samples unrelated streams.
SEED_PRIME_EPOCH, SEED_PRIME_INDEX = 1_000_003, 1_000_000_007


@contextlib.contextmanager
def sample_rng(seed: int | None, epoch: int, key: int):
    """Seed torch's and Python's RNG for the transform of sample `key` (its index, or the key of a repeated draw) in
    `epoch`, restoring the outer state afterwards; `seed` None: the RNG as it is."""
    if seed is None:
        yield
        return
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        s = (seed * SEED_PRIME_EPOCH + epoch) * SEED_PRIME_INDEX + key
        torch.manual_seed(s % (2**63))
        random.seed(s)
        try:
            yield
        finally:
            random.setstate(state)
