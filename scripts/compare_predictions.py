"""Is B better than A? Two predictions files on the same ground truth: the AP difference, its 95 % interval by paired
image bootstrap, and the probability that B is better (detlib.evaluation.diagnostics.compare_evaluations, hotcoco).

    python scripts/compare_predictions.py --annotations val.json --a runA/predictions_val.json --b runB/predictions_val.json
    python scripts/compare_predictions.py --annotations val.json --a A.json --b B.json --n_bootstrap 2000 --seed 1 --out cmp.json

Both files are COCO results (what `train_retinanet.py` writes as predictions_val.json: the json's image ids, xywh px).
Every image of the annotations is evaluated (an image without a detection counts as one with nothing found). The same
seed gives the same numbers. Exit 0 when it ran, whatever the answer; 1 for a file that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys

from detlib.engine import ArgumentParser, HelpFormatter, int_at_least


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)  # escapes what the console cannot write
    p.add_argument("--annotations", required=True, help="the ground truth both runs were evaluated on (COCO json)")
    p.add_argument("--a", required=True, help="predictions of run A (COCO results json)")
    p.add_argument("--b", required=True, help="predictions of run B (COCO results json)")
    p.add_argument("--n_bootstrap", type=int_at_least(1), default=1000, help="image resamples")
    p.add_argument("--seed", type=int, default=0, help="the resampling seed")
    p.add_argument("--out", help="also write the comparison as JSON here (default: none)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from detlib.evaluation.coco import checked_ground_truth, evaluate_coco
    from detlib.evaluation.diagnostics import compare_evaluations

    try:
        with open(args.annotations) as f:
            gt = checked_ground_truth(json.load(f))
        runs = {}
        for name in ("a", "b"):
            with open(getattr(args, name)) as f:
                runs[name] = json.load(f)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    internal = {im["original_id"]: im["id"] for im in gt["images"] if "original_id" in im}
    ids = [im["id"] for im in gt["images"]]
    evals = {}
    for name, results in runs.items():
        if internal:
            results = [dict(r, image_id=internal.get(r["image_id"], r["image_id"])) for r in results]
        evals[name] = evaluate_coco(gt, results, image_ids=ids, backend="hotcoco", checked=True, return_cocoeval=True)[2]
        if evals[name] is None:
            print(f"error: {getattr(args, name)} holds no detection", file=sys.stderr)
            raise SystemExit(1)
    c = compare_evaluations(evals["a"], evals["b"], n_bootstrap=args.n_bootstrap, seed=args.seed)
    print(f"{c['num_images']} images, {c['n_bootstrap']} paired image resamples, seed {c['seed']}")
    for m in ("AP", "AP50"):
        v = c[m]
        verdict = ("the same on every resample" if v["lower"] == v["upper"] == 0 else
                   f"P(B better) {v['prob_b_better']:.3f}")  # identical files: a tie, not "B never better"
        print(f"{m:<5} A {v['A']:.4f}  B {v['B']:.4f}  B - A {v['delta']:+.4f}  95 % [{v['lower']:+.4f}, {v['upper']:+.4f}]"
              f"  {verdict}")
    losses = [p for p in c["per_class"] if p["delta"] < 0][:3]  # per_class: the largest loss first
    gains = [p for p in reversed(c["per_class"]) if p["delta"] > 0][:3]
    print("largest AP losses:", ", ".join(f"{p['class']} {p['delta']:+.3f}" for p in losses) or "none")
    print("largest AP gains: ", ", ".join(f"{p['class']} {p['delta']:+.3f}" for p in gains) or "none")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(c, f, indent=1)
    return c


if __name__ == "__main__":
    main()
