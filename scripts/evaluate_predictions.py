"""Evaluate a COCO results file as a training run's evaluation does: the 12 stats, per-class AP, the best-F1
thresholds, the error breakdown, calibration, the 95 % intervals and the likely label errors.

    python scripts/evaluate_predictions.py --annotations val.json --predictions run/predictions_val.json
    python scripts/evaluate_predictions.py --annotations val.json --predictions other_tool.json --out eval.json --plots eval/

The results name images by the json's ids (what `train_retinanet.py` writes as predictions_val.json and
`predict_retinanet.py` on a COCO json); results that all carry a `file_name` (predict on a folder) are matched by it.
Every image of the annotations is evaluated, an image without a result counting as one where nothing was found, as
in the run. Given a run's predictions_val.json (and its --area_ranges, --seed, --eval_bootstrap), the numbers are the
run's evaluation's. `--out` writes one JSON object with the keys of the evaluation line of metrics.jsonl;
`--plots DIR` writes the plots and label_errors.json as a run writes them (DIR/plots/final/, DIR/label_errors.json).
Exit 0 when it ran; 1 for a file that cannot be read or matched to the annotations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from detlib.engine import HelpFormatter, float_range, int_at_least


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--annotations", required=True, help="the ground truth (COCO json)")
    p.add_argument("--predictions", required=True, help="the detections (COCO results json)")
    p.add_argument("--out", help="write the evaluation as one JSON object here (default: none)")
    p.add_argument("--plots", metavar="DIR", help="write the plots and label_errors.json under DIR (default: none)")
    p.add_argument("--area_ranges", type=float_range(0), nargs="+", metavar="PX", help="edges of the small / medium / "
                   "large ranges in px of the box side, sqrt(area), not px^2 (default: COCO's 0 32 96)")
    p.add_argument("--n_bootstrap", type=int_at_least(0), default=100, help="image resamples of the 95%% intervals "
                   "(0: none; a run's --eval_bootstrap)")
    p.add_argument("--seed", type=int, default=0, help="the resampling seed (a run's --seed)")
    p.add_argument("--coco_eval_backend", default="auto", choices=["auto", "hotcoco", "pycocotools", "faster"],
                   help="COCOeval implementation (all give the same stats)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    import logging

    from detlib.evaluation import (CocoEvaluator, area_ranges_from_edges, best_f1_thresholds,
                                   evaluation_diagnostics, format_best_f1, per_class_ap, per_class_without_detections)
    from detlib.evaluation.metrics import format_per_class
    from detlib.evaluation.plots import write_evaluation_plots
    from detlib.engine import stop
    from detlib.evaluation.results_file import ResultsFileError, covered_images, read_files

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        ranges = area_ranges_from_edges(args.area_ranges) if args.area_ranges else None
    except ValueError as e:
        stop(f"--area_ranges: {e}", code=1)
    try:
        gt, (results,), notes = read_files(args.annotations, [args.predictions])
    except ResultsFileError as e:
        stop(str(e), code=1)
    for note in notes:
        print(note)
    evaluator = CocoEvaluator(gt, args.coco_eval_backend, area_ranges=ranges)
    by_image = {im["id"]: [] for im in gt["images"]}
    for r in results:
        by_image[r["image_id"]].append(r)
    for image_id in sorted(by_image):  # the run's order: by image id, each image's results as written
        evaluator.add(image_id, by_image[image_id])
    covered = len(covered_images(results))
    print(f"{args.predictions}: results on {covered} of the {len(by_image)} images of {args.annotations}"
          + ("" if covered == len(by_image) else "; the others count as images where nothing was found"))
    stats, summary = evaluator.evaluate()
    print(summary)
    per_class = (per_class_ap(evaluator.coco_eval) if evaluator.coco_eval is not None
                 else per_class_without_detections(evaluator.gt_dataset))
    print(format_per_class(per_class))
    best_f1 = best_f1_thresholds(evaluator.gt_dataset, *evaluator.evaluated())
    print(format_best_f1(best_f1))
    with tempfile.TemporaryDirectory() as scratch:  # the diagnostics write their files; kept only with --plots
        folder = args.plots or scratch
        report_log = logging.getLogger("detlib.evaluation.report")
        level = report_log.level
        if not args.plots:  # its log names files that will not be kept
            report_log.setLevel(logging.WARNING)
        try:
            diagnosed = evaluation_diagnostics(evaluator, folder, None, args.n_bootstrap, args.seed, label_errors=True)
        finally:
            report_log.setLevel(level)
        print(diagnosed["line"])
        if not args.plots:
            print("likely label errors:", ", ".join(f"{k} {v}" for k, v in diagnosed["metrics"]["label_errors"].items()),
                  "(--plots DIR writes the list)")
        if args.plots:
            write_evaluation_plots(os.path.join(folder, "plots"), None, evaluator.coco_eval, evaluator.gt_dataset,
                                   evaluator.evaluated()[0], image_ids=evaluator.evaluated()[1], best_f1=best_f1)
    line = {"epoch": None, "step": None, **stats, "per_class": per_class,
            "best_f1": {k: v for k, v in best_f1.items() if k != "curves"}, **diagnosed["metrics"],
            "predictions": os.path.abspath(args.predictions)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(line, f, indent=1)
    return line


if __name__ == "__main__":
    main()
