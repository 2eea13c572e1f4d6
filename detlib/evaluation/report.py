"""What an evaluation adds to the run folder and the trackers, beside its 12 stats.

`log_evaluation_extras` is the one call a training script makes after each COCO evaluation (main process
does the work; it is not collective). It writes

  output_dir/plots/epoch_NNNN/   per_class_ap, pr_curve, confusion_matrix, f1_curve (.png + .json, `detlib.evaluation.plots`)
  output_dir/plots/training_curves.png   loss and AP curves from output_dir/metrics.jsonl (no tracker needed)
  output_dir/samples/epoch_NNNN/ the fixed sample of val images with detections and ground truth drawn

and, for the trackers the Accelerator was built with:

  wandb        per_class/table (wandb.Table), per_class/AP_bar (bar chart), samples (wandb.Image with boxes=,
               toggled by class and filtered by score in the UI), plots/* (the PNGs)
  tensorboard  per_class/AP/<class> and per_class/AP50/<class> scalars, per_class/table (text),
               samples/<image id> (drawn images, one tag per image so the step slider scrubs epochs), plots/*

Everything is logged at the training step of the evaluation, the step the stats were logged with.

`log_classification_extras` does the same for the classifier: `plots/epoch_NNNN/per_class.json`,
`confusion_matrix.{json,png}` (the full K x K matrix in the json; the PNG shows up to 30 classes, those with the
most errors), wandb `val_per_class` (table) and `plots/confusion_matrix`, tensorboard `per_class/table` (text) and
`plots/confusion_matrix`. The log line only summarises them (detlib.classification.per_class_summary).
"""

from __future__ import annotations

import logging
import os
import time

from ..files import write_json
from . import drawing
from .metrics import format_per_class
from .plots import plot_class_confusion, plot_training_curves, write_evaluation_plots

logger = logging.getLogger(__name__)


def _tracker(accelerator, name: str):
    if not any(getattr(t, "name", "") == name for t in accelerator.trackers):
        return None
    return accelerator.get_tracker(name, unwrap=True)


