"""The peers detlib is compared with, shared by `tests/test_fast_paths.py` and `benchmarks/kit.py` (neither's own module).

* `torchvision_retinanet`: torchvision's `retinanet_resnet50_fpn` carrying exactly our model's weights.
  Two settings are aligned so that every weight maps one to one (and the head outputs agree, checked by
  `head_output_gap`):
    - backbone BatchNorm frozen (`FrozenBatchNorm2d`), as in our model and as torchvision itself does
      whenever backbone weights are given; all backbone stages stay trainable in both;
    - P6 computed from C5 (our model, the paper, torchvision's `_v2` model) instead of from P5
      (torchvision's v1 default): +0.27 GMAC per 512 px image, under 0.5 % of the forward.
  What still differs is each kit's own code: input transform, anchors (torchvision's are rounded to whole
  pixels and centred at offset 0), matching, loss and decoding.
* `coco_eval_inputs`: a large COCO ground truth made of renumbered copies of the subset's annotations, and
  detections that are jittered copies of the ground truth plus false positives, so the AP is non-trivial.
"""

from __future__ import annotations

import copy
import json
import os
import random

import numpy as np
import timm
import torch
from torchvision.models.detection import retinanet_resnet50_fpn
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COCO_SUBSET = os.environ.get("DETLIB_COCO_SUBSET", os.path.join(os.path.dirname(REPO), "shared", "data", "coco_subset"))
COCO_TRAIN_JSON = os.path.join(COCO_SUBSET, "annotations", "instances_train.json")
COCO_SUBSET_JSON = os.path.join(COCO_SUBSET, "annotations", "instances_subset.json")
COCO_IMAGES = os.path.join(COCO_SUBSET, "images")

# Our module prefix -> torchvision's, for the parts outside the backbone.
_PREFIXES = (
    ("fpn.", "backbone.fpn."),
    ("cls_head.tower.", "head.classification_head.conv."),
    ("cls_head.out.", "head.classification_head.cls_logits."),
    ("box_head.tower.", "head.regression_head.conv."),
    ("box_head.out.", "head.regression_head.bbox_reg."),
)


def _tv_key(key: str) -> str:
    if key.startswith("backbone."):
        return "backbone.body." + key[len("backbone."):]  # timm and torchvision ResNets share names
    for ours, theirs in _PREFIXES:
        if key.startswith(ours):
            rest = key[len(ours):]
            if ours.endswith("tower."):
                # ours: Sequential(conv, relu, conv, relu, ...) -> index 2i; theirs: conv.i.0 (Conv2dNormActivation)
                i, param = rest.split(".", 1)
                return f"{theirs}{int(i) // 2}.0.{param}"
            return theirs + rest
    raise KeyError(f"no torchvision counterpart for {key}")


def torchvision_retinanet(ours: torch.nn.Module, image_size: int) -> torch.nn.Module:
    """torchvision's `retinanet_resnet50_fpn` with `ours`' weights (an R50 `detlib.retinanet.model.RetinaNet`).

    Its transform is set to `min_size = max_size = image_size`, so a square image of that size goes in
    unchanged (it is still interpolated at scale 1, part of torchvision's own cost).

    Raises:
        RuntimeError: if a weight has no counterpart or a different shape.
    """
    tv = retinanet_resnet50_fpn(weights=None, weights_backbone=None, num_classes=ours.num_classes,
                                min_size=image_size, max_size=image_size)
    tv.backbone.body = timm.layers.freeze_batch_norm_2d(tv.backbone.body)
    tv.backbone.fpn.extra_blocks = LastLevelP6P7(2048, tv.backbone.out_channels)
    theirs = tv.state_dict()
    mapped = {}
    for k, v in ours.state_dict().items():
        tk = _tv_key(k)
        if tk not in theirs or theirs[tk].shape != v.shape:
            raise RuntimeError(f"cannot map {k} -> {tk}")
        mapped[tk] = v.clone()
    missing = sorted(set(theirs) - set(mapped))
    if missing:
        raise RuntimeError(f"torchvision weights not covered: {missing[:5]}")
    tv.load_state_dict(mapped)
    return tv


@torch.no_grad()
def head_output_gap(ours: torch.nn.Module, tv: torch.nn.Module, images: torch.Tensor) -> float:
    """Largest |difference| between the two models' class logits on `images` ([B, 3, H, W] uint8)."""
    was = ours.training, tv.training
    ours.eval(), tv.eval()
    a = ours(images)["cls_logits"]
    x = (images.float() / 255 - torch.tensor(tv.transform.image_mean).view(1, 3, 1, 1)) / torch.tensor(
        tv.transform.image_std).view(1, 3, 1, 1)
    b = tv.head.classification_head(list(tv.backbone(x).values()))
    ours.train(was[0]), tv.train(was[1])
    return float((a - b).abs().max())


def coco_eval_inputs(num_images: int, dets_per_image: int = 100, seed: int = 0) -> tuple[dict, list[dict]]:
    """A COCO ground truth of `num_images` images and `dets_per_image` detections for each.

    Image i is a copy of subset image i % 130 (new image and annotation ids, crowd flags and areas kept).
    Detections per image: each non-crowd ground-truth box, jittered by up to ~15 % of its size, with the
    right class 80 % of the time; then random boxes of random classes; scores random, higher on average
    for the jittered copies. Built with a fixed seed.

    Returns:
        (gt_dataset dict, list of COCO result dicts with Python floats and ints).
    """
    with open(COCO_SUBSET_JSON) as f:
        base = json.load(f)
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    cat_ids = [c["id"] for c in base["categories"]]
    by_image: dict[int, list[dict]] = {}
    for a in base["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    src_images = sorted(base["images"], key=lambda im: im["id"])
    images, annotations, results = [], [], []
    ann_id = 1
    for i in range(num_images):
        src = src_images[i % len(src_images)]
        image_id = i + 1
        W, H = src["width"], src["height"]
        # a file name of its own: one file listed under two ids is merged by the data check (detlib.datacheck.coco)
        images.append({**src, "id": image_id, "file_name": f"copy{i:06d}_{src['file_name']}"})
        dets = []
        for a in by_image.get(src["id"], []):
            ann = copy.deepcopy(a)
            ann.update(id=ann_id, image_id=image_id)
            annotations.append(ann)
            ann_id += 1
            if a.get("iscrowd", 0) or len(dets) >= dets_per_image:
                continue
            x, y, w, h = a["bbox"]
            jx, jy, jw, jh = nrng.normal(0.0, 0.08, 4)
            cat = a["category_id"] if rng.random() < 0.8 else rng.choice(cat_ids)
            dets.append({"image_id": image_id, "category_id": cat,
                         "bbox": [x + jx * w, y + jy * h, max(1.0, w * (1 + jw)), max(1.0, h * (1 + jh))],
                         "score": 0.3 + 0.7 * rng.random()})
        while len(dets) < dets_per_image:
            w, h = W * (0.02 + 0.5 * rng.random()), H * (0.02 + 0.5 * rng.random())
            dets.append({"image_id": image_id, "category_id": rng.choice(cat_ids),
                         "bbox": [rng.random() * (W - w), rng.random() * (H - h), w, h], "score": 0.7 * rng.random()})
        results.extend(dets)
    gt = {"info": base.get("info", {}), "licenses": base.get("licenses", []), "images": images,
          "annotations": annotations, "categories": base["categories"]}
    return gt, results
