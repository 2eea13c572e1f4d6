"""Sample images with boxes: the fixed sample (1 and 2 processes), EXIF orientation of boxes against PIL, the
drawn files, and a wandb offline + TensorBoard run of `log_evaluation_extras` read back from the files written."""

import json
import runpy
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from detlib.evaluation.coco import evaluate_coco
from detlib.evaluation.drawing import (GT_COLOR, OUTLINE_COLOR, SAMPLE_DISPLAY_SIZE, class_color, exif_transpose_boxes,
                                       sample_detections, sample_layout, select_sample_ids)

from conftest import COCO_SUBSET, REPO, needs_coco_subset
from helpers import forked_ok


def test_sample_ids_fixed_by_seed_not_by_order():
    ids = list(range(100, 160))
    a = select_sample_ids(ids, 16, seed=0)
    assert len(a) == 16 and a == sorted(a) and set(a) <= set(ids)
    assert select_sample_ids(reversed(ids), 16, seed=0) == a
    assert select_sample_ids(ids, 16, seed=1) != a
    assert select_sample_ids(ids[:5], 16) == ids[:5]


@needs_coco_subset
@pytest.mark.slow
def test_sample_ids_same_on_one_and_two_processes(tmp_path, monkeypatch):
    picks = {}
    probe = REPO / "tests" / "probes" / "sample_ids_probe.py"
    for n in (1, 2):  # the probe in this process as 1 process, forked on 2
        out = tmp_path / f"ids{n}.json"
        args = [str(COCO_SUBSET / "annotations" / "instances_val.json"), str(out)]
        if n == 1:
            monkeypatch.setattr(sys, "argv", [str(probe), *args])
            runpy.run_path(str(probe), run_name="__main__")
        else:
            forked_ok(probe, args)
        data = json.loads(out.read_text())
        assert data["num_processes"] == n
        picks[n] = [r["picks"] for r in data["ranks"]]
    first = picks[1][0][0]
    assert len(first) == 16
    for per_rank in picks.values():
        for p in per_rank:
            assert p == [first, first]  # every rank, both evaluations


def _exif_file(path, orientation: int):
    """A 60x40 black PNG with a red box at x 10..25, y 5..30, tagged with an EXIF orientation."""
    arr = np.zeros((40, 60, 3), dtype=np.uint8)
    arr[5:30, 10:25, 0] = 255
    img = Image.fromarray(arr)
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.save(path, exif=exif)
    return torch.tensor([[10.0, 5.0, 25.0, 30.0]])


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_box_mapping_matches_pil_exif_transpose(tmp_path, orientation):
    box = _exif_file(tmp_path / "a.png", orientation)
    with Image.open(tmp_path / "a.png") as im:
        upright = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    ys, xs = np.nonzero(upright[..., 0] > 127)
    expected = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]  # pixel edges
    got = exif_transpose_boxes(box, orientation, 60, 40)
    assert got.tolist() == [[float(v) for v in expected]]


def test_sample_drawn_upright_with_boxes_on_the_objects(tmp_path):
    """An image stored sideways (EXIF 6): the drawn sample is upright (40 x 60 -> 60 x 40 turned), the
    ground-truth box (green) and the detection (its class colour) lie on the red object."""
    (tmp_path / "img").mkdir()
    _exif_file(tmp_path / "img" / "a.png", 6)
    gt = {"images": [{"id": 7, "file_name": "a.png", "width": 60, "height": 40}],
          "annotations": [{"id": 1, "image_id": 7, "category_id": 3, "bbox": [10, 5, 15, 25], "iscrowd": 0}],
          "categories": [{"id": 3, "name": "red thing"}]}
    res = [{"image_id": 7, "category_id": 3, "bbox": [10, 5, 15, 25], "score": 0.9},
           {"image_id": 7, "category_id": 3, "bbox": [40, 5, 10, 10], "score": 0.1}]  # below the display threshold
    (s,) = sample_detections(gt, res, str(tmp_path / "img"), [7], display_thresh=0.3)
    assert s["image"].shape == (3, 60, 40)  # EXIF 6: rotated 90 degrees clockwise
    # (x, y) -> (H - y, x) for ROTATE_270: x 10..35, y 10..25
    assert s["boxes"].tolist() == [[10.0, 10.0, 35.0, 25.0]] and s["gt_boxes"].tolist() == [[10.0, 10.0, 35.0, 25.0]]
    assert s["scores"].tolist() == pytest.approx([0.9])
    assert int(s["image"][0, 20, 20]) == 255  # the red object is inside the upright box
    assert tuple(s["drawn"].shape[-2:]) == sample_layout(60, 40)["size"]


def _rgb(drawn: torch.Tensor) -> np.ndarray:
    return drawn.permute(1, 2, 0).numpy().astype(int)


