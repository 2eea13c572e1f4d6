"""--tile in the scripts (issue 40): tiled evaluation gives the same stats and detections on 1 and 2 processes and the
same detections as tiled predict on the same COCO json; tiled predict of a folder with a video is the same on 1 and 2
processes, and a video's frames are tiled as the same frames saved as images are; a 13,500 x 13,400 px image is
predicted with memory bounded by the image held once and the tile batch.

The weights: a freshly initialised tiny RetinaNet (`helpers.write_tiny_detector`, 64 px), scored at --score_thresh
0 so that every tile has detections to compare."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import COCO_SUBSET, REPO, needs_coco_subset, read_metrics
from helpers import forked_ok, run_ok, write_tiny_detector

pytestmark = [pytest.mark.slow]
STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
TILE = ["--tile", "160", "--tile_overlap", "0.25"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """4 real val images (640 px: 3 x 4 tiles of 160 px) with their boxes as the detector's class 1."""
    root = tmp_path_factory.mktemp("tiled")
    val = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    images = sorted(val["images"], key=lambda im: im["id"])[:4]
    ids = {im["id"] for im in images}
    val.update(images=images, annotations=[{**a, "category_id": 1} for a in val["annotations"] if a["image_id"] in ids],
               categories=[{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}, {"id": 3, "name": "bird"}])
    (root / "val.json").write_text(json.dumps(val))
    return {"root": root, "json": root / "val.json", "images": COCO_SUBSET / "images", "val": val,
            "weights": write_tiny_detector(root)}


def evaluate(data, out, processes: int, extra: list) -> tuple[dict, list]:
    args = ["--val_images", data["images"], "--val_annotations", data["json"], "--evaluate_only", data["weights"],
            "--score_thresh", "0", "--report_to", "none", "--num_workers", "0", "--num_log_images", "0",
            "--eval_bootstrap", "0", "--per_device_eval_batch_size", "3", "--output_dir", out, *extra]
    if processes == 1:
        run_ok("train_retinanet", args)
    else:
        forked_ok("train_retinanet.py", args, processes)
    (line,) = read_metrics(out / "evaluate_only")
    return {k: line[k] for k in STATS}, json.loads((out / "evaluate_only" / "predictions_val.json").read_text())


@needs_coco_subset
def test_tiled_evaluation_is_the_same_on_1_and_2_processes_and_equals_tiled_predict(data, tmp_path):
    stats1, preds1 = evaluate(data, tmp_path / "p1", 1, [*TILE, "--tile_full"])
    stats2, preds2 = evaluate(data, tmp_path / "p2", 2, [*TILE, "--tile_full"])
    assert stats1 == stats2 and preds1 == preds2
    assert len(preds1) == 4 * 100  # score threshold 0: each image its 100 best after the merge
    whole, whole_preds = evaluate(data, tmp_path / "whole", 1, [])
    assert whole_preds != preds1  # the tiles were predicted, not the whole image
    # predict --tile on the same json, batch size = the evaluation's: the evaluation's detections
    out = tmp_path / "predict"
    run_ok("predict_retinanet", ["--weights", data["weights"], "--source", data["json"], "--images", data["images"],
                                 "--score_thresh", "0", "--batch_size", "3", "--num_workers", "0", "--no_images",
                                 "--tile_full", "--output_dir", out, *TILE])
    assert json.loads((out / "predictions.json").read_text()) == preds1


@needs_coco_subset
def test_tiled_predict_of_a_folder_and_a_video_is_the_same_on_1_and_2_processes(data, tmp_path):
    pytest.importorskip("av")
    from detlib.data.video import VideoWriter, video_frames

    src = tmp_path / "src"
    src.mkdir()
    for im in data["val"]["images"]:
        shutil.copy(data["images"] / im["file_name"], src / im["file_name"])
    (src / "zz_broken.jpg").write_text("not an image")
    photo = np.asarray(Image.open(data["images"] / data["val"]["images"][0]["file_name"]).convert("RGB"))
    with VideoWriter(str(src / "clip.mp4"), 5) as w:  # 320 x 200 frames: 3 x 2 tiles of 160 px
        for i in range(4):
            w.write(photo[100:300, 16 * i:16 * i + 320])
    frames = src / "frames"  # the decoded frames, lossless, predicted as images beside the video
    frames.mkdir()
    for i, _, rgb in video_frames(str(src / "clip.mp4")):
        Image.fromarray(rgb).save(frames / f"f{i}.png")
    outs = {}
    for n in (1, 2):
        out = tmp_path / f"out{n}"
        args = ["--weights", data["weights"], "--source", src, "--score_thresh", "0", "--batch_size", "3",
                "--num_workers", "0", "--no_images", "--output_dir", out, *TILE]
        log = run_ok("predict_retinanet", args) if n == 1 else forked_ok("predict_retinanet.py", args, 2)
        assert f"in tiles of 160 px overlapping 0.25, {n} process(es)" in log
        outs[n] = json.loads((out / "predictions.json").read_text())
        assert (out / "skipped.txt").read_text().strip() == f"{src / 'zz_broken.jpg'} (unreadable)"
    assert outs[1] == outs[2]
    video = [r for r in outs[1] if r["file_name"] == "clip.mp4"]
    as_images = [r for r in outs[1] if r["file_name"].startswith("frames/")]
    assert {r["frame"] for r in video} == {0, 1, 2, 3} and len(video) == len(as_images)
    key = ("category_id", "bbox", "score")
    for v, im in zip(video, as_images):
        assert im["file_name"] == f"frames/f{v['frame']}.png" and {k: v[k] for k in key} == {k: im[k] for k in key}
    assert max(r["bbox"][0] + r["bbox"][2] for r in video) > 160  # boxes of the second column, in frame pixels


