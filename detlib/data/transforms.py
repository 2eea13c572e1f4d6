"""Box-aware augmentation and resizing on `torchvision.transforms.v2` with `tv_tensors`.

A sample is a dict {"image": tv_tensors.Image uint8 [3, H, W], "boxes": tv_tensors.BoundingBoxes
[N, 4] XYXY pixels, "labels": int64 [N], "iscrowd": bool [N]}: crowd regions travel in the same
BoundingBoxes so they are flipped, cropped and moved exactly like the targets. After the geometric
transforms, `SanitizeBoundingBoxes` drops boxes that became smaller than 1 px (an object cropped away),
together with their labels and crowd flags, so an image can end with no box at all: that is a
valid all-background sample.

Augmentation presets (`--augmentation`), written once in `augmentation_steps` (change them there):
  none                 resize only
  flip                 horizontal flip (p = 0.5)
  flip_crop_translate  flip, a random crop keeping 60-100 % of each side (p = 0.5), and a random
                       translation of up to 10 % of each side (p = 0.5; the uncovered area filled with
                       `PAD_VALUE`, as the batch padding): the 600 px AdamW recipe's "-aug" (docs/recipes.md).
  photometric          flip_crop_translate, then colour jitter (ultralytics' HSV defaults: value and saturation
                       x0.6-1.4 and x0.3-1.7, hue +-0.015 of the circle)
  scale_jitter         flip, then large-scale jitter (Copy-Paste, Ghiasi et al. 2021; ViTDet): resized so that it
                       fits a square canvas of the largest `image_size` times a random factor in [0.1, 2.0], then
                       cropped or padded (`PAD_VALUE`, at a random place) to that canvas
Every level ends with a resize to `image_size` (aspect ratio kept; see `ResizeKeepAspect`; a no-op on the
scale_jitter canvas).
"""

from __future__ import annotations

import math
import random

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from .options import AUGMENTATIONS  # beside the flags, where --help reads it without torch

# ImageNet statistics of the RGB channels, for backbones pretrained on ImageNet, in pixel units [0, 255]: RetinaNet
# takes images in [0, 255] and normalises them itself. timm's constants are in [0, 1] units, hence the x 255.
IMAGENET_MEAN = tuple(255 * v for v in IMAGENET_DEFAULT_MEAN)  # (123.675, 116.28, 103.53)
IMAGENET_STD = tuple(255 * v for v in IMAGENET_DEFAULT_STD)  # (58.395, 57.12, 57.375)
# Inputs are padded to a multiple of the backbone's output stride, so C3-C5 have exactly H / s rows (torchvision's
# GeneralizedRCNNTransform `size_divisible`); the anchors check it (detlib.retinanet.anchors).
INPUT_DIVISIBILITY = 32
# Padding colour of the batch (detlib.data.coco) and of the area a translation uncovers: the ImageNet mean in uint8,
# so both are ~0 after normalisation, and the model never learns that a black band means "edge of the image".
PAD_VALUE = (124, 116, 104)
RESIZE_MODES = ("antialias", "torchvision")


def _box_fields(sample):
    # SanitizeBoundingBoxes filters these along with the boxes.
    return sample["labels"], sample["iscrowd"]


class RandomCropFraction:
    """Crop a random window whose sides are `min_fraction`..1 of the image's, with probability `p`.

    Boxes are clipped to the window (their parts outside it are cut off); boxes left empty are removed
    later by `SanitizeBoundingBoxes`.
    """

    def __init__(self, min_fraction: float = 0.6, p: float = 0.5):
        self.min_fraction = min_fraction
        self.p = p

    def __call__(self, sample: dict) -> dict:
        if random.random() >= self.p:
            return sample
        h, w = sample["image"].shape[-2:]
        ch = max(1, int(round(h * random.uniform(self.min_fraction, 1.0))))
        cw = max(1, int(round(w * random.uniform(self.min_fraction, 1.0))))
        top = random.randint(0, h - ch)
        left = random.randint(0, w - cw)
        out = dict(sample)
        out["image"] = F.crop(sample["image"], top, left, ch, cw)
        out["boxes"] = F.clamp_bounding_boxes(F.crop(sample["boxes"], top, left, ch, cw))
        return out


