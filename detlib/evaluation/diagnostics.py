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
* `bootstrap_interval` and `compare_evaluations`: image bootstrap (images drawn with replacement), basic (reflected)
  intervals that hold the reported value (Davison & Hinkley 1997, eq. 5.6), the same draws
  for both runs of a comparison (a paired bootstrap), a fixed seed so the numbers repeat; each resample's AP is
  COCOeval's accumulation over the drawn images, from hotcoco's matches. No interval (and why) where resampling
  cannot give one. Coverage by simulation: `benchmarks/interval_coverage.py` (docs/evaluation.md).

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
# Fewer images than this: no interval (one image resamples to itself)
MIN_BOOTSTRAP_IMAGES = 2
BOOTSTRAP_METHOD = "image bootstrap, basic interval holding the value"


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


def _image_matches(coco_eval, results) -> tuple[list[tuple], np.ndarray]:
    """Every detection COCO's AP counts, by class, as `COCOeval.accumulate` orders them (area "all", the last maxDets).

    Args:
        coco_eval: hotcoco's COCOeval after evaluate(); results: the detections it loaded, in the order it loaded them
            (hotcoco numbers them 1..N in that order).
    Returns:
        (per class of `params.catIds` with ground truth: (image [D] int64, the index in `params.imgIds`; tp [T, D]
        bool; fp [T, D] bool), in decreasing score, ties by image then load order, T = `params.iouThrs`; npig [K', I]
        float64: the non-ignored ground-truth boxes of each class and image). Matches are hotcoco's
        (`image_diagnostics`, pycocotools' matching), so at weight 1 `_resampled_ap` gives COCOeval's AP and AP50 bit
        for bit (tests/test_evaluation_diagnostics.py, every case of benchmarks/coco_eval_cases.py).
    Raises:
        ValueError: `results` are not the detections `coco_eval` loaded.
    """
    from .coco import _results_table

    table = _results_table(results)
    if table is None or len(coco_eval.cocoDt.get_ann_ids()) != len(table):
        raise ValueError("the results are not those the evaluation loaded (hotcoco numbers them 1..N in order)")
    p = coco_eval.params
    image_index = {int(i): n for n, i in enumerate(p.imgIds)}
    cat_index = {int(c): k for k, c in enumerate(p.catIds)}
    max_det = int(p.maxDets[-1])
    with _quiet():
        status = [coco_eval.image_diagnostics(iou_thr=float(t), score_thr=1.0) for t in p.iouThrs]
    gt_anns = coco_eval.cocoGt.anns
    npig = np.zeros((len(p.catIds), len(p.imgIds)))
    for g in status[0]["gt_status"]:  # the boxes matched or missed: crowd and ignored ones are absent
        a = gt_anns[g]
        if a["image_id"] in image_index and a["category_id"] in cat_index:
            npig[cat_index[a["category_id"]], image_index[a["image_id"]]] += 1
    T, N = len(p.iouThrs), len(table)
    tp, counted = np.zeros((T, N), bool), np.zeros((T, N), bool)
    for t, s in enumerate(status):
        ids = np.fromiter(s["dt_status"].keys(), np.int64, len(s["dt_status"])) - 1
        tp[t, ids] = np.fromiter((v == "tp" for v in s["dt_status"].values()), bool, len(ids))
        counted[t, ids] = True
    img = np.array([image_index.get(int(i), -1) for i in table[:, 0]], np.int64)
    cat = np.array([cat_index.get(int(c), -1) for c in table[:, 6]], np.int64)
    score = table[:, 5]
    order = np.lexsort((np.arange(N), img, -score, cat))  # by class, score down, then image, then load order
    keep = order[(img[order] >= 0) & (cat[order] >= 0)]
    # COCOeval keeps the `max_det` highest-scoring detections of an image and class
    rank = np.zeros(N, np.int64)
    by_group = keep[np.lexsort((np.arange(len(keep)), -score[keep], img[keep], cat[keep]))]
    starts = np.r_[True, (np.diff(cat[by_group]) != 0) | (np.diff(img[by_group]) != 0)]
    rank[by_group] = np.arange(len(by_group)) - np.maximum.accumulate(np.where(starts, np.arange(len(by_group)), 0))
    keep = keep[rank[keep] < max_det]
    per_class = []
    for k in np.flatnonzero(npig.sum(1) > 0):
        d = keep[cat[keep] == k]
        per_class.append((img[d], tp[:, d] & counted[:, d], ~tp[:, d] & counted[:, d]))
    return per_class, npig[npig.sum(1) > 0]


