"""The COCO evaluation cases every evaluator must score exactly as pycocotools does.

Shared by `benchmarks/coco_evaluators.py` (equality and time of each evaluator) and
`tests/test_evaluation_backends.py` (the adopted one against pycocotools). Each case is a ground truth (COCO dict),
detections (COCO results: xywh pixels, category id, score) and optionally COCOeval parameters (`area_rng`: the
four [min, max] area ranges in px^2, all / small / medium / large; `img_ids`: the images evaluated).

The cases cover what the tests of `detlib.evaluation` hold: crowd regions (with detections on them), the
`ignore` flag (pycocotools overrides it with `iscrowd`), images without ground truth, images without
detections, categories without ground truth or without detections, one class, non-contiguous category ids,
more than 100 detections per image (the maxDets cut), tied scores, an image subset and other area ranges.
The real cases use the shared COCO subset (`../shared/data/coco_subset`, `DETLIB_COCO_SUBSET`); without it only
the hand-made cases are built. A run with no detection at all is not a case: `evaluate_coco` answers it
without any evaluator (all 12 stats 0.0), since pycocotools' `loadRes` cannot take an empty list.

Detections are model-like: each ground-truth box jittered (normal, 8 % of its size), the right class 80 % of the
time, plus background boxes of random classes, scores higher for the jittered copies; fixed seeds.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COCO_SUBSET = os.environ.get("DETLIB_COCO_SUBSET", os.path.join(os.path.dirname(REPO), "shared", "data", "coco_subset"))
# Area edges in px (sqrt of the area) of a non-COCO range: small < 16^2, medium < 32^2, large < 96^2.
SMALL_OBJECT_RANGES = [[0.0, 1e10], [0.0, 16.0 ** 2], [16.0 ** 2, 32.0 ** 2], [32.0 ** 2, 96.0 ** 2]]


def real_json(split: str) -> dict | None:
    """The shared subset's `instances_{split}.json` (train, val, subset), None when it is absent."""
    path = os.path.join(COCO_SUBSET, "annotations", f"instances_{split}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def model_like_detections(gt: dict, seed: int = 0, false_per_image: int = 20, jitter: float = 0.08,
                          right_class: float = 0.8, on_crowd: bool = True, categories: list[int] | None = None) -> list[dict]:
    """Detections that look like a detector's on `gt` (see the module docstring); `categories`: the classes the
    wrong-class and background detections draw from (default: all of `gt`'s)."""
    rng = random.Random(seed)
    cat_ids = categories or [c["id"] for c in gt["categories"]]
    size = {im["id"]: (im["width"], im["height"]) for im in gt["images"]}
    out = []
    for a in sorted(gt["annotations"], key=lambda a: a["id"]):
        if a.get("iscrowd", 0) and not on_crowd:
            continue
        x, y, w, h = a["bbox"]
        cat = a["category_id"] if rng.random() < right_class else rng.choice(cat_ids)
        out.append({"image_id": a["image_id"], "category_id": cat,
                    "bbox": [x + rng.gauss(0, jitter) * w, y + rng.gauss(0, jitter) * h,
                             max(1.0, w * (1 + rng.gauss(0, jitter))), max(1.0, h * (1 + rng.gauss(0, jitter)))],
                    "score": 0.3 + 0.7 * rng.random()})
    for im in sorted(gt["images"], key=lambda im: im["id"]):
        W, H = size[im["id"]]
        for _ in range(false_per_image):
            w, h = W * (0.02 + 0.4 * rng.random()), H * (0.02 + 0.4 * rng.random())
            out.append({"image_id": im["id"], "category_id": rng.choice(cat_ids),
                        "bbox": [rng.random() * (W - w), rng.random() * (H - h), w, h], "score": 0.6 * rng.random()})
    return out


def _image(i: int, w: int = 100, h: int = 80) -> dict:
    return {"id": i, "width": w, "height": h, "file_name": f"{i}.jpg"}


def _ann(i: int, image_id: int, cat: int, bbox: list[float], **kw) -> dict:
    return {"id": i, "image_id": image_id, "category_id": cat, "bbox": bbox, "area": bbox[2] * bbox[3],
            "iscrowd": 0, **kw}


