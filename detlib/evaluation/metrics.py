"""What a COCO evaluation says beyond its 12 stats: per-class AP, PR curves, a detection confusion matrix,
and the plots of them (plus the loss / AP curves of a run drawn from its metrics.jsonl).

Everything per class is read from the accumulated COCOeval object, not recomputed: `coco_eval.eval["precision"]`
is [T, R, K, A, M] = (IoU thresholds 0.50:0.05:0.95, 101 recall thresholds 0:0.01:1, categories in
`params.catIds` order, area ranges all/small/medium/large, maxDets 1/10/100), with -1 where a category has
no ground truth (pycocotools cocoeval.py, COCOeval.accumulate). faster-coco-eval fills the same array, so
both backends give the same numbers. AP of a class is the mean of its [T, R] slice at area "all" and
maxDets 100, exactly as `summarize()` averages over all classes for the overall AP.

Plots are drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch, no
display needed) and written as PNG next to a JSON file with the numbers they show.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Iterable

import numpy as np
import torch
from torchvision.ops import box_iou

from ..boxes import box_ioa, box_xywh_to_xyxy
from ..files import atomic_path, write_json
from ..logtext import EXTREMES, NAME_CHARS, short_name

logger = logging.getLogger(__name__)

# Index of the area range "all" and of maxDets=100 in COCOeval.params (areaRngLbl, maxDets).
AREA_ALL = 0
MAX_DETS_LAST = -1
# Index of IoU 0.5 in params.iouThrs (0.50:0.05:0.95).
IOU50 = 0
BACKGROUND_NAME = "background"
# Class names in the plots, in points (at 100 dpi: 12.5 px): readable at 3 classes and at 80, the figure grows
LABEL_FONTSIZE = 9


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


# ---- plots ---------------------------------------------------------------------------------------------

def _figure(width: float, height: float, margins: tuple[float, float, float, float] = (0.1, 0.1, 0.97, 0.92), dpi: int = 100):
    """A figure on matplotlib's Agg canvas with fixed margins (left, bottom, right, top as figure fractions).

    Fixed margins instead of constrained layout: the layout solver measures every tick label and took a
    third of the plotting time; the plots are written at every evaluation.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    fig.subplots_adjust(*margins)
    return fig


def _save(fig, path: str) -> str:
    # zlib level 1: a third of the default's encoding time for plots of flat colours, files barely larger
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", pil_kwargs={"compress_level": 1})
    return path




def _plot_with_legend_beside(labels: list[str]):
    """(figure, axes) of a 6 x 4 inch plot with room on its right for the legend of `labels`, as wide as its longest
    entry needs; `_save_with_legend_beside` draws the legend there."""
    left, plot_w, legend_w, plot_h = 0.8, 6.0, _text_inches(labels, LABEL_FONTSIZE) + 0.8, 4.0
    W, H = left + plot_w + legend_w, plot_h + 0.9
    fig = _figure(W, H, margins=(left / W, 0.6 / H, (left + plot_w) / W, 1 - 0.3 / H))
    return fig, fig.add_subplot()


def _save_with_legend_beside(fig, ax, path: str) -> str:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=LABEL_FONTSIZE, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return _save(fig, path)


def plot_pr_curves(curves: dict, path: str, num_extremes: int = 3) -> str:
    """PNG of the PR curves of `pr_curves`: the mean over all classes, and the `num_extremes` classes with
    the lowest and the highest AP50 (by the area under their curve), the legend beside the plot (as wide as
    its longest entry needs). Returns `path`."""
    recall = curves["recall"]
    ranked = sorted(curves["per_class"].items(), key=lambda kv: float(np.mean(kv[1])))
    if len(ranked) <= 2 * num_extremes:  # few classes: all of them, no worst / best split
        shown = [(name, p, "-", "") for name, p in ranked]
    else:
        shown = [(name, p, "-", ", best") for name, p in ranked[-num_extremes:][::-1]]
        shown += [(name, p, "--", ", worst") for name, p in ranked[:num_extremes]]
    labels = [f"{name} (AP50 {np.mean(p):.2f}{tag})" for name, p, _, tag in shown]
    labels.append(f"all {len(curves['per_class'])} classes (AP50 {np.mean(curves['all']):.3f})")
    fig, ax = _plot_with_legend_beside(labels)
    for (name, p, ls, tag), label in zip(shown, labels):
        ax.plot(recall, p, lw=1.2, ls=ls, label=label)
    ax.plot(recall, curves["all"], color="black", lw=2.5, label=labels[-1])
    ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1), ylim=(0, 1.02),
           title=f"precision-recall at IoU {curves['iou']:.2f}")
    return _save_with_legend_beside(fig, ax, path)


