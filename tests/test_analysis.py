"""Per-class AP, PR curves and the detection confusion matrix against a case worked out by hand; the two
COCOeval backends give the same per-class numbers; the plots and their JSON are written."""

import json

import numpy as np
import pytest

from detlib.evaluation.coco import CocoEvaluator, evaluate_coco
from detlib.evaluation.metrics import (detection_confusion_matrix, format_per_class, per_class_ap, pr_curves,
                                       read_metrics_jsonl)
from detlib.evaluation.plots import plot_training_curves, write_evaluation_plots

from conftest import COCO_SUBSET, needs_coco_subset

# Four categories (non-contiguous ids), four 100x100 images, 40x40 boxes far apart (IoU of two boxes is 1 or 0).
CATS = [{"id": 1, "name": "cat"}, {"id": 3, "name": "dog"}, {"id": 5, "name": "bird"}, {"id": 9, "name": "fish"}]


def _gt_and_results():
    """cat: 2 boxes, both found (scores 0.9, 0.8), and one cat detection on the fish (0.5, the lowest).
    dog: 2 boxes; one found (0.9), one missed; a dog detection on empty ground (0.8).
    bird: no ground truth, one detection (0.7).  fish: 1 box, only "found" as a cat."""
    images = [{"id": i, "width": 100, "height": 100, "file_name": f"{i}.jpg"} for i in (1, 2, 3, 4)]
    A, B = [5, 5, 40, 40], [55, 55, 40, 40]
    anns = [(1, 1, A), (2, 1, A), (1, 3, B), (2, 3, B), (3, 9, A)]
    gt = {"images": images, "categories": CATS, "info": {}, "licenses": [],
          "annotations": [{"id": k + 1, "image_id": i, "category_id": c, "bbox": b, "area": 1600.0, "iscrowd": 0}
                          for k, (i, c, b) in enumerate(anns)]}
    res = [{"image_id": 1, "category_id": 1, "bbox": A, "score": 0.9}, {"image_id": 2, "category_id": 1, "bbox": A, "score": 0.8},
           {"image_id": 3, "category_id": 1, "bbox": A, "score": 0.5},
           {"image_id": 1, "category_id": 3, "bbox": B, "score": 0.9}, {"image_id": 4, "category_id": 3, "bbox": A, "score": 0.8},
           {"image_id": 4, "category_id": 5, "bbox": B, "score": 0.7}]
    return gt, res


def _coco_eval(backend):
    gt, res = _gt_and_results()
    ev = CocoEvaluator(gt, backend=backend)
    for iid in (1, 2, 3, 4):
        ev.add(iid, [r for r in res if r["image_id"] == iid])
    stats, _ = ev.evaluate()
    return stats, ev.coco_eval


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_per_class_ap_worked_by_hand(backend):
    stats, coco_eval = _coco_eval(backend)
    pc = per_class_ap(coco_eval)
    # bird has no ground truth: absent, not 0
    assert list(pc) == ["cat", "dog", "fish"]
    # cat: TP 0.9, TP 0.8 reach recall 1 at precision 1; the FP at 0.5 comes after, so AP = 1 at every IoU.
    assert pc["cat"] == pytest.approx({"AP": 1.0, "AP50": 1.0, "num_gt": 2}, abs=1e-12)
    # dog: TP 0.9 (recall 0.5, precision 1), then FP. Recall thresholds 0, 0.01, ..., 0.50 (51 of 101) get
    # precision 1, the 50 above recall 0.5 get 0: AP = 51 / 101 at every IoU threshold.
    assert pc["dog"]["AP"] == pytest.approx(51 / 101, abs=1e-12)
    assert pc["dog"]["AP50"] == pytest.approx(51 / 101, abs=1e-12)
    assert pc["dog"]["num_gt"] == 2
    # fish: ground truth, no fish detection: 0 (present)
    assert pc["fish"] == {"AP": 0.0, "AP50": 0.0, "num_gt": 1}
    # COCO's overall AP is the mean over the classes with ground truth
    assert stats["AP"] == pytest.approx((1 + 51 / 101 + 0) / 3, abs=1e-12)
    table = format_per_class(pc)
    assert table.splitlines()[1].split() == ["fish", "0.000", "0.000", "1"]  # worst first
    assert "dog" in table and "bird" not in table


