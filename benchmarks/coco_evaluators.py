"""The maintained COCO evaluators side by side: equal to pycocotools on every case, and how fast.

    python benchmarks/coco_evaluators.py                       # 5,000 images x 100 detections, 2 timed rounds
    python benchmarks/coco_evaluators.py --images 1000 --repeats 3 --out /tmp/evaluators.json

Equality: each evaluator runs every case of `benchmarks/coco_eval_cases.py` (crowd, the ignore flag, images without
ground truth or detections, one class, non-contiguous ids, ties, > 100 detections per image, an image subset, other
area ranges) and its 12 stats and its `eval["precision"]` / `eval["recall"]` arrays are compared with
pycocotools' with `==` (bit for bit): `exact` is True only when every case is equal, `max_stat_diff` is the largest
difference seen. An evaluator that refuses a case (an unsupported parameter) is not exact.

Time: `devtools.peers.coco_eval_inputs(N, 100)` (N copies of the subset's 130 images, crowd kept, 100 model-like
detections each: the benchmark of docs/benchmarks.md). Each evaluator does what a user does: index the ground truth,
load the results, evaluate, accumulate, summarize; `detlib` is `evaluate_coco(backend=...)` of the adopted one (its
copies and checks included). One warm-up on a 20-image set, then rounds alternating the order (reversed every round,
as in benchmarks/run.py); medians; ratio = time / pycocotools' time.

Writes a JSON summary (`--out`, default benchmarks/results_coco_evaluators.json) and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from coco_eval_cases import all_cases  # noqa: E402

from detlib.engine import HelpFormatter  # noqa: E402
from detlib.evaluation.coco import evaluate_coco  # noqa: E402

EVALUATORS = ("pycocotools", "faster-coco-eval", "hotcoco", "ultrafast-pycocotools", "vernier")
ADOPTED = "hotcoco"  # detlib.evaluation.coco's "auto" backend
GOAL = 0.05  # the issue's: at most 0.05 of pycocotools' time on 5,000 images


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def run_evaluator(name: str, gt: dict, results: list[dict], area_rng=None, img_ids=None):
    """One plain evaluation with library `name`; returns the COCOeval-like object (accumulated, summarized).

    `gt` is not modified (the pycocotools-style libraries get a shallow copy of each dict they write into).
    """
    gt = dict(gt, info=gt.get("info", {}), licenses=gt.get("licenses", []),
              images=[dict(im) for im in gt["images"]], annotations=[dict(a) for a in gt["annotations"]])
    res = [dict(r) for r in results]
    with contextlib.redirect_stdout(io.StringIO()):
        if name == "hotcoco":
            import hotcoco

            coco_gt = hotcoco.COCO(gt)
            ev = hotcoco.COCOeval(coco_gt, coco_gt.load_res(res), "bbox")
        else:
            if name == "pycocotools" or name == "vernier":
                from pycocotools.coco import COCO
            elif name == "faster-coco-eval":
                from faster_coco_eval import COCO
            elif name == "ultrafast-pycocotools":
                from ultrafast_pycocotools import COCO
            else:
                raise ValueError(name)
            coco_gt = COCO()
            coco_gt.dataset = gt
            coco_gt.createIndex()
            coco_dt = coco_gt.loadRes(res)
            if name == "pycocotools":
                from pycocotools.cocoeval import COCOeval

                ev = COCOeval(coco_gt, coco_dt, "bbox")
            elif name == "faster-coco-eval":
                from faster_coco_eval import COCOeval_faster

                ev = COCOeval_faster(coco_gt, coco_dt, "bbox", print_function=lambda *a, **k: None)
            elif name == "ultrafast-pycocotools":
                from ultrafast_pycocotools import COCOeval

                ev = COCOeval(coco_gt, coco_dt, "bbox")
            else:
                import vernier

                ev = vernier.COCOeval(coco_gt, coco_dt, "bbox")
        if img_ids is not None:
            ev.params.imgIds = sorted(img_ids)
        if area_rng is not None:
            ev.params.areaRng = [list(r) for r in area_rng]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


def equality(names) -> dict:
    """{evaluator: {"exact", "max_stat_diff", "cases": {case: "equal" | "stats differ by ..." | "refused: ..."}}}."""
    cases = all_cases()
    ref = {}
    for case, c in cases.items():
        ev = run_evaluator("pycocotools", c["gt"], c["results"], c.get("area_rng"), c.get("img_ids"))
        ref[case] = (np.asarray(ev.stats, np.float64), np.asarray(ev.eval["precision"]), np.asarray(ev.eval["recall"]))
    out = {}
    for name in names:
        per_case, exact, worst = {}, True, 0.0
        for case, c in cases.items():
            try:
                ev = run_evaluator(name, c["gt"], c["results"], c.get("area_rng"), c.get("img_ids"))
            except Exception as e:  # an unsupported parameter: the evaluator cannot score this case
                per_case[case] = f"refused: {type(e).__name__}: {str(e)[:120]}"
                exact = False
                continue
            stats = np.asarray(ev.stats, np.float64)
            p, r = np.asarray(ev.eval["precision"]), np.asarray(ev.eval["recall"])
            diff = float(np.abs(stats - ref[case][0]).max())
            worst = max(worst, diff)
            same = (np.array_equal(stats, ref[case][0]) and p.shape == ref[case][1].shape
                    and np.array_equal(p, ref[case][1]) and np.array_equal(r, ref[case][2]))
            exact &= same
            per_case[case] = "equal" if same else f"stats differ by {diff:.1e}, precision arrays equal: " \
                                                  f"{p.shape == ref[case][1].shape and np.array_equal(p, ref[case][1])}"
        out[name] = {"exact": exact, "max_stat_diff": worst, "cases": per_case}
    return out


def timing(names, images: int, repeats: int) -> dict:
    from devtools.peers import coco_eval_inputs

    gt, results = coco_eval_inputs(images, 100)
    warm_gt, warm_results = coco_eval_inputs(20, 100, seed=1)
    fns = {n: (lambda n=n, g=gt, r=results: run_evaluator(n, g, r)) for n in names}
    fns["detlib"] = lambda: evaluate_coco(gt, results, backend=ADOPTED)
    for n in names:
        run_evaluator(n, warm_gt, warm_results)
    evaluate_coco(warm_gt, warm_results, backend=ADOPTED)
    times = {n: [] for n in fns}
    for k in range(repeats):
        for n in (list(fns) if k % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
            print(f"  round {k + 1}: {n} {times[n][-1]:.2f} s", flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    return {"images": images, "detections": len(results), "annotations": len(gt["annotations"]),
            "median_s": med, "ratio_to_pycocotools": {n: med[n] / med["pycocotools"] for n in med}, "all_s": times}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--images", type=int, default=5000, help="images of the timing benchmark")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (medians reported)")
    p.add_argument("--skip_timing", action="store_true", help="only the equality on the cases")
    p.add_argument("--out", default=os.path.join(HERE, "results_coco_evaluators.json"), help="the JSON summary")
    return p


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    dists = {"pycocotools": "pycocotools", "faster-coco-eval": "faster-coco-eval", "hotcoco": "hotcoco",
             "ultrafast-pycocotools": "ultrafast-pycocotools", "vernier": "vernier"}
    names = [n for n in EVALUATORS if _version(dists[n])]
    result = {"machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "load_average_start": os.getloadavg()},
              "versions": {n: _version(dists[n]) for n in EVALUATORS}, "adopted": ADOPTED, "goal": GOAL,
              "equality": equality(names)}
    if not args.skip_timing:
        result["timing"] = timing(names, args.images, args.repeats)
        result["machine"]["load_average_end"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n| evaluator | version | exact on all {len(all_cases())} cases | max stat diff | median s | ratio |")
    print("|---|---|---|---|---|---|")
    for n in [*names, "detlib"]:
        eq = result["equality"].get(n, result["equality"].get(ADOPTED) if n == "detlib" else None)
        t = result.get("timing", {})
        med, ratio = t.get("median_s", {}).get(n), t.get("ratio_to_pycocotools", {}).get(n)
        label = f"detlib evaluate_coco ({ADOPTED})" if n == "detlib" else n
        print(f"| {label} | {result['versions'].get(n, result['versions'][ADOPTED] if n == 'detlib' else '')} | "
              f"{eq['exact'] if eq else '-'} | {eq['max_stat_diff']:.1e} | "
              f"{'-' if med is None else f'{med:.2f}'} | {'-' if ratio is None else f'{ratio:.3f}'} |")
    return result


if __name__ == "__main__":
    main()