def plot_f1_curves(best: dict, path: str, num_extremes: int = 3) -> str:
    """PNG of F1 against the score threshold (`best_f1_thresholds`): all classes pooled, and the `num_extremes` classes
    with the lowest and the highest best F1, each with its best threshold marked. Returns `path`."""
    grid = best["curves"]["score_thresh"]
    ranked = sorted(best["per_class"].items(), key=lambda kv: kv[1]["F1"])
    shown = ranked if len(ranked) <= 2 * num_extremes else ranked[-num_extremes:][::-1] + ranked[:num_extremes]
    labels = [f"{name} (F1 {v['F1']:.2f} at {v['score_thresh']:.2f})" if v["score_thresh"] is not None
              else f"{name} (never found)" for name, v in shown]
    a = best["all"]
    labels.append(f"all {len(ranked)} classes pooled" + (f" (F1 {a['F1']:.3f} at {a['score_thresh']:.3f})"
                                                         if a["score_thresh"] is not None else ""))
    fig, ax = _plot_with_legend_beside(labels)
    for (name, v), label in zip(shown, labels):
        (line,) = ax.plot(grid, best["curves"][name], lw=1.2, label=label)
        if v["score_thresh"] is not None:
            ax.plot([v["score_thresh"]], [v["F1"]], "o", color=line.get_color(), ms=4)
    ax.plot(grid, best["curves"]["all"], color="black", lw=2.5, label=labels[-1])
    if a["score_thresh"] is not None:
        ax.plot([a["score_thresh"]], [a["F1"]], "o", color="black", ms=6)
    ax.set(xlabel="score threshold (detections with score >= it)", ylabel="F1", xlim=(0, 1), ylim=(0, 1.02),
           title=f"F1 at IoU {best['iou']:.2f} against the score threshold")
    return _save_with_legend_beside(fig, ax, path)


def _text_inches(texts: Iterable[str], fontsize: float) -> float:
    """Width in inches that the longest of `texts` takes at `fontsize` points in DejaVu Sans (about 0.6 em
    per character: an estimate that errs wide, so names are never cut)."""
    return max((len(t) for t in texts), default=0) * 0.6 * fontsize / 72


def plot_confusion_matrix(cm: dict, path: str, max_classes: int = 80) -> str:
    """PNG heat map of `detection_confusion_matrix` (counts). Only classes that occur as ground truth or
    prediction are shown, the `max_classes` most frequent of them, plus background. The figure grows with the
    number of classes shown (cells of 0.3 in, names at LABEL_FONTSIZE pt), so 3 classes and 80 read alike."""
    m = np.asarray(cm["matrix"])
    K = m.shape[0] - 1
    used = m[:K].sum(1) + m[:, :K].sum(0)
    keep = [i for i in np.argsort(-used, kind="stable")[:max_classes] if used[i] > 0]
    keep = sorted(keep) + [K]
    title = (f"detections with score >= {cm['score_thresh']:g}\nmatched to ground truth at IoU >= {cm['iou_thresh']:g}"
             + (f"\n{len(keep) - 1} of {K} classes (those that occur)" if len(keep) - 1 < K else ""))
    return _plot_matrix(m[np.ix_(keep, keep)], [cm["names"][i] for i in keep], title, path)