def test_sample_of_a_small_image_drawn_large_with_labels_outside_and_boxes_visible_on_green(tmp_path):
    """A 160 px built-in-sized image with a green square: the drawn sample is 640 px, the detection's label
    sits on a tag above the box (the object's pixels keep their colour), and both boxes stay visible on the
    green: the ground truth dashed white over black, the detection in its class colour over black."""
    (tmp_path / "img").mkdir()
    arr = np.full((160, 160, 3), 90, dtype=np.uint8)
    arr[40:120, 40:120] = (0, 255, 0)  # a green square, as the built-in set draws them
    Image.fromarray(arr).save(tmp_path / "img" / "a.png")
    gt = {"images": [{"id": 1, "file_name": "a.png", "width": 160, "height": 160}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 2, "bbox": [40, 40, 80, 80], "iscrowd": 0}],
          "categories": [{"id": 2, "name": "square"}]}
    res = [{"image_id": 1, "category_id": 2, "bbox": [44, 44, 72, 72], "score": 0.87}]
    (s,) = sample_detections(gt, res, str(tmp_path / "img"), [1])
    lay = sample_layout(160, 160)
    assert lay["scale"] == SAMPLE_DISPLAY_SIZE / 160 and lay["font_size"] >= 16
    drawn = _rgb(s["drawn"])
    assert drawn.shape[:2] == lay["size"] == (640 + lay["top"] + lay["bottom"], 640)
    k, top = lay["scale"], lay["top"]
    # inside the detection, away from its edges, the green object is as it was: no label over it
    x1, y1, x2, y2 = (round(v * k) for v in (44, 44, 116, 116))
    inner = drawn[y1 + top + 8:y2 + top - 8, x1 + 8:x2 - 8]
    assert (np.abs(inner - np.array([0, 255, 0])) <= 2).all()
    # the label tag (class colour) sits just above the box, over the grey background
    tag = drawn[y1 + top - lay["font_size"]:y1 + top - 3, x1 + 2:x1 + 20]
    assert (np.abs(tag - np.array(class_color(2))).max(-1) <= 2).mean() > 0.5
    # the detection's left edge: its class colour with a black line on the green side
    row = drawn[(y1 + y2) // 2 + top, x1 - 2:x1 + lay["line_width"] + 2]
    colors = {tuple(c) for c in row.tolist()}
    assert class_color(2) in colors and OUTLINE_COLOR in colors
    # the ground truth's top edge, on the green square: white dashes and black between them
    gx1, gy1, gx2 = round(40 * k), round(40 * k) + top, round(120 * k)
    edge = drawn[gy1:gy1 + lay["line_width"] + 2, gx1 + 20:gx2 - 20].reshape(-1, 3)
    edge_colors = {tuple(c) for c in edge.tolist()}
    assert GT_COLOR in edge_colors and OUTLINE_COLOR in edge_colors


@needs_coco_subset
def test_log_evaluation_extras_wandb_offline_and_tensorboard_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from detlib.evaluation.report import log_evaluation_extras

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    gt = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    # 6 images; detections: the ground truth, shifted for "person" so that class is half found
    keep = sorted(im["id"] for im in gt["images"])[:6]
    gt["images"] = [im for im in gt["images"] if im["id"] in keep]
    gt["annotations"] = [a for a in gt["annotations"] if a["image_id"] in keep]
    res = []
    for a in gt["annotations"]:
        x, y, w, h = a["bbox"]
        res.append({"image_id": a["image_id"], "category_id": a["category_id"],
                    "bbox": [x + (w if a["category_id"] == 1 and a["id"] % 2 else 0), y, w, h], "score": 0.9})
    stats, _, coco_eval = evaluate_coco(gt, res, return_cocoeval=True)
    out = tmp_path / "run"
    acc = Accelerator(cpu=True, log_with=["wandb", "tensorboard"],
                      project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "tensorboard")))
    acc.init_trackers("detlib-test", config={"x": 1}, init_kwargs={"wandb": {"dir": str(out)}})
    (out / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"epoch": 0, "step": 1, "loss": 2.0, "cls_loss": 1.2, "box_loss": 0.8},
        {"epoch": 0, "step": 2, "loss": 1.5, "cls_loss": 1.0, "box_loss": 0.5},
        {"epoch": 0, "step": 2, **stats}]) + "\n")
    per_class = log_evaluation_extras(acc, str(out), 0, 2, gt, res, coco_eval, str(COCO_SUBSET / "images"),
                                      num_log_images=4)
    acc.end_training()

    # per-class AP: every class found exactly except person
    assert per_class["person"]["AP"] < 0.9 and all(v["AP"] == pytest.approx(1.0) for k, v in per_class.items() if k != "person")
    n_person = sum(1 for a in gt["annotations"] if a["category_id"] == 1 and not a["iscrowd"])
    assert per_class["person"]["num_gt"] == n_person
    # files
    written = json.loads((out / "plots" / "epoch_0000" / "per_class_ap.json").read_text())
    assert written == json.loads(json.dumps(per_class))
    for f in ("pr_curve.png", "confusion_matrix.png", "per_class_ap.png"):
        assert (out / "plots" / "epoch_0000" / f).stat().st_size > 5000
    assert (out / "plots" / "training_curves.png").is_file()
    ids = select_sample_ids(keep, 4)
    drawn = sorted(p.name for p in (out / "samples" / "epoch_0000").iterdir())
    assert drawn == [f"{i:012d}.png" for i in ids]
    # a detection is drawn in its class colour on the left edge of the box it found (PNG: exact colours)
    a = next(a for a in gt["annotations"] if a["image_id"] == ids[0] and a["bbox"][3] > 20 and a["category_id"] != 1)
    info = next(im for im in gt["images"] if im["id"] == ids[0])
    lay = sample_layout(info["height"], info["width"])
    x, y, w, h = (v * lay["scale"] for v in a["bbox"])
    sample = np.asarray(Image.open(out / "samples" / "epoch_0000" / f"{ids[0]:012d}.png"))
    assert sample.shape[:2] == lay["size"]
    row = sample[round(y + h / 2) + lay["top"], round(x) - 1:round(x) + lay["line_width"] + 1].astype(int).tolist()
    assert [tuple(c) for c in row] == [OUTLINE_COLOR] + [class_color(a["category_id"])] * lay["line_width"] + [OUTLINE_COLOR]

    # wandb offline run: the sample images with their boxes, and the per-class table
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    media = run_dir / "files" / "media"
    sample_files = sorted(p.name for p in (media / "images" / "samples").iterdir())
    assert len(sample_files) == 4 and all(n.endswith(".jpg") for n in sample_files)
    for i in ids:  # the predictions (with scores) and the ground truth of each sample image
        boxes = [json.loads(p.read_text()) for p in (media / "metadata" / "boxes2D" / "samples").glob(f"{i}_*.boxes2D.json")]
        n_gt = sum(1 for b in gt["annotations"] if b["image_id"] == i)
        if n_gt:  # (wandb stores identical box sets once: an image without any box has one empty file)
            preds = [b for b in boxes if b["box_data"] and "scores" in b["box_data"][0]]
            truth = [b for b in boxes if b["box_data"] and "scores" not in b["box_data"][0]]
            assert len(preds[0]["box_data"]) == len(truth[0]["box_data"]) == n_gt  # one detection per gt box, all >= 0.3
            assert preds[0]["class_labels"]["1"] == "person"
            assert {d["box_caption"].rsplit(" ", 1)[-1] for d in preds[0]["box_data"]} == {"0.90"}
    (table_file,) = (media / "table" / "per_class").glob("table_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["class", "AP", "AP50", "num_gt"]
    assert {r[0]: r[1] for r in table["data"]} == pytest.approx({k: v["AP"] for k, v in per_class.items()})
    assert (run_dir / f"run-{run_dir.name.split('-')[-1]}.wandb").stat().st_size > 0

    # TensorBoard: per-class scalars, the table as text, the drawn samples and the plots as images
    (ev_file,) = [p for p in (out / "tensorboard").rglob("events.out.tfevents.*") if p.stat().st_size > 1000]
    acc_tb = EventAccumulator(str(ev_file), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc_tb.Reload()
    tags = acc_tb.Tags()
    assert acc_tb.Scalars("per_class/AP/person")[0].value == pytest.approx(per_class["person"]["AP"])
    assert acc_tb.Scalars("per_class/AP50/person")[0].step == 2
    assert f"samples/{ids[0]}" in tags["images"] and "plots/pr_curve" in tags["images"]
    img = acc_tb.Images(f"samples/{ids[0]}")[0]
    assert (img.height, img.width) == lay["size"] and img.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
    assert "per_class/table/text_summary" in tags["tensors"]


@needs_coco_subset
def test_log_evaluation_extras_without_trackers_or_detections(tmp_path):
    """No tracker and an evaluation that detected nothing (no COCOeval object): the files are still written."""
    from accelerate import Accelerator

    from detlib.evaluation.report import log_evaluation_extras

    gt = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    per_class = log_evaluation_extras(Accelerator(cpu=True), str(tmp_path), None, 0, gt, [], None, str(COCO_SUBSET / "images"),
                                      num_log_images=2)
    cm = json.loads((tmp_path / "plots" / "final" / "confusion_matrix.json").read_text())
    n_gt = sum(1 for a in gt["annotations"] if not a["iscrowd"])
    # nothing detected: every class with ground truth scores 0 (absent only when it has no ground truth)
    with_gt = {c["name"] for c in gt["categories"] if any(a["category_id"] == c["id"] and not a["iscrowd"]
                                                         for a in gt["annotations"])}
    assert set(per_class) == with_gt and all(v["AP"] == v["AP50"] == 0.0 for v in per_class.values())
    assert sum(v["num_gt"] for v in per_class.values()) == n_gt
    assert sum(row[-1] for row in cm["matrix"]) == n_gt  # every box missed
    assert len(list((tmp_path / "samples" / "final").iterdir())) == 2


def test_labels_of_neighbouring_boxes_do_not_cover_each_other():
    """Two detections side by side: the higher score's tag goes above its box, the other's, which would cover it
    there, below its own box (outside it too); predict's drawing keeps the image size."""
    from detlib.evaluation.drawing import draw_detections

    image = torch.full((3, 200, 200), 90, dtype=torch.uint8)
    boxes = torch.tensor([[20.0, 60.0, 100.0, 120.0], [30.0, 62.0, 110.0, 122.0]])
    colors = [class_color(1), class_color(2)]
    drawn = _rgb(draw_detections(image, boxes, ["first 0.90", "second 0.80"], colors))
    assert drawn.shape[:2] == (200, 200)

    def share(region, color):
        return (np.abs(region - np.array(color)).max(-1) <= 2).mean()

    assert share(drawn[48:58, 22:60], colors[0]) > 0.5  # above the first box
    assert share(drawn[48:58, 102:112], colors[1]) == 0  # nothing of the second tag above, beside the first's
    assert share(drawn[125:135, 32:70], colors[1]) > 0.5  # below the second box


def test_tags_of_many_boxes_in_one_place_never_cover_each_other():
    """Eight detections on the same spot of a 640 px sample (a young model's stack): every tag finds its own place
    within the image, none over another (the tags above and below the box are taken after two)."""
    from detlib.evaluation.drawing import _place_label

    taken: list = []
    for i in range(8):
        _place_label([200.0, 300.0 + i, 400.0, 420.0 + i], 110, 22, 640, 640, 0, taken)
    assert all(0 <= x1 and 0 <= y1 and x2 <= 640 and y2 <= 640 for x1, y1, x2, y2 in taken)
    assert not any(a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
                   for i, a in enumerate(taken) for b in taken[i + 1:]), taken


def test_sample_has_no_empty_band_above_the_image(tmp_path):
    """The drawn sample starts with the image's own first row (no dark strip), its legend band below it."""
    from detlib.evaluation.drawing import BAND_COLOR

    (tmp_path / "img").mkdir()
    Image.fromarray(np.full((128, 128, 3), 90, dtype=np.uint8)).save(tmp_path / "img" / "a.png")
    gt = {"images": [{"id": 1, "file_name": "a.png", "width": 128, "height": 128}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [40, 40, 40, 40], "iscrowd": 0}],
          "categories": [{"id": 1, "name": "square"}]}
    res = [{"image_id": 1, "category_id": 1, "bbox": [42, 42, 40, 40], "score": 0.9}]
    (s,) = sample_detections(gt, res, str(tmp_path / "img"), [1])
    drawn = _rgb(s["drawn"])
    assert (np.abs(drawn[:10] - 90) <= 2).all()  # the image itself from the first row
    assert drawn.shape[0] == SAMPLE_DISPLAY_SIZE + sample_layout(128, 128)["bottom"]
    assert (drawn[-1] == np.array(BAND_COLOR)).mean() > 0.9  # the legend band


def test_predict_draws_a_thumbnail_enlarged_and_a_photo_at_its_own_size():
    """A 128 px image (the built-in set's) is drawn 4x, pixels repeated, its boxes scaled with it, so 13 px labels
    do not cover its objects; 257 px and more keep their size."""
    from detlib.evaluation.drawing import draw_detections, drawing_scale

    assert [drawing_scale(128, 128), drawing_scale(96, 200), drawing_scale(256, 100), drawing_scale(257, 300),
            drawing_scale(480, 640)] == [4, 3, 2, 1, 1]
    image = torch.zeros((3, 128, 96), dtype=torch.uint8)
    image[:, 40:80, 30:60] = 200  # a grey object
    box = torch.tensor([[30.0, 40.0, 60.0, 80.0]])
    drawn = _rgb(draw_detections(image, box, ["square 0.95"], [(0, 255, 0)], scale=4))
    assert drawn.shape[:2] == (512, 384)
    assert (drawn[200:300, 150:220] == 200).all()  # the object's inside, repeated pixels, no label over it
    assert (np.abs(drawn[160:320, 120:122] - np.array([0, 255, 0])).max(-1) <= 2).mean() > 0.9  # its box at 4x
    assert (drawn[0:100, 300:384] == 0).all()  # far from the box: the image itself
