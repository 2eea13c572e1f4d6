"""Issue 42, part 1: class-balanced sampling (detlib.data.balanced, `--sampler` of both training scripts) and the data
check's imbalance warning: the LVIS repeat factors by hand, per-image and per-class draws of an epoch within rounding of
the rule, a fixed epoch length, 2 gloo processes (disjoint shards of the 1-process epoch, equal lengths, a mid-epoch
resume), the real COCO subset and a 10:1 cats / dogs subset of ../shared/data (skipped when absent)."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import time
from collections import Counter

import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import COCO_SUBSET, REPO, SHARED_DATA, needs_coco_subset, read_metrics, write_coco
from helpers import ForkedRun, forked_ok, load_script, make_tiny_folder, run_ok
from detlib.data.balanced import (FREQUENCIES_FILE, ClassBalancedSampler, RepeatFactorSampler, class_frequencies,
                                  repeat_factors)
from detlib.data.sampler import GroupedBatchSampler
from detlib.datacheck.report import IMBALANCE_RATIO

CATSDOGS = SHARED_DATA / "catsdogs"
needs_catsdogs = pytest.mark.skipif(not CATSDOGS.is_dir(), reason="../shared/data/catsdogs is not present")


def epoch_draws(sampler, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_repeat_factors_by_hand():
    # 10 images: class 0 in 9 of them (f 0.9), class 1 in 1 (f 0.1), class 2 in 2 (f 0.2); image 9 holds 0 and 1
    classes = [[0]] * 7 + [[0, 2, 2], [2]] + [[0, 1]] + [[]]
    r = repeat_factors(classes, threshold=0.4)
    f0, f1, f2 = 9 / 11, 1 / 11, 2 / 11  # 11 images with the empty one
    expected = [max(1, math.sqrt(0.4 / f0))] * 7 + [math.sqrt(0.4 / f2)] * 2 + [math.sqrt(0.4 / f1), 1.0]
    assert r.tolist() == pytest.approx(expected)  # an image takes its rarest class's factor; no box: 1
    assert r[9] == pytest.approx(math.sqrt(4.4)) and r[0] == 1.0
    assert repeat_factors(classes, threshold=0.01).tolist() == [1.0] * 11  # no class below T: the plain epoch
    for bad in (0, -0.1, float("nan")):
        with pytest.raises(ValueError):
            repeat_factors(classes, bad)


@pytest.mark.parametrize("threshold", [0.05, 0.3, 1.0])
def test_repeat_factor_epochs_follow_the_rule_within_rounding(threshold):
    rng = np.random.RandomState(0)  # 60 images, 4 classes of image frequencies about 0.8, 0.25, 0.08, 0.03
    classes = [[c for c, p in enumerate((0.8, 0.25, 0.08, 0.03)) if rng.rand() < p] for _ in range(60)]
    r = repeat_factors(classes, threshold)
    sampler = RepeatFactorSampler(r, seed=3)
    assert len(sampler) == math.floor(r.sum() + 1e-9)
    holds = np.array([[c in set(cs) for c in range(4)] for cs in classes])
    totals, orders = np.zeros(60), []
    for epoch in range(300):
        keys = epoch_draws(sampler, epoch)
        counts = np.bincount(np.array(keys) % 60, minlength=60)
        assert len(keys) == len(sampler) and len(set(keys)) == len(keys)  # a key per draw: each copy its own
        assert np.all((counts == np.floor(r)) | (counts == np.floor(r) + 1))  # each image within rounding
        assert (counts == sampler.draws_per_image()).all()
        per_class = counts @ holds
        assert np.all(per_class >= np.floor(r) @ holds) and np.all(per_class <= np.ceil(r) @ holds)
        totals += counts
        orders.append(keys)
    # over the epochs each image is drawn r times on average, less its part of the draw under one that the epoch's
    # fixed length floor(sum r) takes from them all (0.12: 4 standard deviations of a mean of 300 draws)
    deficit = r.sum() - len(sampler)
    assert -deficit - 0.12 < (totals / 300 - r).min() and (totals / 300 - r).max() < 0.12
    assert np.all((totals / 300) @ holds - r @ holds > -deficit - 0.5)
    assert np.all((totals / 300) @ holds - r @ holds < 0.5)
    assert orders[0] != orders[1] and epoch_draws(sampler, 1) == orders[1]  # a new order each epoch, replayed
    with pytest.raises(ValueError):
        RepeatFactorSampler([1.0, 0.5])


def test_class_balanced_epochs_draw_each_class_equally():
    labels = [0] * 20 + [1] * 5 + [2] * 1  # 26 images: 20:5:1
    sampler = ClassBalancedSampler(labels, seed=0)
    assert len(sampler) == 26
    orders = []
    for epoch in range(20):
        draws = epoch_draws(sampler, epoch)
        images = np.array(draws) % 26
        per_class = np.bincount(np.array(labels)[images], minlength=3)
        assert len(draws) == 26 and sorted(per_class) == [8, 9, 9]  # 26 // 3 each, 26 % 3 classes one more
        per_image = np.bincount(images, minlength=26)
        for c, members in ((0, range(0, 20)), (1, range(20, 25)), (2, range(25, 26))):
            quota = per_class[c] / len(members)
            assert set(per_image[list(members)]) <= {math.floor(quota), math.ceil(quota)}  # evenly through a class
        # image i's k-th draw is the key i + k * 26: each repeat has a key, and so an augmentation, of its own
        assert sorted(draws) == sorted(i + k * 26 for i in range(26) for k in range(per_image[i]))
        orders.append(draws)
    assert orders[0] != orders[1] and epoch_draws(sampler, 1) == orders[1]
    assert len({tuple(sorted(set(o) & set(range(20)))) for o in orders}) > 1  # the majority's subset changes


def test_grouped_batches_take_a_balanced_sampler():
    groups = [0, 1] * 10
    sampler = RepeatFactorSampler([1.0] * 12 + [1.5] * 4 + [2.5] * 4, seed=1)  # 28 draws an epoch
    batches = GroupedBatchSampler(groups, batch_size=3, drop_last=False, sampler=sampler)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        drawn = list(sampler)
        got = list(batches)
        assert len(got) == len(batches) == 10  # ceil(28 / 3), whichever images got their extra draw
        assert sorted(k for b in got for k in b) == sorted(drawn)
        per_group = Counter(groups[k % 20] for k in drawn)
        full = sum(c // 3 for c in per_group.values())  # the full batches of a group come first, pure
        assert all(len({groups[k % 20] for k in b}) == 1 for b in got[:full])


@pytest.mark.slow
def test_balanced_samplers_on_two_processes(tmp_path):
    setup = {"factors": [1.0] * 12 + [1.5] * 4 + [2.5] * 4, "groups": [int(c) for c in "01101001100101101001"],
             "labels": [0] * 20 + [1] * 3 + [2], "batch_size": 2, "seed": 5}
    out = tmp_path / "seen.json"
    forked_ok(REPO / "tests" / "probes" / "balanced_sampler_probe.py", [out, json.dumps(setup)])
    data = json.loads(out.read_text())
    assert data["num_processes"] == 2
    ranks = sorted(data["ranks"], key=lambda r: r["rank"])
    one_process = {  # the batches of the same samplers on 1 process, in the order accelerate deals them out
        "repeat_factor": GroupedBatchSampler(setup["groups"], 2, drop_last=True,
                                             sampler=RepeatFactorSampler(setup["factors"], seed=5)),
        "class_balanced": ClassBalancedSampler(setup["labels"], seed=5)}
    for name, expected_len in (("repeat_factor", 7), ("class_balanced", 6)):  # 28 and 24 draws in batches of 2
        assert [r[name]["len"] for r in ranks] == [expected_len, expected_len]
        for epoch in range(3):
            a, b = ranks[0][name]["epochs"][epoch], ranks[1][name]["epochs"][epoch]
            assert len(a) == len(b) == expected_len
            sampler = one_process[name]
            (sampler.sampler if name == "repeat_factor" else sampler).set_epoch(epoch)
            single = list(sampler)
            if name == "class_balanced":
                single = [single[i:i + 2] for i in range(0, len(single), 2)]
            assert [x for pair in zip(a, b) for x in pair] == single  # every draw on exactly one process
        for r in ranks:  # the resume replays epoch 2 less its first batch on each rank
            assert r[name]["resumed"] == r[name]["epochs"][2][1:]


# ---- the data check's warning


def test_imbalance_warning_follows_the_rule_for_detection_and_folders(tmp_path):
    from detlib.data.imagefolder import FolderScan
    from detlib.datacheck.coco import check_coco
    from detlib.datacheck.imagefolder import check_folder_scans

    def detection(counts):  # one box per image, `counts[c]` images of class c
        labels = [c for c, n in enumerate(counts) for _ in range(n)]
        images = [{"id": i + 1, "file_name": f"{i}.jpg", "width": 64, "height": 64} for i in range(len(labels))]
        anns = [{"id": i + 1, "image_id": i + 1, "category_id": c + 1, "bbox": [4, 4, 20, 20], "area": 400,
                 "iscrowd": 0} for i, c in enumerate(labels)]
        path = write_coco(tmp_path / f"{'_'.join(map(str, counts))}.json", images, anns,
                          [{"id": c + 1, "name": f"c{c}"} for c in range(len(counts))])
        return check_coco(str(path), check_images=False, split="train").report

    def folders(counts):
        names = [f"c{c}" for c in range(len(counts))]
        scan = FolderScan(str(tmp_path), names, {name: c for c, name in enumerate(names)},
                          [(str(tmp_path / f"c{c}" / f"{i}.jpg"), c) for c, n in enumerate(counts) for i in range(n)])
        return check_folder_scans({"train": scan})[1]

    for check, option in ((detection, "--sampler repeat_factor"), (folders, "--sampler class_balanced")):
        for counts, warned in (([30, 4, 3], True), ([30, 3], True), ([29, 3], False), ([30, 30], False),
                               ([10, 1, 0], True), ([5, 0], False)):  # 10x or more of the rarest class with an image
            found = [f for f in check(counts).findings if "imbalance" in f.message]
            assert bool(found) == warned, (check.__name__, counts)
            if warned:
                (f,) = found
                assert f.level == "warning" and option in f.message
                rare = [(c, n) for c, n in enumerate(counts) if n and n * IMBALANCE_RATIO <= max(counts)]
                assert f.examples == [f"{'c%d' % c if check is folders else f'{c + 1} {chr(39)}c{c}{chr(39)}'} "
                                      f"({n} image{'s' * (n != 1)})" for c, n in sorted(rare, key=lambda x: x[1])]


@needs_catsdogs
@needs_coco_subset
def test_data_check_warns_on_the_real_sets_only_where_skewed(tmp_path, capsys):
    main = load_script("check_dataset").main
    skewed = cats_dogs_subset(tmp_path / "skewed", 150, 15)
    for argv, warned in ((["--image_folder", skewed], "--sampler class_balanced"),
                         (["--image_folder", CATSDOGS / "train"], None),
                         (["--annotations", COCO_SUBSET / "annotations" / "instances_train.json", "--skip_image_check"],
                          "--sampler repeat_factor")):
        capsys.readouterr()
        main([str(a) for a in argv])
        out = capsys.readouterr().out
        lines = [line for line in out.splitlines() if "strong class imbalance" in line]
        assert len(lines) == (1 if warned else 0), out
        if warned:
            assert warned in lines[0]
    assert "1 'person' is in 47 images" in out  # the subset's most frequent class, in 47 of its 100 images


# ---- end to end on the real data


def cats_dogs_subset(root, cats: int, dogs: int):
    """The first `cats` cat and `dogs` dog images of the shared training set, linked into an ImageFolder at `root`."""
    for name, n in (("cat", cats), ("dog", dogs)):
        (root / name).mkdir(parents=True)
        for p in sorted((CATSDOGS / "train" / name).iterdir())[:n]:
            os.symlink(p, root / name / p.name)
    return root


@needs_coco_subset
def test_repeat_factors_on_the_coco_subset_and_each_copy_augmented_on_its_own():
    from detlib.data import CocoDetection, build_transform

    ds = CocoDetection(str(COCO_SUBSET / "images"), str(COCO_SUBSET / "annotations" / "instances_train.json"),
                       build_transform(64, "flip_crop_translate"), seed=0, filter_empty=True)
    classes = [r["labels"][~r["iscrowd"]] for r in ds.records]
    r = repeat_factors(classes, 0.1)
    n, names = len(ds), ds.category_map.names
    holds = Counter(c for cs in classes for c in set(cs.tolist()))
    f = {c: holds[c] / n for c in holds}
    assert r.max() == pytest.approx(math.sqrt(0.1 / min(f.values())))  # a class in one image: sqrt(0.1 * 100) = 3.16
    sampler = RepeatFactorSampler(r, seed=0)
    keys = epoch_draws(sampler, 0)
    rows = class_frequencies(classes, keys, names)
    for row, c in zip(rows, range(len(names))):
        members = [i for i, cs in enumerate(classes) if c in set(cs.tolist())]
        low, high = sum(math.floor(r[i]) for i in members), sum(math.ceil(r[i]) for i in members)
        assert low <= row["images_drawn"] <= high and row["images"] == len(members)  # the rule, within rounding
    person = names.index("person")
    assert rows[person]["share_drawn"] < rows[person]["share"]  # the frequent class's share falls
    rare = min((c for c in holds), key=lambda c: holds[c])
    assert rows[rare]["images_drawn"] in (3, 4) and rows[rare]["share_drawn"] > 1.5 * rows[rare]["share"]
    copies = [k for k in keys if k >= n][:6]  # a repeated draw: the same image, its own crop / flip / translation
    assert copies
    for k in copies:
        first, again = ds[k % n], ds[k]
        assert again["image_id"] == first["image_id"]
    assert any(not (ds[k % n]["boxes"].shape == ds[k]["boxes"].shape and (ds[k % n]["boxes"] == ds[k]["boxes"]).all())
               for k in copies)


@pytest.mark.slow  # in-process, 2 steps and an evaluation
@needs_coco_subset
def test_train_retinanet_logs_the_class_frequencies_of_its_sampler(tmp_path, capsys):
    out = tmp_path / "run"
    images, annotations = COCO_SUBSET / "images", COCO_SUBSET / "annotations"
    run_ok("train_retinanet", ["--train_images", images, "--train_annotations", annotations / "instances_train.json",
                               "--val_images", images, "--val_annotations", annotations / "instances_val.json",
                               "--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "32",
                               "--per_device_batch_size", "8", "--per_device_eval_batch_size", "8",
                               "--num_workers", "0", "--max_steps", "2", "--log_interval", "1", "--eval_bootstrap", "0",
                               "--num_log_images", "0",
                               "--skip_image_check", "--sampler", "repeat_factor", "--repeat_threshold", "0.2",
                               "--output_dir", out, "--report_to", "none"], capsys)
    log = (out / "train.log").read_text()
    said = "--sampler repeat_factor --repeat_threshold 0.2: an epoch draws"
    (line,) = [line for line in log.splitlines() if said in line]
    rows = list(csv.DictReader(open(out / FREQUENCIES_FILE)))
    drawn = int(line.split("an epoch draws ")[1].split()[0])
    assert drawn > 100 and "(100 without it)" in line  # the subset's 100 training images
    assert len(rows) == 80 and sum(int(r["images"]) for r in rows if r["class"] == "person") == 47
    # the steps of an epoch are those of the epoch's draws: 2 logged steps of 8 images
    assert [m["step"] for m in read_metrics(out) if "loss" in m] == [1, 2]
    assert f"training: 2 optimizer steps ({drawn // 8} per epoch, 8 images each" in log


@pytest.mark.slow  # in-process, two short trainings
@needs_catsdogs
def test_class_balanced_sampler_makes_the_minority_predicted_on_a_10_to_1_subset(tmp_path, capsys):
    train = cats_dogs_subset(tmp_path / "train", 150, 15)
    recall = {}
    for sampler in ("shuffle", "class_balanced"):
        out = tmp_path / sampler
        run_ok("train_catsdogs", ["--train_dir", train, "--val_dir", CATSDOGS / "val", "--model", "test_resnet",
                                  "--image_size", "32", "--num_workers", "0", "--per_device_batch_size", "16",
                                  "--epochs", "4", "--verify_images", "none", "--sampler", sampler, "--output_dir", out,
                                  "--report_to", "none"], capsys)
        last = [m for m in read_metrics(out) if "val_accuracy" in m][-1]
        recall[sampler] = last["val_recall_dog"]
    rows = {r["class"]: r for r in csv.DictReader(open(tmp_path / "class_balanced" / FREQUENCIES_FILE))}
    assert (int(rows["cat"]["images"]), int(rows["dog"]["images"])) == (150, 15)
    assert {int(rows["cat"]["images_drawn"]), int(rows["dog"]["images_drawn"])} == {82, 83}  # 165 draws, half each
    assert not (tmp_path / "shuffle" / FREQUENCIES_FILE).exists()
    assert recall["class_balanced"] >= recall["shuffle"] + 0.2, recall



# ---- a mid-epoch resume replays the epoch exactly: its draws and each draw's augmentation

@pytest.mark.slow  # a run killed after its first step checkpoint, then two in-process runs
@pytest.mark.parametrize("sampler", ["shuffle", "class_balanced"])
def test_catsdogs_killed_mid_epoch_resumes_to_the_uninterrupted_run(tmp_path, capsys, sampler):
    """kill -9 after a --checkpoint_steps checkpoint, with DataLoader workers: the resumed run trains on the images and
    random crops / flips the uninterrupted run trained on (the same losses step by step, the same weights)."""
    data = make_tiny_folder(tmp_path / "data", [12, 4])  # 16 images, 8 steps an epoch
    common = ["--train_dir", data, "--val_dir", data, "--model", "test_resnet", "--image_size", "32", "--num_workers",
              "2", "--per_device_batch_size", "2", "--epochs", "3", "--checkpoint_steps", "3", "--log_interval", "1",
              "--verify_images", "none", "--report_to", "none", "--sampler", sampler]
    full, part = tmp_path / "full", tmp_path / "part"
    run = ForkedRun("train_catsdogs.py", common + ["--output_dir", part])  # forked: the launcher plays no part
    deadline = time.time() + 120
    while not list((part / "checkpoints").glob("step_*[0-9]")) and run.procs[0].is_alive() and time.time() < deadline:
        time.sleep(0.02)
    run.kill()  # the training process and its workers at once: nothing can save
    assert run.finish("train_catsdogs.py killed mid-epoch")[0] == -signal.SIGKILL, run.text[-3000:]
    run_ok("train_catsdogs", common + ["--output_dir", full], capsys)
    resumed = run_ok("train_catsdogs", common + ["--output_dir", part, "--resume_from_checkpoint", "latest"], capsys)
    start = int(re.search(r"global step (\d+)", resumed).group(1))
    assert start % 8, f"resumed at step {start}: an epoch's end, not mid-epoch"
    by_step = {m["step"]: m for m in read_metrics(part) if "loss" in m}  # the resumed run's values (later lines win)
    after = [m for m in read_metrics(full) if "loss" in m and m["step"] > start]
    assert len(after) == 24 - start
    for m in after:
        assert by_step[m["step"]]["loss"] == pytest.approx(m["loss"], rel=1e-5, abs=1e-6), m["step"]
    a, b = (load_file(str(out / "last" / "model.safetensors")) for out in (full, part))
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())
    assert worst <= 1e-6
    print(f"--sampler {sampler}: killed, resumed from step {start}; max weight difference {worst:.2e}")
