"""E cases of prediction and evaluation (../shared/cases/README.md, "E cases"): scores in float32 at every precision
(E24), videos that yield no frame or end early (E14), a local folder that hides a Hub repo id (E18). Inputs are
built from the real COCO subset."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import COCO_SUBSET, needs_coco_subset
from helpers import fresh_accelerate, load_script, run_main, write_tiny_detector

# ---- E24: scores and decoding in float32 whatever the precision

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
SMALL_DETECTOR = {"num_classes": 80, "backbone": "resnet18", "fpn_channels": 32, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def val_subset(n: int = 6) -> dict:
    """The first `n` images of the subset's val json, normalised, with their annotations."""
    from detlib.datacheck.coco import check_coco

    gt = check_coco(str(COCO_SUBSET / "annotations" / "instances_val.json"), None, split="val", check_images=False).dataset
    gt["images"] = gt["images"][:n]
    ids = {im["id"] for im in gt["images"]}
    gt["annotations"] = [a for a in gt["annotations"] if a["image_id"] in ids]
    return gt


@pytest.fixture(scope="module")
def early_detector():
    """A seeded, freshly initialised RetinaNet on the subset's 80 classes (what an early evaluation scores: every
    logit near the prior's -4.6), 6 val images at 128 px in batches of 3, and its float32 evaluation of them."""
    from detlib.data.coco import CocoDetection, collate_detection
    from detlib.data.transforms import build_transform
    from detlib.retinanet.model import build_retinanet_from_config

    torch.manual_seed(0)
    model = build_retinanet_from_config(SMALL_DETECTOR).eval()
    gt = val_subset()
    ds = CocoDetection(str(COCO_SUBSET / "images"), gt, build_transform(128, "none", None), train=False)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=collate_detection))
    return model, gt, batches, evaluate_at(model, gt, batches, None)


def evaluate_at(model, gt: dict, batches: list, dtype) -> tuple[list[dict], dict, set]:
    """(COCO results with score threshold 0, the 12 stats, the head outputs' dtypes) of `model` under
    torch.autocast("cpu", dtype) (None: float32), decoded as the training script's evaluation decodes."""
    from detlib.evaluation.coco import detections_to_coco, evaluate_coco
    from detlib.labels import CategoryMap
    from detlib.retinanet import anchor_generator_from_config, decode_detections

    category_map = CategoryMap([c["id"] for c in gt["categories"]], [c["name"] for c in gt["categories"]])
    anchor_gen = anchor_generator_from_config(SMALL_DETECTOR)
    results, dtypes = [], set()
    for b in batches:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(b["images"])
        dtypes |= {out["cls_logits"].dtype, out["box_deltas"].dtype}
        anchors, counts = anchor_gen(*b["images"].shape[-2:], device="cpu")
        dets = decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, b["image_sizes"], b["scales"],
                                 score_thresh=0.0)
        for i, d in enumerate(dets.per_image(len(b["image_ids"]))):
            iid = int(b["image_ids"][i])
            results += detections_to_coco(d["boxes"], d["scores"], category_map.to_category_ids(d["labels"]), iid)
    stats, _ = evaluate_coco(gt, results)
    return results, stats, dtypes


def by_rank(results: list[dict]) -> list[dict]:
    return sorted(results, key=lambda r: (r["image_id"], -r["score"], r["category_id"], r["bbox"]))


