"""The plots of an evaluation (`detlib.evaluation.metrics`' numbers): per-class AP, PR curves, the detection and
the classifier confusion matrices, the F1 curves, each written as PNG next to a JSON file with the numbers it shows
(`write_evaluation_plots`); and the loss / AP curves of a run drawn from its metrics.jsonl.

Plots are drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch, no
display needed).
"""

from __future__ import annotations

import math
import os
from typing import Iterable

import numpy as np

from ..files import atomic_path, write_json
from ..logtext import short_name
from .metrics import (detection_confusion_matrix, per_class_ap, per_class_without_detections, pr_curves,
                      read_metrics_jsonl)

# Class names in the plots, in points (at 100 dpi: 12.5 px): readable at 3 classes and at 80, the figure grows
LABEL_FONTSIZE = 9


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


def _text_inches(texts: Iterable[str], fontsize: float) -> float:
    """Width in inches that the longest of `texts` takes at `fontsize` points in DejaVu Sans (about 0.6 em
    per character: an estimate that errs wide, so names are never cut)."""
    return max((len(t) for t in texts), default=0) * 0.6 * fontsize / 72


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