PEAK_RSS = """
import resource, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_rss(weights, image, out) -> int:
    """Peak RSS (bytes) of predict --tile 2048 --tile_overlap 0.5 --batch_size 2 on `image`, in a process of its own."""
    run = subprocess.run([sys.executable, "-c", PEAK_RSS, str(REPO / "scripts" / "predict_retinanet.py"), "--weights",
                          str(weights), "--source", str(image), "--output_dir", str(out), "--tile", "2048",
                          "--tile_overlap", "0.5", "--batch_size", "2", "--num_workers", "0", "--no_images",
                          "--score_thresh", "0.5"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return int(run.stdout.split("PEAK_RSS_KB")[1]) * 1024


def test_a_13500_x_13400_image_is_predicted_with_memory_bounded_by_the_tile_batch(tmp_path):
    """181 M pixels (above PIL's decompression-bomb limit, which --tile lifts): the peak RSS is that of the same run
    on a 2048 px image plus the image held once while it is read (PIL's 4 bytes a pixel and our 3), and at most two
    tile batches more (2 tiles of 2048 px). Cutting all 169 tiles at once would add 2.1 GB; the image as PIL's
    `np.asarray` copies it, 1 GB."""
    big, small = tmp_path / "big.png", tmp_path / "small.png"
    subprocess.run([sys.executable, "-c", f"""
from PIL import Image, ImageDraw
im = Image.new("RGB", (13500, 13400), (90, 120, 80))
for i in range(20):
    ImageDraw.Draw(im).rectangle([600 * i + 100, 500 * i + 50, 600 * i + 140, 500 * i + 90], fill=(250, 20 * i, 30))
im.save({str(big)!r}, compress_level=1)
Image.new("RGB", (2048, 2048), (90, 120, 80)).save({str(small)!r})
"""], check=True, timeout=300)
    weights = write_tiny_detector(tmp_path)
    baseline = peak_rss(weights, small, tmp_path / "small_out")
    peak = peak_rss(weights, big, tmp_path / "big_out")
    pixels, tile_batch = 13500 * 13400, 2 * 2048 * 2048 * 3
    assert peak - baseline < 7 * pixels + 2 * tile_batch, (peak - baseline) / pixels
    assert json.loads((tmp_path / "big_out" / "predictions.json").read_text()) == []  # read, predicted, not skipped
    assert not (tmp_path / "big_out" / "skipped.txt").exists()


# ---- issue 52: the windows' scale; G05: a single window; G03: a grid of absurdly many windows

SMALL_TILE_RUN = ["--backbone", "resnet18", "--fpn_channels", "32", "--head_norm", "none", "--anchor_sizes", "8", "16",
                  "32", "64", "128", "--per_device_batch_size", "4", "--num_workers", "0", "--report_to", "none",
                  "--num_log_images", "0", "--eval_bootstrap", "0", "--lr_scheduler", "constant", "--warmup_steps", "0",
                  "--augmentation", "flip", "--score_thresh", "0", "--detections_per_image", "5"]


def by_hand_at_native_scale(weights, image_path, tile: int, overlap: float, max_detections: int) -> list[tuple]:
    """The image's windows (`tile_grid`) cut and run through the model as they are (no resize), 8 at a time, decoded,
    shifted back, merged, written as results are (`detections_to_coco`): (category id, xywh rounded to 1e-3 px, score
    rounded to 1e-5) in the writer's order."""
    import torch

    from detlib.evaluation import detections_to_coco
    from detlib.inference import load_retinanet
    from detlib.retinanet import anchor_generator_from_config, decode_detections
    from detlib.tiling import merge_detections, tile_grid

    model, config, category_map = load_retinanet(weights)
    anchors = anchor_generator_from_config(config)
    image = torch.from_numpy(np.array(Image.open(image_path).convert("RGB"))).permute(2, 0, 1)
    windows = tile_grid(image.shape[2], image.shape[1], tile, overlap)
    boxes, scores, labels, sources = [], [], [], []
    with torch.no_grad():
        for start in range(0, len(windows), 8):
            part = windows[start:start + 8]
            crops = torch.stack([image[:, y0:y1, x0:x1] for x0, y0, x1, y1 in part])
            out = model(crops.contiguous(memory_format=torch.channels_last))  # as decode_batch passes a CPU batch
            a, counts = anchors(*crops.shape[-2:])
            n = len(part)
            for k, d in enumerate(decode_detections(out["cls_logits"], out["box_deltas"], a, counts,
                                                    torch.tensor([[tile, tile]] * n), torch.ones((n, 2)),
                                                    score_thresh=0.0, max_detections=max_detections).per_image(n)):
                x0, y0 = part[k][:2]
                boxes.append(d["boxes"] + torch.tensor([x0, y0, x0, y0]))
                scores.append(d["scores"])
                labels.append(d["labels"])
                sources.append(torch.full((len(d["scores"]),), start + k))
    merged = merge_detections(torch.cat(boxes), torch.cat(scores), torch.cat(labels), torch.cat(sources),
                              torch.tensor(windows, dtype=torch.float32))
    ids = torch.tensor(category_map.category_ids)
    kept = slice(0, max_detections)  # the merge's order decides which equal scores are kept; the writer ranks them
    return rounded(detections_to_coco(merged["boxes"][kept], merged["scores"][kept], ids[merged["labels"][kept]], 0))


def rounded(predictions: list[dict]) -> list[tuple]:
    return [(p["category_id"], tuple(round(v, 3) for v in p["bbox"]), round(p["score"], 5)) for p in predictions]


def test_a_model_trained_on_tiles_gets_its_windows_at_native_scale(tmp_path):
    """Issue 52: trained with --train_tile 64 --image_size 256 on the built-in small-object set (2 steps), its tiled
    evaluation during training (--tile 64) gives the detections of the same windows run at native scale by hand (not
    enlarged 4x to 256 px); --evaluate_only with --image_size 64 and predict_retinanet.py --tile 64 give the same
    detections, so the same AP. The val set: one 768 x 1024 image of the set (300 windows)."""
    from detlib.data import make_small_objects_coco

    paths = make_small_objects_coco()
    val = json.loads(open(paths["val_annotations"]).read())
    image = val["images"][0]
    assert (image["width"], image["height"]) == (768, 1024)
    val.update(images=[image], annotations=[a for a in val["annotations"] if a["image_id"] == image["id"]])
    (tmp_path / "val.json").write_text(json.dumps(val))
    data = ["--val_images", paths["val_images"], "--val_annotations", tmp_path / "val.json"]
    out = tmp_path / "run"
    log = run_ok("train_retinanet", ["--train_images", paths["train_images"], "--train_annotations",
                                     paths["train_annotations"], *data, *SMALL_TILE_RUN, "--train_tile", "64",
                                     "--image_size", "256", "--tile", "64", "--max_steps", "2", "--epochs", "1",
                                     "--output_dir", out])
    trained = json.loads((out / "predictions_val.json").read_text())
    assert len(trained) == 5
    expected = by_hand_at_native_scale(out / "last", os.path.join(paths["val_images"], image["file_name"]), 64, 0.2, 5)
    assert rounded(trained) == expected
    assert "--tile 64 --tile_overlap 0.2: 300 windows on 1 images, each window at native scale (x1)" in log
    assert json.loads((out / "last" / "model_config.json").read_text())["train_tile"] == 64
    (final,) = [m for m in read_metrics(out) if "AP" in m]
    # --evaluate_only at --image_size 64: the same windows, so the same detections and AP
    run_ok("train_retinanet", [*data, *SMALL_TILE_RUN, "--evaluate_only", out / "last", "--image_size", "64",
                               "--tile", "64", "--output_dir", tmp_path / "eval64"])
    assert rounded(json.loads((tmp_path / "eval64" / "evaluate_only" / "predictions_val.json").read_text())) == expected
    (evaluated,) = read_metrics(tmp_path / "eval64" / "evaluate_only")
    assert final["AP"] >= evaluated["AP"]  # the issue's: not lower than the evaluation at --image_size 64
    assert {k: evaluated[k] for k in STATS} == {k: final[k] for k in STATS}  # the same, since the same windows
    # predict: the same rule
    run_ok("predict_retinanet", ["--weights", out / "last", "--source", tmp_path / "val.json", "--images",
                                 paths["val_images"], "--score_thresh", "0", "--detections_per_image", "5",
                                 "--num_workers", "0", "--no_images", "--tile", "64",
                                 "--output_dir", tmp_path / "pred"])
    assert rounded(json.loads((tmp_path / "pred" / "predictions.json").read_text())) == expected


def test_an_image_that_is_one_tile_gives_its_untiled_detections(tmp_path):
    """G05: a 128 px image predicted whole and with --tile 128 (one window, the image, resized as the whole image is
    to the model's 64 px): the same 114 detections (what the decoder's NMS keeps at --score_thresh 0), none merged
    away (the merge only merges boxes of different windows)."""
    weights = write_tiny_detector(tmp_path)
    source = tmp_path / "src"
    source.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)).save(source / "a.png")
    found = {}
    for name, extra in (("whole", []), ("tiled", ["--tile", "128"])):
        run_ok("predict_retinanet", ["--weights", weights, "--source", source, "--score_thresh", "0",
                                     "--detections_per_image", "300", "--num_workers", "0", "--no_images",
                                     "--output_dir", tmp_path / name, *extra])
        found[name] = json.loads((tmp_path / name / "predictions.json").read_text())
    assert len(found["whole"]) == 114 and found["tiled"] == found["whole"]