@needs_coco_subset
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_case_e24_reduced_precision_evaluation_scores_in_fp32_and_gives_the_fp32_ap(early_detector, precision):
    model, gt, batches, (ref, ref_stats, ref_dtypes) = early_detector
    got, stats, dtypes = evaluate_at(model, gt, batches, PRECISIONS[precision])
    assert ref_dtypes == dtypes == {torch.float32}  # the heads' outputs, inside autocast too
    assert len(got) == len(ref) == 600  # threshold 0: each image its 100 best
    # before: every logit rounded to one bf16 / fp16 value (-4.59375), so all 600 detections had one score and AP 0.0
    distinct = len({r["score"] for r in ref})
    assert distinct > 20 and len({r["score"] for r in got}) >= 0.9 * distinct
    assert ref_stats["AP"] > 0 and ref_stats["AP50"] > 0
    for key in ("AP", "AP50", "AR100"):  # the same AP as fp32 within the towers' rounding
        assert stats[key] == pytest.approx(ref_stats[key], rel=0.15), key
    # the detections: scores in rank order within 1e-5 of fp32's
    score_gap = max(abs(a["score"] - b["score"]) for a, b in zip(by_rank(ref), by_rank(got)))
    assert score_gap < 1e-5
    # the logits themselves: within the towers' rounding (measured: up to 3e-6), far below bf16's step at the prior's
    # -4.6 (2**-6: a logit rounded to bf16 is up to 0.008 off). Which detections are kept is not compared: a fresh
    # model's 600 kept scores tie within 1e-6, so the towers' rounding picks others among equals (on an AMD EPYC,
    # 83 of 600 under bf16), which says nothing about the decoding.
    images = batches[0]["images"]
    with torch.no_grad():
        fp32 = model(images)["cls_logits"]
        with torch.autocast("cpu", dtype=PRECISIONS[precision]):
            reduced = model(images)["cls_logits"]
    assert reduced.dtype == torch.float32 and (reduced - fp32).abs().max() < 1e-4


@needs_coco_subset
def test_case_e24_prepared_bf16_model_as_the_training_evaluation_runs_it_scores_in_fp32(early_detector):
    """The training script evaluates the model accelerate prepared: its forward wrapped in autocast (bf16) and its
    outputs cast to float32 afterwards, which cannot bring back what bf16 rounded away."""
    import copy

    from accelerate import Accelerator

    model, gt, batches, _ = early_detector
    fresh_accelerate()
    try:
        prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare(copy.deepcopy(model)).eval()
        with torch.no_grad():
            logits = prepared(batches[0]["images"])["cls_logits"]
        with torch.no_grad():
            ref = model(batches[0]["images"])["cls_logits"]
    finally:
        fresh_accelerate()
    assert logits.dtype == torch.float32
    assert len(torch.unique(logits)) > 0.5 * len(torch.unique(ref))  # before: a handful of bf16 values
    assert (logits - ref).abs().max() < 1e-3


@needs_coco_subset
def test_case_e24_predict_under_bf16_writes_the_fp32_detections(early_detector, tmp_path, capsys):
    from safetensors.torch import save_file

    model = early_detector[0]
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights / "model.safetensors"))
    (weights / "model_config.json").write_text(json.dumps({**SMALL_DETECTOR, "image_size": 128, "max_size": None}))
    source = tmp_path / "photos"
    source.mkdir()
    for im in val_subset(3)["images"]:
        os.symlink(COCO_SUBSET / "images" / im["file_name"], source / im["file_name"])
    out = {}
    for precision in ("no", "bf16"):
        fresh_accelerate()
        try:
            code, _, err = run_main("predict_retinanet", ["--weights", weights, "--source", source, "--output_dir",
                                                          tmp_path / precision, "--score_thresh", "0", "--no_images",
                                                          "--num_workers", "0", "--mixed_precision", precision], capsys)
        finally:
            fresh_accelerate()
        assert code == 0, err
        out[precision] = by_rank(json.loads((tmp_path / precision / "predictions.json").read_text()))
    assert len(out["bf16"]) == len(out["no"]) == 300
    assert len({r["score"] for r in out["bf16"]}) >= 0.9 * len({r["score"] for r in out["no"]}) > 20
    assert max(abs(a["score"] - b["score"]) for a, b in zip(out["no"], out["bf16"])) < 1e-5


# ---- E14: damaged videos

