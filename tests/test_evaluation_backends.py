"""Issue 29, items 3 and 7: the adopted COCOeval (hotcoco) against pycocotools, the reference, bit for bit; area ranges.

Every case of `benchmarks/coco_eval_cases.py` (crowd, the ignore flag, empty images, images without detections, one
class, ties, > 100 detections, an image subset, other area ranges) through `evaluate_coco(backend="hotcoco")` and
through plain pycocotools: the 12 stats and the precision / recall arrays are equal with `==`. `--area_ranges`
edges give pycocotools' own `params.areaRng` for COCO's defaults, and other edges the stats pycocotools gives with the
same `params.areaRng`.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from detlib.evaluation.coco import (COCO_AREA_EDGES, COCO_AREA_RANGES, STAT_NAMES, CocoEvaluator, _coco_classes,
                                    _results_table, area_ranges_from_edges, evaluate_coco)

from conftest import REPO, needs_coco_subset

sys.path.insert(0, str(REPO / "benchmarks"))
from coco_eval_cases import (SMALL_OBJECT_RANGES, hand_made_cases, model_like_detections, pycocotools_eval,  # noqa: E402
                             real_cases, real_json)


def check_equal(case: dict):
    ref = pycocotools_eval(case["gt"], case["results"], case.get("area_rng"), case.get("img_ids"))
    stats, _, ev = evaluate_coco(case["gt"], case["results"], image_ids=case.get("img_ids"), backend="hotcoco",
                                 return_cocoeval=True, area_ranges=case.get("area_rng"))
    assert hasattr(ev, "tide_errors")  # hotcoco's COCOeval
    assert [stats[k] for k in STAT_NAMES] == [float(v) for v in ref.stats]  # bit for bit
    assert np.array_equal(np.asarray(ev.eval["precision"]), np.asarray(ref.eval["precision"]))
    assert np.array_equal(np.asarray(ev.eval["recall"]), np.asarray(ref.eval["recall"]))
    return stats, ref


@pytest.mark.parametrize("name", sorted(hand_made_cases()))
def test_hotcoco_equals_pycocotools_hand_made(name):
    stats, _ = check_equal(hand_made_cases()[name])
    assert 0 < stats["AP"] < 1  # a case where the matching decides something


@needs_coco_subset
@pytest.mark.parametrize("name", ["real_val", "real_subset_crowd", "real_val_small_object_ranges",
                                  "real_subset_image_subset_no_dets", "real_one_class"])
def test_hotcoco_equals_pycocotools_real(name):
    stats, _ = check_equal(real_cases()[name])
    assert 0.05 < stats["AP"] < 0.9


def test_auto_backend_is_hotcoco():
    assert _coco_classes("auto")[2] == "hotcoco"
    with pytest.raises(ValueError, match="backend must be one of"):
        evaluate_coco({"images": [], "annotations": [], "categories": []}, [], backend="nope")


def test_area_range_edges():
    from pycocotools.cocoeval import Params

    assert area_ranges_from_edges(COCO_AREA_EDGES[:3]) == COCO_AREA_RANGES
    assert area_ranges_from_edges(COCO_AREA_EDGES) == COCO_AREA_RANGES
    assert [list(r) for r in COCO_AREA_RANGES] == Params("bbox").areaRng  # pycocotools' own defaults, exactly
    assert [list(r) for r in area_ranges_from_edges([0, 16, 32, 96])] == SMALL_OBJECT_RANGES
    for bad in ([0, 32], [0, 32, 32], [-1, 32, 96], [0, 32, 96, 1e5, 2e5], [0, float("nan"), 96]):
        with pytest.raises(ValueError):
            area_ranges_from_edges(bad)
    with pytest.raises(ValueError, match="4 \\(lo, hi\\) pairs"):
        CocoEvaluator({"images": [], "annotations": [], "categories": []}, area_ranges=[(0, 1)])


@needs_coco_subset
def test_area_ranges_reach_the_size_stats_only():
    gt = real_json("val")
    results = model_like_detections(gt, seed=7)
    coco, _ = evaluate_coco(gt, results, backend="hotcoco")
    small = area_ranges_from_edges([0, 16, 32, 96])
    ours, _ = evaluate_coco(gt, results, backend="hotcoco", area_ranges=small)
    ref = pycocotools_eval(gt, results, area_rng=small)
    assert [ours[k] for k in STAT_NAMES] == [float(v) for v in ref.stats]
    for k in ("AP", "AP50", "AP75", "AR1", "AR10", "AR100"):  # "all" stays COCO's
        assert ours[k] == coco[k]
    assert ours["APl"] != coco["APl"] and ours["APs"] != coco["APs"]
    ev = CocoEvaluator(gt, backend="pycocotools", area_ranges=small)
    for iid in {im["id"] for im in gt["images"]}:
        ev.add(iid, [r for r in results if r["image_id"] == iid])
    assert ev.evaluate()[0] == ours and ev.num_images_evaluated == len(gt["images"])


def test_results_table_is_exact_and_falls_back():
    results = [{"image_id": 3, "category_id": 7, "bbox": [0.1, 2.0000000001, 3.5, 1e-3], "score": 0.123456789012345}]
    table = _results_table(results)
    assert table.tolist() == [[3.0, 0.1, 2.0000000001, 3.5, 1e-3, 0.123456789012345, 7.0]]
    assert _results_table([{"image_id": "a", "category_id": 1, "bbox": [0, 0, 1, 1], "score": 1.0}]) is None
    assert _results_table([{"image_id": 1, "category_id": 1, "bbox": [0, 0, 1], "score": 1.0}]) is None
    assert _results_table([]).shape == (0, 7)
