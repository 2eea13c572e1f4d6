"""Ending a run early (detlib.engine.stopping): --early_stopping_patience ends both scripts as a finished run ends,
after exactly N evaluations without a better best, and its count survives a resume; --time_limit's forms (its launch,
which stops at a step with a resumable checkpoint before the budget runs out, is in tests/test_time_bounds.py). Also
the first training batch drawn (samples/train_batch.jpg), checked in these runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import COCO_SUBSET, needs_coco_subset, read_metrics, write_coco, write_image
from detlib.engine import stopping
from detlib.argtypes import duration_seconds
from detlib.evaluation.drawing import class_color, drawing_scale
from helpers import make_tiny_folder, run_main, run_ok

CATS = ["--model", "test_resnet", "--image_size", "32", "--num_workers", "0", "--report_to", "none",
        "--per_device_batch_size", "4"]
# lr 0 and frozen BatchNorm: the weights and so the AP never change, every evaluation after the first ties it
DETECTOR = ["--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "16", "--per_device_batch_size", "4",
            "--num_workers", "0", "--report_to", "none", "--eval_bootstrap", "0", "--num_log_images", "0",
            "--backbone_bn", "frozen", "--lr", "0"]


def evaluations(out: Path, metric: str) -> list[float]:
    return [m[metric] for m in read_metrics(out) if metric in m and "epoch" in m]


def expected_stop(values: list[float], patience: int, best: float = -1.0, count: int = 0) -> int | None:
    """The rule written out: the 1-based evaluation after which `patience` evaluations in a row brought no better
    best (None: never), from `best` and `count` carried over."""
    for i, v in enumerate(values, 1):
        best, count = (v, 0) if v > best else (best, count + 1)
        if count >= patience:
            return i
    return None


def status(out: Path) -> dict:
    return json.loads((out / "run_status.json").read_text())


def tiny_detection_set(root: Path, n: int = 8) -> list[str]:
    images, anns = [], []
    for i in range(n):
        write_image(root / "img" / f"{i}.png", 64, 64, seed=i)
        images.append({"id": i + 1, "file_name": f"{i}.png", "width": 64, "height": 64})
        anns.append({"image_id": i + 1, "category_id": 1 + i % 2, "bbox": [4 + i, 6, 30, 24]})
    cats = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
    write_coco(root / "train.json", images, anns, cats)
    return ["--train_images", str(root / "img"), "--train_annotations", str(root / "train.json"),
            "--val_images", str(root / "img"), "--val_annotations", str(root / "train.json")]


# ---- the rules, on their own

def test_time_limit_forms_and_refusals():
    assert [duration_seconds(t) for t in ("00:00:40", "1:30:00", "100:00:00", "1-02:03:04")] == [40, 5400, 360000, 93784]
    for bad in ("40", "00:61:00", "1:2", "a:b:c", "-1:00:00"):
        with pytest.raises(ValueError):
            duration_seconds(bad)


def test_time_limit_keeps_room_for_the_longest_stretch_and_save(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(stopping.time, "time", lambda: clock[0])
    limit = stopping.TimeLimit("00:02:00", start=1000.0)  # deadline 1120
    assert not limit.up()  # 0 s gone, no stretch yet, FIRST_SAVE_S kept for the first save
    limit.note_save(4.0)
    for t in (1010.0, 1011.0, 1031.0, 1032.0):  # steps of 1 s, one 20 s stretch (an evaluation)
        clock[0] = t
        assert not limit.up()
    for t in np.arange(1033.0, 1096.0, 0.5):  # steps of 0.5 s up to 1095.5: 1095.5 + 20 + 4 < 1120
        clock[0] = t
        assert not limit.up(), t
    clock[0] = 1096.0  # 1096 + 20 + 4 >= 1120: the next stretch and the save would not fit
    assert limit.up()


# ---- early stopping, end to end

def test_catsdogs_early_stopping_ends_like_a_finished_run_and_draws_the_first_batch(tmp_path, capsys):
    data = make_tiny_folder(tmp_path / "data", [8, 8])
    out = tmp_path / "run"
    stdout = run_ok("train_catsdogs", CATS + ["--train_dir", data, "--val_dir", data, "--epochs", "10", "--lr", "0",
                                              "--early_stopping_patience", "2", "--output_dir", out], capsys)
    values = evaluations(out, "val_accuracy")
    stop = expected_stop(values, 2)
    assert stop is not None and stop < 10 and len(values) == stop  # exactly the evaluations the rule allows
    assert status(out)["status"] == "finished" and "early stopping" in status(out)["message"]
    assert status(out)["epoch"] == stop and (out / "best" / "model.safetensors").is_file()
    assert (out / "last" / "model.safetensors").is_file() and "summary:" in stdout
    assert (out / "checkpoints" / f"epoch_{stop:04d}" / "trainer_state.json").is_file()  # the end's checkpoint
    # the first batch: 4 images of 32 px, each drawn 16x (drawing_scale) in a 2 x 2 grid, its class on a tag
    grid = np.asarray(Image.open(out / "samples" / "train_batch.jpg").convert("RGB")).astype(int)
    tile = 32 * drawing_scale(32, 32)
    assert grid.shape == (2 * tile + 2, 2 * tile + 2, 3)
    assert grid[tile:tile + 2].max() < 40 and grid[:, tile:tile + 2].max() < 40  # the black gaps
    for y in (0, tile + 2):
        for x in (0, tile + 2):
            assert grid[y + 40:y + tile, x:x + tile].std() > 10  # an image, not a blank tile
            tag = grid[y + 2:y + 4, x + 2:x + 4].reshape(-1, 3).mean(0)  # the tag's fill, left of its text
            assert min(np.abs(tag - class_color(k)).max() for k in (0, 1)) < 40, tag


def test_retinanet_early_stopping_count_survives_a_resume(tmp_path, capsys):
    flags = DETECTOR + tiny_detection_set(tmp_path / "data") + ["--early_stopping_patience", "2", "--eval_interval", "1",
                                                                 "--output_dir", tmp_path / "run"]
    out = tmp_path / "run"
    run_ok("train_retinanet", flags + ["--epochs", "2"], capsys)  # evaluation 2 ties the first: 1 without a better
    assert status(out)["message"] == "" and evaluations(out, "AP")[0] == evaluations(out, "AP")[1]
    state = json.loads(sorted((out / "checkpoints").iterdir())[-1].joinpath("trainer_state.json").read_text())
    assert state["evals_without_improvement"] == 1
    run_ok("train_retinanet", flags + ["--epochs", "8", "--resume_from_checkpoint", "latest"], capsys)
    values = evaluations(out, "AP")
    assert len(values) == 3 == expected_stop(values, 2)  # one more evaluation, not two: the count was resumed
    assert status(out)["status"] == "finished" and "early stopping: no better AP" in status(out)["message"]
    assert status(out)["epoch"] == 3 and (out / "last" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "epoch_0003" / "trainer_state.json").is_file()
    # its last evaluation is the final one a finished run has: the label errors, in the line and label_errors.json
    final = [m for m in read_metrics(out) if "AP" in m][-1]
    assert final["epoch"] == 3 and set(final["label_errors"]) == {"wrong_class", "badly_placed", "missing_box"}
    assert json.loads((out / "label_errors.json").read_text())["counts"] == final["label_errors"]
    again = run_main("train_retinanet", flags + ["--epochs", "8", "--resume_from_checkpoint", "latest"], capsys)
    assert again[0] == 0 and len(evaluations(out, "AP")) == 3 and status(out)["epoch"] == 3  # stopped stays stopped


# ---- the real data

@needs_coco_subset
@pytest.mark.parametrize("augmentation", ["photometric", "scale_jitter"])
def test_retinanet_on_the_coco_subset_draws_its_first_batch(tmp_path, capsys, augmentation):
    out = tmp_path / "run"
    ann = COCO_SUBSET / "annotations"
    run_ok("train_retinanet", DETECTOR[:2] + ["--image_size", "128", "--fpn_channels", "16", "--per_device_batch_size",
                                              "4", "--num_workers", "0", "--report_to", "none", "--eval_bootstrap", "0",
                                              "--num_log_images", "0", "--max_steps", "1", "--augmentation", augmentation,
                                              "--train_images", COCO_SUBSET / "images", "--train_annotations",
                                              ann / "instances_train.json", "--val_images", COCO_SUBSET / "images",
                                              "--val_annotations", ann / "instances_val.json", "--output_dir", out], capsys)
    grid = np.asarray(Image.open(out / "samples" / "train_batch.jpg").convert("RGB")).astype(int)
    assert grid.shape[0] == grid.shape[1] >= 2 * 128 * drawing_scale(128, 128)  # 4 images: 2 x 2 tiles
    assert grid.std() > 20


def test_time_limit_keeps_what_the_state_size_takes_for_a_save_until_one_is_timed(monkeypatch):
    """Before a save is timed the stop keeps MIN_SAVE_S plus the state's bytes at SAVE_BYTES_PER_S (`expect_save`,
    called by start_run with the models' size), FIRST_SAVE_S when no size was given; a timed save replaces both."""
    clock = [1000.0]
    monkeypatch.setattr(stopping.time, "time", lambda: clock[0])
    monkeypatch.setattr(stopping, "launch_start", lambda: 1000.0)
    for num_bytes, reserve in ((None, stopping.FIRST_SAVE_S), (0, 2.0), (4e6, 2.2), (440e6, 24.0)):
        stopping.start_time_limit("00:01:00")  # deadline 1060
        try:
            if num_bytes is not None:
                stopping.expect_save(int(num_bytes))
            clock[0] = 1060.0 - reserve - 0.01
            assert stopping.time_limit_up() is False, (num_bytes, reserve)
            clock[0] = 1060.0 - reserve + 0.01  # the gap between the two polls (0.02 s) counts too
            assert stopping.time_limit_up() is True, (num_bytes, reserve)
        finally:
            stopping.start_time_limit(None)
    stopping.expect_save(10**9)  # no budget: nothing to keep, nothing raised
    assert stopping.time_limit_up() is None