def _resampled_ap(per_class: list[tuple], npig: np.ndarray, weights: np.ndarray, rec_thrs: np.ndarray,
                  chunk: int = 100) -> np.ndarray:
    """AP and AP50 of resampled image sets, as `COCOeval.accumulate` + `summarize` compute them.

    Args:
        per_class, npig: `_image_matches`.
        weights: [B, I] how often each image is drawn in each resample (all ones: the evaluation itself). A
            detection drawn w times counts w times: the precision-recall points of w copies in a row.
        rec_thrs: COCO's 101 recall thresholds.
    Returns:
        [B, 2] float64 (AP, AP50); a class without ground truth in a resample is left out of its mean, as COCO does.
    """
    out = []
    for b0 in range(0, len(weights), chunk):
        W = weights[b0:b0 + chunk].astype(np.float64)  # [B, I]
        B = len(W)
        ap = np.full((B, len(per_class), 2), np.nan)
        for k, (img, tp, fp) in enumerate(per_class):
            n_gt = W @ npig[k]  # [B]
            T, D = tp.shape
            q = np.zeros((B, T, len(rec_thrs)))
            if D:
                wd = W[:, img]  # [B, D]
                offset = 2.0 * np.arange(B)[:, None]  # rows shifted apart: one searchsorted for every row
                for t in range(T):
                    found = np.flatnonzero(tp[t])
                    if not len(found):
                        continue
                    # detections after the last true positive change no recall and lower no envelope: left out
                    n = found[-1] + 1
                    ctp = np.cumsum(wd[:, :n] * tp[t, :n], axis=1)
                    cfp = np.cumsum(wd[:, :n] * fp[t, :n], axis=1)
                    rc = ctp / np.maximum(n_gt, 1e-300)[:, None]
                    pr = ctp / (ctp + cfp + np.spacing(1))
                    pr = np.maximum.accumulate(pr[:, ::-1], axis=1)[:, ::-1]  # COCO's precision envelope
                    at = np.searchsorted((rc + offset).ravel(), (rec_thrs[None, :] + offset).ravel(), side="left")
                    at = at.reshape(B, -1) - np.arange(B)[:, None] * n
                    q[:, t] = np.where(at < n, np.take_along_axis(pr, np.minimum(at, n - 1), axis=1), 0.0)
            has_gt = n_gt > 0
            ap[has_gt, k, 0] = q[has_gt].mean(axis=(1, 2))
            ap[has_gt, k, 1] = q[has_gt, 0].mean(axis=1)
        with warnings.catch_warnings():  # a resample without any ground truth: nan, as COCO's -1 means nothing
            warnings.simplefilter("ignore", RuntimeWarning)
            out.append(np.nanmean(ap, axis=1))
    return np.concatenate(out) if out else np.zeros((0, 2))


def _resample_weights(num_images: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """[n_bootstrap, num_images] int: how often each image is drawn (with replacement, as many draws as images) in
    each resample; the same seed, the same draws."""
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, num_images, size=(n_bootstrap, num_images))
    return np.stack([np.bincount(d, minlength=num_images) for d in drawn])


