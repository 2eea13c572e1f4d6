"""Issue 29, item 6: the ranked list of likely annotation errors (`detlib.evaluation.label_errors`).

A copy of the real subset (130 images, 1,200 boxes) with 5 % of its non-crowd boxes damaged on purpose (a third
each: class swapped to another class of the set, box dropped, box shifted by 40 % of its width and height), and the
detections of a model-like detector on the undamaged truth (fixed seed): 95 % of the boxes found with their own
class (box jittered by 5 %, score 0.5-1.0), 20 % of them also seen as a wrong class (score 0.05-0.45), 5 background
boxes per image (score 0.05-0.4). At least 80 % of the k damaged boxes are in the top 2k entries (a dropped box
counts when a missing_box entry's suggested box overlaps it with IoU >= 0.5). Small cases check each kind by hand.
"""

from __future__ import annotations

import copy
import json
import random
import sys

import numpy as np
import pytest

from detlib.evaluation.label_errors import (KINDS, _iou, _xyxy, find_label_errors, format_label_errors,
                                            load_label_errors, write_label_errors)

from conftest import REPO, needs_coco_subset

sys.path.insert(0, str(REPO / "benchmarks"))
from coco_eval_cases import real_json  # noqa: E402


def damage(gt: dict, frac: float = 0.05, seed: int = 0) -> tuple[dict, dict[int, str]]:
    """A copy of `gt` with `frac` of its non-crowd boxes damaged: {annotation id: "class" | "drop" | "shift"}."""
    rng = random.Random(seed)
    gt = copy.deepcopy(gt)
    boxes = [a for a in gt["annotations"] if not a.get("iscrowd", 0)]
    cats = sorted({a["category_id"] for a in boxes})
    kinds, dropped = {}, set()
    for j, a in enumerate(rng.sample(boxes, round(frac * len(boxes)))):
        kind = ("class", "drop", "shift")[j % 3]
        kinds[a["id"]] = kind
        if kind == "class":
            a["category_id"] = rng.choice([c for c in cats if c != a["category_id"]])
        elif kind == "drop":
            dropped.add(a["id"])
        else:
            x, y, w, h = a["bbox"]
            a["bbox"] = [x + rng.choice((-1, 1)) * 0.4 * w, y + rng.choice((-1, 1)) * 0.4 * h, w, h]
    gt["annotations"] = [a for a in gt["annotations"] if a["id"] not in dropped]
    return gt, kinds


def detector(gt: dict, seed: int = 0, found: float = 0.95, confused: float = 0.2, background: int = 5,
             jitter: float = 0.05) -> list[dict]:
    """Model-like detections of the true boxes of `gt` (see the module docstring)."""
    rng = random.Random(seed)
    cats = sorted({a["category_id"] for a in gt["annotations"]})
    out = []
    for a in sorted(gt["annotations"], key=lambda a: a["id"]):
        if a.get("iscrowd", 0):
            continue
        x, y, w, h = a["bbox"]

        def box():
            return [x + rng.gauss(0, jitter) * w, y + rng.gauss(0, jitter) * h, w * (1 + rng.gauss(0, jitter)),
                    h * (1 + rng.gauss(0, jitter))]

        if rng.random() < found:
            out.append({"image_id": a["image_id"], "category_id": a["category_id"], "bbox": box(),
                        "score": rng.uniform(0.5, 1.0)})
        if rng.random() < confused:
            out.append({"image_id": a["image_id"], "category_id": rng.choice([c for c in cats if c != a["category_id"]]),
                        "bbox": box(), "score": rng.uniform(0.05, 0.45)})
    for im in sorted(gt["images"], key=lambda im: im["id"]):
        W, H = im["width"], im["height"]
        for _ in range(background):
            w, h = W * rng.uniform(0.05, 0.4), H * rng.uniform(0.05, 0.4)
            out.append({"image_id": im["id"], "category_id": rng.choice(cats),
                        "bbox": [rng.random() * (W - w), rng.random() * (H - h), w, h], "score": rng.uniform(0.05, 0.4)})
    return out


