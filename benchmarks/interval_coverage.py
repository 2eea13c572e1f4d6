"""Coverage of the AP / AP50 bootstrap intervals by simulation (issue 36, point 3; docs/evaluation.md).

A known truth: a synthetic detector on a synthetic world of images. `--classes` classes with Zipf frequencies (the
rare ones harder to detect, as on COCO), 1-7 boxes per image, and detections drawn around the ground truth: each
box found with its class's recall, jittered by its class's noise, the right class 85 % of the time, scored higher
the better it fits; plus background boxes of random classes with low scores. The truth is each class's AP on
`--population` images of that world; the AP a val set estimates is the mean over the classes it holds (COCO's AP
averages the classes with ground truth), so the target of a val set is the mean of those classes' true APs.

Then `--sets` val sets of each size are drawn; on each, COCOeval's AP and the intervals of
`detlib.evaluation.diagnostics` (today's method and the ones compared) are computed; coverage is the share of
intervals holding the target. Prints a table and writes benchmarks/results_interval_coverage.json.

    python benchmarks/interval_coverage.py                          # the numbers in docs/evaluation.md
    python benchmarks/interval_coverage.py --sizes 30 --sets 50     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from detlib.evaluation import diagnostics as dg  # noqa: E402
from detlib.evaluation.coco import evaluate_coco  # noqa: E402
from detlib.evaluation.metrics import per_class_ap  # noqa: E402

WIDTH, HEIGHT = 640, 480


def world(classes: int, seed: int = 0) -> dict:
    """The classes' frequencies and how hard each is (rarer: lower recall, noisier boxes)."""
    rng = np.random.default_rng(seed)
    freq = 1.0 / np.arange(1, classes + 1)
    rarity = np.arange(classes) / max(classes - 1, 1)  # 0 the most common, 1 the rarest
    return {"freq": freq / freq.sum(), "recall": 0.9 - 0.5 * rarity + 0.05 * rng.standard_normal(classes),
            "jitter": 0.05 + 0.15 * rarity}


def draw_images(w: dict, n: int, rng: np.random.Generator, first_id: int = 1) -> tuple[dict, list[dict]]:
    """`n` images of the world with their ground truth and the detector's detections (COCO dicts, xywh px)."""
    K = len(w["freq"])
    images, anns, dets = [], [], []
    for i in range(first_id, first_id + n):
        images.append({"id": i, "width": WIDTH, "height": HEIGHT, "file_name": f"{i}.jpg"})
        for c in rng.choice(K, size=rng.integers(1, 8), p=w["freq"]):
            bw, bh = rng.uniform(20, 300), rng.uniform(20, 300)
            x, y = rng.uniform(0, WIDTH - bw), rng.uniform(0, HEIGHT - bh)
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": int(c) + 1, "bbox": [x, y, bw, bh],
                         "area": bw * bh, "iscrowd": 0})
            if rng.random() < w["recall"][c]:
                e = rng.normal(0, w["jitter"][c], 4)
                fit = float(np.exp(-4 * np.abs(e).sum()))
                cat = int(c) + 1 if rng.random() < 0.85 else int(rng.integers(1, K + 1))
                dets.append({"image_id": i, "category_id": cat, "score": float(np.clip(0.3 + 0.6 * fit
                                                                                        + 0.1 * rng.random(), 0, 1)),
                             "bbox": [x + e[0] * bw, y + e[1] * bh, bw * (1 + e[2]), bh * (1 + e[3])]})
        for _ in range(rng.poisson(3)):
            bw, bh = rng.uniform(20, 200), rng.uniform(20, 200)
            dets.append({"image_id": i, "category_id": int(rng.integers(1, K + 1)), "score": float(rng.uniform(0, 0.6)),
                         "bbox": [rng.uniform(0, WIDTH - bw), rng.uniform(0, HEIGHT - bh), bw, bh]})
    cats = [{"id": k + 1, "name": f"c{k + 1}"} for k in range(K)]
    return {"images": images, "annotations": anns, "categories": cats}, dets


def true_class_ap(w: dict, population: int, seed: int) -> dict[int, tuple[float, float]]:
    """{category id: (AP, AP50)} of every class on `population` images: the truth."""
    gt, dets = draw_images(w, population, np.random.default_rng(seed))
    ev = evaluate_coco(gt, dets, backend="hotcoco", return_cocoeval=True)[2]
    names = {c["name"]: c["id"] for c in gt["categories"]}
    return {names[n]: (v["AP"], v["AP50"]) for n, v in per_class_ap(ev).items()}


def bias_corrected(draws: np.ndarray, value: float) -> tuple[float, float]:
    """The bias-corrected percentile interval (Efron & Tibshirani 1993, ch. 14.3), z0 capped at +-z so that it holds
    `value`: compared, not adopted."""
    from statistics import NormalDist

    nd = NormalDist()
    share = (np.sum(draws < value) + 0.5 * np.sum(draws == value)) / len(draws)
    z = nd.inv_cdf(0.5 + dg.CONFIDENCE / 2)
    z0 = float(np.clip(nd.inv_cdf(min(max(share, 0.5 / len(draws)), 1 - 0.5 / len(draws))), -z, z))
    lo, hi = np.quantile(draws, [nd.cdf(2 * z0 - z), nd.cdf(2 * z0 + z)])
    return min(lo, value), max(hi, value)


