"""Is B better than A? Two predictions files on the same ground truth: the AP difference, its 95 % interval by paired
image bootstrap, and the probability that B is better (detlib.evaluation.diagnostics.compare_evaluations).

    python scripts/compare_predictions.py --annotations val.json --a runA/predictions_val.json --b runB/predictions_val.json
    python scripts/compare_predictions.py --annotations val.json --a A.json --b B.json --n_bootstrap 2000 --seed 1 --out cmp.json

Both files are COCO results (what `train_retinanet.py` writes as predictions_val.json: the json's image ids, xywh px;
results that all carry a `file_name`, as `predict_retinanet.py` writes for a folder, are matched by it). It says first
how many val images each file covers (has a result on); when the two cover different images, the comparison is of the
images both cover, and says so (`--all_images`: every image of the annotations, an image without a result counting as
one where nothing was found); no common image: exit 1. The interval is a paired image bootstrap with
bias-corrected percentiles (docs/evaluation.md). The same seed gives the same numbers. Exit 0 when it ran, whatever
the answer; 1 for a file that cannot be read or matched to the annotations.
"""

from __future__ import annotations

import argparse
import json

from detlib.engine import ArgumentParser, HelpFormatter, int_at_least


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)  # escapes what the console cannot write
    p.add_argument("--annotations", required=True, help="the ground truth both runs were evaluated on (COCO json)")
    p.add_argument("--a", required=True, help="predictions of run A (COCO results json)")
    p.add_argument("--b", required=True, help="predictions of run B (COCO results json)")
    p.add_argument("--all_images", action="store_true", help="compare on every image of the annotations even when "
                   "the files cover different images (default: on the images both cover)")
    p.add_argument("--n_bootstrap", type=int_at_least(1), default=1000, help="image resamples")
    p.add_argument("--seed", type=int, default=0, help="the resampling seed")
    p.add_argument("--out", help="also write the comparison as JSON here (default: none)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from detlib.engine import stop
    from detlib.evaluation.coco import evaluate_coco
    from detlib.evaluation.diagnostics import compare_evaluations
    from detlib.evaluation.results_file import ResultsFileError, covered_images, read_files

    try:
        gt, (a, b), notes = read_files(args.annotations, [args.a, args.b])
    except ResultsFileError as e:
        stop(str(e), code=1)
    runs = {"a": a, "b": b}
    for note in notes:
        print(note)
    all_ids = sorted(im["id"] for im in gt["images"])
    covered = {name: covered_images(results) for name, results in runs.items()}
    print(f"val images: {len(all_ids)}; A covers {len(covered['a'])}, B covers {len(covered['b'])}")
    ids = all_ids
    if covered["a"] != covered["b"] and not args.all_images:
        ids = sorted(covered["a"] & covered["b"])
        if not ids:
            stop("the two files have no image in common: nothing to compare", code=1)
        print(f"comparing on the {len(ids)} images both cover (--all_images: on all {len(all_ids)}, an image without "
              "results counting as nothing found)")
        runs = {name: [r for r in results if r["image_id"] in set(ids)] for name, results in runs.items()}
    evals = {}
    for name, results in runs.items():
        evals[name] = evaluate_coco(gt, results, image_ids=ids, backend="hotcoco", checked=True, return_cocoeval=True)[2]
        if evals[name] is None:
            stop(f"{getattr(args, name)} holds no detection", code=1)
    c = compare_evaluations(evals["a"], evals["b"], runs["a"], runs["b"], n_bootstrap=args.n_bootstrap, seed=args.seed)
    c.update(images_covered={"A": len(covered["a"]), "B": len(covered["b"]), "val": len(all_ids)})
    print(f"{c['num_images']} images, {c['n_bootstrap']} paired image resamples, seed {c['seed']}")
    for m in ("AP", "AP50"):
        v = c[m]
        if "none" in v:
            print(f"{m:<5} A {v['A']:.4f}  B {v['B']:.4f}  B - A {v['delta']:+.4f}  no interval: {v['none']}")
            continue
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
