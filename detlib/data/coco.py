"""COCO-format detection data set and the batch collate function.

Annotations are read with pycocotools. On load, each annotation's COCO xywh box becomes xyxy pixels
(the one conversion on the way in), is clipped to the image, and is dropped with a logged count and the
annotation ids when it is degenerate: width or height <= `min_box_size` px after clipping, which also
covers boxes entirely outside the image and negative sizes. Category ids become
contiguous labels through `CategoryMap`.

Crowd annotations (`iscrowd=1`) are excluded from the training targets by default and returned as
`crowd_boxes` instead: the loss ignores anchors inside them (`detlib.retinanet.matching`). With
`include_crowd=True` they are ordinary targets.

The annotations come checked and normalised by `detlib.datacheck.coco` (ids, numeric values, boxes derived from
polygons, sizes): the training script passes the normalised dict; given a path, the data set runs the json
part of the check itself, logs its repairs and raises ValueError with the report on errors.

Images without annotations are kept: they are valid all-background samples. An image file
that is missing or empty is found when the data set is built and left out with a logged count; one that
fails to decode later is, in training, replaced by the next image (logged), and in evaluation returned
with `valid=False` so the evaluator leaves it out of AP and says so (never a silent wrong AP).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Callable

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from ..datacheck.coco import check_coco
from ..datacheck.report import DEFAULT_MAX_IMAGE_PIXELS
from ..labels import PAD_LABEL, CategoryMap
from .images import load_rgb, load_skipping_unreadable
from .records import CompactRecords
from .seeds import sample_rng
from .transforms import IMAGENET_MEAN, INPUT_DIVISIBILITY, PAD_VALUE, make_sample, padded_input_shape

logger = logging.getLogger(__name__)

# Annotation ids and image paths named in a log line (the rest is counted).
LOGGED_IDS, LOGGED_PATHS = 10, 5


class CocoDetection(torch.utils.data.Dataset):
    """A COCO-format detection data set.

    Args:
        image_dir: folder holding the images named by each image's `file_name`.
        annotation_file: the normalised COCO dict of `detlib.datacheck.coco.check_coco` (used as is), or the path of
            a COCO instances json (checked here, json part only).
        transform: a callable on a sample dict (see `detlib.data.transforms`), e.g. `build_transform(...)`.
        include_crowd: use crowd annotations as ordinary targets instead of ignore regions.
        min_box_size: boxes with width or height <= this many pixels (after clipping) are dropped.
        train: on a decode failure, substitute the next image (training) instead of returning an invalid
            sample (evaluation); training also drops the json dict (`dataset` None) once the records are built.
        category_map: use this mapping instead of building one from the file (val must share train's).
        seed: when given, the random augmentation of a sample is a function of (seed, epoch, key) alone
            (`detlib.data.seeds.sample_rng`; the epoch: `set_epoch`).
        max_image_pixels: PIL's decompression-bomb limit while loading (the data check refuses larger images
            at start; `--max_image_pixels` raises both); None: no limit.
        filter_empty: leave out images with no usable (non-crowd) box, as torchvision's and detectron2's
            training sets do (`DATASETS.FILTER_EMPTY_ANNOTATIONS`); the count is logged. For training only:
            an evaluation must keep every image.
    Item (an index k >= len(self) is image k % len(self) drawn again, a copy augmented on its own:
    `detlib.data.balanced.RepeatFactorSampler`): dict with
        image: [3, h, w] uint8 RGB, after the transform
        boxes: [N, 4] float32 xyxy pixels of the transformed image;  labels: [N] int64 in 0..K-1
        crowd_boxes: [C, 4] float32 xyxy pixels (empty when `include_crowd`)
        image_id: int, the json's image id;  scale: (sy, sx) resized / original
        valid: bool, False when the image could not be decoded (evaluation only)
    Raises:
        FileNotFoundError: the annotation file or the image folder does not exist (names the path).
        ValueError: the json is not COCO-format or the check finds errors (the message holds the report).
    """

    def __init__(
        self,
        image_dir: str,
        annotation_file: str | dict,
        transform: Callable | None = None,
        include_crowd: bool = False,
        min_box_size: float = 1.0,
        train: bool = True,
        category_map: CategoryMap | None = None,
        seed: int | None = None,
        max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
        filter_empty: bool = False,
    ):
        self.seed = seed
        self.epoch = 0
        self.max_image_pixels = max_image_pixels
        if not os.path.isdir(image_dir):
            raise FileNotFoundError(f"image folder not found: {image_dir}")
        self.dataset, checked_dropped = _checked_json(annotation_file, train)
        source = annotation_file if isinstance(annotation_file, str) else "annotations"
        self.image_dir = image_dir
        self.transform = transform
        self.train = train
        cats = self.dataset["categories"]
        self.category_map = category_map or CategoryMap([c["id"] for c in cats], [c.get("name", c["id"]) for c in cats])
        records, dropped, unknown_category, missing = self._index(include_crowd, min_box_size)
        _log_left_out(source, min_box_size, dropped, unknown_category, missing)
        self.num_dropped_boxes = len(dropped) + checked_dropped
        self.missing_images = missing
        self.num_filtered_empty = 0
        if filter_empty:
            kept = [r for r in records if (~r["iscrowd"]).any()]
            self.num_filtered_empty = len(records) - len(kept)
            if self.num_filtered_empty:
                logger.info("%s: left out %d of %d training images with no usable box (--filter_empty)", source,
                            self.num_filtered_empty, len(records))
            if not kept and records:
                raise ValueError(f"{source}: no usable (non-crowd, non-degenerate) box in the whole training set; nothing "
                                 "to learn from (use --include_crowd to train on crowd boxes)")
            records = kept
        # Flat arrays, not a list of dicts: forked DataLoader workers share them instead of copying them
        # (detlib.data.records; benchmarks/dataset_memory.py measures both).
        self.records = CompactRecords(records)
        if train:  # the records hold all a training sample needs; the json would be copied per worker
            self.dataset = None
        if not len(self.records):
            raise ValueError(f"no usable image in {source} (image folder {image_dir})")

    def _index(self, include_crowd: bool, min_box_size: float) -> tuple[list[dict], list, list, list[str]]:
        """One record per image whose file is there, sorted by image id, with its boxes as xyxy pixels.

        Returns:
            (records, ids of degenerate boxes dropped, ids of annotations with an unknown category,
            "path (missing)" / "path (empty file)" of the images left out).
        """
        annotations_of: dict[int, list[dict]] = {}
        for ann in self.dataset["annotations"]:
            annotations_of.setdefault(ann["image_id"], []).append(ann)
        records: list[dict] = []
        dropped: list = []
        unknown_category: list = []
        missing: list[str] = []
        for img in sorted(self.dataset["images"], key=lambda im: im["id"]):
            path = os.path.join(self.image_dir, img["file_name"])
            try:
                if os.path.getsize(path) == 0:
                    missing.append(f"{path} (empty file)")
                    continue
            except OSError:
                missing.append(f"{path} (missing)")
                continue
            H, W = int(img["height"]), int(img["width"])
            boxes, labels, crowd = [], [], []
            for ann in annotations_of.get(img["id"], []):
                x, y, w, h = (float(v) for v in ann["bbox"])
                # COCO xywh -> xyxy, clipped to the image.
                x1, y1 = min(max(x, 0.0), W), min(max(y, 0.0), H)
                x2, y2 = min(max(x + w, 0.0), W), min(max(y + h, 0.0), H)
                if not all(map(math.isfinite, (x, y, w, h))) or x2 - x1 <= min_box_size or y2 - y1 <= min_box_size:
                    dropped.append(ann.get("_source", ann.get("id", -1)))
                    continue
                try:
                    label = self.category_map.to_label(ann["category_id"])
                except KeyError:
                    unknown_category.append(ann.get("_source", ann.get("id", -1)))
                    continue
                boxes.append((x1, y1, x2, y2))
                labels.append(label)
                crowd.append(bool(ann.get("iscrowd", 0)) and not include_crowd)
            records.append({
                "id": int(img["id"]), "path": path, "size": (H, W),
                "boxes": np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
                "labels": np.asarray(labels, dtype=np.int64),
                "iscrowd": np.asarray(crowd, dtype=bool),
            })
        return records, dropped, unknown_category, missing

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's augmentation stream (with `seed`). DataLoader workers must be re-created
        each epoch to see it (`persistent_workers=False`)."""
        self.epoch = int(epoch)

    @property
    def num_classes(self) -> int:
        return len(self.category_map)

    def num_target_boxes(self) -> int:
        """Number of non-crowd boxes over the whole data set (0 means nothing to learn from)."""
        return int((~self.records.iscrowd).sum())

    def read(self, index: int) -> dict:
        """Image `index` and its boxes as the json gives them, untransformed: a transform sample (`make_sample`:
        image [3, H, W] uint8, boxes [N, 4] xyxy pixels, labels [N], iscrowd [N]). Raises `IMAGE_ERRORS`."""
        rec = self.records[index]
        # Set in the worker that loads: DataLoader workers do not share the parent's later changes.
        Image.MAX_IMAGE_PIXELS = self.max_image_pixels
        # turned as PIL's exif_transpose shows it unless the json's size is the stored one (the EXIF rule)
        pil, truncated = load_rgb(rec["path"], labelled_size=rec["size"][::-1])
        if truncated:
            logger.warning("image %s is truncated; its missing part is decoded as grey", rec["path"])
        image = F.pil_to_tensor(pil)
        if tuple(image.shape[-2:]) != rec["size"]:
            # The json's size is what boxes refer to; a file of another size is resized to it.
            logger.warning("image %s is %dx%d but the json says %dx%d; resized to the json's size",
                           rec["path"], image.shape[-1], image.shape[-2], rec["size"][1], rec["size"][0])
            image = F.resize(image, list(rec["size"]), antialias=True)
        return make_sample(image, torch.from_numpy(rec["boxes"]), torch.from_numpy(rec["labels"]),
                           torch.from_numpy(rec["iscrowd"]))

    def _load(self, index: int, copy: int = 0) -> dict:
        sample = self.read(index)
        if self.transform is not None:
            with sample_rng(self.seed, self.epoch, index + copy * len(self)):
                sample = self.transform(sample)
        return sample_item(sample, self.records[index]["id"])

    def __getitem__(self, index: int) -> dict:
        # a key past the last image is a repeated draw of image key % N (`RepeatFactorSampler`): its own augmentation
        copy, index = divmod(index, len(self))
        return load_skipping_unreadable(lambda i: self._load(i, copy), index, len(self), self.train, self._unreadable)

    def _unreadable(self, index: int, error: Exception) -> dict:
        logger.warning("skipping unreadable image: %s", error)
        return unreadable_item(self.records[index]["id"])


