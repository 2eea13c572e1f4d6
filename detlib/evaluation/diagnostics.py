"""Why an AP is what it is: the TIDE error breakdown, calibration, and bootstrap intervals, from one COCOeval.

All of it is hotcoco's (https://github.com/derekallman/hotcoco, MIT), run on the hotcoco COCOeval that
`detlib.evaluation.coco.evaluate_coco` returns (its matching is pycocotools', bit for bit: tests/test_evaluation_backends.py);
`hotcoco_evaluation` builds one when the evaluation ran on another backend. Checked against independent code in
tests/test_evaluation_diagnostics.py:

* `error_breakdown`: TIDE (Bolya et al., "TIDE: A General Toolbox for Identifying Object Detection Errors",
  ECCV 2020), at IoU 0.5 for matches and 0.1 for background: every false positive and missed box gets one of six
  types, and dAP is how much AP50 rises when the errors of that type alone are fixed. Against `tidecv` (its
  reference code on PyPI): the same counts and dAP within 1e-4 on the real subset's val set and on the subset with
  its crowd boxes left out. Two deliberate differences: tidecv averages AP over every class that has detections
  (a class with detections but no ground truth counts 0; COCO and hotcoco leave such classes out, so dAPs are
  comparable with AP50), and tidecv ignores crowd regions when typing an error where hotcoco lets a crowd box be the
  "localisation" target of a detection overlapping it by 0.1-0.5 (one detection of 2,857 on the real subset).
* `calibration`: expected calibration error (Guo et al., "On Calibration of Modern Neural Networks", ICML 2017) of
  the detection scores against "is a true positive at IoU 0.5" (COCO's matching, area all, 100 detections per image
  and class, detections COCO ignores left out), in 10 equal-width score bins: ECE = sum_b n_b / N |acc_b - conf_b|.
  Equal to the same sum over pycocotools' own `evalImgs` (to 1e-12).
* `bootstrap_interval` and `compare_evaluations`: image bootstrap (images drawn with replacement, the same draw for
  both runs of a comparison: a paired bootstrap), percentile intervals, a fixed seed so the numbers repeat.

Each function returns plain dicts (JSON-ready) and raises ValueError on an evaluation that was not accumulated.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings

import numpy as np

logger = logging.getLogger(__name__)

# TIDE's six error types: hotcoco's keys -> the names in metrics.jsonl, the log and the plots (TIDE paper, fig. 2).
ERROR_TYPES = {"Cls": "classification", "Loc": "localisation", "Both": "both", "Dupe": "duplicate",
               "Bkg": "background", "Miss": "missed"}
CALIBRATION_BINS = 10
CALIBRATION_IOU = 0.5
# Resamples of the per-evaluation interval (cost: docs/evaluation.md) and of `scripts/compare_predictions.py`.
EVALUATION_BOOTSTRAP = 100
COMPARE_BOOTSTRAP = 1000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


def _quiet():
    """hotcoco prints its summary and warns about non-default parameters the caller chose: neither goes to the log."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore", UserWarning)
    return stack


def _check(coco_eval) -> None:
    if coco_eval is None or not hasattr(coco_eval, "tide_errors"):
        raise ValueError("needs hotcoco's COCOeval (evaluate_coco(..., backend='hotcoco') or hotcoco_evaluation)")
    if not getattr(coco_eval, "eval", None):
        raise ValueError("needs a COCOeval after evaluate() and accumulate()")


def hotcoco_evaluation(coco_eval, gt_dataset: dict, results: list[dict], image_ids=None, area_ranges=None):
    """`coco_eval` when it is hotcoco's; else the same evaluation run again by hotcoco (same stats, bit for bit).

    Args: as `detlib.evaluation.coco.evaluate_coco` (`gt_dataset` the normalised ground truth of the evaluator,
        `results` with its image ids: `CocoEvaluator.evaluated()`). Returns None when nothing was detected.
    """
    if coco_eval is not None and hasattr(coco_eval, "tide_errors"):
        return coco_eval
    from .coco import evaluate_coco

    return evaluate_coco(gt_dataset, results, image_ids=image_ids, backend="hotcoco", checked=True,
                         return_cocoeval=True, area_ranges=area_ranges)[2]


