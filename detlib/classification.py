"""Image classification: the transforms, the model builder with its weight loading, the metrics, and the evaluation's
extra files (predictions CSV, wandb table).

The data (ImageFolder scan and data set) is `detlib.data.imagefolder`; the built-in stripes data set is
`detlib.data.builtin`; weights files are read by `detlib.weights.load_state_dict_file`.
"""

from __future__ import annotations

import logging
import os
import pickle

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from .logtext import EXTREMES, short_name
from .weights import load_state_dict_file, refused, weights_only_loads


logger = logging.getLogger(__name__)

# Val resize: the shorter side to image_size / 0.875, then a centre crop (ResNet's 256 -> 224).
CENTER_CROP_FRACTION = 0.875


def classification_transform(image_size: int, train: bool):
    """PIL RGB image -> float32 [3, image_size, image_size], ImageNet-normalised (timm's mean / std, 0-1 units).

    Train: RandomResizedCrop (scale 0.08-1, aspect 3/4-4/3, the ImageNet recipe) + horizontal flip.
    Eval: shorter side resized to image_size / 0.875, centre crop.
    """
    from torchvision.transforms import v2

    if train:
        geometry = [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
    else:
        geometry = [v2.Resize(int(round(image_size / CENTER_CROP_FRACTION)), antialias=True), v2.CenterCrop(image_size)]
    return v2.Compose([*geometry, v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])


TORCHVISION_MODELS = ("resnet18",)


def check_classifier(name: str, image_size: int | None = None) -> None:
    """Check before the data is scanned that `name` is a classifier `build_classifier` can build and that it takes
    `image_size` x `image_size` inputs (a ViT fixed at 224 does not take 64). Nothing is downloaded and no weights
    are allocated (a timm model is built and run on the meta device; see `detlib.backbones.meta_forward_problem`).

    Raises:
        ValueError: one line: not a model name (with close timm names), or the input size the model refuses.
    """
    import timm

    from .backbones import meta_forward_problem, unknown_timm_model

    problem = unknown_timm_model(name, extra=TORCHVISION_MODELS)
    if problem:
        raise ValueError(problem + "; 'resnet18' is torchvision's")
    if name in TORCHVISION_MODELS or not image_size:
        return

    def build(device: str):
        with torch.device(device):
            return timm.create_model(name, pretrained=False, num_classes=2)

    try:
        model = build("meta")
    except Exception:  # a model that cannot be built on the meta device: the real build decides
        return
    problem = meta_forward_problem(model, [(image_size, image_size)], lambda: build("cpu"))
    if problem:
        raise ValueError(f"{name!r} at --image_size {image_size}: {problem}")


def build_classifier(name: str, num_classes: int, pretrained: bool = False, weights: str | None = None) -> nn.Module:
    """An image classifier with `num_classes` outputs.

    Args:
        name: "resnet18" (torchvision, its `fc` replaced by `Linear(512, num_classes)`) or any timm model name
            (timm builds its head for `num_classes`).
        pretrained: ImageNet weights through the library's own download (torchvision / timm; online or cached).
        weights: local weights (.safetensors, or a torch state dict read with `weights_only=True`); a
            classifier of another size (e.g. ImageNet's 1000 classes) is left at its fresh initialisation.
    Model: images float32 [B, 3, H, W] normalised -> logits [B, num_classes].
    Raises:
        ValueError: unknown model name; weights that miss keys of the model (other architecture).
        RuntimeError: pretrained weights cannot be downloaded (offline), with what to do instead.
    """
    import timm

    if name in TORCHVISION_MODELS:
        import torchvision

        try:
            with weights_only_loads():  # torch.hub reads its cached file with weights_only=False by default
                model = torchvision.models.resnet18(weights="IMAGENET1K_V1" if pretrained else None)
        except pickle.UnpicklingError as e:
            cache = os.path.join(torch.hub.get_dir(), "checkpoints")
            raise RuntimeError(f"{refused(f'the cached torchvision weights of {name!r} in {cache}', e)}; delete the file "
                               "to download it again, or pass --weights PATH") from None
        except Exception as e:  # urllib / hub errors of many kinds when offline
            raise RuntimeError(_offline_message(name, "torchvision", e)) from e
        model.fc = nn.Linear(model.fc.in_features, num_classes)
    else:
        if not timm.is_model(name):
            raise ValueError(f"unknown model {name!r}: use 'resnet18' (torchvision) or a timm model name "
                             f"(e.g. resnet50, efficientnet_b0, convnext_tiny; `timm.list_models()` lists them)")
        try:
            model = timm.create_model(name, pretrained=pretrained, num_classes=num_classes)
        except Exception as e:
            if pretrained:
                raise RuntimeError(_offline_message(name, "timm", e)) from e
            raise
    if weights:
        load_pretrained_weights(model, weights)
    return model


def _offline_message(name: str, library: str, e: Exception) -> str:
    return (f"could not download the pretrained {library} weights of {name!r} ({type(e).__name__}: {e}). "
            f"Offline? Fetch them on a machine with internet access and pass the file with --weights PATH "
            f"(.safetensors or a torch state dict of the same model), or train from scratch without --pretrained.")


def classifier_prefixes(model: nn.Module) -> tuple[str, ...]:
    """State-dict key prefixes of the model's final classifier ("fc." for ResNets, timm's `classifier` entry)."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    names = cfg.get("classifier") or "fc"
    names = (names,) if isinstance(names, str) else tuple(names)
    return tuple(n + "." for n in names)


def load_pretrained_weights(model: nn.Module, path: str) -> str:
    """Load a weights file into `model`, keeping a fresh classifier when the file's has another shape.

    Returns a one-line summary (also logged).
    Raises:
        ValueError: the file misses keys of the model other than the classifier (another architecture).
    """
    sd = load_state_dict_file(path)
    own = model.state_dict()
    heads = classifier_prefixes(model)
    reset = [k for k in list(sd) if k.startswith(heads) and k in own and sd[k].shape != own[k].shape]
    for k in reset:
        del sd[k]
    shape_mismatch = [k for k in sd if k in own and sd[k].shape != own[k].shape]
    if shape_mismatch:
        raise ValueError(f"{path} does not fit this model: shapes differ for {shape_mismatch[:5]}")
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith(heads)]
    if missing:
        raise ValueError(f"{path} does not fit this model: {len(missing)} keys missing, e.g. {missing[:5]}")
    msg = f"loaded {len(sd)} tensors from {path}"
    if reset:
        msg += f"; classifier {reset} kept freshly initialised (the file's has another number of classes)"
    if result.unexpected_keys:
        msg += f"; ignored {len(result.unexpected_keys)} keys not in the model, e.g. {result.unexpected_keys[:3]}"
    logger.info(msg)
    return msg


def classification_metrics(preds: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict:
    """Accuracy, confusion matrix, per-class precision and recall.

    Args:
        preds, labels: int64 [N] class indices.
    Returns:
        {"accuracy": float, "confusion": [K][K] ints (row = true class, column = predicted),
         "precision": [K] floats, "recall": [K] floats}; a class never predicted (or absent) gets 0.0.
    """
    preds, labels = preds.long().cpu(), labels.long().cpu()
    confusion = torch.bincount(labels * num_classes + preds, minlength=num_classes ** 2).reshape(num_classes, num_classes)
    tp = confusion.diag().double()
    predicted, actual = confusion.sum(0).double(), confusion.sum(1).double()
    n = int(labels.numel())
    return {
        "accuracy": float(tp.sum() / n) if n else float("nan"),
        "confusion": confusion.tolist(),
        "precision": (tp / predicted.clamp(min=1)).tolist(),
        "recall": (tp / actual.clamp(min=1)).tolist(),
    }


# Up to this many classes the per-class precision / recall are scalars of metrics.jsonl and the trackers (a chart
# each) and the confusion matrix is in metrics.jsonl; with more they are in the evaluation's files only (and the
# trackers' tables), so a line of metrics.jsonl does not grow with K squared.
PER_CLASS_SCALARS = 20
# Up to this many classes the evaluation line of the log holds every class and the confusion matrix.
PER_CLASS_INLINE = 4


def per_class_table(classes: list[str], confusion: list[list[int]]) -> dict[str, dict]:
    """Per-class numbers from a confusion matrix ([K][K] counts, row = true class, column = predicted).

    Returns:
        {class: {"precision", "recall", "f1": floats, "support": true images, "predicted": images predicted as
        it}} in class-index order; a class never predicted (or without images) gets precision (recall) 0.0, as
        in `classification_metrics`.
    """
    m = torch.tensor(confusion, dtype=torch.float64).reshape(len(classes), len(classes))
    tp, predicted, support = m.diag(), m.sum(0), m.sum(1)
    precision, recall = tp / predicted.clamp(min=1), tp / support.clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
    return {c: {"precision": float(precision[k]), "recall": float(recall[k]), "f1": float(f1[k]),
                "support": int(support[k]), "predicted": int(predicted[k])} for k, c in enumerate(classes)}


def per_class_summary(per_class: dict[str, dict], confusion: list[list[int]]) -> str:
    """The per-class part of the evaluation's log line, of bounded length whatever the number of classes:
    every class and the confusion matrix up to `PER_CLASS_INLINE` classes; beyond, the macro means and the
    `EXTREMES` classes with the lowest and the highest recall (ties by name), names cut by `short_name`."""
    if len(per_class) <= PER_CLASS_INLINE:
        return ", ".join(f"{short_name(c)}: P {v['precision']:.3f} R {v['recall']:.3f}" for c, v in per_class.items()) \
            + f"; confusion (rows true) {confusion}"
    ranked = sorted(per_class.items(), key=lambda kv: (kv[1]["recall"], kv[0]))
    mean_p = sum(v["precision"] for v in per_class.values()) / len(per_class)
    mean_r = sum(v["recall"] for v in per_class.values()) / len(per_class)

    def name(kv):
        return f"{short_name(kv[0])} {kv[1]['recall']:.3f} ({kv[1]['support']})"

    return (f"{len(per_class)} classes, mean precision {mean_p:.3f}, mean recall {mean_r:.3f}; lowest recall (images): "
            f"{', '.join(map(name, ranked[:EXTREMES]))}; highest: {', '.join(map(name, ranked[::-1][:EXTREMES]))}")


def write_predictions(path: str, samples: list[tuple[str, int]], classes: list[str], preds: dict) -> None:
    """One CSV row per val image: path, true class, predicted class, confidence. `samples`: the data set's
    (path, label); `preds`: [N] tensors "index" (into `samples`), "label", "pred", "confidence"."""
    import csv

    from .files import atomic_write

    with atomic_write(path, newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "pred", "confidence"])
        for i, y, p, c in zip(*(preds[k].tolist() for k in ("index", "label", "pred", "confidence"))):
            w.writerow([samples[i][0], classes[y], classes[p], f"{c:.6f}"])


# wandb's confusion-matrix chart is a table of K x K rows, of which wandb keeps 10,000: a true chart up to 100 classes
# (beyond, the PNG of detlib.evaluation.report.log_classification_extras shows the classes with the most errors).
WANDB_CONFUSION_CLASSES = 100


def log_wandb_extras(accelerator, samples: list[tuple[str, int]], classes: list[str], preds: dict, step: int,
                     max_rows: int) -> None:
    """wandb (main process): the confusion matrix (up to WANDB_CONFUSION_CLASSES classes) and a table of the first
    `max_rows` misclassified val images (`samples`, `preds` as `write_predictions` takes them)."""
    if not any(t.name == "wandb" for t in accelerator.trackers):
        return
    import wandb

    from .data.images import load_rgb

    labels, predicted = preds["label"].tolist(), preds["pred"].tolist()
    table = wandb.Table(columns=["image", "path", "label", "predicted", "confidence"])
    for k in [k for k in range(len(labels)) if labels[k] != predicted[k]][:max_rows]:
        path = samples[int(preds["index"][k])][0]
        img, _ = load_rgb(path)
        img.thumbnail((128, 128))
        table.add_data(wandb.Image(img), path, classes[labels[k]], classes[predicted[k]], float(preds["confidence"][k]))
    log = {"val_misclassified": table}
    if len(classes) <= WANDB_CONFUSION_CLASSES:
        log["val_confusion_matrix"] = wandb.plot.confusion_matrix(y_true=labels, preds=predicted, class_names=list(classes))
    accelerator.get_tracker("wandb", unwrap=True).log(log, step=step)