def sample_item(sample: dict, image_id: int) -> dict:
    """The data set item (see `CocoDetection`) of a transformed sample: crowd boxes apart from the targets."""
    crowd = sample["iscrowd"]
    boxes = sample["boxes"].as_subclass(torch.Tensor)
    return {
        "image": sample["image"].as_subclass(torch.Tensor),
        "boxes": boxes[~crowd].reshape(-1, 4).float(),
        "labels": sample["labels"][~crowd].reshape(-1),
        "crowd_boxes": boxes[crowd].reshape(-1, 4).float(),
        "image_id": image_id,
        "scale": sample.get("scale", (1.0, 1.0)),
        "valid": True,
    }


def unreadable_item(image_id: int) -> dict:
    """The item of an image that could not be read where none may be skipped (evaluation, prediction): an 8x8
    black uint8 image, no boxes, `valid=False`, so the collate still works and the evaluation counts the image
    with no detections (`CocoEvaluator.add_failed`)."""
    return {"image": torch.zeros((3, 8, 8), dtype=torch.uint8), "boxes": torch.zeros((0, 4)),
            "labels": torch.zeros((0,), dtype=torch.int64), "crowd_boxes": torch.zeros((0, 4)),
            "image_id": image_id, "scale": (1.0, 1.0), "valid": False}