def error_breakdown(coco_eval, pos_thr: float = 0.5, bg_thr: float = 0.1) -> dict:
    """The TIDE error breakdown of an evaluation (see the module docstring).

    Args:
        coco_eval: hotcoco's COCOeval after evaluate() and accumulate().
        pos_thr: IoU of a match (TIDE's foreground threshold, 0.5: the breakdown explains AP50).
        bg_thr: IoU below which a false positive touches no object (background).
    Returns:
        {"AP50": the AP at `pos_thr` the errors are measured from, "dAP": {type: AP50 gained by fixing that type
        alone}, "count": {type: number of errors}, "dAP_false_positives" / "dAP_false_negatives": AP50 gained by
        removing every false positive / finding every missed box} with the types of `ERROR_TYPES` by their long
        names. dAPs are AP fractions (0-1) like the 12 stats; they overlap and need not add up to 1 - AP50.
    Raises:
        ValueError: not hotcoco's COCOeval, or not accumulated.
    """
    _check(coco_eval)
    with _quiet():
        t = coco_eval.tide_errors(pos_thr=pos_thr, bg_thr=bg_thr)
    return {"AP50": float(t["ap_base"]),
            "dAP": {name: float(t["delta_ap"][key]) for key, name in ERROR_TYPES.items()},
            "count": {name: int(t["counts"][key]) for key, name in ERROR_TYPES.items()},
            "dAP_false_positives": float(t["delta_ap"]["FP"]), "dAP_false_negatives": float(t["delta_ap"]["FN"]),
            "pos_thr": pos_thr, "bg_thr": bg_thr}


def calibration(coco_eval, n_bins: int = CALIBRATION_BINS, iou: float = CALIBRATION_IOU) -> dict:
    """Expected and maximum calibration error of the detection scores, with the reliability diagram's bins.

    Returns:
        {"ECE": float, "MCE": float (the largest |acc - conf| of a non-empty bin), "num_detections": int,
        "iou": float, "bins": [{"lower", "upper", "confidence" (mean score), "accuracy" (share of true
        positives), "count"}] x n_bins (empty bins: count 0, confidence and accuracy 0)}.
    Raises:
        ValueError: not hotcoco's COCOeval, or not accumulated.
    """
    _check(coco_eval)
    with _quiet():
        c = coco_eval.calibration(n_bins=n_bins, iou_threshold=iou)
    return {"ECE": float(c["ece"]), "MCE": float(c["mce"]), "num_detections": int(c["num_detections"]),
            "iou": float(iou), "bins": [{"lower": float(b["bin_lower"]), "upper": float(b["bin_upper"]),
                                         "confidence": float(b["avg_confidence"]), "accuracy": float(b["avg_accuracy"]),
                                         "count": int(b["count"])} for b in c["bins"]]}


def _null_evaluation(coco_eval):
    """The same ground truth, images and parameters with no detection at all (every stat 0 on every resample)."""
    import hotcoco

    gt = coco_eval.cocoGt
    with _quiet():
        ev = hotcoco.COCOeval(gt, gt.load_res(np.zeros((0, 7))), "bbox")
        ev.params.imgIds = list(coco_eval.params.imgIds)
        ev.params.areaRng = [list(r) for r in coco_eval.params.areaRng]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


def _ci(c: dict, key: str) -> dict:
    ci = c["ci"][key]
    return {"lower": float(ci["lower"]), "upper": float(ci["upper"]), "std_err": float(ci["std_err"])}