def log_evaluation_extras(accelerator, output_dir: str, epoch: int | None, step: int, coco_gt: dict,
                          results: list[dict], coco_eval, image_dir: str, num_log_images: int = 16,
                          display_thresh: float = 0.3, confusion_score_thresh: float = 0.25, seed: int = 0,
                          category_names: dict[int, str] | None = None, sample_format: str = "png",
                          best_f1: dict | None = None) -> dict | None:
    """Per-class AP table, plots and sample images of one evaluation, to files and every tracker.

    Call on every process after `CocoEvaluator.evaluate()`; only the main process works (no collective),
    the others return None at once.

    Args:
        accelerator: the run's Accelerator (its trackers are looked up by name; none is fine).
        output_dir: the run folder (plots/ and samples/ are created in it; metrics.jsonl is read from it).
        epoch: the epoch evaluated, counted from 1 (names the folders; None -> "final");
            step: the tracker step.
        coco_gt: the validation ground truth as a COCO dict; `image_dir`: its image folder.
        results: the gathered detections in COCO results format (xywh pixels, category ids, scores).
        coco_eval: the accumulated COCOeval object (`CocoEvaluator.coco_eval`), or None when nothing was detected.
        num_log_images: size of the fixed sample of val images (`drawing.select_sample_ids` with `seed`).
        display_thresh: lowest score drawn on the sample images (the wandb UI can still filter above it).
        confusion_score_thresh: lowest score counted in the confusion matrix.
        category_names: {category id: name}; default the json's names.
        sample_format: "png" (the default: sharp lines and text) or "jpg" for the files under samples/.
        best_f1: `metrics.best_f1_thresholds` of the evaluation (with its curves): the F1 curve plot too.
    Returns:
        (main process) {category name: {"AP", "AP50", "num_gt"}} for the classes with ground truth, the
        object to put into the evaluation line of metrics.jsonl; None on the other processes.
    """
    if not accelerator.is_main_process:
        return None
    t0 = time.perf_counter()
    names = category_names or {c["id"]: str(c.get("name", c["id"])) for c in coco_gt["categories"]}
    tag = "final" if epoch is None else f"epoch_{int(epoch):04d}"
    plots_dir = os.path.join(output_dir, "plots")
    evaluated = coco_eval.params.imgIds if coco_eval is not None else [im["id"] for im in coco_gt["images"]]
    plots = write_evaluation_plots(plots_dir, epoch, coco_eval, coco_gt, results,
                                   confusion_score_thresh=confusion_score_thresh, image_ids=evaluated, best_f1=best_f1)
    per_class = plots["per_class"]
    logger.info("per-class AP at step %d (%d classes with ground truth):\n%s", step, len(per_class),
                format_per_class(per_class, full_table=plots["files"].get("per_class_ap_json")))
    curves = plot_training_curves(os.path.join(output_dir, "metrics.jsonl"),
                                  os.path.join(plots_dir, "training_curves.png"))
    if curves:
        plots["files"]["training_curves"] = curves

    ids = drawing.select_sample_ids(evaluated, num_log_images, seed)
    samples = drawing.sample_detections(coco_gt, results, image_dir, ids, names, display_thresh)
    encoded = drawing.save_samples(samples, os.path.join(output_dir, "samples", tag), ext=sample_format)
    pngs = {k: v for k, v in plots["files"].items()
            if k in ("per_class_ap", "pr_curve", "confusion_matrix", "training_curves", "f1_curve")}

    run = _tracker(accelerator, "wandb")
    if run is not None:
        import wandb

        table = wandb.Table(columns=["class", "AP", "AP50", "num_gt"],
                            data=[[k, v["AP"], v["AP50"], v["num_gt"]] for k, v in per_class.items()])
        log = {"per_class/table": table,
               "per_class/AP_bar": wandb.plot.bar(table, "class", "AP", title="per-class AP (IoU 0.50:0.95)"),
               # the undrawn image: wandb draws the boxes itself, toggled by class and filtered by score
               **{f"samples/{s['image_id']}": wandb.Image(s["image"].permute(1, 2, 0).numpy(), file_type="jpg",
                                                          boxes=drawing.wandb_boxes(s, names), caption=s["file_name"])
                  for s in samples}}
        log.update({f"plots/{k}": wandb.Image(p) for k, p in pngs.items()})
        run.log(log, step=step)

    writer = _tracker(accelerator, "tensorboard")
    if writer is not None:
        for name, v in per_class.items():
            writer.add_scalar(f"per_class/AP/{name}", v["AP"], step)
            writer.add_scalar(f"per_class/AP50/{name}", v["AP50"], step)
        table = "| class | AP | AP50 | #gt |\n|---|---|---|---|\n" + "\n".join(
            f"| {k} | {v['AP']:.4f} | {v['AP50']:.4f} | {v['num_gt']} |" for k, v in per_class.items())
        writer.add_text("per_class/table", table, step)
        for s, data in zip(samples, encoded):
            _tb_encoded_image(writer, f"samples/{s['image_id']}", data, *s["drawn"].shape[-2:], step)
        for k, p in pngs.items():
            with open(p, "rb") as f:
                data = f.read()
            _tb_encoded_image(writer, f"plots/{k}", data, *drawing.image_size(p), step)
        writer.flush()
    logger.info("evaluation extras (plots, %d sample images, trackers) took %.2f s", len(samples), time.perf_counter() - t0)
    return per_class