def _checked_json(annotation_file: str | dict, train: bool) -> tuple[dict, int]:
    """(the normalised json, annotations the check dropped): a dict is used as is (the script checked it);
    a path gets the json part of `check_coco`, its repairs logged.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the check finds errors (the message holds the report).
    """
    if isinstance(annotation_file, dict):
        return annotation_file, 0
    check = check_coco(annotation_file, split="train" if train else "val", check_images=False)
    if not check.report.ok:
        raise ValueError(f"{annotation_file}: {check.report.format()}")
    for f in check.report.findings:
        logger.warning("%s: %s: %d, annotation ids / items %s", annotation_file, f.message, f.count, f.examples)
    return check.dataset, check.dropped_annotations


def _log_left_out(source: str, min_box_size: float, dropped: list, unknown_category: list, missing: list[str]) -> None:
    """One warning per kind of box or image the data set left out while indexing."""
    if dropped:
        logger.warning("%s: dropped %d degenerate boxes (w or h <= %g px after clipping to the image, "
                       "or outside it): %s%s", source, len(dropped), min_box_size,
                       dropped[:LOGGED_IDS], " ..." if len(dropped) > LOGGED_IDS else "")
    if unknown_category:
        logger.warning("%s: dropped %d annotations whose category_id is not in 'categories': %s",
                       source, len(unknown_category), unknown_category[:LOGGED_IDS])
    if missing:
        logger.warning("%s: left out %d images whose file is missing or empty, e.g. %s",
                       source, len(missing), missing[:LOGGED_PATHS])


