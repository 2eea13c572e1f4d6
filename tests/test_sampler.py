"""Aspect-ratio grouped batches (detlib.data.sampler): pure groups, every index once per epoch, a new order each epoch,
the same order when replayed (resume), disjoint shards on 2 processes."""

import json

import pytest

from conftest import REPO
from helpers import forked_ok
from detlib.data.sampler import GroupedBatchSampler, aspect_groups


def test_aspect_groups_from_sizes():
    assert aspect_groups([(480, 640), (640, 480), (500, 500)]) == [0, 1, 0]  # (H, W): landscape, portrait, square


def test_grouped_batches_are_pure_cover_the_set_and_reshuffle():
    groups = [0] * 9 + [1] * 7  # 9 landscape, 7 portrait: 4 + 3 full batches of 2, leftovers 1 + 1
    sampler = GroupedBatchSampler(groups, batch_size=2, seed=0, drop_last=False)
    epochs = []
    for epoch in range(3):
        sampler.sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == 8
        assert sorted(i for b in batches for i in b) == list(range(16))  # every index exactly once
        pure = [b for b in batches[:-1]]
        assert all(len({groups[i] for i in b}) == 1 for b in pure)  # only the leftovers' batch may mix
        epochs.append(batches)
    assert epochs[0] != epochs[1] != epochs[2]
    sampler.sampler.set_epoch(1)
    assert list(sampler) == epochs[1]  # replayed for a resume: the same batches
    dropping = GroupedBatchSampler(groups, batch_size=2, seed=0, drop_last=True)
    assert len(dropping) == len(list(dropping)) == 8  # the mixed leftovers make one full batch
    assert len(GroupedBatchSampler([0] * 5 + [1] * 3, 2, drop_last=True)) == 4  # 2 + 1 full, leftovers 1 + 1
    with pytest.raises(ValueError):
        GroupedBatchSampler([], 2)


@pytest.mark.slow
def test_grouped_sampler_on_two_processes(tmp_path):
    out = tmp_path / "seen.json"
    forked_ok(REPO / "tests" / "probes" / "grouped_sampler_probe.py", [out])  # 2 processes, forked
    data = json.loads(out.read_text())
    assert data["num_processes"] == 2
    groups = data["groups"]
    ranks = sorted(data["ranks"], key=lambda r: r["rank"])
    assert [r["len"] for r in ranks] == [4, 4]
    orders = []
    for epoch in range(3):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        flat_a, flat_b = [i for x in a for i in x], [i for x in b for i in x]
        assert not set(flat_a) & set(flat_b) and sorted(flat_a + flat_b) == list(range(16))
        assert all(len({groups[i] for i in batch}) == 1 for batch in a + b)  # 8 + 8: every batch pure
        orders.append((a, b))
    assert orders[0] != orders[1] != orders[2]
    for r in ranks:  # the resume replays epoch 2 minus its first batch on each rank
        assert r["resumed"] == r["epochs"][2][1:]
