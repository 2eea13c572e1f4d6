"""Issue 29, items 2, 4 and 5: the TIDE breakdown, calibration and bootstrap intervals against independent code.

* TIDE: hotcoco's `tide_errors` (through `diagnostics.error_breakdown`) against tidecv-light, the TIDE authors' code
  on PyPI (boxes given as xyxy, which its IoU takes), on the real subset with model-like detections of its own
  classes. tidecv treats crowd boxes as regions to ignore while COCO matches detections to them: the detections COCO
  ignores (pycocotools' own `dtIgnore` at IoU 0.5) are left out of tidecv's input, the crowd boxes too. Same counts
  and dAP within 0.005 (measured: 5e-5) on the val set and on the subset without its crowd boxes; dAP within 0.005 on
  the whole subset, where one detection overlapping a crowd box is typed differently (docs/evaluation.md).
* Calibration: ECE, MCE and the bins equal the same sums over pycocotools' `evalImgs`.
* Bootstrap: the interval holds the evaluation's AP; its spread matches a bootstrap done by hand (images drawn
  with replacement, each draw evaluated as a data set of its own); the seed repeats it; comparing a run with itself
  gives 0, with a better run a positive difference equal to the stats' difference.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import sys

import numpy as np
import pytest

from detlib.evaluation import diagnostics as dg
from detlib.evaluation.coco import evaluate_coco

from conftest import REPO, needs_coco_subset

sys.path.insert(0, str(REPO / "benchmarks"))
from coco_eval_cases import model_like_detections, pycocotools_eval, real_json  # noqa: E402


def hot(gt, results):
    return evaluate_coco(gt, results, backend="hotcoco", return_cocoeval=True)[2]


def own_class_detections(gt: dict, seed: int) -> list[dict]:
    return model_like_detections(gt, seed=seed, categories=sorted({a["category_id"] for a in gt["annotations"]}))


def tidecv_breakdown(gt: dict, results: list[dict]) -> tuple[dict, dict]:
    """(dAP by hotcoco's key, count by key) from tidecv; COCO-ignored detections and crowd boxes left out."""
    tidecv = pytest.importorskip("tidecv")
    ref = pycocotools_eval(gt, results)
    ignored = set()
    for e in ref.evalImgs:
        if e is not None and e["aRng"] == [0, 1e10] and e["maxDet"] == 100:
            ignored.update(d for d, ig in zip(e["dtIds"], np.asarray(e["dtIgnore"])[0]) if ig)
    G, P = tidecv.Data("gt"), tidecv.Data("pred")
    for a in gt["annotations"]:
        if not a.get("iscrowd", 0):
            x, y, w, h = a["bbox"]
            G.add_ground_truth(a["image_id"], a["category_id"], [x, y, x + w, y + h])
    for k, r in enumerate(results, 1):  # loadRes numbers the detections 1..N in order
        if k not in ignored:
            x, y, w, h = r["bbox"]
            P.add_detection(r["image_id"], r["category_id"], r["score"], [x, y, x + w, y + h])
    tide = tidecv.TIDE()
    with contextlib.redirect_stdout(io.StringIO()):
        run = tide.evaluate(G, P, mode=tidecv.TIDE.BOX)
        main = tide.get_main_errors()["pred"]
    return {k: v / 100 for k, v in main.items()}, {t.short_name: len(v) for t, v in run.error_dict.items()}


@needs_coco_subset
@pytest.mark.parametrize("split,no_crowd,equal_counts", [("val", False, True), ("subset", True, True),
                                                         ("subset", False, False)])
def test_error_breakdown_matches_tidecv(split, no_crowd, equal_counts):
    gt = real_json(split)
    results = own_class_detections(gt, seed=1)
    if no_crowd:
        gt["annotations"] = [a for a in gt["annotations"] if not a.get("iscrowd", 0)]
    b = dg.error_breakdown(hot(gt, results))
    dap, counts = tidecv_breakdown(gt, results)
    assert b["AP50"] == pytest.approx(evaluate_coco(gt, results, backend="pycocotools")[0]["AP50"], abs=1e-12)
    for key, name in dg.ERROR_TYPES.items():
        assert abs(b["dAP"][name] - dap[key]) <= 0.005, name
        if equal_counts:
            assert b["count"][name] == counts[key], name
        else:
            assert abs(b["count"][name] - counts[key]) <= 2, name
    assert b["count"]["classification"] > 50 and b["count"]["background"] > 300 and b["dAP"]["classification"] > 0.1


@needs_coco_subset
@pytest.mark.parametrize("split", ["val", "subset"])
def test_calibration_matches_pycocotools_matches(split):
    gt = real_json(split)
    results = model_like_detections(gt, seed=3)
    c = dg.calibration(hot(gt, results))
    ref = pycocotools_eval(gt, results)
    scores, tp = [], []
    for e in ref.evalImgs:
        if e is not None and e["aRng"] == [0, 1e10] and e["maxDet"] == 100:
            keep = ~np.asarray(e["dtIgnore"], bool)[0]
            scores += list(np.asarray(e["dtScores"])[keep])
            tp += list(np.asarray(e["dtMatches"])[0][keep] > 0)
    scores, tp = np.array(scores), np.array(tp, float)
    bins = np.minimum((scores * dg.CALIBRATION_BINS).astype(int), dg.CALIBRATION_BINS - 1)
    gaps = [abs(tp[bins == k].mean() - scores[bins == k].mean()) for k in range(10) if (bins == k).any()]
    weights = [(bins == k).mean() for k in range(10) if (bins == k).any()]
    assert c["num_detections"] == len(scores)
    assert c["ECE"] == pytest.approx(float(np.dot(weights, gaps)), abs=1e-12)
    assert c["MCE"] == pytest.approx(max(gaps), abs=1e-12)
    assert [b["count"] for b in c["bins"]] == [int((bins == k).sum()) for k in range(10)]
    assert 0.05 < c["ECE"] < 0.5


def resampled(gt: dict, results: list[dict], rng: random.Random) -> tuple[dict, list[dict]]:
    """One bootstrap draw of the images, each drawn image a new image (id and file name of its own)."""
    ids = sorted(im["id"] for im in gt["images"])
    images = {im["id"]: im for im in gt["images"]}
    anns, dets = {}, {}
    for a in gt["annotations"]:
        anns.setdefault(a["image_id"], []).append(a)
    for r in results:
        dets.setdefault(r["image_id"], []).append(r)
    G, R = {"images": [], "annotations": [], "categories": gt["categories"]}, []
    for n, iid in enumerate((rng.choice(ids) for _ in ids), 1):
        G["images"].append(dict(images[iid], id=n, file_name=f"{n}_{images[iid]['file_name']}"))
        G["annotations"] += [dict(a, id=len(G["annotations"]) + 1 + j, image_id=n) for j, a in enumerate(anns.get(iid, []))]
        R += [dict(r, image_id=n) for r in dets.get(iid, [])]
    return G, R


@pytest.mark.slow
@needs_coco_subset
def test_bootstrap_interval_matches_a_bootstrap_by_hand():
    gt = real_json("val")
    results = model_like_detections(gt, seed=0)
    ev = hot(gt, results)
    interval = dg.bootstrap_interval(ev, results, n_bootstrap=200, seed=0)
    stats = evaluate_coco(gt, results, backend="pycocotools")[0]
    rng = random.Random(0)
    draws = np.array([[s["AP"], s["AP50"]] for s in (evaluate_coco(*resampled(gt, results, rng), backend="hotcoco",
                                                                   checked=True)[0] for _ in range(100))])
    for j, m in enumerate(("AP", "AP50")):
        assert interval[m]["value"] == stats[m]
        se = draws[:, j].std(ddof=1)
        assert 0.7 < interval[m]["std_err"] / se < 1.4, m
        hi = np.percentile(draws[:, j], 97.5)  # resampled AP runs high: the bias correction moves the interval down
        assert interval[m]["upper"] < hi + se / 4, m
        assert interval[m]["lower"] < stats[m] < interval[m]["upper"]
    assert dg.bootstrap_interval(ev, results, n_bootstrap=200, seed=0) == interval  # the seed repeats it
    assert dg.bootstrap_interval(ev, results, n_bootstrap=200, seed=1)["AP"] != interval["AP"]


@needs_coco_subset
def test_compare_evaluations():
    gt = real_json("val")
    a = model_like_detections(gt, seed=0)
    # B: the same detections, the false-positive background boxes (the last 20 per image) scored lower: better AP
    n_fp = 20 * len(gt["images"])
    b = a[:-n_fp] + [dict(r, score=r["score"] * 0.5) for r in a[-n_fp:]]
    ev_a, ev_b = hot(gt, a), hot(gt, b)
    same = dg.compare_evaluations(ev_a, ev_a, a, a, n_bootstrap=20)
    assert same["AP"]["delta"] == 0 and same["AP"]["prob_b_better"] == 0 and same["AP"]["lower"] == same["AP"]["upper"] == 0
    c = dg.compare_evaluations(ev_a, ev_b, a, b, n_bootstrap=40, seed=0)
    sa, sb = evaluate_coco(gt, a)[0], evaluate_coco(gt, b)[0]
    for m in ("AP", "AP50"):
        assert c[m]["A"] == sa[m] and c[m]["B"] == sb[m] and c[m]["delta"] == pytest.approx(sb[m] - sa[m], abs=1e-15)
        assert c[m]["delta"] > 0 and c[m]["prob_b_better"] > 0.9 and c[m]["lower"] <= c[m]["delta"] <= c[m]["upper"]
    assert dg.compare_evaluations(ev_a, ev_b, a, b, n_bootstrap=40, seed=0) == c
    assert c["num_images"] == 30 and c["per_class"][0]["delta"] <= c["per_class"][-1]["delta"]


@needs_coco_subset
def test_one_line_and_plots(tmp_path):
    gt = real_json("val")
    results = model_like_detections(gt, seed=0)
    ev = hot(gt, results)
    b, c = dg.error_breakdown(ev), dg.calibration(ev)
    interval = dg.bootstrap_interval(ev, results, n_bootstrap=20)
    line = dg.format_diagnostics(b, c, interval)
    assert "\n" not in line and line.startswith("errors dAP50/count: cls ") and f"ECE {c['ECE']:.3f}" in line
    assert f"bkg {100 * b['dAP']['background']:.1f}/{b['count']['background']}" in line
    for f, path in ((dg.plot_error_breakdown, b), (dg.plot_reliability, c)):
        out = f(path, str(tmp_path / f"{f.__name__}.png"))
        assert os.path.getsize(out) > 10_000
    assert dg.format_diagnostics(None, None, None) == "no diagnostics (nothing detected)"
    with pytest.raises(ValueError, match="hotcoco"):
        dg.error_breakdown(pycocotools_eval(gt, model_like_detections(gt, seed=0)))