def _pad_boxes(items: list[torch.Tensor], fill: float) -> torch.Tensor:
    n = max(1, max(t.shape[0] for t in items))  # at least one slot so gather() works on an empty batch
    out = torch.full((len(items), n) + tuple(items[0].shape[1:]), fill, dtype=items[0].dtype)
    for i, t in enumerate(items):
        out[i, : t.shape[0]] = t
    return out


def collate_detection(samples: list[dict], size_divisibility: int = INPUT_DIVISIBILITY) -> dict[str, torch.Tensor]:
    """Stack samples into a padded batch of tensors (all on the same device after `accelerator.prepare`).

    Returns a dict of
        images: [B, 3, Hp, Wp] uint8 (float32 0-255 when the samples are float), padded at bottom/right with
            `PAD_VALUE` (float images: `IMAGENET_MEAN`, so padded pixels are 0 after normalisation, as torchvision
            pads) to the batch's largest height and width, rounded up to a multiple of `size_divisibility`
        boxes: [B, M, 4] float32 xyxy (zeros in padding slots);  labels: [B, M] int64 (`PAD_LABEL` in padding)
        crowd_boxes: [B, C, 4] float32 xyxy, zero boxes as padding (C may be 0)
        image_ids: [B] int64;  image_sizes: [B, 2] (h, w) before padding
        scales: [B, 2] float32 (sy, sx);  valid: [B] bool
    """
    B = len(samples)
    hs = [s["image"].shape[1] for s in samples]
    ws = [s["image"].shape[2] for s in samples]
    Hp = int(math.ceil(max(hs) / size_divisibility) * size_divisibility)
    Wp = int(math.ceil(max(ws) / size_divisibility) * size_divisibility)
    # an unreadable image's uint8 placeholder in a float batch is cast, never the other way round
    dtype = torch.uint8 if all(s["image"].dtype == torch.uint8 for s in samples) else torch.float32
    pad = PAD_VALUE if dtype == torch.uint8 else IMAGENET_MEAN
    images = torch.tensor(pad, dtype=dtype).view(1, 3, 1, 1).repeat(B, 1, Hp, Wp)
    for i, s in enumerate(samples):
        images[i, :, : hs[i], : ws[i]] = s["image"]
    crowd = [s["crowd_boxes"] for s in samples]
    C = max(t.shape[0] for t in crowd)
    crowd_boxes = torch.zeros((B, C, 4), dtype=torch.float32)
    for i, t in enumerate(crowd):
        crowd_boxes[i, : t.shape[0]] = t
    return {
        "images": images,
        "boxes": _pad_boxes([s["boxes"].float() for s in samples], 0.0),
        "labels": _pad_boxes([s["labels"].long() for s in samples], PAD_LABEL),
        "crowd_boxes": crowd_boxes,
        "image_ids": torch.tensor([s["image_id"] for s in samples], dtype=torch.int64),
        "image_sizes": torch.tensor([[h, w] for h, w in zip(hs, ws)], dtype=torch.int64),
        "scales": torch.tensor([list(s["scale"]) for s in samples], dtype=torch.float32),
        "valid": torch.tensor([bool(s["valid"]) for s in samples]),
    }