def _basic_interval(draws: np.ndarray, value: float) -> tuple[float, float]:
    """The basic bootstrap interval (Davison & Hinkley, "Bootstrap Methods and their Application", 1997, eq. 5.6) of
    `draws` [B] around `value`: [2 value - q_hi, 2 value - q_lo], q the draws' (1 -+ `CONFIDENCE`) / 2 quantiles.
    Resampled AP runs high (rare classes, mostly hard ones, drop out of resamples; the precision envelope of a
    noisier curve rises), and reflecting the quantiles about the value takes that bias off where percentiles add it.
    An end that the shift moves past the value is moved back to it: the interval always holds the value it is
    reported with (coverage can only gain).
    """
    lo, hi = np.quantile(draws, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return float(min(2 * value - hi, value)), float(max(2 * value - lo, value))


def _no_interval(num_images: int, draws: np.ndarray | None) -> str | None:
    """Why resampling gives no interval, or None when it gives one."""
    if num_images < MIN_BOOTSTRAP_IMAGES:
        return f"{num_images} image(s): too few to resample (at least {MIN_BOOTSTRAP_IMAGES})"
    if draws is not None and not np.ptp(draws) > 0:
        return "every resample gives the same value: no spread to measure (too few images, or one image per class)"
    return None


def bootstrap_interval(coco_eval, results, n_bootstrap: int = EVALUATION_BOOTSTRAP, seed: int = BOOTSTRAP_SEED,
                       metrics=("AP", "AP50")) -> dict:
    """95 % (`CONFIDENCE`) intervals of AP and AP50: image bootstrap, basic (reflected) intervals holding the value.

    Images are drawn with replacement; each resample's AP is COCOeval's on the drawn images (`_resampled_ap`). Resampled
    AP runs high, so percentiles of it can miss the AP itself; the basic interval (`_basic_interval`) reflects them
    about the AP and always holds it. Percentiles, bias-corrected percentiles and a bootstrap stratified by each
    image's rarest class covered worse in the simulation (docs/evaluation.md). Coverage measured by
    simulation: `benchmarks/interval_coverage.py`, docs/evaluation.md. The interval describes the spread over val
    sets like this one (same classes, same size), not the training noise.
    Args:
        coco_eval: hotcoco's COCOeval after evaluate() and accumulate(); results: the detections it loaded, in order.
    Returns:
        {metric: {"value", "lower", "upper", "std_err"} or {"value", "none": why} where there is no interval (fewer
        than `MIN_BOOTSTRAP_IMAGES` images, or no spread: every resample the same),
        "n_bootstrap", "seed", "confidence", "num_images", "method"}.
    Raises:
        ValueError: not hotcoco's COCOeval, or not accumulated; n_bootstrap < 2; results not those it loaded.
    """
    _check(coco_eval)
    if n_bootstrap < 2:
        raise ValueError(f"n_bootstrap must be at least 2, got {n_bootstrap}")
    values = dict(zip(("AP", "AP50"), (float(coco_eval.stats[0]), float(coco_eval.stats[1]))))
    num_images = len(coco_eval.params.imgIds)
    out = {"n_bootstrap": int(n_bootstrap), "seed": int(seed), "confidence": CONFIDENCE, "num_images": num_images,
           "method": BOOTSTRAP_METHOD}
    draws = None
    if num_images >= MIN_BOOTSTRAP_IMAGES:
        per_class, npig = _image_matches(coco_eval, results)
        W = _resample_weights(npig.shape[1], int(n_bootstrap), int(seed))
        draws = _resampled_ap(per_class, npig, W, np.asarray(coco_eval.params.recThrs, np.float64))
    for j, m in enumerate(("AP", "AP50")):
        if m not in metrics:
            continue
        d = None if draws is None else draws[:, j][np.isfinite(draws[:, j])]
        why = _no_interval(num_images, d)
        ci = None if why else _basic_interval(d, values[m])
        out[m] = {"value": values[m], "none": why} if why else {
            "value": values[m], "lower": ci[0], "upper": ci[1], "std_err": float(d.std(ddof=1))}
    return out


def compare_evaluations(eval_a, eval_b, results_a, results_b, n_bootstrap: int = COMPARE_BOOTSTRAP,
                        seed: int = BOOTSTRAP_SEED, metrics=("AP", "AP50")) -> dict:
    """Is B better than A? The stat differences B - A with a paired image bootstrap.

    The same draws of images for both runs, each draw's B - A as
    `bootstrap_interval` computes a stat; the interval is the basic interval of the difference, holding B - A.
    Both evaluations must score the same ground truth and images (two predictions files on one val set).
    Returns:
        {metric: {"A", "B", "delta" (B - A), "lower", "upper" (the 95 % interval of the delta; absent with "none": why
        where there is none), "std_err", "prob_b_better" (share of resamples where B - A > 0)}, "n_bootstrap", "seed",
        "confidence", "num_images", "method", "per_class": [{"class", "A", "B", "delta"}] (AP, by delta, the largest
        loss first)}.
    Raises:
        ValueError: either is not an accumulated hotcoco COCOeval, or they evaluate different images.
    """
    _check(eval_a)
    _check(eval_b)
    if list(eval_a.params.imgIds) != list(eval_b.params.imgIds):
        raise ValueError("compare_evaluations needs two evaluations of the same images")
    import hotcoco

    with _quiet():  # the stats and per-class APs (no resampling: ours below)
        c = hotcoco.compare(eval_a, eval_b, n_bootstrap=0)
    num_images = len(eval_a.params.imgIds)
    out = {"n_bootstrap": int(n_bootstrap), "seed": int(seed), "confidence": CONFIDENCE, "num_images": num_images,
           "method": BOOTSTRAP_METHOD}
    deltas = None
    if num_images >= MIN_BOOTSTRAP_IMAGES and n_bootstrap >= 2:
        rec = np.asarray(eval_a.params.recThrs, np.float64)
        (pa, na), (pb, nb) = _image_matches(eval_a, results_a), _image_matches(eval_b, results_b)
        W = _resample_weights(na.shape[1], int(n_bootstrap), int(seed))
        deltas = _resampled_ap(pb, nb, W, rec) - _resampled_ap(pa, na, W, rec)
    for j, m in enumerate(("AP", "AP50")):
        if m not in metrics:
            continue
        a, b = float(c["metrics_a"][m]), float(c["metrics_b"][m])
        v = {"A": a, "B": b, "delta": b - a}
        d = None if deltas is None else deltas[:, j][np.isfinite(deltas[:, j])]
        why = _no_interval(num_images, d) or (None if d is not None else "no resampling asked for")
        if d is not None and len(d) and not d.any():  # the same detections on every resample: a tie, not noise
            why = None
        ci = None if why else (0.0, 0.0) if not d.any() else _basic_interval(d, b - a)
        if why:
            v["none"] = why
        else:
            v.update(lower=ci[0], upper=ci[1], std_err=float(d.std(ddof=1)))
        if d is not None and len(d):
            v["prob_b_better"] = float(np.mean(d > 0))
        out[m] = v
    out["per_class"] = sorted(({"class": str(p["cat_name"]), "A": float(p["ap_a"]), "B": float(p["ap_b"]),
                                "delta": float(p["delta"])} for p in c["per_category"]), key=lambda p: p["delta"])
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
    AP 0.370 [0.339, 0.417] AP50 0.688 [0.659, 0.772] (95 %, 100 image resamples)"; a metric without an
    interval shows its value and why there is none (`bootstrap_interval`).
    """
    parts = []
    if breakdown:
        parts.append("errors dAP50/count: " + " ".join(
            f"{'cls' if n == 'classification' else 'loc' if n == 'localisation' else 'bkg' if n == 'background' else n} "
            f"{100 * breakdown['dAP'][n]:.1f}/{breakdown['count'][n]}" for n in ERROR_TYPES.values()))
    if calib:
        parts.append(f"ECE {calib['ECE']:.3f}")
    if interval:
        shown = [m for m in ("AP", "AP50") if m in interval]
        why = sorted({interval[m]["none"] for m in shown if "none" in interval[m]})
        parts.append(" ".join(f"{m} {interval[m]['value']:.3f}" + ("" if "none" in interval[m] else
                                                                  f" [{interval[m]['lower']:.3f}, {interval[m]['upper']:.3f}]")
                              for m in shown)
                     + (f" (no interval: {'; '.join(why)})" if why else
                        f" ({100 * interval['confidence']:.0f} %, {interval['n_bootstrap']} image resamples)"))
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
