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