# An evaluation batch holds at least this many images: on a CPU (oneDNN) a batch of 1 runs other convolution kernels
# than a batch of 2 or more and its outputs differ in the last bits (measured: resnet18 / resnet50 RetinaNets, 1 or 2
# threads, NCHW and channels_last: batches of 2, 3, 4, 5 and 8 give bit-identical outputs per image, a batch of 1
# differs by up to 6e-6 in the logits); tests/test_evaluation_batching.py checks it where it runs.
MIN_EVALUATION_BATCH = 2


def evaluation_shapes(sizes, image_size: int, max_size: int | None = None, resize_mode: str = "antialias",
                      size_divisibility: int = INPUT_DIVISIBILITY) -> list[tuple[int, int]]:
    """The padded input shape (H, W) px of each evaluation image, the keys of `EvaluationBatchSampler`.

    Args:
        sizes: (H, W) in px of every image as the json gives it (`[r["size"] for r in dataset.records]`; a file of
            another size is resized to it on load).
        image_size, max_size, resize_mode: the evaluation transform's (`build_transform(image_size, "none", max_size,
            resize_mode)`).
    """
    return [padded_input_shape(h, w, image_size, max_size, resize_mode, size_divisibility) for h, w in sizes]


class EvaluationCollate:
    """The evaluation and prediction loaders' collate: an image's padded input, so its detections, are those of the
    image evaluated by itself, whatever its batch (issue 36).

    * The batches hold images of one padded shape (`EvaluationBatchSampler` on `evaluation_shapes`; consecutive
      frames of a video), so each image is padded at the bottom and right only up to a multiple of
      `size_divisibility`, as when it is alone. (Before, every image was padded to the largest shape of the val set:
      padding shifts the features near the right and bottom borders, and torchvision's model run image by image
      agreed on 119 of 160 top-20 detections.)
    * A batch of one image is filled with a copy of it up to `MIN_EVALUATION_BATCH`, so the convolutions never run
      a batch of one (other kernels on a CPU). The copy carries the image's id and `valid` flag: `CocoEvaluator.add`
      and `detect_images` keep the first results of an id.
    * An empty list (a process's filler batch, `EvaluationBatchSampler`) gives {}: nothing to run.
    A batch whose images' padded shapes differ anyway (a size that did not predict the transform's output) is padded
    to its largest, with a warning naming the image, whose detections then depend on its batch.
    A plain class, not a closure: DataLoader workers pickle it.
    """

    def __init__(self, size_divisibility: int = INPUT_DIVISIBILITY):
        self.size_divisibility = size_divisibility

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        if not samples:
            return {}
        d = self.size_divisibility
        shapes = {(s["image_id"], -(-s["image"].shape[1] // d) * d, -(-s["image"].shape[2] // d) * d)
                  for s in samples if s["valid"]}
        if len({shape[1:] for shape in shapes}) > 1:
            image_id, h, w = min(shapes, key=lambda t: (t[1] * t[2], t[0]))
            logger.warning("image %s is padded beyond its %dx%d input in a batch of %s: its detections depend on "
                           "its batch (its size in the json or its file header is not the one it was read at)",
                           image_id, h, w, sorted({shape[1:] for shape in shapes}))
        filled = list(samples) + [samples[-1]] * max(0, MIN_EVALUATION_BATCH - len(samples))
        return collate_detection(filled, d)

    def __repr__(self) -> str:
        return f"EvaluationCollate(size_divisibility={self.size_divisibility})"