def recall_in_top(errors: list[dict], original: dict, kinds: dict[int, str]) -> tuple[float, dict]:
    k = len(kinds)
    by_id = {a["id"]: a for a in original["annotations"]}
    hit = set()
    for e in errors[: 2 * k]:
        aid = e["annotation_id"]
        if aid in kinds and kinds[aid] != "drop":
            hit.add(aid)
        if e["type"] == "missing_box":
            for d, kind in kinds.items():
                a = by_id[d]
                if kind == "drop" and a["image_id"] == e["image_id"] and \
                        _iou(_xyxy([e["suggested_bbox"]]), _xyxy([a["bbox"]]))[0, 0] >= 0.5:
                    hit.add(d)
    return len(hit) / k, {kind: sum(kinds[a] == kind for a in hit) for kind in ("class", "drop", "shift")}


@needs_coco_subset
@pytest.mark.parametrize("seed", [0, 2])
def test_damaged_annotations_rank_high(seed, tmp_path):
    original = real_json("subset")
    damaged, kinds = damage(original, seed=seed)
    assert len(kinds) == 59 and sorted(set(kinds.values())) == ["class", "drop", "shift"]
    errors = find_label_errors(damaged, detector(original, seed=seed))
    recall, per_kind = recall_in_top(errors, original, kinds)
    assert recall >= 0.8, per_kind
    assert all(v >= 10 for v in per_kind.values()), per_kind  # each kind is found, not just the easy ones
    assert [e["rank"] for e in errors] == list(range(1, len(errors) + 1))
    assert all(a["score"] >= b["score"] for a, b in zip(errors, errors[1:]))
    # the undamaged set gives a much shorter list, and what it does list scores low
    clean = find_label_errors(original, detector(original, seed=seed))
    assert sum(e["score"] >= 0.5 for e in clean) < 0.2 * sum(e["score"] >= 0.5 for e in errors)
    path = write_label_errors(str(tmp_path / "label_errors.json"), errors, {"score_thresh": 0.3})
    assert load_label_errors(path) == json.loads(json.dumps(errors))
    assert json.loads(open(path).read())["counts"] == {k: sum(e["type"] == k for e in errors) for k in KINDS}
    assert format_label_errors(errors).count("\n") == 5


def test_each_kind_by_hand():
    gt = {"images": [{"id": 1, "width": 200, "height": 200}],
          "annotations": [{"id": 10, "image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40], "iscrowd": 0},   # right
                          {"id": 11, "image_id": 1, "category_id": 2, "bbox": [100, 10, 40, 40], "iscrowd": 0},  # class
                          {"id": 12, "image_id": 1, "category_id": 1, "bbox": [16, 116, 40, 40], "iscrowd": 0},  # moved
                          {"id": 13, "image_id": 1, "category_id": 1, "bbox": [150, 150, 40, 40], "iscrowd": 1}],
          "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]}
    dets = [{"image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40], "score": 0.9},
            {"image_id": 1, "category_id": 1, "bbox": [100, 10, 40, 40], "score": 0.8},   # says cat where "dog"
            {"image_id": 1, "category_id": 1, "bbox": [0, 100, 40, 40], "score": 0.7},     # IoU 0.22 with box 12
            {"image_id": 1, "category_id": 2, "bbox": [60, 60, 30, 30], "score": 0.6},     # no box there
            {"image_id": 1, "category_id": 1, "bbox": [155, 155, 20, 20], "score": 0.95},  # inside the crowd box
            {"image_id": 1, "category_id": 2, "bbox": [60, 60, 30, 30], "score": 0.2}]     # below score_thresh
    errors = find_label_errors(gt, dets)
    assert [(e["type"], e["annotation_id"], e["suggested_category"]) for e in errors] == [
        ("wrong_class", 11, "cat"), ("badly_placed", 12, "cat"), ("missing_box", None, "dog")]
    assert errors[1]["iou"] == pytest.approx(24 * 24 / (2 * 1600 - 24 * 24))
    assert errors[0]["category"] == "dog" and errors[0]["annotated_bbox"] == [100.0, 10.0, 40.0, 40.0]
    assert find_label_errors(gt, []) == []
    assert np.isclose(find_label_errors(gt, dets, score_thresh=0.0)[-1]["score"], 0.2)