def bootstrap_interval(coco_eval, n_bootstrap: int = EVALUATION_BOOTSTRAP, seed: int = BOOTSTRAP_SEED,
                       metrics=("AP", "AP50")) -> dict:
    """Percentile confidence interval (`CONFIDENCE`, 95 %) of AP and AP50 by image bootstrap.

    hotcoco's paired bootstrap (`hotcoco.compare`) of this evaluation against the same evaluation with no detection:
    every resample of the empty one scores 0, so each resampled difference is this evaluation's own stat on that
    resample of the images. The interval describes the spread over val sets like this one, not the training noise.
    Returns:
        {metric: {"value", "lower", "upper", "std_err"}, "n_bootstrap", "seed", "confidence", "num_images"}.
    Raises:
        ValueError: not hotcoco's COCOeval, or not accumulated; n_bootstrap < 2.
    """
    _check(coco_eval)
    if n_bootstrap < 2:
        raise ValueError(f"n_bootstrap must be at least 2, got {n_bootstrap}")
    import hotcoco

    with _quiet():
        c = hotcoco.compare(_null_evaluation(coco_eval), coco_eval, n_bootstrap=int(n_bootstrap), seed=int(seed),
                            confidence=CONFIDENCE)
    out = {m: {"value": float(c["metrics_b"][m]), **_ci(c, m)} for m in metrics}
    out.update(n_bootstrap=int(n_bootstrap), seed=int(seed), confidence=CONFIDENCE, num_images=int(c["num_images"]))
    return out


def compare_evaluations(eval_a, eval_b, n_bootstrap: int = COMPARE_BOOTSTRAP, seed: int = BOOTSTRAP_SEED,
                        metrics=("AP", "AP50")) -> dict:
    """Is B better than A? The stat differences B - A with a paired image bootstrap (hotcoco.compare).

    Both evaluations must score the same ground truth and images (two predictions files on one val set).
    Returns:
        {metric: {"A", "B", "delta" (B - A), "lower", "upper" (the 95 % percentile interval of the delta),
        "std_err", "prob_b_better" (share of resamples where B - A > 0)}, "n_bootstrap", "seed", "confidence",
        "num_images", "per_class": [{"class", "A", "B", "delta"}] (AP, by delta, the largest loss first)}.
    Raises:
        ValueError: either is not an accumulated hotcoco COCOeval, or they evaluate different images.
    """
    _check(eval_a)
    _check(eval_b)
    if sorted(eval_a.params.imgIds) != sorted(eval_b.params.imgIds):
        raise ValueError("compare_evaluations needs two evaluations of the same images")
    import hotcoco

    with _quiet():
        c = hotcoco.compare(eval_a, eval_b, n_bootstrap=int(n_bootstrap), seed=int(seed), confidence=CONFIDENCE)
    out = {m: {"A": float(c["metrics_a"][m]), "B": float(c["metrics_b"][m]), "delta": float(c["deltas"][m]),
               **_ci(c, m), "prob_b_better": float(c["ci"][m]["prob_positive"])} for m in metrics}
    out.update(n_bootstrap=int(n_bootstrap), seed=int(seed), confidence=CONFIDENCE, num_images=int(c["num_images"]),
               per_class=sorted(({"class": str(p["cat_name"]), "A": float(p["ap_a"]), "B": float(p["ap_b"]),
                                  "delta": float(p["delta"])} for p in c["per_category"]), key=lambda p: p["delta"]))
    return out


# The key printed under the first evaluation line of a run (a reader meets the line before any page that explains it).
DIAGNOSTICS_KEY = ("  key: errors dAP50/count = the AP50 points (x100) that fixing the errors of one type alone would add "
                   "/ how many there are: cls right place, wrong class; loc right class, IoU 0.1-0.5; both; duplicate; "
                   "bkg on no box; missed box. ECE: the mean gap between score and share of correct detections (0: "
                   "scores are probabilities). AP [lo, hi]: 95 % interval over resamples of the val images. "
                   "docs/evaluation.md, \"Why the AP is what it is\"")


