"""Prediction on image files with a trained model: what `scripts/predict_*.py` share.

Sources: an image file, a folder (searched recursively, hidden entries skipped), or a glob pattern; the
files are sorted, so image i is the same file on every process. Work is split by whole batches: the batches
are formed once over the sorted list, exactly as one process forms them, and process r takes batches
r, r + n, r + 2n, ... So no image is seen twice, nothing is padded, and every batch is the same tensor it
is with one process: the results of n processes are those of one, to the bit (a detection batch is padded to
its largest image, and the convolutions near an image's border see that padding).

Orientation: image files are turned upright by their EXIF tag (a phone photo is predicted as it is shown),
unless `exif_transpose=False`; COCO-json sources are read as stored, as in evaluation, because their boxes
refer to the stored pixels.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os

import numpy as np
import torch
from PIL import Image

from .imagefolder import IMG_EXTENSIONS, is_hidden
from .images import IMAGE_ERRORS, load_rgb
from .data import unreadable_item
from .labels import CategoryMap
from .model import build_retinanet_from_config
from .transforms import make_sample
from .weights import load_model_weights, read_model_config, weights_path

logger = logging.getLogger(__name__)


def list_image_files(source: str) -> tuple[str, list[str]]:
    """The image files of `source` and the folder their names are relative to.

    Args:
        source: an existing file (taken whatever its extension), a folder (every file with an image extension
            below it, hidden files and folders skipped), or a glob pattern (`**` recurses; every match that is
            a file).
    Returns:
        (root, sorted absolute paths); `os.path.relpath(path, root)` names each file in the outputs.
    Raises:
        FileNotFoundError: nothing matches (names the source).
    """
    if os.path.isfile(source):
        path = os.path.abspath(source)
        return os.path.dirname(path), [path]
    if os.path.isdir(source):
        root = os.path.abspath(source)
        found = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
            found += [os.path.join(dirpath, f) for f in filenames
                      if not is_hidden(f) and f.lower().endswith(IMG_EXTENSIONS)]
        if not found:
            raise FileNotFoundError(f"no image file ({', '.join(IMG_EXTENSIONS)}) below {source}")
        return root, sorted(found)
    found = sorted(os.path.abspath(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p))
    if not found:
        raise FileNotFoundError(f"no file matches {source} (not a file, a folder or a glob pattern that matches)")
    root = os.path.commonpath([os.path.dirname(p) for p in found])
    return root, found


def shard_batches(num_items: int, batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """The batches (lists of item indices, in order) that process `rank` of `world_size` runs: batch b covers
    items [b * batch_size, (b + 1) * batch_size), and process r takes batches r, r + world_size, ..."""
    batches = [list(range(i, min(i + batch_size, num_items))) for i in range(0, num_items, batch_size)]
    return batches[rank::world_size]


class DetectionImageFiles(torch.utils.data.Dataset):
    """Image files as detection samples, in the item layout of `CocoDetection` (so `collate_detection` and the
    evaluation's decoding apply unchanged).

    Args:
        paths: the files; item i has `image_id` = i.
        transform: the evaluation transform (`build_transform(size, "none", max_size)`).
        exif_transpose: turn images upright by their EXIF orientation before anything else.
    Item: {"image": [3, h, w] uint8 resized, "boxes" / "crowd_boxes": [0, 4], "labels": [0], "image_id": int,
           "scale": (sy, sx), "valid": bool}; an unreadable file gives
           an 8x8 placeholder with valid=False (and a logged warning), never an exception.
    """

    def __init__(self, paths: list[str], transform=None, exif_transpose: bool = True):
        self.paths = list(paths)
        self.transform = transform
        self.exif_transpose = exif_transpose

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict:
        empty = torch.zeros((0, 4))
        try:
            pil, truncated = load_rgb(self.paths[index], exif_transpose=self.exif_transpose)
        except IMAGE_ERRORS as e:
            logger.warning("skipping unreadable image: %s", e)
            return unreadable_item(index)
        if truncated:
            logger.warning("image %s is truncated; its missing part is decoded as grey", self.paths[index])
        image = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
        sample = make_sample(image, empty, torch.zeros((0,), dtype=torch.int64), torch.zeros((0,), dtype=torch.bool))
        if self.transform is not None:
            sample = self.transform(sample)
        return {"image": sample["image"].as_subclass(torch.Tensor), "boxes": empty, "labels": torch.zeros((0,), dtype=torch.int64),
                "crowd_boxes": empty, "image_id": index, "scale": sample.get("scale", (1.0, 1.0)), "valid": True}


def load_retinanet(weights: str) -> tuple[torch.nn.Module, dict, CategoryMap]:
    """Rebuild a trained RetinaNet from its weights and model_config.json, in eval mode on the CPU.

    Args:
        weights: a run folder (its best/, else last/), best/ or last/, a checkpoint folder, or a weights file
            with model_config.json beside it or in its parent folder.
    Returns:
        (model, model_config, CategoryMap of the config's `category_ids` and `category_names`; a config
        without names, written before names were stored, names each class by its id).
    Raises:
        FileNotFoundError: no weights, or no model_config.json next to them (names the path).
        RuntimeError: the weights do not fit the config's model.
    """
    f = weights_path(weights)
    config = read_model_config(weights)
    if config is None:
        raise FileNotFoundError(f"no model_config.json next to {f} (nor in its parent folder): the model cannot be "
                                "rebuilt; the training script writes one into best/, last/ and every checkpoint")
    model = build_retinanet_from_config(config)
    load_model_weights(model, weights)
    return model.eval(), config, category_map_from_config(config)


def category_map_from_config(config: dict) -> CategoryMap:
    """The CategoryMap of a model_config.json: `category_ids` (default 1..num_classes) named by
    `category_names` in the same order, or by the ids as strings when the config has no names."""
    ids = config.get("category_ids") or list(range(1, int(config["num_classes"]) + 1))
    return CategoryMap(ids, config.get("category_names"))


class ClassificationImageFiles(DetectionImageFiles):
    """Image files for a classifier.

    Args:
        paths: the files; transform: PIL RGB -> tensor (`classification_transform(size, train=False)`).
        exif_transpose: turn images upright by their EXIF orientation first.
    Item: {"image": float32 [3, S, S] (a black image's transform when unreadable), "index": int, "valid": bool};
    an unreadable file is logged and flagged, never raised. (The file list and EXIF handling are the detection
    set's; only the item differs.)
    """

    def __getitem__(self, index: int) -> dict:
        try:
            img, _ = load_rgb(self.paths[index], exif_transpose=self.exif_transpose)
            valid = True
        except IMAGE_ERRORS as e:
            logger.warning("skipping unreadable image: %s", e)
            img, valid = Image.new("RGB", (64, 64)), False
        return {"image": self.transform(img), "index": index, "valid": valid}


def load_classifier(weights: str) -> tuple[torch.nn.Module, dict]:
    """Rebuild a trained classifier from its weights and model_config.json (`model`, `classes`), eval mode.

    Raises:
        FileNotFoundError: no weights or no model_config.json (names the path).
        RuntimeError: the weights do not fit the config's model.
    """
    from .classification import build_classifier

    f = weights_path(weights)
    config = read_model_config(weights)
    if config is None or "classes" not in config:
        raise FileNotFoundError(f"no classifier model_config.json (with 'classes') next to {f}: the model cannot be rebuilt")
    model = build_classifier(config["model"], len(config["classes"]))
    load_model_weights(model, weights)
    return model.eval(), config


def prediction_parser(description: str, batch_size: int) -> tuple[argparse.ArgumentParser, dict]:
    """The parser of a predict script with the flags every one reads (`start_prediction`, the file loop), and its
    groups {"data", "model", "output"} for the script's own flags. Data: `--no_exif_transpose`, `--batch_size`
    (images per process and forward pass), `--num_workers`; model: `--weights`, `--mixed_precision`, `--cpu`;
    output: `--output_dir`, `--verbose`. `--help` shows every default."""
    from .flags import HelpFormatter, int_at_least

    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    groups = {name: p.add_argument_group(name) for name in ("data", "model", "output")}
    groups["data"].add_argument("--no_exif_transpose", action="store_true",
                                help="read image files as stored instead of turning them upright by their EXIF tag")
    groups["data"].add_argument("--batch_size", type=int_at_least(1), default=batch_size, help="images per process and forward pass")
    groups["data"].add_argument("--num_workers", type=int_at_least(0), default=2, help="data loader workers per process")
    groups["model"].add_argument("--weights", required=True,
                                 help="a run folder, best/, last/, a checkpoint folder or a model.safetensors")
    groups["model"].add_argument("--mixed_precision", choices=["no", "fp16", "bf16"],
                                 help="precision of the forward pass (default None: the accelerate config's)")
    groups["model"].add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    groups["output"].add_argument("--output_dir", required=True, help="where the predictions and predict.log go")
    groups["output"].add_argument("--verbose", action="store_true", help="also the INFO lines of the libraries")
    return p, groups


def start_prediction(args):
    """The Accelerator of a predict script (CPU or GPU, any number of processes) and its log,
    `OUTPUT_DIR/predict.log` on the main process. Reads `args.output_dir`, `args.mixed_precision`, `args.cpu`,
    `args.verbose`."""
    from .runtime import make_accelerator, setup_logging

    os.makedirs(args.output_dir, exist_ok=True)
    accelerator = make_accelerator(args.mixed_precision, 1, "none", args.output_dir, cpu=args.cpu)
    setup_logging(args.output_dir, accelerator.is_main_process, filename="predict.log", verbose=args.verbose)
    return accelerator
