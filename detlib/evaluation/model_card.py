"""Model cards: the README.md of a weights folder (best/, last/, scripts/convert_weights.py's output), written from
what the run knows, in the Hugging Face Hub's format so the folder can be uploaded as it is (`detlib.hub`).

The card opens with the Hub's metadata block (YAML, built with `huggingface_hub.ModelCardData`, so the Hub and
`huggingface_hub.ModelCard.load` / `metadata_load` read it back): `library_name: detlib`, `pipeline_tag`, `tags`,
`datasets` (the data set's name, or its Hub id), `classes` (the class names in output order) and
`category_ids`, and the evaluation as `model-index` results: the 12 COCO stats and the best-F1 numbers, the
values of the evaluation's metrics.jsonl line exactly. Then the text: the model, the evaluation with the
per-class table (AP, the best-F1 score threshold), the command that trained it, and how to predict, evaluate
and export it.
"""

from __future__ import annotations

import os
import shlex
import sys

from ..files import atomic_write
from .coco import STAT_NAMES

CARD_FILE = "README.md"
# COCO stats in model-index: Papers-with-Code style metric types, the names pycocotools prints.
STAT_TITLES = {"AP": "AP (IoU 0.50:0.95)", "AP50": "AP (IoU 0.50)", "AP75": "AP (IoU 0.75)", "APs": "AP small",
               "APm": "AP medium", "APl": "AP large", "AR1": "AR (1 detection)", "AR10": "AR (10 detections)",
               "AR100": "AR (100 detections)", "ARs": "AR small", "ARm": "AR medium", "ARl": "AR large"}


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that ran `script` with `argv` (default: this process's arguments), as one shell line."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["accelerate", "launch", f"scripts/{script}", *map(str, args)])


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def card_dataset(paths: dict, data_format: str, data_dir: str | None = None, builtin: str | None = None) -> dict:
    """`detector_card`'s `dataset` of a run on `paths` (its data paths: "train_annotations", "val_annotations"): named
    after the `builtin` set trained on without data, else `data_dir`'s folder, else the val json."""
    if builtin:
        name = f"detlib synthetic {builtin.replace('_', ' ')}"
    elif data_dir:
        name = os.path.basename(os.path.abspath(data_dir))
    else:
        name = os.path.splitext(os.path.basename(paths["val_annotations"]))[0]
    return {"name": name, "format": data_format, "train": paths.get("train_annotations"),
            "val": paths.get("val_annotations")}


def detector_card(model_config: dict, *, evaluation: dict | None, dataset: dict, command: str | None,
                  weights_name: str, where: str, notes: list[str] = ()):
    """The model card of a RetinaNet weights folder (a `huggingface_hub.ModelCard`).

    Args:
        model_config: the folder's model_config.json (backbone, width, size, `category_ids`, `category_names`).
        evaluation: the metrics.jsonl line of the evaluation of these weights (the 12 stats, `per_class`,
            `best_f1`, `epoch`, `step`), or None when they were not evaluated.
        dataset: {"name": shown and put in `datasets`, "format", "train", "val": where the splits came from}.
        command: the command that trained the weights (None: not trained here, e.g. converted).
        weights_name: "best", "last" or the folder's name; where: how the usage lines name the weights (the
            folder's path, or the Hub repo id it is pushed to).
        notes: paragraphs added under the model's description.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    names = [str(n) for n in model_config.get("category_names") or model_config.get("category_ids") or []]
    ids = [int(i) for i in model_config.get("category_ids") or range(1, len(names) + 1)]
    data_name = str(dataset.get("name") or "unknown")
    results = []
    if evaluation:
        split = os.path.basename(str(dataset.get("val") or "val"))
        common = dict(task_type="object-detection", task_name="Object Detection", dataset_type=data_name,
                      dataset_name=data_name, dataset_split=split)
        for k in STAT_NAMES:
            if _number(evaluation.get(k)) is not None:
                results.append(EvalResult(metric_type=k, metric_value=float(evaluation[k]), metric_name=STAT_TITLES[k],
                                          **common))
        pooled = (evaluation.get("best_f1") or {}).get("all") or {}
        if pooled.get("score_thresh") is not None:
            for k in ("F1", "precision", "recall"):
                results.append(EvalResult(metric_type=f"best_{k.lower()}", metric_value=float(pooled[k]),
                                          metric_name=f"{k} at the best-F1 score threshold {pooled['score_thresh']:.3f} "
                                                      "(IoU 0.50, all classes pooled)", **common))
    title = f"RetinaNet {model_config.get('backbone')} ({weights_name})"
    data = ModelCardData(library_name="detlib", pipeline_tag="object-detection", datasets=[data_name],
                         tags=["object-detection", "retinanet", "detlib", str(model_config.get("backbone")), "safetensors"],
                         metrics=["mAP"] if evaluation else None, model_name=title, eval_results=results or None,
                         classes=names, category_ids=ids)
    # --score_thresh best_f1 works only where the evaluation found a threshold (some true detection)
    thresholds = ((evaluation or {}).get("best_f1") or {}).get("all", {}).get("score_thresh") is not None
    size = f"{model_config.get('image_size')} px" + (f", at most {model_config['max_size']} px" if model_config.get(
        "max_size") else "")
    body = [f"# {title}", "",
            f"A RetinaNet detector ({model_config.get('backbone')} backbone, FPN and heads of "
            f"{model_config.get('fpn_channels')} channels, {len(names)} classes, images resized to {size}) "
            f"trained with detlib: `model.safetensors` holds the weights, `model_config.json` how to rebuild the model"
            + (", `score_thresholds.json` the score thresholds that maximised F1 in the evaluation." if thresholds
               else "."), ""]
    body += [*notes, ""] if notes else []
    body += [f"Data: {data_name}" + (f" ({dataset['format']})" if dataset.get("format") else "")
             + "".join(f"; {k} {dataset[k]}" for k in ("train", "val") if dataset.get(k)) + ".", ""]
    body += _evaluation_section(evaluation, names, ids)
    if command:
        body += ["## Training", "", "```bash", command, "```", ""]
    body += ["## Use", "", "```bash",
             "# detect" + (" (per-class best-F1 score thresholds of this evaluation: score_thresholds.json)"
                           if thresholds else ""),
             f"python scripts/predict_retinanet.py --weights {shlex.quote(where)} --source photos/ --output_dir out"
             + (" --score_thresh best_f1" if thresholds else ""),
             "# evaluate on a COCO / VOC / YOLO data set",
             f"python scripts/train_retinanet.py --data_dir DATA --evaluate_only {shlex.quote(where)}",
             "# fine-tune on other classes",
             f"python scripts/train_retinanet.py --data_dir DATA --init_from {shlex.quote(where)}",
             "# ONNX",
             f"python scripts/export_retinanet.py --weights {shlex.quote(where)} --output model.onnx", "```", ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def classifier_card(model_config: dict, *, evaluation: dict | None, dataset: dict, command: str | None,
                    weights_name: str, where: str):
    """The model card of an image classifier's weights folder (scripts/train_catsdogs.py); arguments as
    `detector_card`. Metrics: validation accuracy and loss, per-class precision and recall."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    classes = [str(c) for c in model_config.get("classes") or []]
    data_name = str(dataset.get("name") or "unknown")
    results = []
    if evaluation:
        common = dict(task_type="image-classification", task_name="Image Classification", dataset_type=data_name,
                      dataset_name=data_name, dataset_split=os.path.basename(str(dataset.get("val") or "val")))
        for k in ("val_accuracy", "val_loss"):
            if _number(evaluation.get(k)) is not None:
                results.append(EvalResult(metric_type=k.removeprefix("val_"), metric_value=float(evaluation[k]),
                                          metric_name=k, **common))
    title = f"{model_config.get('model')} classifier ({weights_name})"
    data = ModelCardData(library_name="detlib", pipeline_tag="image-classification", datasets=[data_name],
                         tags=["image-classification", "detlib", str(model_config.get("model")), "safetensors"],
                         metrics=["accuracy"] if evaluation else None, model_name=title, eval_results=results or None,
                         classes=classes)
    body = [f"# {title}", "", f"An image classifier ({model_config.get('model')}, {len(classes)} classes: "
            f"{', '.join(classes)}; {model_config.get('image_size')} px) trained with detlib: `model.safetensors` "
            "holds the weights, `model_config.json` how to rebuild the model.", "",
            f"Data: {data_name}" + "".join(f"; {k} {dataset[k]}" for k in ("train", "val") if dataset.get(k)) + ".", "",
            "## Evaluation", ""]
    if evaluation:
        when = f"epoch {evaluation.get('epoch')}, step {evaluation.get('step')}"
        body += [f"Validation ({when}, {evaluation.get('num_val_samples')} images): accuracy "
                 f"{float(evaluation['val_accuracy']):.4f}, loss {float(evaluation['val_loss']):.4f}.", "",
                 "| class | precision | recall |", "|---|---|---|"]
        body += [f"| {c} | {evaluation.get(f'val_precision_{c}', float('nan')):.4f} | "
                 f"{evaluation.get(f'val_recall_{c}', float('nan')):.4f} |" for c in classes] + [""]
    else:
        body += ["Not evaluated by the run that wrote these weights.", ""]
    if command:
        body += ["## Training", "", "```bash", command, "```", ""]
    body += ["## Use", "", "```bash",
             f"python scripts/predict_catsdogs.py --weights {shlex.quote(where)} --source photos/ --output_dir out",
             f"python scripts/train_catsdogs.py --val_dir DATA/val --evaluate_only {shlex.quote(where)}", "```", ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def _evaluation_section(evaluation: dict | None, names: list[str], ids: list[int]) -> list[str]:
    if not evaluation:
        return ["## Evaluation", "", "Not evaluated by the run that wrote these weights.", ""]
    when = f"epoch {evaluation['epoch']}, step {evaluation.get('step')}" if evaluation.get("epoch") is not None else \
        f"step {evaluation.get('step')}"
    out = ["## Evaluation", "", f"COCO box evaluation of these weights ({when}):", "",
           "| " + " | ".join(STAT_NAMES) + " |", "|" + "---|" * len(STAT_NAMES),
           "| " + " | ".join(f"{float(evaluation[k]):.4f}" if _number(evaluation.get(k)) is not None else "-"
                             for k in STAT_NAMES) + " |", ""]
    best = evaluation.get("best_f1") or {}
    pooled = best.get("all") or {}
    if pooled.get("score_thresh") is not None:
        out += [f"Best F1 at IoU 0.5, all classes pooled: {pooled['F1']:.4f} at score threshold "
                f"{pooled['score_thresh']:.4f} (precision {pooled['precision']:.4f}, recall {pooled['recall']:.4f}).", ""]
    per_class, f1 = evaluation.get("per_class") or {}, best.get("per_class") or {}
    if names:
        out += ["| id | class | AP | AP50 | boxes | best-F1 threshold | F1 | precision | recall |",
                "|---|---|---|---|---|---|---|---|---|"]
        for i, n in zip(ids, names):
            ap, b = per_class.get(n) or {}, f1.get(n) or {}
            cells = [str(i), n] + [f"{ap[k]:.4f}" if k in ap else "-" for k in ("AP", "AP50")]
            cells += [str(ap.get("num_gt", b.get("num_gt", 0)))]
            cells += [f"{b['score_thresh']:.4f}" if b.get("score_thresh") is not None else "-"]
            cells += [f"{b[k]:.4f}" if k in b else "-" for k in ("F1", "precision", "recall")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out


def write_card(card, folder: str) -> str:
    """Write `card` as `folder/README.md` (atomically). Returns the path."""
    path = os.path.join(folder, CARD_FILE)
    with atomic_write(path) as f:
        f.write(str(card))
    return path