def format_diagnostics(breakdown: dict | None, calib: dict | None, interval: dict | None) -> str:
    """The evaluation block's one line: the AP each error type costs (dAP50 x100 / count), ECE, the intervals.

    e.g. "errors dAP50/count: cls 23.3/71 loc 0.2/11 both 2.4/217 dupe 0.0/0 bkg 5.1/366 missed 0.1/3 | ECE 0.150 |
    AP 0.370 [0.339, 0.417] AP50 0.688 [0.659, 0.772] (95 %, 100 image resamples)"
    """
    parts = []
    if breakdown:
        parts.append("errors dAP50/count: " + " ".join(
            f"{'cls' if n == 'classification' else 'loc' if n == 'localisation' else 'bkg' if n == 'background' else n} "
            f"{100 * breakdown['dAP'][n]:.1f}/{breakdown['count'][n]}" for n in ERROR_TYPES.values()))
    if calib:
        parts.append(f"ECE {calib['ECE']:.3f}")
    if interval:
        parts.append(" ".join(f"{m} {interval[m]['value']:.3f} [{interval[m]['lower']:.3f}, {interval[m]['upper']:.3f}]"
                              for m in ("AP", "AP50") if m in interval)
                     + f" ({100 * interval['confidence']:.0f} %, {interval['n_bootstrap']} image resamples)")
    return " | ".join(parts) if parts else "no diagnostics (nothing detected)"


def plot_error_breakdown(breakdown: dict, path: str) -> str:
    """A horizontal bar chart of dAP50 per error type (count on each bar), TIDE's summary plot; returns `path`."""
    from matplotlib.figure import Figure

    from ..files import atomic_path

    names = list(ERROR_TYPES.values())
    values = [100 * breakdown["dAP"][n] for n in names]
    fig = Figure(figsize=(6.4, 3.2), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["#d62728", "#ff7f0e", "#8c564b", "#9467bd", "#7f7f7f", "#1f77b4"]
    bars = ax.barh(range(len(names))[::-1], values, color=colors)
    for bar, n in zip(bars, names):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {bar.get_width():.1f} ({breakdown['count'][n]})",
                va="center", fontsize=9)
    ax.set_yticks(range(len(names))[::-1], [n for n in names], fontsize=9)
    ax.set_xlim(0, max(1.0, max(values) * 1.3))
    ax.set_xlabel("AP50 points gained by fixing the errors of that type alone (count in brackets)")
    ax.set_title(f"TIDE error breakdown: AP50 {100 * breakdown['AP50']:.1f}; all false positives "
                 f"{100 * breakdown['dAP_false_positives']:.1f}, all misses {100 * breakdown['dAP_false_negatives']:.1f}",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def plot_reliability(calib: dict, path: str) -> str:
    """The reliability diagram: per score bin the share of true positives against the mean score, with the
    diagonal of perfect calibration and the count per bin; returns `path`."""
    from matplotlib.figure import Figure

    from ..files import atomic_path

    bins = calib["bins"]
    fig = Figure(figsize=(4.8, 4.8), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    centres = [(b["lower"] + b["upper"]) / 2 for b in bins]
    width = bins[0]["upper"] - bins[0]["lower"] if bins else 0.1
    ax.bar(centres, [b["accuracy"] for b in bins], width=width * 0.9, color="#1f77b4", label="true positives")
    for b, x in zip(bins, centres):
        if b["count"]:
            ax.text(x, b["accuracy"] + 0.01, str(b["count"]), ha="center", fontsize=7)
    used = [b for b in bins if b["count"]]
    ax.plot([b["confidence"] for b in used], [b["accuracy"] for b in used], "o", color="#d62728", label="each bin at its mean score")
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("detection score")
    ax.set_ylabel(f"share of true positives (IoU {calib['iou']:.2f})")
    ax.set_title(f"reliability: ECE {calib['ECE']:.3f}, MCE {calib['MCE']:.3f}, {calib['num_detections']} detections",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