needs_av = pytest.mark.skipif(importlib.util.find_spec("av") is None, reason="needs PyAV (pip install av)")
VIDEO_FPS = 5


def write_clip(path: Path, frames: int, faststart: bool = False) -> Path:
    """A 96 x 64 MPEG-4 clip of a real photo panning right by 2 px a frame (0 frames: a stream that holds none)."""
    import av

    photo = np.asarray(Image.open(COCO_SUBSET / "images" / "000000000790.jpg").convert("RGB").resize((160, 106)))
    c = av.open(str(path), mode="w", options={"movflags": "faststart"} if faststart else {})
    s = c.add_stream("mpeg4", rate=VIDEO_FPS)
    s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
    c.start_encoding()
    for i in range(frames):
        for packet in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(photo[20:84, 2 * i: 2 * i + 96]),
                                                          format="rgb24")):
            c.mux(packet)
    for packet in s.encode():
        c.mux(packet)
    c.close()
    return path


def cut(path: Path, fraction: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


@pytest.fixture(scope="module")
def damaged_videos(tmp_path_factory) -> Path:
    """clip.mp4 (10 frames, intact), empty.avi (a video stream without a frame), cut.mp4 (30 frames, its index at
    the start, the file cut to 40%: one frame decodes) and cut.avi (30 frames, cut in half)."""
    folder = tmp_path_factory.mktemp("videos")
    write_clip(folder / "clip.mp4", 10)
    write_clip(folder / "empty.avi", 0)
    cut(write_clip(folder / "cut.mp4", 30, faststart=True), 0.4)
    cut(write_clip(folder / "cut.avi", 30), 0.5)
    return folder


@pytest.fixture(scope="module")
def tiny_detector(tmp_path_factory) -> Path:
    return write_tiny_detector(tmp_path_factory.mktemp("detector"))


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    from detlib.classification import build_classifier

    folder = tmp_path_factory.mktemp("classifier")
    torch.manual_seed(0)
    model = build_classifier("resnet18", 2).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps({"model": "resnet18", "num_classes": 2, "classes": ["cat", "dog"],
                                                          "image_size": 32}))
    return folder


@needs_coco_subset
@needs_av
def test_case_e14_damaged_videos_are_named_in_skipped_txt_and_nothing_unwritten_is_announced(
        damaged_videos, tiny_detector, tmp_path, capsys):
    from detlib.data.video import video_frames

    out = tmp_path / "out"
    code, _, err = run_main("predict_retinanet", ["--weights", tiny_detector, "--source", damaged_videos, "--output_dir",
                                                  out, "--score_thresh", "0", "--num_workers", "0", "--batch_size", "4",
                                                  "--save_json_per_image"], capsys)
    assert code == 0, err
    src = str(damaged_videos)
    assert (out / "skipped.txt").read_text().splitlines() == [
        f"{src}/cut.avi (video ended early: 1 of 30 frames decoded (the file is cut short?))",
        f"{src}/cut.mp4 (video ended early: 1 of 30 frames decoded (the file is cut short?))",
        f"{src}/empty.avi (unreadable video)"]
    # the intact clip and the cut ones' decoded frames are predicted and drawn; nothing for the empty one
    frames = {(r["file_name"], r["frame"]) for r in json.loads((out / "predictions.json").read_text())}
    assert frames == {("clip.mp4", i) for i in range(10)} | {("cut.avi", 0), ("cut.mp4", 0)}
    assert sorted(p.name for p in (out / "videos").iterdir()) == ["clip.mp4", "cut.avi.mp4", "cut.mp4.mp4"]
    assert sum(1 for _ in video_frames(str(out / "videos" / "cut.mp4.mp4"))) == 1
    assert sorted(p.name for p in (out / "json").iterdir()) == ["clip.json", "cut.avi.json", "cut.mp4.json"]
    log = (out / "predict.log").read_text()
    for line in log.splitlines():  # every drawn video the log announces is on disk
        if "drawn into" in line:
            assert Path(line.rsplit("drawn into ", 1)[1].strip()).is_file(), line
    assert "empty.avi: no frame could be decoded" in log and "video cut.mp4: 1 of 30 frames" in log
    assert f"video {src}/cut.mp4 ended early: 1 of 30 frames decoded" in log


