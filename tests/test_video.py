"""Videos in the predict scripts (detlib.data.video, PyAV): a video predicted frame by frame equals the same frames
predicted as images; files that are neither image nor video are named unsupported, not unreadable."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import re

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import COCO_SUBSET, REPO, needs_coco_subset
from helpers import write_tiny_detector

av = pytest.importorskip("av")

from detlib.data.video import VideoWriter, video_frames, video_info  # noqa: E402

FRAMES, FPS = 10, 5


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> Path:
    """A freshly initialised tiny RetinaNet folder (seeded): what predict reads, without a training run."""
    return write_tiny_detector(tmp_path_factory.mktemp("detector"))


def write_video(path: Path, frames: int = FRAMES) -> Path:
    """A 96 x 64 clip of a real photo panning right by 4 px a frame."""
    photo = np.asarray(Image.open(COCO_SUBSET / "images" / "000000000790.jpg").convert("RGB").resize((160, 106)))
    with VideoWriter(str(path), FPS) as w:
        for i in range(frames):
            w.write(photo[20:84, 4 * i: 4 * i + 96])
    return path


@needs_coco_subset
def test_video_predicted_frame_by_frame_equals_its_frames_as_images(detector, tmp_path):
    video = write_video(tmp_path / "clip.mp4")
    info = video_info(str(video))
    assert (info["frames"], info["fps"], info["width"], info["height"]) == (FRAMES, FPS, 96, 64)
    frames_dir = tmp_path / "frames"
    frames_dir.mkdir()
    times = []
    for i, t, rgb in video_frames(str(video)):  # the decoded frames, lossless
        Image.fromarray(rgb).save(frames_dir / f"frame_{i:03d}.png")
        times.append(t)
    assert times == [i / FPS for i in range(FRAMES)]
    predict = load_script("predict_retinanet")
    common = ["--weights", str(detector), "--batch_size", "4", "--score_thresh", "0", "--num_workers", "0",
              "--save_json_per_image"]
    from_video = predict.main([*common, "--source", str(video), "--output_dir", str(tmp_path / "v")])
    from_images = predict.main([*common, "--source", str(frames_dir), "--output_dir", str(tmp_path / "i")])
    assert len(from_video) == len(from_images) == FRAMES * 100  # score 0: every frame its 100 best
    for v, im in zip(from_video, from_images):
        assert im["file_name"] == f"frame_{v['frame']:03d}.png" and v["file_name"] == "clip.mp4"
        assert v["time"] == v["frame"] / FPS and v["image_id"] == v["frame"] == im["image_id"]
        assert {k: v[k] for k in ("category_id", "bbox", "score")} == {k: im[k] for k in ("category_id", "bbox", "score")}
    # the drawn video has every frame; the per-frame json is an image's json with frame and time
    drawn = tmp_path / "v" / "videos" / "clip.mp4"
    assert sum(1 for _ in video_frames(str(drawn))) == FRAMES
    per_frame = json.loads((tmp_path / "v" / "json" / "clip.json").read_text())
    image_json = json.loads((tmp_path / "i" / "json" / "frame_003.json").read_text())
    assert per_frame[3]["detections"] == image_json["detections"] and per_frame[3]["time"] == 0.6
    assert set(per_frame[3]) == set(image_json) | {"frame", "time"}
    assert json.loads((tmp_path / "v" / "predictions.json").read_text()) == from_video


@needs_coco_subset
def test_files_neither_image_nor_video_are_named_unsupported_not_unreadable(detector, tmp_path, capsys):
    src = tmp_path / "mixed"
    src.mkdir()
    Image.open(COCO_SUBSET / "images" / "000000000790.jpg").convert("RGB").resize((96, 64)).save(src / "a.jpg")
    write_video(src / "b.mp4", frames=2)
    (src / "c.txt").write_text("notes")
    (src / "d.mp4").write_text("not a video")
    predict = load_script("predict_retinanet")
    common = ["--weights", str(detector), "--num_workers", "0", "--no_images", "--score_thresh", "0"]
    results = predict.main([*common, "--source", str(src / "*"), "--output_dir", str(tmp_path / "out")])
    skipped = (tmp_path / "out" / "skipped.txt").read_text().splitlines()
    assert skipped[0] == f"{src / 'c.txt'} (unsupported file type .txt: neither an image nor a video)"
    assert skipped[1:] == [f"{src / 'd.mp4'} (unreadable video)"]
    assert {r["file_name"] for r in results} == {"a.jpg", "b.mp4"}
    # a single file of no type we read: one line, never "unreadable"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # engine.stop: the line on stderr, exit 1
        predict.main([*common, "--source", str(src / "c.txt"), "--output_dir", str(tmp_path / "out2")])
    assert e.value.code == 1 and re.search(r"nothing to predict: .*c.txt \(unsupported file type .txt",
                                           capsys.readouterr().err)
    # without PyAV: a video source says what to install
    predict.av_available = lambda: False
    with pytest.raises(SystemExit) as e:
        predict.main([*common, "--source", str(src / "b.mp4"), "--output_dir", str(tmp_path / "out3")])
    assert e.value.code == 1 and "reading videos needs PyAV: pip install av" in capsys.readouterr().err


@needs_coco_subset
def test_classifier_predicts_a_video_frame_by_frame_as_its_frames_as_images(tmp_path):
    from safetensors.torch import save_file

    from detlib.classification import build_classifier

    weights = tmp_path / "classifier"
    weights.mkdir()
    torch.manual_seed(0)
    model = build_classifier("resnet18", 2).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights / "model.safetensors"))
    (weights / "model_config.json").write_text(json.dumps({"model": "resnet18", "num_classes": 2, "classes": ["cat", "dog"],
                                                           "image_size": 32}))
    video = write_video(tmp_path / "clip.mp4")
    frames_dir = tmp_path / "frames"
    frames_dir.mkdir()
    for i, _, rgb in video_frames(str(video)):
        Image.fromarray(rgb).save(frames_dir / f"frame_{i:03d}.png")
    predict = load_script("predict_catsdogs")
    common = ["--weights", str(weights), "--batch_size", "4", "--num_workers", "0", "--topk", "2"]
    predict.main([*common, "--source", str(video), "--output_dir", str(tmp_path / "v")])
    predict.main([*common, "--source", str(frames_dir), "--output_dir", str(tmp_path / "i")])
    from_video = json.loads((tmp_path / "v" / "predictions.json").read_text())
    from_images = json.loads((tmp_path / "i" / "predictions.json").read_text())
    assert [(r["file_name"], r["frame"], r["time"]) for r in from_video] == [("clip.mp4", i, i / FPS) for i in range(FRAMES)]
    assert [r["topk"] for r in from_video] == [r["topk"] for r in from_images]
    csv_rows = (tmp_path / "v" / "predictions.csv").read_text().splitlines()
    assert csv_rows[0].endswith(",frame,time") and csv_rows[4].startswith("clip.mp4,") and csv_rows[4].endswith(",3,0.6")