def test_pr_curve_at_iou_05_worked_by_hand():
    _, coco_eval = _coco_eval("pycocotools")
    c = pr_curves(coco_eval)
    assert c["iou"] == 0.5 and len(c["recall"]) == 101 and c["recall"][50] == 0.5
    assert set(c["per_class"]) == {"cat", "dog", "fish"}
    # COCOeval divides by tp + fp + eps, so "1" is 1 - 2e-16
    assert c["per_class"]["cat"] == pytest.approx([1.0] * 101, abs=1e-12)
    assert c["per_class"]["dog"] == pytest.approx([1.0] * 51 + [0.0] * 50, abs=1e-12)
    assert c["per_class"]["fish"] == [0.0] * 101
    assert c["all"][:51] == pytest.approx([2 / 3] * 51) and c["all"][51:] == pytest.approx([1 / 3] * 50)


def test_confusion_matrix_worked_by_hand():
    gt, res = _gt_and_results()
    cm = detection_confusion_matrix(gt, res, score_thresh=0.25)
    assert cm["names"] == ["cat", "dog", "bird", "fish", "background"]
    m = np.asarray(cm["matrix"])
    expected = np.zeros((5, 5), dtype=int)
    expected[0, 0] = 2  # both cats found as cats
    expected[1, 1] = 1  # one dog found
    expected[1, 4] = 1  # one dog missed
    expected[3, 0] = 1  # the fish detected as a cat
    expected[4, 1] = 1  # dog detection on empty ground
    expected[4, 2] = 1  # bird detection (no bird anywhere)
    np.testing.assert_array_equal(m, expected)
    # a higher score threshold drops the 0.5 cat on the fish: the fish becomes a miss
    m2 = np.asarray(detection_confusion_matrix(gt, res, score_thresh=0.6)["matrix"])
    assert m2[3, 0] == 0 and m2[3, 4] == 1


def test_confusion_matrix_one_to_one_and_crowd():
    """Two detections on one box: the better-overlapping one matches, the other is a false alarm; a detection
    inside a crowd region is not counted as a false alarm."""
    gt = {"images": [{"id": 1, "width": 200, "height": 200}], "categories": [{"id": 1, "name": "a"}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 40, 40], "iscrowd": 0},
                          {"id": 2, "image_id": 1, "category_id": 1, "bbox": [100, 100, 90, 90], "iscrowd": 1}]}
    res = [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 40, 36], "score": 0.9},   # IoU 0.9
           {"image_id": 1, "category_id": 1, "bbox": [0, 0, 40, 40], "score": 0.3},   # IoU 1.0: wins
           {"image_id": 1, "category_id": 1, "bbox": [120, 120, 20, 20], "score": 0.9}]  # inside the crowd
    m = detection_confusion_matrix(gt, res, score_thresh=0.25)["matrix"]
    assert m == [[1, 0], [1, 0]]


@needs_coco_subset
def test_per_class_ap_equal_between_backends_on_real_data():
    """Detections: the val ground truth, with boxes shifted by a class-dependent amount and made-up scores,
    so the classes get different APs between 0 and 1."""
    gt = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    rng = np.random.RandomState(0)
    res = []
    for a in gt["annotations"]:
        if a["iscrowd"]:
            continue
        x, y, w, h = a["bbox"]
        shift = (a["category_id"] % 5) * 0.08 * w
        res.append({"image_id": a["image_id"], "category_id": a["category_id"], "bbox": [x + shift, y, w, h],
                    "score": float(rng.uniform(0.05, 1))})
        res.append({"image_id": a["image_id"], "category_id": int(rng.choice([1, 3, 62])),
                    "bbox": [x, y + h * 0.3, w, h], "score": float(rng.uniform(0.05, 1))})
    out = {}
    for backend in ("pycocotools", "faster"):
        stats, _, ev = evaluate_coco(gt, res, backend=backend, return_cocoeval=True)
        out[backend] = (stats, per_class_ap(ev))
    (s1, p1), (s2, p2) = out["pycocotools"], out["faster"]
    assert s1 == pytest.approx(s2, abs=1e-12)
    assert list(p1) == list(p2)
    n_with_gt = len({a["category_id"] for a in gt["annotations"] if not a["iscrowd"]})
    assert len(p1) == n_with_gt  # categories with only crowd boxes or none are absent
    assert "bicycle" not in p1
    for name in p1:
        assert p1[name]["AP"] == pytest.approx(p2[name]["AP"], abs=1e-12), name
        assert p1[name]["AP50"] == pytest.approx(p2[name]["AP50"], abs=1e-12), name
        assert p1[name]["num_gt"] == p2[name]["num_gt"]
    aps = [v["AP"] for v in p1.values()]
    assert min(aps) < 0.5 < max(aps)
    assert np.mean(aps) == pytest.approx(s1["AP"], abs=1e-12)
    assert np.mean([v["AP50"] for v in p1.values()]) == pytest.approx(s1["AP50"], abs=1e-12)