def stratified_weights(npig: np.ndarray, n_bootstrap: int, seed: int) -> np.ndarray:
    """[B, I] draws within strata: each image in the stratum of its rarest class (no class vanishes from a resample),
    each stratum resampled to its own size: compared, not adopted."""
    present = npig > 0
    rarity = np.where(present, present.sum(1, keepdims=True), np.iinfo(np.int64).max)
    strata = np.where(present.any(0), rarity.argmin(0), -1)
    rng = np.random.default_rng(seed)
    W = np.zeros((n_bootstrap, npig.shape[1]), np.int64)
    for s in np.unique(strata):
        members = np.flatnonzero(strata == s)
        for b, drawn in enumerate(members[rng.integers(0, len(members), size=(n_bootstrap, len(members)))]):
            W[b] += np.bincount(drawn, minlength=npig.shape[1])
    return W


def intervals(ev, dets: list[dict], n_bootstrap: int, seed: int) -> dict[str, np.ndarray | None]:
    """{method: [2, 2] (AP, AP50) x (lower, upper), None where it gives none} for one val set."""
    per_class, npig = dg._image_matches(ev, dets)
    rec = np.asarray(ev.params.recThrs, np.float64)
    value = np.asarray(ev.stats[:2], np.float64)
    plain = dg._resampled_ap(per_class, npig, dg._resample_weights(npig.shape[1], n_bootstrap, seed), rec)
    strat = dg._resampled_ap(per_class, npig, stratified_weights(npig, n_bootstrap, seed), rec)
    alpha = 100 * (1 - dg.CONFIDENCE) / 2
    out = {}
    for name, draws in (("image", plain), ("stratified", strat)):
        out[f"{name} percentile"] = np.percentile(draws, [alpha, 100 - alpha], axis=0).T  # before issue 36
        out[f"{name} bias-corrected percentile"] = np.array([bias_corrected(draws[:, j], value[j]) for j in range(2)])
        out[f"{name} basic, holding the value"] = np.array([dg._basic_interval(draws[:, j], value[j])
                                                                       for j in range(2)])
    return out


def build_parser() -> argparse.ArgumentParser:
    from detlib.engine import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--classes", type=int, default=20, help="classes of the world (Zipf frequencies)")
    p.add_argument("--population", type=int, default=20000, help="images the true per-class AP is measured on")
    p.add_argument("--sizes", type=int, nargs="+", default=[30, 100, 300], help="val set sizes (images)")
    p.add_argument("--sets", type=int, default=100, help="val sets drawn per size")
    p.add_argument("--n_bootstrap", type=int, default=100, help="resamples per interval")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results_interval_coverage.json"),
                   help="the results json")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    w = world(args.classes)
    t0 = time.time()
    truth = true_class_ap(w, args.population, seed=1)
    print(f"truth: {len(truth)} classes on {args.population} images ({time.time() - t0:.0f} s); population AP "
          f"{np.mean([v[0] for v in truth.values()]):.4f}")
    report = {"classes": args.classes, "population": args.population, "n_bootstrap": args.n_bootstrap,
              "confidence": dg.CONFIDENCE, "sets": args.sets, "sizes": {}}
    for n in args.sizes:
        rng = np.random.default_rng(1000 + n)
        tally: dict[str, dict] = {}
        bias = []
        for s in range(args.sets):
            gt, dets = draw_images(w, n, rng)
            ev = evaluate_coco(gt, dets, backend="hotcoco", return_cocoeval=True)[2]
            held = sorted({a["category_id"] for a in gt["annotations"]})
            target = np.array([np.mean([truth[c][j] for c in held]) for j in range(2)])
            value = np.asarray(ev.stats[:2])
            bias.append(value - target)
            for name, ci in intervals(ev, dets, args.n_bootstrap, seed=s).items():
                t = tally.setdefault(name, {"covered": np.zeros(2), "holds_value": np.zeros(2), "width": np.zeros(2),
                                            "given": 0})
                if ci is None:
                    continue
                t["given"] += 1
                t["covered"] += (ci[:, 0] <= target) & (target <= ci[:, 1])
                t["holds_value"] += (ci[:, 0] <= value) & (value <= ci[:, 1])
                t["width"] += ci[:, 1] - ci[:, 0]
        rows = {name: {"coverage_AP": t["covered"][0] / max(t["given"], 1),
                       "coverage_AP50": t["covered"][1] / max(t["given"], 1),
                       "holds_value_AP": t["holds_value"][0] / max(t["given"], 1),
                       "holds_value_AP50": t["holds_value"][1] / max(t["given"], 1),
                       "mean_width_AP": t["width"][0] / max(t["given"], 1), "given": t["given"] / args.sets}
                for name, t in tally.items()}
        report["sizes"][str(n)] = {"mean_AP_minus_target": float(np.mean(bias, axis=0)[0]), "methods": rows}
        print(f"\n{n} images, {args.sets} val sets ({time.time() - t0:.0f} s); mean AP - target "
              f"{np.mean(bias, axis=0)[0]:+.4f}")
        print(f"{'method':<44} {'cover AP':>8} {'AP50':>6} {'holds AP':>8} {'AP50':>6} {'width AP':>8} {'given':>6}")
        for name, r in rows.items():
            print(f"{name:<44} {r['coverage_AP']:8.3f} {r['coverage_AP50']:6.3f} {r['holds_value_AP']:8.3f} "
                  f"{r['holds_value_AP50']:6.3f} {r['mean_width_AP']:8.4f} {r['given']:6.2f}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