@needs_coco_subset
@needs_av
def test_case_e14_classifier_names_damaged_videos_in_skipped_txt(damaged_videos, tiny_classifier, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_main("predict_catsdogs", ["--weights", tiny_classifier, "--source", damaged_videos, "--output_dir",
                                                 out, "--num_workers", "0", "--batch_size", "4", "--topk", "1"], capsys)
    assert code == 0, err
    src = str(damaged_videos)
    assert (out / "skipped.txt").read_text().splitlines() == [
        f"{src}/cut.avi (video ended early: 1 of 30 frames decoded (the file is cut short?))",
        f"{src}/cut.mp4 (video ended early: 1 of 30 frames decoded (the file is cut short?))",
        f"{src}/empty.avi (unreadable video)"]
    rows = json.loads((out / "predictions.json").read_text())
    assert [(r["file_name"], r["frame"]) for r in rows] == [("clip.mp4", i) for i in range(10)] + [("cut.avi", 0),
                                                                                                   ("cut.mp4", 0)]


# ---- E18: a local folder that hides a Hub repo id


def hub_cache_with(root: Path, repo_id: str, folder: Path) -> Path:
    """A Hub cache holding one snapshot of `repo_id` (the files of `folder`), in huggingface_hub's layout."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    return root


@needs_coco_subset
def test_case_e18_a_local_folder_hiding_a_hub_repo_id_is_named_with_the_hub_prefix(tiny_detector, tmp_path, monkeypatch,
                                                                                   capsys):
    import huggingface_hub

    from detlib import hub

    cache = hub_cache_with(tmp_path / "hub", "me/retinanet", tiny_detector)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "me").mkdir()  # a local folder named like the repo's owner (its runs, say)
    hub.download.cache_clear()
    image = COCO_SUBSET / "images" / "000000000790.jpg"
    common = ["--source", image, "--no_images", "--num_workers", "0", "--score_thresh", "0"]
    code, _, err = run_main("predict_retinanet", ["--weights", "me/retinanet", *common, "--output_dir", tmp_path / "a"],
                            capsys)
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    # before: "no model weights at me/retinanet (expected a file, ...)": the Hub never tried, nor said why
    assert code == 1 and line == ("error: no local file or folder me/retinanet: ./me is a local folder, so me/retinanet "
                                  "is read as a path in it, not as the Hub repo id me/retinanet; for the Hub write "
                                  "hf://me/retinanet (the Hub cache holds it)")
    # the prefix asks for the Hub: read from the cache offline, the same detections as the folder itself
    fresh_accelerate()
    code, _, err = run_main("predict_retinanet", ["--weights", "hf://me/retinanet", *common, "--output_dir",
                                                  tmp_path / "b"], capsys)
    assert code == 0, err
    fresh_accelerate()
    code, _, err = run_main("predict_retinanet", ["--weights", tiny_detector, *common, "--output_dir", tmp_path / "c"],
                            capsys)
    assert code == 0, err
    assert (tmp_path / "b" / "predictions.json").read_text() == (tmp_path / "c" / "predictions.json").read_text()
    # offline, a repo the cache lacks: one line, with or without the prefix
    for weights in ("hf://me/other", "someone/other"):
        fresh_accelerate()
        code, _, err = run_main("predict_retinanet", ["--weights", weights, *common, "--output_dir", tmp_path / "d"],
                                capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 1 and len(lines) == 1 and "HF_HUB_OFFLINE is set and it is not in the Hub cache" in lines[0]
    hub.download.cache_clear()