def hand_made_cases() -> dict[str, dict]:
    """Small cases built by hand: one class, empty images, the ignore flag, ties, the maxDets cut."""
    cases = {}
    # one class; image 3 has no ground truth (its detection is a false positive); image 4 no detection
    gt = {"images": [_image(i) for i in (1, 2, 3, 4)],
          "annotations": [_ann(1, 1, 1, [10, 10, 30, 20]), _ann(2, 1, 1, [50, 40, 20, 20]), _ann(3, 2, 1, [5, 5, 60, 50]),
                          _ann(4, 4, 1, [20, 20, 10, 10])],
          "categories": [{"id": 1, "name": "thing"}]}
    dets = [{"image_id": 1, "category_id": 1, "bbox": [11, 10, 30, 21], "score": 0.9},
            {"image_id": 1, "category_id": 1, "bbox": [52, 41, 20, 18], "score": 0.4},
            {"image_id": 1, "category_id": 1, "bbox": [0, 0, 8, 8], "score": 0.7},
            {"image_id": 2, "category_id": 1, "bbox": [8, 5, 55, 50], "score": 0.8},
            {"image_id": 3, "category_id": 1, "bbox": [30, 30, 20, 20], "score": 0.95}]
    cases["one_class_empty_images"] = {"gt": gt, "results": dets}
    # the `ignore` flag beside `iscrowd` (pycocotools sets ignore = iscrowd, whatever the json says), crowd regions; a
    # true `ignore` is written with iscrowd 1, as the data check reads it (F07), so plain pycocotools reads it alike
    gt2 = copy.deepcopy(gt)
    gt2["annotations"][1].update(ignore=1, iscrowd=1)
    gt2["annotations"].append(_ann(5, 2, 1, [60, 50, 35, 25], iscrowd=1))
    gt2["annotations"][2]["ignore"] = 0
    dets2 = dets + [{"image_id": 2, "category_id": 1, "bbox": [62, 52, 10, 10], "score": 0.85},
                    {"image_id": 2, "category_id": 1, "bbox": [61, 51, 30, 20], "score": 0.6}]
    cases["ignore_flag_and_crowd"] = {"gt": gt2, "results": dets2}
    # tied scores across images and classes, non-contiguous category ids, a category with no detection
    gt3 = {"images": [_image(i) for i in (7, 9, 11)],
           "annotations": [_ann(1, 7, 3, [10, 10, 20, 20]), _ann(2, 9, 3, [30, 30, 20, 20]), _ann(3, 9, 8, [5, 5, 10, 40]),
                           _ann(4, 11, 8, [50, 10, 40, 40]), _ann(5, 11, 12, [0, 0, 5, 5])],
           "categories": [{"id": 3, "name": "a"}, {"id": 8, "name": "b"}, {"id": 12, "name": "c"}, {"id": 20, "name": "d"}]}
    dets3 = [{"image_id": 7, "category_id": 3, "bbox": [10, 10, 20, 20], "score": 0.5},
             {"image_id": 9, "category_id": 3, "bbox": [60, 30, 20, 20], "score": 0.5},
             {"image_id": 9, "category_id": 3, "bbox": [30, 31, 20, 20], "score": 0.5},
             {"image_id": 9, "category_id": 8, "bbox": [5, 6, 10, 38], "score": 0.5},
             {"image_id": 11, "category_id": 8, "bbox": [52, 10, 40, 38], "score": 0.25},
             {"image_id": 11, "category_id": 20, "bbox": [52, 10, 40, 38], "score": 0.9}]
    cases["ties_noncontiguous_ids"] = {"gt": gt3, "results": dets3}
    # 150 detections on one image: the 100-detection cut decides which count
    rng = random.Random(3)
    gt4 = {"images": [_image(1, 200, 200)],
           "annotations": [_ann(i + 1, 1, 1 + i % 2, [10.0 * (i % 15), 12.0 * (i // 15), 9, 11]) for i in range(120)],
           "categories": [{"id": 1, "name": "x"}, {"id": 2, "name": "y"}]}
    dets4 = [{"image_id": 1, "category_id": 1 + i % 2,
              "bbox": [10.0 * (i % 15) + rng.uniform(-2, 2), 12.0 * (i // 15) + rng.uniform(-2, 2), 9, 11],
              "score": rng.random()} for i in range(150)]
    cases["over_100_detections"] = {"gt": gt4, "results": dets4}
    return cases


def real_cases() -> dict[str, dict]:
    """Cases on the shared COCO subset (empty when it is absent)."""
    val, subset = real_json("val"), real_json("subset")
    if val is None or subset is None:
        return {}
    cases = {"real_val": {"gt": val, "results": model_like_detections(val, seed=0)},
             "real_subset_crowd": {"gt": subset, "results": model_like_detections(subset, seed=1, on_crowd=True)},
             "real_val_small_object_ranges": {"gt": val, "results": model_like_detections(val, seed=2),
                                              "area_rng": SMALL_OBJECT_RANGES}}
    # an image subset, half the images with no detection at all
    ids = sorted(im["id"] for im in subset["images"])
    keep = set(ids[::2])
    dets = [r for r in model_like_detections(subset, seed=4) if r["image_id"] in keep]
    cases["real_subset_image_subset_no_dets"] = {"gt": subset, "results": dets, "img_ids": ids[: 3 * len(ids) // 4]}
    # one class of the real data: persons only
    person = copy.deepcopy(subset)
    person["annotations"] = [a for a in person["annotations"] if a["category_id"] == 1]
    person["categories"] = [c for c in person["categories"] if c["id"] == 1]
    cases["real_one_class"] = {"gt": person, "results": model_like_detections(person, seed=5)}
    return cases


def pycocotools_eval(gt: dict, results: list[dict], area_rng=None, img_ids=None):
    """The reference: plain pycocotools as a user calls it (annotation ids renumbered 1..N as evaluate_coco does),
    evaluated, accumulated and summarized; `gt` and `results` are not modified."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt = copy.deepcopy(gt)
    gt.setdefault("info", {})
    gt.setdefault("licenses", [])
    for k, a in enumerate(gt["annotations"], 1):
        a["id"] = k
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = gt
        coco_gt.createIndex()
        ev = COCOeval(coco_gt, coco_gt.loadRes(copy.deepcopy(results)), "bbox")
        if img_ids is not None:
            ev.params.imgIds = sorted(img_ids)
        if area_rng is not None:
            ev.params.areaRng = [list(r) for r in area_rng]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


def all_cases() -> dict[str, dict]:
    """Every case: name -> {"gt", "results", optional "area_rng", "img_ids"}."""
    return {**hand_made_cases(), **real_cases()}
