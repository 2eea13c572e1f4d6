"""Torchvision's COCO RetinaNet (`retinanet_resnet50_fpn`, v1, and `_v2`) as a detlib RetinaNet: weights and settings.

What our model must do to reproduce its predictions, written into model_config.json as plain values:
  * backbone `resnet50` (timm's and torchvision's ResNet-50 have the same modules and parameter names under
    `backbone.body.` / `backbone.`), fpn_channels 256, P6 from P5 (`p6_input: "p5"`: torchvision's
    LastLevelP6P7(256, 256) reads P5);
  * its anchors (`detlib.retinanet.anchors.torchvision_anchor_settings`: truncated sizes, rounded cells, offset 0,
    strides from the grid);
  * its preprocessing: shorter side 800, longer at most 1333, float bilinear resize without antialiasing
    (`resize_mode: "torchvision"`), ImageNet mean / std (the model's own normalisation, the same values x 255);
  * its 91 class slots (label = COCO category id, 0 and the 10 unused ids never trained) cut to the rows of the
    wanted category ids, in sorted order: our contiguous labels 0..K-1.
The box coder weights (1, 1, 1, 1), the decoding and its defaults (0.05, top 1000 per level, NMS 0.5, 100 per
image) are already torchvision's. v2 (`retinanet_resnet50_fpn_v2`, 41.5 AP) differs in two settings only:
GroupNorm in the heads' hidden convs (`head_norm: "gn"`, convs without bias) and P6 from C5 (`p6_input: "c5"`);
its anchors, resize and classes are v1's. (Its GIoU box loss is a training choice; `--box_loss` has one.)
"""

from __future__ import annotations

import re
from collections import OrderedDict

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from .anchors import anchor_config, torchvision_anchor_settings

# torchvision's RetinaNet head: conv.{i}.0 is the i-th Conv2dNormActivation's conv (conv.{i}.1 its GroupNorm in
# v2); ours is tower.{2i} (conv, ReLU), or in v2 tower.{3i} and tower.{3i + 1} (conv, GroupNorm, ReLU).
_HEAD_RE = re.compile(r"^head\.(classification|regression)_head\.conv\.(\d+)\.([01])\.(weight|bias)$")
_HEADS = {"classification": "cls_head", "regression": "box_head"}
TORCHVISION_NUM_ANCHORS = 9


def torchvision_coco_categories() -> tuple[list[int], list[str]]:
    """The 80 COCO category ids and names of torchvision's detection weights: the slots of its 91-entry
    category list (`RetinaNet_ResNet50_FPN_Weights.COCO_V1.meta["categories"]`, no download) that are neither
    `__background__` nor `N/A`; the slot index is the COCO id."""
    from torchvision.models.detection import RetinaNet_ResNet50_FPN_Weights

    names = RetinaNet_ResNet50_FPN_Weights.COCO_V1.meta["categories"]
    kept = [(i, n) for i, n in enumerate(names) if n not in ("__background__", "N/A")]
    return [i for i, _ in kept], [n for _, n in kept]


def torchvision_version(state_dict: dict) -> str:
    """"v2" when the heads have GroupNorm tensors (`head.classification_head.conv.0.1.*`), else "v1"."""
    return "v2" if any(k.startswith("head.classification_head.conv.0.1.") for k in state_dict) else "v1"


def torchvision_model_config(category_ids: list[int], category_names: list[str], image_size: int = 800,
                             max_size: int = 1333, version: str = "v1") -> dict:
    """The model_config.json of a converted RetinaNet (see the module docstring).

    Raises:
        ValueError: for a version other than "v1" or "v2"."""
    if version not in ("v1", "v2"):
        raise ValueError(f"torchvision RetinaNet version must be v1 or v2, got {version!r}")
    return {"num_classes": len(category_ids), "backbone": "resnet50", "fpn_channels": 256,
            "p6_input": "p5" if version == "v1" else "c5", "head_norm": "none" if version == "v1" else "gn",
            **anchor_config(torchvision_anchor_settings()), "image_size": image_size, "max_size": max_size,
            "resize_mode": "torchvision", "category_ids": list(category_ids), "category_names": list(category_names),
            # GeneralizedRCNNTransform's image_mean / image_std
            "mean": list(IMAGENET_DEFAULT_MEAN), "std": list(IMAGENET_DEFAULT_STD)}


def convert_torchvision_retinanet(state_dict: dict, category_ids: list[int]) -> OrderedDict:
    """Rename a torchvision `retinanet_resnet50_fpn` (v1) or `_v2` state dict to our RetinaNet's (the version is
    read from the keys, `torchvision_version`) and keep the class rows of `category_ids`.

    Args:
        state_dict: torchvision's tensors (FrozenBatchNorm2d buffers or BatchNorm2d ones; wrapper prefixes
            already stripped, see `detlib.weights.load_state_dict_file`).
        category_ids: the COCO ids to keep, any order; they become labels 0..K-1 in sorted order. Torchvision's
            label of a class is its COCO id, and its classification output has A x 91 channels, anchor-major
            (channel = a * 91 + id), the layout of our head's [A * K] output, so our channel a * K + k is
            torchvision's a * 91 + ids[k].
    Returns:
        our state dict (plain BatchNorm2d names: `num_batches_tracked` added as 0 where the file has none).
    Raises:
        ValueError: a file that is not a torchvision RetinaNet, or an id outside the file's class slots.
    """
    step = 3 if torchvision_version(state_dict) == "v2" else 2
    logits_w = state_dict.get("head.classification_head.cls_logits.weight")
    if logits_w is None or not any(k.startswith("backbone.body.") for k in state_dict):
        raise ValueError("not a torchvision RetinaNet state dict (no backbone.body.* or head.classification_head.cls_logits)")
    slots = logits_w.shape[0] // TORCHVISION_NUM_ANCHORS
    ids = sorted(int(c) for c in category_ids)
    if not ids or ids[0] < 0 or ids[-1] >= slots:
        raise ValueError(f"category ids must lie in 0..{slots - 1} (the checkpoint's class slots), got {ids[:3]}..{ids[-3:]}")
    rows = torch.tensor([a * slots + c for a in range(TORCHVISION_NUM_ANCHORS) for c in ids])
    out = OrderedDict()
    for k, v in state_dict.items():
        if k.startswith("backbone.body."):
            out["backbone." + k[len("backbone.body."):]] = v
        elif k.startswith("backbone.fpn."):
            out["fpn." + k[len("backbone.fpn."):]] = v
        elif (m := _HEAD_RE.match(k)):
            out[f"{_HEADS[m[1]]}.tower.{step * int(m[2]) + int(m[3])}.{m[4]}"] = v
        elif k.startswith("head.classification_head.cls_logits."):
            out["cls_head.out." + k.rsplit(".", 1)[1]] = v[rows].clone()
        elif k.startswith("head.regression_head.bbox_reg."):
            out["box_head.out." + k.rsplit(".", 1)[1]] = v
        else:
            raise ValueError(f"unexpected key in a torchvision RetinaNet state dict: {k}")
    for k in [k for k in out if k.endswith(".running_var")]:
        out.setdefault(k[: -len("running_var")] + "num_batches_tracked", torch.tensor(0, dtype=torch.int64))
    return out