def _tb_encoded_image(writer, tag: str, data: bytes, height: int, width: int, step: int) -> None:
    """An image summary from already encoded JPEG / PNG bytes.

    `SummaryWriter.add_image` would re-encode every image as PNG (~40-60 ms for 640x480, ten times the rest of
    the work per image); TensorBoard shows any encoding the browser decodes, so the files written anyway go in
    as they are, through the writer's own `file_writer` and its public `add_summary`.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary

    image = Summary.Image(height=int(height), width=int(width), colorspace=3, encoded_image_string=data)
    writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


# wandb logs at most this many rows of a table (wandb.Table.MAX_ROWS; it truncates beyond with a warning)
WANDB_TABLE_ROWS = 10_000
TENSORBOARD_TEXT_ROWS = 1_000


def log_classification_extras(accelerator, output_dir: str, epoch: int | None, step: int, classes: list[str],
                              confusion: list[list[int]], per_class: dict[str, dict]) -> dict:
    """A classifier evaluation's per-class numbers and confusion matrix, to files and every tracker.

    Call on the main process (not collective). `per_class`: `classification.per_class_table(classes, confusion)`;
    `confusion`: [K][K] counts, rows = true class. Tables go worst recall first; wandb gets at most
    `WANDB_TABLE_ROWS` rows, tensorboard's text `TENSORBOARD_TEXT_ROWS` (the json files have every class).
    Returns {"folder": the evaluation's folder, "files": {name: path}}.
    """
    folder = os.path.join(output_dir, "plots", "final" if epoch is None else f"epoch_{int(epoch):04d}")
    files = {"per_class_json": write_json(per_class, os.path.join(folder, "per_class.json")),
             "confusion_matrix_json": write_json({"names": list(classes), "matrix": confusion},
                                                 os.path.join(folder, "confusion_matrix.json")),
             "confusion_matrix": plot_class_confusion(classes, confusion, os.path.join(folder, "confusion_matrix.png"))}
    ranked = sorted(per_class.items(), key=lambda kv: (kv[1]["recall"], kv[0]))
    columns = ["class", "precision", "recall", "f1", "support", "predicted"]
    rows = [[c, v["precision"], v["recall"], v["f1"], v["support"], v["predicted"]] for c, v in ranked]
    run = _tracker(accelerator, "wandb")
    if run is not None:
        import wandb

        run.log({"val_per_class": wandb.Table(columns=columns, data=rows[:WANDB_TABLE_ROWS]),
                 "plots/confusion_matrix": wandb.Image(files["confusion_matrix"])}, step=step)
    writer = _tracker(accelerator, "tensorboard")
    if writer is not None:
        shown = rows[:TENSORBOARD_TEXT_ROWS]
        note = f"\n\n{len(rows) - len(shown)} more classes in {files['per_class_json']}" if len(rows) > len(shown) else ""
        header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
        body = "\n".join(f"| {c} | {p:.4f} | {r:.4f} | {f:.4f} | {n} | {k} |" for c, p, r, f, n, k in shown)
        writer.add_text("per_class/table", header + body + note, step)
        with open(files["confusion_matrix"], "rb") as f:
            data = f.read()
        size = drawing.image_size(files["confusion_matrix"])
        _tb_encoded_image(writer, "plots/confusion_matrix", data, *size, step)
        writer.flush()
    return {"folder": folder, "files": files}


def evaluation_diagnostics(evaluator, output_dir: str, epoch: int | None, n_bootstrap: int | None = None,
                           seed: int = 0, label_errors: bool = False, category_names: dict | None = None) -> dict:
    """Why the AP is what it is (issue 29): TIDE errors, calibration, bootstrap intervals, optionally label errors.

    Call on the main process after `CocoEvaluator.evaluate()` (not collective: it reads the gathered results and
    `evaluator.coco_eval`), before the evaluation's metrics.jsonl line, so that `metrics` goes into it.

    Args:
        evaluator: the `CocoEvaluator` just evaluated (its backend any: a hotcoco evaluation is made when it is not).
        output_dir: the run folder; epoch: as `log_evaluation_extras` (names plots/epoch_NNNN/, None -> final).
        n_bootstrap: image resamples of the 95 % intervals (default `diagnostics.EVALUATION_BOOTSTRAP`; 0: none).
        seed: the bootstrap's seed (the same seed repeats the intervals).
        label_errors: also write output_dir/label_errors.json (the final evaluation's ranked list).
    Writes:
        plots/<tag>/error_breakdown.{png,json}, plots/<tag>/reliability.{png,json}, plots/<tag>/bootstrap.json, and
        with `label_errors` output_dir/label_errors.json.
    Returns:
        {"metrics": {"num_images_evaluated": int, "errors": {"AP50", "dAP": {type: float}, "count": {type: int},
        "dAP_false_positives", "dAP_false_negatives"}, "calibration": {"ECE", "MCE", "num_detections"},
        "AP_ci95": [lower, upper], "AP50_ci95": [lower, upper], "bootstrap": {"n_bootstrap", "seed", "method",
        "std_err_AP", "std_err_AP50"}} (the keys without a figure are absent when nothing was detected; where
        resampling gives no interval, `bootstrap` says why in "no_interval" and the ci95 and std_err keys are absent),
        "line": `diagnostics.format_diagnostics` (one line for train.log; the first of `output_dir` in this process
        followed by `diagnostics.DIAGNOSTICS_KEY`), "files": {name: path},
        "seconds": the time it took}.
    """
    from . import diagnostics, label_errors as errors_mod

    t0 = time.perf_counter()
    tag = "final" if epoch is None else f"epoch_{int(epoch):04d}"
    folder = os.path.join(output_dir, "plots", tag)
    results, image_ids = evaluator.evaluated()
    out = {"num_images_evaluated": evaluator.num_images_evaluated}
    files = {}
    ev = diagnostics.hotcoco_evaluation(evaluator.coco_eval, evaluator.gt_dataset, results, image_ids,
                                        getattr(evaluator, "area_ranges", None)) if results else None
    breakdown = calib = interval = None
    if ev is not None:
        breakdown = diagnostics.error_breakdown(ev)
        calib = diagnostics.calibration(ev)
        files["error_breakdown"] = diagnostics.plot_error_breakdown(breakdown, os.path.join(folder, "error_breakdown.png"))
        files["error_breakdown_json"] = write_json(breakdown, os.path.join(folder, "error_breakdown.json"))
        files["reliability"] = diagnostics.plot_reliability(calib, os.path.join(folder, "reliability.png"))
        files["reliability_json"] = write_json(calib, os.path.join(folder, "reliability.json"))
        out["errors"] = {k: breakdown[k] for k in ("AP50", "dAP", "count", "dAP_false_positives", "dAP_false_negatives")}
        out["calibration"] = {k: calib[k] for k in ("ECE", "MCE", "num_detections")}
        n = diagnostics.EVALUATION_BOOTSTRAP if n_bootstrap is None else int(n_bootstrap)
        if n >= 2:
            interval = diagnostics.bootstrap_interval(ev, results, n_bootstrap=n, seed=seed)
            files["bootstrap_json"] = write_json(interval, os.path.join(folder, "bootstrap.json"))
            out["bootstrap"] = {"n_bootstrap": n, "seed": int(seed), "method": interval["method"]}
            missing = [m for m in ("AP", "AP50") if "none" in interval[m]]
            if missing:  # one line: F06
                out["bootstrap"]["no_interval"] = interval[missing[0]]["none"]
                logger.warning("no 95 %% interval of %s: %s", " or ".join(missing), interval[missing[0]]["none"])
            for m in ("AP", "AP50"):
                if m not in missing:
                    out[f"{m}_ci95"] = [interval[m]["lower"], interval[m]["upper"]]
                    out["bootstrap"][f"std_err_{m}"] = interval[m]["std_err"]
    if label_errors:
        found = errors_mod.find_label_errors(evaluator.gt_dataset, results, image_ids, category_names=category_names)
        found = errors_mod.original_ids(found, evaluator.original_ids)
        files["label_errors"] = errors_mod.write_label_errors(os.path.join(output_dir, errors_mod.LABEL_ERRORS_FILE),
                                                              found, {"score_thresh": 0.3, "iou": 0.5})
        out["label_errors"] = errors_mod.count_label_errors(found)
        logger.info("%s\n  (all of them: %s)", errors_mod.format_label_errors(found), files["label_errors"])
    seconds = time.perf_counter() - t0
    logger.info("evaluation diagnostics (errors, calibration, %s) took %.2f s",
                f"{interval['n_bootstrap']} bootstrap resamples" if interval else "no bootstrap", seconds)
    line = diagnostics.format_diagnostics(breakdown, calib, interval)
    if breakdown and output_dir not in _KEYED:  # the first line of this run folder in this process gets the key
        _KEYED.add(output_dir)
        line += "\n" + diagnostics.DIAGNOSTICS_KEY
    return {"metrics": out, "line": line, "files": files, "seconds": seconds}


_KEYED: set[str] = set()  # the run folders whose diagnostics line was explained (`evaluation_diagnostics`)


def log_diagnostics_to_trackers(accelerator, diagnostics_out: dict, step: int) -> None:
    """The diagnostics' scalars and plots to every tracker (main process; not collective), at the evaluation's step.

    Scalars: errors/dAP_<type>, errors/count_<type> (types: classification, localisation, both, duplicate,
    background, missed), errors/dAP_false_positives, errors/dAP_false_negatives, calibration/ECE, calibration/MCE,
    ci/AP_lower, ci/AP_upper, ci/AP50_lower, ci/AP50_upper; images: plots/error_breakdown, plots/reliability.
    """
    if not accelerator.is_main_process:
        return
    m = diagnostics_out["metrics"]
    scalars = {}
    if "errors" in m:
        scalars.update({f"errors/dAP_{k}": v for k, v in m["errors"]["dAP"].items()})
        scalars.update({f"errors/count_{k}": v for k, v in m["errors"]["count"].items()})
        scalars.update({"errors/dAP_false_positives": m["errors"]["dAP_false_positives"],
                        "errors/dAP_false_negatives": m["errors"]["dAP_false_negatives"],
                        "calibration/ECE": m["calibration"]["ECE"], "calibration/MCE": m["calibration"]["MCE"]})
    for key in ("AP", "AP50"):
        if f"{key}_ci95" in m:
            scalars[f"ci/{key}_lower"], scalars[f"ci/{key}_upper"] = m[f"{key}_ci95"]
    pngs = {k: p for k, p in diagnostics_out["files"].items() if k in ("error_breakdown", "reliability")}
    run = _tracker(accelerator, "wandb")
    if run is not None:
        import wandb

        run.log({**scalars, **{f"plots/{k}": wandb.Image(p) for k, p in pngs.items()}}, step=step)
    writer = _tracker(accelerator, "tensorboard")
    if writer is not None:
        for k, v in scalars.items():
            writer.add_scalar(k, v, step)
        for k, p in pngs.items():
            with open(p, "rb") as f:
                data = f.read()
            _tb_encoded_image(writer, f"plots/{k}", data, *drawing.image_size(p), step)
        writer.flush()
