"""What a COCO evaluation says beyond its 12 stats: per-class AP, PR curves, a detection confusion matrix, the
best-F1 score thresholds (and their file beside the weights), and the lines of a run's metrics.jsonl. Their plots
are `detlib.evaluation.plots`.

Everything per class is read from the accumulated COCOeval object, not recomputed: `coco_eval.eval["precision"]`
is [T, R, K, A, M] = (IoU thresholds 0.50:0.05:0.95, 101 recall thresholds 0:0.01:1, categories in
`params.catIds` order, area ranges all/small/medium/large, maxDets 1/10/100), with -1 where a category has
no ground truth (pycocotools cocoeval.py, COCOeval.accumulate). faster-coco-eval fills the same array, so
both backends give the same numbers. AP of a class is the mean of its [T, R] slice at area "all" and
maxDets 100, exactly as `summarize()` averages over all classes for the overall AP.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np
import torch
from torchvision.ops import box_iou

from ..boxes import box_ioa, box_xywh_to_xyxy
from ..files import write_json
from ..logtext import EXTREMES, NAME_CHARS, short_name

# Index of the area range "all" and of maxDets=100 in COCOeval.params (areaRngLbl, maxDets).
AREA_ALL = 0
MAX_DETS_LAST = -1
# Index of IoU 0.5 in params.iouThrs (0.50:0.05:0.95).
IOU50 = 0
BACKGROUND_NAME = "background"


def _category_names(coco_eval) -> list[str]:
    """Names of `params.catIds`, in that order; a name shared by two categories gets its id appended."""
    cats = coco_eval.cocoGt.cats
    names = [str(cats[c].get("name", c)) for c in coco_eval.params.catIds]
    return [f"{n} ({c})" if names.count(n) > 1 else n for n, c in zip(names, coco_eval.params.catIds)]


def _mean_valid(x: np.ndarray) -> float:
    """Mean of the entries > -1 (COCOeval's "no ground truth" marker), -1 when there is none."""
    v = x[x > -1]
    return float(v.mean()) if v.size else -1.0


def per_class_ap(coco_eval) -> dict[str, dict[str, float]]:
    """AP (IoU 0.50:0.95) and AP50 of every category that has ground truth in the evaluated images.

    Args:
        coco_eval: a pycocotools `COCOeval` or faster-coco-eval `COCOeval_faster` after `evaluate()` and
            `accumulate()` (`CocoEvaluator.coco_eval`), bbox type.
    Returns:
        {category name: {"AP": float, "AP50": float, "num_gt": int}} in `params.catIds` order. A category
        without ground truth (its precision slice is all -1) is absent, not 0; `num_gt` counts its non-crowd
        boxes in `params.imgIds`.
    Raises:
        ValueError: if `coco_eval` has not been accumulated.
    """
    if not getattr(coco_eval, "eval", None) or "precision" not in coco_eval.eval:
        raise ValueError("per_class_ap needs a COCOeval after evaluate() and accumulate()")
    precision = np.asarray(coco_eval.eval["precision"])  # [T, R, K, A, M]
    num_gt = _num_gt(coco_eval)
    out = {}
    for k, (cat, name) in enumerate(zip(coco_eval.params.catIds, _category_names(coco_eval))):
        p = precision[:, :, k, AREA_ALL, MAX_DETS_LAST]  # [T, R]
        if not (p > -1).any():
            continue
        out[name] = {"AP": _mean_valid(p), "AP50": _mean_valid(p[IOU50]), "num_gt": num_gt.get(cat, 0)}
    return out


def per_class_without_detections(coco_gt: dict, image_ids: Iterable[int] | None = None) -> dict[str, dict[str, float]]:
    """Per-class AP when nothing at all was detected: 0 for every category with (non-crowd) ground truth in the
    evaluated images, in the same form as `per_class_ap`; categories without ground truth stay absent."""
    ids = set(image_ids) if image_ids is not None else None
    counts: dict[int, int] = {}
    for a in coco_gt["annotations"]:
        if not a.get("iscrowd", 0) and (ids is None or a["image_id"] in ids):
            counts[a["category_id"]] = counts.get(a["category_id"], 0) + 1
    return {str(c.get("name", c["id"])): {"AP": 0.0, "AP50": 0.0, "num_gt": counts[c["id"]]}
            for c in coco_gt["categories"] if c["id"] in counts}


def _num_gt(coco_eval) -> dict[int, int]:
    img_ids = set(coco_eval.params.imgIds)
    counts: dict[int, int] = {}
    for a in coco_eval.cocoGt.anns.values():
        if a["image_id"] in img_ids and not a.get("iscrowd", 0):
            counts[a["category_id"]] = counts.get(a["category_id"], 0) + 1
    return counts


def format_per_class(per_class: dict[str, dict[str, float]], max_rows: int = 4 * EXTREMES,
                     full_table: str | None = None) -> str:
    """A text table for train.log, sorted by AP, the worst first: every class up to `max_rows` classes, beyond
    that the `2 * EXTREMES` worst and best with a line saying how many are left out and where the whole
    table is (`full_table`, e.g. plots/epoch_NNNN/per_class_ap.json). At most `max_rows + 2` lines whatever the
    number of classes, rows of ~64 characters (names cut to `logtext.NAME_CHARS`)."""
    if not per_class:
        return "(no class with ground truth)"
    width = min(NAME_CHARS, max(12, max(len(n) for n in per_class)))
    ranked = sorted(per_class.items(), key=lambda kv: kv[1]["AP"])
    lines = [f"{'class':<{width}} {'AP':>6} {'AP50':>6} {'#gt':>5}"]

    def row(name, v):
        return f"{short_name(name, width):<{width}} {v['AP']:6.3f} {v['AP50']:6.3f} {v['num_gt']:5d}"

    if len(ranked) <= max_rows:
        return "\n".join(lines + [row(*kv) for kv in ranked])
    k = 2 * EXTREMES
    lines += [row(*kv) for kv in ranked[:k]]
    mean = float(np.mean([v["AP"] for _, v in ranked[k:-k]]))
    lines.append(f"... {len(ranked) - 2 * k} classes between (mean AP {mean:.3f})"
                 + (f"; all {len(ranked)}: {full_table}" if full_table else ""))
    return "\n".join(lines + [row(*kv) for kv in ranked[-k:]])


def pr_curves(coco_eval, iou_index: int = IOU50) -> dict:
    """Interpolated precision-recall curves at one IoU threshold (IoU 0.5 by default), area "all", 100 dets.

    Returns:
        {"iou": float, "recall": [R] list (0, 0.01, ..., 1), "all": [R] mean precision over the classes with
        ground truth, "per_class": {name: [R] precision}} (classes without ground truth absent). The area
        under each curve, averaged as COCO does, is that class's AP50.
    """
    precision = np.asarray(coco_eval.eval["precision"])[iou_index, :, :, AREA_ALL, MAX_DETS_LAST]  # [R, K]
    names = _category_names(coco_eval)
    valid = (precision > -1).any(axis=0)
    per_class = {names[k]: precision[:, k].tolist() for k in range(len(names)) if valid[k]}
    mean = precision[:, valid].mean(axis=1) if valid.any() else np.zeros(precision.shape[0])
    return {"iou": float(coco_eval.params.iouThrs[iou_index]), "recall": [float(r) for r in coco_eval.params.recThrs],
            "all": mean.tolist(), "per_class": per_class}


def detection_confusion_matrix(coco_gt: dict, results: list[dict], score_thresh: float = 0.25, iou_thresh: float = 0.5,
                               image_ids: Iterable[int] | None = None) -> dict:
    """An IoU-matched confusion matrix of detections against ground truth, with a background row and column.

    Per image, detections with score >= `score_thresh` are matched one-to-one to non-crowd ground-truth boxes
    regardless of class, greedily by decreasing IoU, pairs with IoU >= `iou_thresh` only (as YOLOv5's
    `ConfusionMatrix`). A matched pair counts at [gt class, predicted class], an unmatched ground-truth box at
    [gt class, background] (missed), an unmatched detection at [background, predicted class] (false alarm),
    except one lying mostly inside a crowd region (IoA >= `iou_thresh`), which COCO ignores too.

    Args:
        coco_gt: ground truth as a COCO-format dict (`bbox` xywh pixels, `category_id`, `iscrowd`).
        results: COCO results (`image_id`, `category_id`, `bbox` xywh pixels, `score`).
        score_thresh, iou_thresh: as above.
        image_ids: the images to count (default: those of `coco_gt`).
    Returns:
        {"names": [K + 1] category names in sorted-id order then "background", "category_ids": [K],
        "matrix": [K + 1, K + 1] int list, rows = ground truth, columns = prediction, "score_thresh",
        "iou_thresh"}.
    """
    cats = sorted(coco_gt["categories"], key=lambda c: c["id"])
    index = {c["id"]: i for i, c in enumerate(cats)}
    K = len(cats)
    ids = {int(i) for i in (image_ids if image_ids is not None else (im["id"] for im in coco_gt["images"]))}
    gt_by_image: dict[int, list[dict]] = {i: [] for i in ids}
    for a in coco_gt["annotations"]:
        if a["image_id"] in gt_by_image:
            gt_by_image[a["image_id"]].append(a)
    dt_by_image: dict[int, list[dict]] = {i: [] for i in ids}
    for r in results:
        if r["image_id"] in dt_by_image and r["score"] >= score_thresh and r["category_id"] in index:
            dt_by_image[r["image_id"]].append(r)
    m = np.zeros((K + 1, K + 1), dtype=np.int64)
    for iid in sorted(ids):
        gts = [a for a in gt_by_image[iid] if not a.get("iscrowd", 0)]
        crowd = [a for a in gt_by_image[iid] if a.get("iscrowd", 0)]
        dts = dt_by_image[iid]
        g_lab = [index[a["category_id"]] for a in gts]
        d_lab = [index[r["category_id"]] for r in dts]
        g_box = _xyxy([a["bbox"] for a in gts])
        d_box = _xyxy([r["bbox"] for r in dts])
        g_used, d_used = set(), set()
        if gts and dts:
            iou = box_iou(g_box, d_box)  # [G, D]
            gi, di = torch.nonzero(iou >= iou_thresh, as_tuple=True)
            # stable sort keeps ties in (gt, detection) order, so the count does not depend on the torch build
            order = torch.argsort(iou[gi, di], descending=True, stable=True)
            for g, d in zip(gi[order].tolist(), di[order].tolist()):
                if g in g_used or d in d_used:
                    continue
                g_used.add(g)
                d_used.add(d)
                m[g_lab[g], d_lab[d]] += 1
        for g, lab in enumerate(g_lab):
            if g not in g_used:
                m[lab, K] += 1
        in_crowd = (box_ioa(d_box, _xyxy([a["bbox"] for a in crowd])).amax(dim=1) >= iou_thresh).tolist() \
            if crowd and dts else [False] * len(dts)
        for d, lab in enumerate(d_lab):
            if d not in d_used and not in_crowd[d]:
                m[K, lab] += 1
    return {"names": [str(c.get("name", c["id"])) for c in cats] + [BACKGROUND_NAME],
            "category_ids": [int(c["id"]) for c in cats], "matrix": m.tolist(),
            "score_thresh": float(score_thresh), "iou_thresh": float(iou_thresh)}


def _xyxy(xywh: list) -> torch.Tensor:
    return box_xywh_to_xyxy(torch.tensor(xywh, dtype=torch.float64).reshape(-1, 4))


# ---- the score threshold a user can use

F1_GRID = 101  # score thresholds 0, 0.01, ..., 1 of the F1 curves


def _match_image(gts: list[dict], dts: list[dict], iou_thresh: float) -> list[tuple[float, bool, bool]]:
    """COCO's matching of one image and category (pycocotools COCOeval.evaluateImg, one IoU threshold, area "all"):
    detections in decreasing score order each take the unmatched ground-truth box of highest IoU >= the threshold,
    non-crowd boxes before crowd ones (a crowd box may take any number; IoU against a crowd box is the
    intersection over the detection's area). Returns (score, matched, ignored) per detection; a detection matched
    to a crowd box is ignored, as COCO ignores it."""
    gts = sorted(gts, key=lambda a: bool(a.get("iscrowd", 0)))  # stable: COCO's order, non-crowd first
    crowd = [bool(a.get("iscrowd", 0)) for a in gts]
    if gts and dts:
        g = _xyxy([a["bbox"] for a in gts])
        d = _xyxy([r["bbox"] for r in dts])
        ious = torch.where(torch.tensor(crowd)[None, :], box_ioa(d, g), box_iou(d, g)).tolist()  # [D, G]
    used = [False] * len(gts)
    out = []
    for i, r in enumerate(dts):
        best, m = min(iou_thresh, 1 - 1e-10), -1
        for j in range(len(gts)):
            if used[j] and not crowd[j]:
                continue
            if m > -1 and not crowd[m] and crowd[j]:
                break
            if ious[i][j] < best:
                continue
            best, m = ious[i][j], j
        if m > -1:
            used[m] = True
        out.append((float(r["score"]), m > -1, m > -1 and crowd[m]))
    return out


def _best_f1(scores: np.ndarray, tp: np.ndarray, num_gt: int) -> dict:
    """The best F1 over "keep detections with score >= t" of one set of (score, true positive) detections.

    Only the last detection of a run of equal scores is a threshold one can set; the highest threshold wins a tie.
    Returns {"score_thresh" (None when nothing is found), "F1", "precision", "recall", "num_gt", "curve": [F1_GRID]
    F1 at the thresholds 0..1}."""
    order = np.argsort(-scores, kind="mergesort")
    scores, tp = scores[order], tp[order]
    ctp = np.cumsum(tp)
    n = np.arange(1, len(scores) + 1)
    ends = np.r_[scores[1:] != scores[:-1], True] if len(scores) else np.zeros(0, dtype=bool)
    precision = ctp / np.maximum(n, 1)
    recall = ctp / max(num_gt, 1)
    f1 = np.where(precision + recall > 0, 2 * precision * recall / np.maximum(precision + recall, 1e-12), 0.0)
    grid = np.linspace(0, 1, F1_GRID)
    kept = np.searchsorted(-scores, -grid, side="right")  # detections with score >= t
    gtp = np.where(kept > 0, ctp[np.maximum(kept - 1, 0)] if len(scores) else 0, 0)
    gp, gr = gtp / np.maximum(kept, 1), gtp / max(num_gt, 1)
    curve = np.where(gp + gr > 0, 2 * gp * gr / np.maximum(gp + gr, 1e-12), 0.0)
    cand = np.flatnonzero(ends & (ctp > 0))
    if not len(cand) or num_gt == 0:
        return {"score_thresh": None, "F1": 0.0, "precision": 0.0, "recall": 0.0, "num_gt": int(num_gt),
                "curve": curve.tolist()}
    k = cand[np.argmax(f1[cand])]  # the first maximum in decreasing score: the highest threshold
    return {"score_thresh": float(scores[k]), "F1": float(f1[k]), "precision": float(precision[k]),
            "recall": float(recall[k]), "num_gt": int(num_gt), "curve": curve.tolist()}


def best_f1_thresholds(coco_gt: dict, results: list[dict], image_ids: Iterable[int] | None = None,
                       iou_thresh: float = 0.5, max_dets: int = 100) -> dict:
    """Per class, the score threshold that maximises F1 at IoU `iou_thresh`, with the F1, precision and recall there:
    the threshold to use a model with (COCO's AP averages over every threshold and tells none).

    Detections are matched to ground truth as COCOeval does at that IoU (`_match_image`: per image and class, the
    `max_dets` highest scores, crowd boxes ignored both ways), so precision and recall are the points of COCO's own
    PR curve before its interpolation. "all" pools the detections and boxes of every class (one threshold for a
    model used without per-class thresholds).

    Args:
        coco_gt: the ground truth, a COCO dict (`bbox` xywh pixels, `category_id`, `iscrowd`).
        results: COCO results (`image_id` as in `coco_gt`, `category_id`, `bbox` xywh pixels, `score`).
        image_ids: the evaluated images (default: all of `coco_gt`).
    Returns:
        {"iou": float, "all": {...}, "per_class": {name: {"category_id", "score_thresh", "F1", "precision",
        "recall", "num_gt"}}, "curves": {"score_thresh": [F1_GRID], "all": [F1_GRID], name: [F1_GRID]}}; a class
        with ground truth but no true detection has score_thresh None and F1 0; classes without (non-crowd)
        ground truth are absent, as in `per_class_ap`. `score_thresh` keeps detections with score >= it.
    """
    ids = {int(i) for i in (image_ids if image_ids is not None else (im["id"] for im in coco_gt["images"]))}
    cats = sorted(coco_gt["categories"], key=lambda c: c["id"])
    names = [str(c.get("name", c["id"])) for c in cats]
    names = [f"{n} ({c['id']})" if names.count(n) > 1 else n for n, c in zip(names, cats)]
    gt: dict[tuple[int, int], list[dict]] = {}
    for a in coco_gt["annotations"]:
        if a["image_id"] in ids:
            gt.setdefault((a["image_id"], a["category_id"]), []).append(a)
    dt: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        if r["image_id"] in ids:
            dt.setdefault((r["image_id"], r["category_id"]), []).append(r)
    per_cat: dict[int, list[tuple[float, bool, bool]]] = {c["id"]: [] for c in cats}
    for key in gt.keys() | dt.keys():
        if key[1] not in per_cat:
            continue
        dts = sorted(dt.get(key, []), key=lambda r: -r["score"])[:max_dets]  # stable, as COCO's mergesort
        per_cat[key[1]] += _match_image(gt.get(key, []), dts, iou_thresh)
    num_gt = {c["id"]: 0 for c in cats}
    for (_, cid), anns in gt.items():
        if cid in num_gt:
            num_gt[cid] += sum(not a.get("iscrowd", 0) for a in anns)

    def arrays(matches):
        kept = [(s, t) for s, t, ignored in matches if not ignored]
        return np.array([s for s, _ in kept], dtype=np.float64), np.array([t for _, t in kept], dtype=bool)

    out = {"iou": float(iou_thresh), "per_class": {}, "curves": {"score_thresh": np.linspace(0, 1, F1_GRID).tolist()}}
    for c, name in zip(cats, names):
        if num_gt[c["id"]] == 0:
            continue
        best = _best_f1(*arrays(per_cat[c["id"]]), num_gt[c["id"]])
        out["curves"][name] = best.pop("curve")
        out["per_class"][name] = {"category_id": int(c["id"]), **best}
    pooled = _best_f1(*arrays([m for c in cats if num_gt[c["id"]] for m in per_cat[c["id"]]]), sum(num_gt.values()))
    out["curves"]["all"] = pooled.pop("curve")
    out["all"] = pooled
    return out


def format_best_f1(best: dict) -> str:
    """One line: the pooled best-F1 threshold and the spread of the per-class ones."""
    a = best["all"]
    if a["score_thresh"] is None:
        return f"best-F1 score threshold (IoU {best['iou']:g}): none (no true detection)"
    found = [v["score_thresh"] for v in best["per_class"].values() if v["score_thresh"] is not None]
    spread = f"; per class {min(found):.3f} .. {max(found):.3f} ({len(found)} of {len(best['per_class'])} classes)" \
        if found else ""
    return (f"best-F1 score threshold (IoU {best['iou']:g}): {a['score_thresh']:.3f} for all classes together (F1 "
            f"{a['F1']:.3f}, precision {a['precision']:.3f}, recall {a['recall']:.3f}){spread}")


def read_metrics_jsonl(path: str) -> list[dict]:
    """The lines of a metrics.jsonl as dicts; "nan" / "inf" strings (how MetricsLogger writes them) become
    floats, and a line cut short by a killed run is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.append({k: (float(v) if v in ("nan", "inf", "-inf") else v) for k, v in row.items()})
    return rows


# ---- the best-F1 thresholds beside a weights folder (predict's --score_thresh best_f1)

SCORE_THRESHOLDS = "score_thresholds.json"


def write_score_thresholds(folder: str, best_f1: dict, evaluation: dict) -> str:
    """`folder/score_thresholds.json`: `best_f1` (`best_f1_thresholds`, without its curves) and the epoch and step of
    the `evaluation` (a metrics.jsonl line) it comes from. Returns the path."""
    out = {k: v for k, v in best_f1.items() if k != "curves"}
    out.update(epoch=evaluation.get("epoch"), step=evaluation.get("step"))
    return write_json(out, os.path.join(folder, SCORE_THRESHOLDS), indent=1)


def read_score_thresholds(weights: str) -> tuple[dict[int, float], float, str]:
    """The best-F1 thresholds beside the weights of `weights` (`detlib.weights.weights_path`): ({category id:
    threshold} of the classes that have one, the pooled threshold for the others, the file).
    Raises:
        FileNotFoundError: no score_thresholds.json there (an older run, or weights never evaluated), naming it.
        WeightsFileError: the file does not parse, or holds no threshold (its evaluation had no true detection).
    """
    from ..weights import WeightsFileError, read_weights_json, weights_path

    path = os.path.join(os.path.dirname(weights_path(weights)), SCORE_THRESHOLDS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {SCORE_THRESHOLDS} beside the weights ({path}): it is written into best/ and last/ "
                                "by the training run's evaluations; give a number instead")
    data = read_weights_json(path)  # WeightsFileError: it does not read or parse
    try:
        pooled = data["all"]["score_thresh"]
        per_class = {int(v["category_id"]): float(v["score_thresh"]) for v in data["per_class"].values()
                     if v.get("score_thresh") is not None}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsFileError(f"{path} is damaged ({type(e).__name__}: {e})") from None
    if pooled is None:  # best_f1_thresholds found no true detection at any score: F1 is 0 everywhere
        raise WeightsFileError(f"no threshold was found in {path}: the evaluation of these weights had no true "
                               "detection (IoU 0.5), so no score maximises F1; give --score_thresh a number")
    return per_class, float(pooled), path