def test_evaluation_plots_and_training_curves_written(tmp_path):
    gt, res = _gt_and_results()
    _, coco_eval = _coco_eval("pycocotools")
    out = write_evaluation_plots(str(tmp_path / "plots"), 3, coco_eval, gt, res)
    folder = tmp_path / "plots" / "epoch_0003"
    for name in ("per_class_ap", "pr_curve", "confusion_matrix"):
        png = folder / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5000
        assert (folder / f"{name}.json").is_file()
    assert json.loads((folder / "per_class_ap.json").read_text())["dog"]["AP50"] == pytest.approx(51 / 101)
    assert out["per_class"]["cat"]["AP"] == pytest.approx(1.0)
    assert json.loads((folder / "confusion_matrix.json").read_text())["matrix"][4] == [0, 1, 1, 0, 0]

    metrics = tmp_path / "metrics.jsonl"
    lines = [{"epoch": 0, "step": s, "loss": 2.0 / s, "cls_loss": 1.0 / s, "box_loss": 1.0 / s, "lr": 1e-3} for s in range(1, 6)]
    lines.insert(2, {"epoch": 0, "step": 3, "loss": "nan", "cls_loss": "nan", "box_loss": 0.1})
    lines += [{"epoch": 0, "step": 5, "AP": 0.1, "AP50": 0.2}, {"epoch": 1, "step": 10, "AP": 0.3, "AP50": 0.5}]
    metrics.write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"step\": 11, \"loss")  # last line cut short
    rows = read_metrics_jsonl(str(metrics))
    assert len(rows) == 8 and np.isnan(rows[2]["loss"])
    png = plot_training_curves(str(metrics), str(tmp_path / "plots" / "training_curves.png"))
    assert png and (tmp_path / "plots" / "training_curves.png").stat().st_size > 5000
    assert plot_training_curves(str(tmp_path / "missing.jsonl"), str(tmp_path / "x.png")) is None


