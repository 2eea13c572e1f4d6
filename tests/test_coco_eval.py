"""COCO evaluation: ground truth fed back gives AP 1.0; B06, B07, B08, B09, B11, B13 (de-duplication)."""

import json
import logging

import numpy as np
import pytest
import torch

from detlib.boxes import box_xywh_to_xyxy
from detlib.evaluation.coco import STAT_NAMES, CocoEvaluator, detections_to_coco, evaluate_coco, to_builtin
from detlib.labels import CategoryMap

from conftest import COCO_SUBSET, needs_coco_subset


def _gt_as_detections(gt: dict, category_map: CategoryMap) -> dict[int, list[dict]]:
    """Non-crowd ground truth -> contiguous labels -> our export path, per image."""
    per_image: dict[int, list[dict]] = {im["id"]: [] for im in gt["images"]}
    by_image: dict[int, list[dict]] = {}
    for a in gt["annotations"]:
        if not a.get("iscrowd", 0):
            by_image.setdefault(a["image_id"], []).append(a)
    for iid, anns in by_image.items():
        boxes = box_xywh_to_xyxy(torch.tensor([a["bbox"] for a in anns], dtype=torch.float64)).float()
        labels = torch.tensor([category_map.to_label(a["category_id"]) for a in anns])
        per_image[iid] = detections_to_coco(boxes, torch.ones(len(anns)), category_map.to_category_ids(labels), iid)
    return per_image


@needs_coco_subset
@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_ground_truth_round_trip_gives_ap_1(backend):
    gt = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    cmap = CategoryMap([c["id"] for c in gt["categories"]])
    ev = CocoEvaluator(gt, backend=backend)
    for iid, res in _gt_as_detections(gt, cmap).items():
        ev.add(iid, res)
    stats, summary = ev.evaluate()
    assert list(stats) == list(STAT_NAMES)
    for k in ("AP", "AP50", "AP75", "AR100"):
        assert stats[k] == pytest.approx(1.0, abs=1e-9), k
    assert "Average Precision" in summary


def test_non_contiguous_ids_round_trip_case_b07():
    gt = {"images": [{"id": i, "width": 100, "height": 100} for i in (1, 2, 3)],
          "annotations": [{"id": i, "image_id": i, "category_id": c, "bbox": [10, 10, 30, 40], "area": 1200, "iscrowd": 0}
                          for i, c in ((1, 1), (2, 3), (3, 7))],
          "categories": [{"id": 1}, {"id": 3}, {"id": 7}]}
    cmap = CategoryMap([1, 3, 7])
    results = [r for rs in _gt_as_detections(gt, cmap).values() for r in rs]
    assert sorted(r["category_id"] for r in results) == [1, 3, 7]
    stats, _ = evaluate_coco(gt, results)
    assert stats["AP"] == pytest.approx(1.0)
    # the bug this guards against: contiguous labels exported as category ids
    wrong = [dict(r, category_id=cmap.to_label(r["category_id"])) for r in results]
    assert evaluate_coco(gt, wrong)[0]["AP"] < 0.5


def test_empty_results_give_zeros_and_a_warning_case_b06(caplog):
    gt = {"images": [{"id": 1, "width": 10, "height": 10}, {"id": 2, "width": 10, "height": 10}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5], "area": 25, "iscrowd": 0}],
          "categories": [{"id": 1}]}
    with caplog.at_level(logging.WARNING):
        stats, _ = evaluate_coco(gt, [])
    assert stats == {k: 0.0 for k in STAT_NAMES}
    assert "no detections" in caplog.text


def test_unknown_image_ids_are_listed_case_b08():
    gt = {"images": [{"id": 1001, "width": 10, "height": 10}, {"id": 1002, "width": 10, "height": 10}],
          "annotations": [], "categories": [{"id": 1}]}
    bad = [{"image_id": 0, "category_id": 1, "bbox": [1, 1, 2, 2], "score": 0.5},
           {"image_id": 1, "category_id": 1, "bbox": [1, 1, 2, 2], "score": 0.5}]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        evaluate_coco(gt, bad)