class ResizeKeepAspect:
    """Resize keeping the aspect ratio (boxes follow).

    With `max_size=None` the longer side becomes `size` (the 600 px AdamW recipe's "600 px"). With `max_size` the
    shorter side becomes `size` unless that makes the longer side exceed `max_size` (Detectron's
    "800 / 1333" convention of the standard COCO recipes).

    Records `scale` = (new_h / old_h, new_w / old_w) in the sample, which decoding divides out to give
    boxes in the original image's pixels.

    `size` may be a list: each sample then draws one of them (multi-scale training, detectron2's
    `MIN_SIZE_TRAIN` with `RandomChoice`), from the sample's own seeded stream (see `CocoDetection`).

    `mode`:
      "antialias"   (default) the new sides are rounded, the uint8 image is resized with antialiasing and
                    stays uint8.
      "torchvision" torchvision's GeneralizedRCNNTransform, for its converted weights: the new sides are
                    floored (`interpolate(scale_factor=..., recompute_scale_factor=True)`), the image is
                    resized as float32 (values 0-255) by plain bilinear interpolation (align_corners=False, no
                    antialiasing) and stays float32, not rounded back to uint8. Torchvision normalises before
                    resizing; a bilinear resize is an affine combination of pixels with weights summing to 1,
                    so it commutes with the per-channel normalisation the model applies (up to float rounding).
    Raises:
        ValueError: for another mode.
    """

    def __init__(self, size: int | list[int], max_size: int | None = None, mode: str = "antialias"):
        if mode not in RESIZE_MODES:
            raise ValueError(f"resize mode must be one of {RESIZE_MODES}, got {mode!r}")
        self.sizes = [int(s) for s in size] if isinstance(size, (list, tuple)) else [int(size)]
        self.max_size = max_size
        self.mode = mode

    def __call__(self, sample: dict) -> dict:
        h, w = sample["image"].shape[-2:]
        size = self.sizes[0] if len(self.sizes) == 1 else random.choice(self.sizes)
        nh, nw = resized_size(h, w, size, self.max_size, self.mode)
        out = dict(sample)
        if self.mode == "torchvision":
            image = torch.nn.functional.interpolate(sample["image"][None].as_subclass(torch.Tensor).float(), size=[nh, nw],
                                                    mode="bilinear", align_corners=False)[0]
            out["image"] = tv_tensors.Image(image)
        else:
            out["image"] = F.resize(sample["image"], [nh, nw], antialias=True)
        out["boxes"] = F.resize(sample["boxes"], [nh, nw])
        out["scale"] = (nh / h, nw / w)
        return out


def resized_size(h: int, w: int, size: int, max_size: int | None = None, mode: str = "antialias") -> tuple[int, int]:
    """(height, width) in px of an h x w image after `ResizeKeepAspect(size, max_size, mode)`: the sides rounded
    ("antialias") or floored ("torchvision"), at least 1."""
    ratio = size / max(h, w) if max_size is None else min(size / min(h, w), max_size / max(h, w))
    if mode == "torchvision":
        return max(1, math.floor(h * ratio)), max(1, math.floor(w * ratio))
    return max(1, int(round(h * ratio))), max(1, int(round(w * ratio)))


def padded_input_shape(h: int, w: int, size: int, max_size: int | None = None, mode: str = "antialias",
                       size_divisibility: int = INPUT_DIVISIBILITY) -> tuple[int, int]:
    """(H, W) in px of the model's input for an h x w image evaluated by itself: its `resized_size`, each side
    rounded up to a multiple of `size_divisibility` (the padding `collate_detection` adds)."""
    nh, nw = resized_size(h, w, size, max_size, mode)
    return (-(-nh // size_divisibility) * size_divisibility, -(-nw // size_divisibility) * size_divisibility)


def augmentation_steps(augmentation: str, canvas: int) -> list:
    """The transforms of preset `augmentation` (one of AUGMENTATIONS) before the final resize, on uint8 images with
    xyxy BoundingBoxes; `canvas`: scale_jitter's square side in px. The one place the presets are written."""
    flip = [v2.RandomHorizontalFlip(p=0.5)]
    crop_translate = [RandomCropFraction(min_fraction=0.6, p=0.5),
                      v2.RandomApply([v2.RandomAffine(degrees=0.0, translate=(0.1, 0.1), fill=list(PAD_VALUE))], p=0.5)]
    presets = {
        "none": [],
        "flip": flip,
        "flip_crop_translate": flip + crop_translate,
        "photometric": flip + crop_translate + [v2.ColorJitter(brightness=0.4, saturation=0.7, hue=0.015)],
        # ScaleJitter fits the image into canvas x factor (aspect kept); RandomCrop then cuts a canvas out of a
        # larger one, or pads a smaller one on random sides
        "scale_jitter": flip + [v2.ScaleJitter((canvas, canvas), scale_range=(0.1, 2.0)),
                                v2.RandomCrop(canvas, pad_if_needed=True, fill=list(PAD_VALUE))],
    }
    return presets[augmentation]


def build_transform(image_size: int | list[int], augmentation: str = "none", max_size: int | None = None,
                    resize_mode: str = "antialias") -> v2.Compose:
    """The sample transform for training (`augmentation` as above) or evaluation (`"none"`).

    `image_size` is the longer side, or with `max_size` the shorter side (see `ResizeKeepAspect`); a list of
    sizes draws one per sample (multi-scale training); `resize_mode` "torchvision" gives float32 images resized
    as torchvision's detection models do.

    Raises:
        ValueError: for an unknown augmentation name.
    """
    if augmentation not in AUGMENTATIONS:
        raise ValueError(f"augmentation must be one of {AUGMENTATIONS}, got {augmentation!r}")
    canvas = max(image_size) if isinstance(image_size, (list, tuple)) else image_size
    steps = augmentation_steps(augmentation, canvas)
    steps.append(ResizeKeepAspect(image_size, max_size, resize_mode))
    steps.append(v2.SanitizeBoundingBoxes(min_size=1.0, labels_getter=_box_fields))
    return v2.Compose(steps)


def make_sample(image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, iscrowd: torch.Tensor) -> dict:
    """Wrap plain tensors as a transform sample. image: [3, H, W] uint8; boxes: [N, 4] xyxy pixels."""
    h, w = image.shape[-2:]
    return {
        "image": tv_tensors.Image(image),
        "boxes": tv_tensors.BoundingBoxes(boxes.reshape(-1, 4).float(), format="XYXY", canvas_size=(h, w)),
        "labels": labels.reshape(-1).long(),
        "iscrowd": iscrowd.reshape(-1).bool(),
    }