def plot_class_confusion(names: list[str], matrix: list[list[int]], path: str, max_classes: int = 30) -> str:
    """PNG heat map of a classifier's confusion matrix ([K, K] counts, rows = true class): all classes up to
    `max_classes`, beyond that the `max_classes` with the most errors (off-diagonal counts in their row and
    column; the title says how many of how many are shown). Returns `path`."""
    m = np.asarray(matrix, dtype=np.int64).reshape(len(names), len(names))
    keep = list(range(len(names)))
    title = "classifier confusion (rows: true class)"
    if len(names) > max_classes:
        errors = m.sum(0) + m.sum(1) - 2 * np.diag(m)
        keep = sorted(np.argsort(-errors, kind="stable")[:max_classes].tolist())
        title += f"\nthe {max_classes} of {len(names)} classes with the most errors"
    return _plot_matrix(m[np.ix_(keep, keep)], [short_name(names[i], 24) for i in keep], title, path)


def _plot_matrix(sub: np.ndarray, names: list[str], title: str, path: str) -> str:
    """A [n, n] count matrix as a PNG heat map that grows with n (cells of 0.3 in beyond 12 classes, names at
    LABEL_FONTSIZE pt), rows = ground truth. Returns `path`."""
    n = len(names)
    cell = 0.3 if n > 12 else 0.6  # inches
    names_in = _text_inches(names, LABEL_FONTSIZE) + 0.55  # tick labels + axis label
    grid = max(cell * n, 2.0)
    left, bottom, top, right = names_in, names_in, 0.9, 1.0  # right: the colour bar
    fig = _figure(left + grid + right, bottom + grid + top, dpi=100)
    W, H = left + grid + right, bottom + grid + top
    ax = fig.add_axes((left / W, bottom / H, grid / W, grid / H))
    im = ax.imshow(np.where(sub > 0, sub, np.nan), cmap="Blues", vmin=0, vmax=max(1, sub.max()), aspect="auto")
    big = sub.max()
    for i in range(n):
        for j in range(n):
            if sub[i, j]:
                ax.text(j, i, str(sub[i, j]), ha="center", va="center", fontsize=8 if n > 12 else 11,
                        color="white" if sub[i, j] > 0.6 * big else "black")
    ax.set_xticks(range(n), names, rotation=90, fontsize=LABEL_FONTSIZE)
    ax.set_yticks(range(n), names, fontsize=LABEL_FONTSIZE)
    ax.set_xticks(np.arange(n + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(n + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="0.88", lw=0.5)  # cell borders: a row can be followed across 80 columns
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("predicted", fontsize=10)
    ax.set_ylabel("ground truth", fontsize=10)
    ax.set_title(title, fontsize=10)
    cax = fig.add_axes(((left + grid + 0.25) / W, bottom / H, 0.2 / W, grid / H))
    fig.colorbar(im, cax=cax)
    cax.tick_params(labelsize=9)
    return _save(fig, path)


def plot_per_class_ap(per_class: dict[str, dict[str, float]], path: str) -> str:
    """PNG bar chart of per-class AP and AP50, one row per class sorted by AP (the best on top), each row with
    its numbers and ground-truth count. The figure is 0.32 in per class tall, and as wide as the longest
    name needs at LABEL_FONTSIZE pt, so 3 classes and 80 read alike."""
    items = sorted(per_class.items(), key=lambda kv: kv[1]["AP"])
    n = max(1, len(items))
    names_in = _text_inches([k for k, _ in items], LABEL_FONTSIZE) + 0.15
    numbers_in = _text_inches(["AP 0.000  AP50 0.000  gt 00000"], LABEL_FONTSIZE) + 0.15
    plot_w, plot_h = 4.5, 0.32 * n
    top, bottom = 0.75, 0.6
    W, H = names_in + plot_w + numbers_in, top + plot_h + bottom
    fig = _figure(W, H, dpi=100)
    ax = fig.add_axes((names_in / W, bottom / H, plot_w / W, plot_h / H))
    y = np.arange(len(items))
    ax.barh(y + 0.2, [v["AP50"] for _, v in items], height=0.4, label="AP50 (IoU 0.5)", color="tab:orange")
    ax.barh(y - 0.2, [v["AP"] for _, v in items], height=0.4, label="AP (IoU 0.50:0.95)", color="tab:blue")
    ax.set_yticks(y, [k for k, _ in items], fontsize=LABEL_FONTSIZE)
    ax.set_ylim(-0.6, len(items) - 0.4)
    for i, (_, v) in enumerate(items):
        ax.text(1.02, i, f"AP {v['AP']:.3f}  AP50 {v['AP50']:.3f}  gt {v['num_gt']}", transform=ax.get_yaxis_transform(),
                va="center", fontsize=LABEL_FONTSIZE, family="DejaVu Sans Mono")
    ax.set_xlim(0, 1)
    ax.set_xlabel("average precision", fontsize=10)
    ax.tick_params(axis="x", labelsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"per-class AP ({len(per_class)} classes with ground truth)", fontsize=11, pad=26)
    ax.legend(fontsize=9, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, frameon=False, borderaxespad=0.2)
    return _save(fig, path)


def write_evaluation_plots(plots_dir: str, epoch: int | None, coco_eval, coco_gt: dict, results: list[dict],
                           confusion_score_thresh: float = 0.25, image_ids: Iterable[int] | None = None,
                           best_f1: dict | None = None) -> dict:
    """Per-class AP, PR curves and the confusion matrix of one evaluation, as PNG + JSON.

    Files go to `plots_dir/epoch_NNNN/` (`plots_dir/final/` when `epoch` is None): `per_class_ap.{png,json}`,
    `pr_curve.{png,json}`, `confusion_matrix.{png,json}`, with `best_f1` `f1_curve.{png,json}`.

    Args:
        coco_eval: the accumulated COCOeval of the evaluation, or None (no detection at all: only the
            confusion matrix is written, and per-class AP is 0 for every class with ground truth).
        coco_gt: the ground-truth COCO dict; results: the COCO results evaluated.
        image_ids: the evaluated images (default: `coco_eval.params.imgIds`, else all of `coco_gt`).
        best_f1: `best_f1_thresholds` of the evaluation, with its curves: also `f1_curve.{png,json}`.
    Returns:
        {"per_class": per_class_ap(...), "files": {name: path}}.
    """
    folder = os.path.join(plots_dir, "final" if epoch is None else f"epoch_{int(epoch):04d}")
    files = {}
    per_class = {}
    if image_ids is None and coco_eval is not None:
        image_ids = coco_eval.params.imgIds
    if coco_eval is not None:
        per_class = per_class_ap(coco_eval)
        files["per_class_ap_json"] = write_json(per_class, os.path.join(folder, "per_class_ap.json"))
        files["per_class_ap"] = plot_per_class_ap(per_class, os.path.join(folder, "per_class_ap.png"))
        curves = pr_curves(coco_eval)
        files["pr_curve_json"] = write_json(curves, os.path.join(folder, "pr_curve.json"))
        files["pr_curve"] = plot_pr_curves(curves, os.path.join(folder, "pr_curve.png"))
    else:  # nothing detected: every class with ground truth scores 0 (not "no class")
        per_class = per_class_without_detections(coco_gt, image_ids)
    cm = detection_confusion_matrix(coco_gt, results, score_thresh=confusion_score_thresh, image_ids=image_ids)
    files["confusion_matrix_json"] = write_json(cm, os.path.join(folder, "confusion_matrix.json"))
    files["confusion_matrix"] = plot_confusion_matrix(cm, os.path.join(folder, "confusion_matrix.png"))
    if best_f1 is not None and best_f1.get("curves"):
        files["f1_curve_json"] = write_json(best_f1, os.path.join(folder, "f1_curve.json"))
        files["f1_curve"] = plot_f1_curves(best_f1, os.path.join(folder, "f1_curve.png"))
    return {"per_class": per_class, "files": files}


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


def plot_training_curves(metrics_path: str, path: str, losses: tuple[str, ...] = ("loss", "cls_loss", "box_loss"),
                         aps: tuple[str, ...] = ("AP", "AP50")) -> str | None:
    """PNG of the loss curves (training lines) and AP curves (evaluation lines) of a metrics.jsonl, over the
    optimizer step. Works without any tracker. Returns `path`, or None when the file has nothing to draw."""
    if not os.path.isfile(metrics_path):
        return None
    fig = training_curves_figure(read_metrics_jsonl(metrics_path), losses, aps)
    return _save(fig, path) if fig is not None else None


# A series with at most this many points is drawn with markers: a run of one step or one epoch has a point or two,
# which a line alone does not show.
MARKERS_UP_TO = 30


def training_curves_figure(rows: list[dict], losses: tuple[str, ...] = ("loss", "cls_loss", "box_loss"),
                           aps: tuple[str, ...] = ("AP", "AP50")):
    """The figure of `plot_training_curves` from metrics.jsonl's rows (`read_metrics_jsonl`), or None when they hold
    nothing to draw: both panels over the same steps, from 0 to the last (a run of any length, 1 step included),
    AP from 0 to 1."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    def number(r, k):
        return isinstance(r.get(k), (int, float)) and math.isfinite(r[k])

    train = [r for r in rows if number(r, "step") and any(number(r, k) for k in losses)]
    ev = [r for r in rows if number(r, "step") and any(number(r, k) for k in aps)]
    if not train and not ev:
        return None
    fig = _figure(10, 4, margins=(0.08, 0.13, 0.98, 0.9))
    fig.subplots_adjust(wspace=0.25)
    ax_l, ax_a = fig.subplots(1, 2)
    for ax, keys, rows_, ok in ((ax_l, losses, train, lambda v: True), (ax_a, aps, ev, lambda v: v >= 0)):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows_ if number(r, k) and ok(r[k])]
            if pts:  # clip_on False: a marker on the axes' edge (the last step, AP 1) is drawn whole
                ax.plot(*zip(*pts), label=k, lw=1.2, clip_on=False,
                        **({"marker": "o", "ms": 4} if len(pts) <= MARKERS_UP_TO else {}))
    ax_l.set(xlabel="step", ylabel="loss", title="training loss")
    if any(number(r, "loss") and r["loss"] > 0 for r in train):
        ax_l.set_yscale("log")
        # plain numbers (0.6, not 6x10^-1, whose width pushed the axis label out of the figure); the minor ticks
        # labelled only when the loss spans less than a decade, where the decades alone leave one label or none
        drawn = [r[k] for r in train for k in losses if number(r, k) and r[k] > 0]
        lo, hi = min(drawn), max(drawn)
        ax_l.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax_l.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if hi < 10 * lo else ""))
    ax_a.set(xlabel="step", ylabel="average precision", title="validation", ylim=(0, 1))
    last = max(r["step"] for r in train + ev)
    for ax in (ax_l, ax_a):
        ax.set_xlim(0, max(last, 1) * 1.03)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # steps: no 0.2 on a 1-step run
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=LABEL_FONTSIZE, loc="best")
    return fig


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
    from ..weights import WeightsFileError, weights_path

    path = os.path.join(os.path.dirname(weights_path(weights)), SCORE_THRESHOLDS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {SCORE_THRESHOLDS} beside the weights ({path}): it is written into best/ and last/ "
                                "by the training run's evaluations; give a number instead")
    try:
        with open(path) as f:
            data = json.load(f)
        pooled = data["all"]["score_thresh"]
        per_class = {int(v["category_id"]): float(v["score_thresh"]) for v in data["per_class"].values()
                     if v.get("score_thresh") is not None}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsFileError(f"{path} is damaged ({type(e).__name__}: {e})") from None
    if pooled is None:  # best_f1_thresholds found no true detection at any score: F1 is 0 everywhere
        raise WeightsFileError(f"no threshold was found in {path}: the evaluation of these weights had no true "
                               "detection (IoU 0.5), so no score maximises F1; give --score_thresh a number")
    return per_class, float(pooled), path