def test_numpy_and_tensor_values_export_case_b09():
    det = {"image_id": np.int64(1), "category_id": np.int64(1), "bbox": np.array([1, 2, 3, 4], np.float32), "score": np.float32(0.9)}
    out = to_builtin(det)
    text = json.dumps(out)
    back = json.loads(text)
    assert type(back["image_id"]) is int and type(back["score"]) is float
    assert back["bbox"] == [1.0, 2.0, 3.0, 4.0] and abs(back["score"] - 0.9) < 1e-6
    assert to_builtin({"x": torch.tensor([1.5, 2.5]), "n": torch.tensor(3)}) == {"x": [1.5, 2.5], "n": 3}
    gt = {"images": [{"id": 1, "width": 10, "height": 10}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 2, 3, 4], "area": 12, "iscrowd": 0}],
          "categories": [{"id": 1}]}
    assert evaluate_coco(gt, [det])[0]["AP"] == pytest.approx(1.0)  # loadRes takes it as is


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_ground_truth_without_info_case_b11(backend):
    gt = {"images": [{"id": 1, "width": 10, "height": 10}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 2, 3, 4], "area": 12, "iscrowd": 0}],
          "categories": [{"id": 1}]}
    stats, _ = evaluate_coco(gt, [{"image_id": 1, "category_id": 1, "bbox": [1, 2, 3, 4], "score": 1.0}], backend=backend)
    assert stats["AP"] == pytest.approx(1.0)
    assert "info" not in gt  # the caller's dict is not modified


@needs_coco_subset
def test_backends_agree_on_jittered_detections():
    gt = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    rng = np.random.RandomState(0)
    results = []
    for a in gt["annotations"]:
        x, y, w, h = a["bbox"]
        results.append({"image_id": a["image_id"], "category_id": a["category_id"],
                        "bbox": [x + rng.uniform(-4, 4), y + rng.uniform(-4, 4), w * rng.uniform(0.8, 1.2), h * rng.uniform(0.8, 1.2)],
                        "score": float(rng.rand())})
    ref, _ = evaluate_coco(gt, results, backend="pycocotools")
    fast, _ = evaluate_coco(gt, results, backend="faster")
    assert 0.2 < ref["AP"] < 0.95
    for k in STAT_NAMES:
        assert fast[k] == pytest.approx(ref[k], abs=1e-6), k


def test_repeated_images_count_once_case_b13():
    # Two "processes": the second one got image 1 again as padding, with the same detections.
    gt = {"images": [{"id": i, "width": 50, "height": 50} for i in (1, 2, 3)],
          "annotations": [{"id": i, "image_id": i, "category_id": 1, "bbox": [5, 5, 20, 20], "area": 400, "iscrowd": 0} for i in (1, 2, 3)],
          "categories": [{"id": 1}]}
    hit = lambda i: [{"image_id": i, "category_id": 1, "bbox": [5, 5, 20, 20], "score": 0.9}]
    miss = lambda i: [{"image_id": i, "category_id": 1, "bbox": [30, 30, 10, 10], "score": 0.8}]
    single = CocoEvaluator(gt, backend="pycocotools")
    for i, r in ((1, hit(1) + miss(1)), (2, hit(2)), (3, miss(3))):
        single.add(i, r)
    ev = CocoEvaluator(gt, backend="pycocotools")
    ev.add(1, hit(1) + miss(1))
    ev.add(2, hit(2))
    ev.add(3, miss(3))
    ev.add(1, hit(1) + miss(1))  # the padding repeat
    assert ev.num_images == 3 and len(ev.results) == 4
    assert ev.evaluate()[0] == single.evaluate()[0]


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_one_summary_per_evaluation_and_no_backend_output(backend, caplog, capsys):
    # faster-coco-eval's COCOeval logs its progress and its own 12-line summary at INFO and pycocotools prints
    # them: with the training script's log line, train.log held the summary twice and ~40 backend lines per run.
    gt = {"images": [{"id": i, "width": 50, "height": 50} for i in (1, 2)],
          "annotations": [{"id": i, "image_id": i, "category_id": 1, "bbox": [5, 5, 20, 20], "area": 400, "iscrowd": 0}
                          for i in (1, 2)],
          "categories": [{"id": 1}]}
    ev = CocoEvaluator(gt, backend=backend)
    ev.add(1, [{"image_id": 1, "category_id": 1, "bbox": [5, 5, 20, 20], "score": 0.9}])
    ev.add(2, [{"image_id": 2, "category_id": 1, "bbox": [30, 30, 10, 10], "score": 0.8}])
    with caplog.at_level(logging.INFO):
        stats, summary = ev.evaluate()
        logging.getLogger("train").info("COCO evaluation on %d images:\n%s", ev.num_images, summary)  # as the script does
    assert stats["AP50"] == pytest.approx(51 / 101)  # precision 1 at the 51 recall points 0.00..0.50 of 101
    info = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.name for r in info] == ["train"]
    assert caplog.text.count("Average Precision  (AP) @[ IoU=0.50      | area=   all | maxDets=100 ]") == 1
    assert capsys.readouterr().out == ""