@pytest.mark.parametrize("last_step", [1, 12, 450])
def test_training_curves_read_at_any_run_length(last_step):
    """1 step, 1 epoch (one train line and one evaluation, at the same step) and a long run: both panels span the
    steps from 0, AP 0..1; series of few points have markers; no axis label or tick label leaves the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from detlib.evaluation.plots import MARKERS_UP_TO, training_curves_figure

    steps = sorted({*range(20, last_step, 20), last_step})
    rows = [{"step": s, "loss": 0.6 + 0.6 / s, "cls_loss": 0.3 + 0.3 / s, "box_loss": 0.58} for s in steps]
    rows += [{"step": last_step, "AP": 0.0, "AP50": 0.001}]
    fig = training_curves_figure(rows)
    FigureCanvasAgg(fig).draw()
    ax_l, ax_a = fig.axes
    for ax in (ax_l, ax_a):
        lo, hi = ax.get_xlim()
        assert lo == 0 and last_step <= hi <= 1.05 * last_step
        y_lo, y_hi = ax.get_ylim()
        shown = [t.label1 for t in ax.yaxis.get_major_ticks() + ax.yaxis.get_minor_ticks() if y_lo <= t.get_loc() <= y_hi]
        for text in [ax.xaxis.label, ax.yaxis.label, *shown]:
            box = text.get_window_extent()
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.x1, text.get_text()
    assert ax_a.get_ylim() == (0, 1)
    assert all(line.get_marker() == ("o" if len(line.get_xdata()) <= MARKERS_UP_TO else "None")
               for ax in (ax_l, ax_a) for line in ax.get_lines())
    assert [len(line.get_xdata()) for line in ax_a.get_lines()] == [1, 1]


def _png(path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("L"))


@pytest.mark.parametrize("num_classes", [3, 80])
def test_per_class_and_confusion_plots_readable_at_3_and_80_classes(tmp_path, num_classes):
    """The figures grow with the class count (at 100 dpi a 9 pt name is 12.5 px; the rows are 32 px / cells 30
    px apart) and are wide enough for the longest name: nothing is drawn at the image's border, where a name
    that does not fit would be cut. At 80 classes the old fixed-width figures cut names and set them at 6 px."""
    from detlib.evaluation.plots import LABEL_FONTSIZE, plot_confusion_matrix, plot_per_class_ap

    assert LABEL_FONTSIZE >= 9
    names = [f"class {i}" if i % 7 else f"class {i} with a rather long custom category name" for i in range(num_classes)]
    per_class = {n: {"AP": i / num_classes, "AP50": min(1.0, 1.5 * i / num_classes), "num_gt": 3 + i}
                 for i, n in enumerate(names)}
    ap = _png(plot_per_class_ap(per_class, str(tmp_path / "per_class_ap.png")))
    K = num_classes
    m = np.zeros((K + 1, K + 1), dtype=int)
    m[np.arange(K), np.arange(K)] = 5
    m[np.arange(K), K] = 1
    m[K, np.arange(K)] = 2
    cm = _png(plot_confusion_matrix({"names": names + ["background"], "matrix": m.tolist(), "score_thresh": 0.25,
                                     "iou_thresh": 0.5}, str(tmp_path / "confusion_matrix.png")))
    assert ap.shape[0] >= 0.32 * 100 * num_classes and cm.shape[0] >= 0.3 * 100 * (num_classes + 1)
    if num_classes == 3:
        assert ap.shape[0] < 300  # a 3-class chart is not a poster
    for img in (ap, cm):
        border = np.concatenate([img[:3].ravel(), img[-3:].ravel(), img[:, :3].ravel(), img[:, -3:].ravel()])
        assert border.min() == 255, "something is drawn at the border: a cut name"


# ---- the best-F1 score threshold


def _f1_case():
    """a: 3 boxes in two images; detections in score order TP .9, FP .8 (nowhere), TP .7, FP .6 (a second one on a
    box already found), TP .5, FP .4, FP .3.  b: a crowd region with a detection inside it (.95, ignored) and one box
    found at .4.  c: one box, never detected.  d: no ground truth, one detection."""
    images = [{"id": i, "width": 200, "height": 200, "file_name": f"{i}.jpg"} for i in (1, 2)]
    cats = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c"}, {"id": 4, "name": "d"}]
    G1, G2, G3 = [0, 0, 10, 10], [20, 20, 10, 10], [0, 0, 10, 10]
    anns = [(1, 1, G1, 0), (1, 1, G2, 0), (2, 1, G3, 0), (1, 2, [100, 100, 50, 50], 1), (1, 2, [60, 60, 10, 10], 0),
            (2, 3, [150, 150, 20, 20], 0)]
    gt = {"images": images, "categories": cats, "info": {}, "licenses": [],
          "annotations": [{"id": k + 1, "image_id": i, "category_id": c, "bbox": b, "area": float(b[2] * b[3]), "iscrowd": z}
                          for k, (i, c, b, z) in enumerate(anns)]}
    det = [(1, 1, G1, .9), (1, 1, [50, 50, 10, 10], .8), (1, 1, G2, .7), (1, 1, [0.5, 0, 10, 10], .6), (2, 1, G3, .5),
           (2, 1, [90, 90, 10, 10], .4), (2, 1, [90, 10, 10, 10], .3),
           (1, 2, [105, 105, 10, 10], .95), (1, 2, [60, 60, 10, 10], .4), (2, 4, [0, 0, 5, 5], .9)]
    return gt, [{"image_id": i, "category_id": c, "bbox": b, "score": s} for i, c, b, s in det]


def test_best_f1_thresholds_worked_by_hand():
    from detlib.evaluation.metrics import best_f1_thresholds

    gt, res = _f1_case()
    best = best_f1_thresholds(gt, res)
    a, b, c = (best["per_class"][k] for k in ("a", "b", "c"))
    # a, 3 boxes: F1 after each score 0.5 (.9) 0.4 (.8) 0.667 (.7) 0.571 (.6) 0.75 (.5: P 3/5, R 1) 0.667 0.6
    assert a["score_thresh"] == 0.5 and a["F1"] == pytest.approx(0.75) and a["precision"] == pytest.approx(0.6)
    assert a["recall"] == 1.0 and a["num_gt"] == 3 and a["category_id"] == 1
    # b: the detection inside the crowd region is neither right nor wrong; the box is found at .4
    assert (b["score_thresh"], b["F1"], b["precision"], b["recall"], b["num_gt"]) == (0.4, 1.0, 1.0, 1.0, 1)
    assert (c["score_thresh"], c["F1"], c["num_gt"]) == (None, 0.0, 1)
    assert "d" not in best["per_class"]  # no ground truth: no F1, as per_class_ap leaves it out
    # all classes pooled (5 boxes): .9 T .8 F .7 T .6 F .5 T, then a tie at .4 (F of a, T of b), .3 F:
    # the tie is one threshold, after it 4 of 7 right and 4 of 5 found: F1 2/3, the best
    pooled = best["all"]
    assert pooled["score_thresh"] == 0.4 and pooled["F1"] == pytest.approx(2 / 3)
    assert pooled["precision"] == pytest.approx(4 / 7) and pooled["recall"] == pytest.approx(0.8)
    # the curves: F1 of "score >= t" at t = 0, 0.01, ..., 1
    assert len(best["curves"]["a"]) == 101 and best["curves"]["a"][50] == pytest.approx(0.75)
    assert best["curves"]["a"][95] == 0.0 and best["curves"]["a"][0] == pytest.approx(0.6)  # 7 kept: P 3/7, R 1


@needs_coco_subset  # coco_eval_inputs reads the subset's images and boxes
def test_best_f1_matching_equals_pycocotools_at_iou_05():
    """Every detection's match at IoU 0.5 as pycocotools' evalImgs has it, on 12 real images with crowd boxes and
    jittered, misclassified and random detections: the same best F1 computed from its matches."""
    from detlib.evaluation.metrics import _best_f1, best_f1_thresholds
    from devtools.peers import coco_eval_inputs

    gt, res = coco_eval_inputs(12, dets_per_image=30, seed=1)
    _, _, ev = evaluate_coco(gt, res, backend="pycocotools", return_cocoeval=True)
    best = best_f1_thresholds(ev.cocoGt.dataset, res)
    names = {c["id"]: c["name"] for c in gt["categories"]}
    compared = 0
    for cid in ev.params.catIds:
        e = [x for x in ev.evalImgs if x is not None and x["category_id"] == cid and x["aRng"] == [0, 1e10]]
        scores = np.concatenate([x["dtScores"] for x in e]) if e else np.zeros(0)
        tp = np.concatenate([x["dtMatches"][0] > 0 for x in e]) if e else np.zeros(0, bool)
        ignored = np.concatenate([x["dtIgnore"][0] for x in e]) if e else np.zeros(0, bool)
        num_gt = int(sum((np.asarray(x["gtIgnore"]) == 0).sum() for x in e))
        if not num_gt:
            assert names[cid] not in best["per_class"]
            continue
        ref = _best_f1(scores[~ignored], tp[~ignored], num_gt)
        ref.pop("curve")
        assert best["per_class"][names[cid]] == {"category_id": cid, **ref}
        compared += ref["score_thresh"] is not None
    assert compared >= 10
