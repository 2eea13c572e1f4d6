"""The one benchmark kit: both detectors, their shared inputs, one train step and one inference pass each.

`run.py` (CPU, fp32) and `gpu_throughput.py` (one GPU, fp32 / bf16 / fp16) time the same two calls, defined once here:

* ours: `detlib.retinanet.model.RetinaNet` (R50-FPN, 80 classes, frozen BatchNorm folded) + `retinanet_loss` for
  training; forward + decoding through `detlib.evaluation.detect.decode_batch` for inference;
* peer: torchvision's `retinanet_resnet50_fpn` carrying exactly our weights (`devtools/peers.py`, shared with
  tests/test_fast_paths.py, which checks it), which computes its own transform, anchors, matching, loss and decoding.

Both train with SGD (lr 1e-4, momentum 0.9) and decode with score > 0.05, top 1000 per level, class-wise NMS
0.5 and at most 100 detections per image (torchvision's `detections_per_img` set to 100 from its 300).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torchvision.transforms.v2 import functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # a benchmark runs as `python benchmarks/<name>.py`: the repository root holds devtools/
    sys.path.insert(0, REPO)
from devtools.peers import COCO_IMAGES, COCO_TRAIN_JSON, torchvision_retinanet  # noqa: E402

from detlib.retinanet.anchors import AnchorGenerator  # noqa: E402
from detlib.evaluation.detect import decode_batch  # noqa: E402
from detlib.retinanet.loss import retinanet_loss  # noqa: E402
from detlib.retinanet.model import RetinaNet  # noqa: E402

NUM_CLASSES = 80
# The paper's cap, which our decoder uses (torchvision's default is 300).
DETECTIONS_PER_IMAGE = 100


def spread_class_scores(model: torch.nn.Module, images: torch.Tensor, target_std: float = 1.0) -> None:
    """Rescale the classifier's output conv so its logits vary with std `target_std` around the prior.

    A freshly initialised head gives every (anchor, class) the same score 0.01, below the 0.05 threshold,
    so decoding would have nothing to do. With a spread of 1 about 5 % of the candidates pass the
    threshold: the top-k, decoding and NMS then run at full size, as they do for a partly trained model.
    """
    with torch.no_grad():
        was = model.training
        model.eval()
        logits = model(images)["cls_logits"].float()
        model.train(was)
        std = float(logits.std().clamp(min=1e-12))
        model.cls_head.out.weight.mul_(target_std / std)


def real_batch(image_size: int | tuple[int, int], batch_size: int, first: int = 0, images: str = COCO_IMAGES,
               annotations: str = COCO_TRAIN_JSON) -> dict:
    """`batch_size` real COCO training images resized to image_size x image_size (or to (height, width)), with
    their boxes; `images` / `annotations`: another COCO-format set (default: the shared subset's training set).

    Returns:
        `collate_detection`'s batch: images [B, 3, H, W] uint8; boxes [B, M, 4] float32 xyxy pixels padded
        with zeros; labels [B, M] int64 (-1 in padding); crowd_boxes [B, C, 4]; image_sizes; scales; plus
        torchvision-style `tv_images` (list of float [3, H, W] in [0, 1]) and `tv_targets` (list of
        {"boxes", "labels"}).
    """
    from detlib.data.coco import CocoDetection, collate_detection

    out_h, out_w = (image_size, image_size) if isinstance(image_size, int) else image_size
    ds = CocoDetection(images, annotations, transform=None)
    samples = []
    for i in range(first, first + batch_size):
        s = ds[i % len(ds)]
        h, w = s["image"].shape[-2:]
        scale = torch.tensor([out_w / w, out_h / h] * 2)
        s["image"] = F.resize(s["image"], [out_h, out_w], antialias=True)
        s["boxes"] = s["boxes"] * scale
        s["crowd_boxes"] = s["crowd_boxes"] * scale
        samples.append(s)
    batch = collate_detection(samples)
    batch["tv_images"] = [s["image"].float() / 255 for s in samples]
    batch["tv_targets"] = [{"boxes": s["boxes"], "labels": s["labels"]} for s in samples]
    return batch


def build_model_pair(image_size: int, batch_size: int, **data) -> tuple[RetinaNet, torch.nn.Module, dict]:
    """Our R50-FPN RetinaNet (seed 0), torchvision's with the same weights, and the real batch both run on
    (`data`: `real_batch`'s `images` / `annotations`).

    The class scores are spread first (`spread_class_scores`) so that decoding has realistic candidate counts.
    """
    torch.manual_seed(0)
    ours = RetinaNet(NUM_CLASSES, "resnet50", fpn_channels=256)
    batch = real_batch(image_size, batch_size, **data)
    spread_class_scores(ours, batch["images"])
    peer = torchvision_retinanet(ours, image_size)
    peer.detections_per_img = DETECTIONS_PER_IMAGE
    return ours, peer, batch


def peer_input_size(peer: torch.nn.Module, height: int, width: int) -> None:
    """Set torchvision's transform so an image of height x width goes in at scale 1 (its resize leaves it as is)."""
    peer.transform.min_size = (min(height, width),)
    peer.transform.max_size = max(height, width)


class Kit:
    """One detector (ours or torchvision's) on one device, with its optimizer, train step and inference pass.

    Args:
        model: a `RetinaNet` (ours) or the peer from `build_model_pair`; moved to `device` (not copied).
        channels_last: run the model and its input images in channels_last memory format.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | str = "cpu", channels_last: bool = False):
        self.ours = isinstance(model, RetinaNet)
        self.device = torch.device(device)
        self.channels_last = channels_last
        self.model = model.to(self.device)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=1e-4, momentum=0.9)
        self.anchor_gen = AnchorGenerator()

    def batch(self, base: dict, size: int | None = None) -> dict:
        """`base` (from `real_batch`) repeated to `size` images (default: as is) on this kit's device, in this
        kit's own input format only (a GPU's memory holds no copy the model does not read)."""
        n = base["images"].shape[0]
        size = size or n
        if not self.ours:
            return {"tv_images": [base["tv_images"][i % n].to(self.device) for i in range(size)],
                    "tv_targets": [{k: v.to(self.device) for k, v in base["tv_targets"][i % n].items()} for i in range(size)]}
        reps = -(-size // n)
        out = {k: base[k].repeat(reps, *[1] * (base[k].dim() - 1))[:size].to(self.device)
               for k in ("images", "boxes", "labels", "crowd_boxes", "image_sizes", "scales")}
        out["image_ids"] = torch.arange(size)
        if self.channels_last:
            out["images"] = out["images"].contiguous(memory_format=torch.channels_last)
        return out

    def _autocast(self, dtype: torch.dtype | None):
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def train_step(self, batch: dict, dtype: torch.dtype | None = None, scaler: torch.amp.GradScaler | None = None,
                   model: torch.nn.Module | None = None, ema=None) -> None:
        """Forward + loss + backward + SGD step (under autocast to `dtype` when given; `scaler` for fp16).

        `model` replaces `self.model` in the forward (e.g. its `torch.compile`d version; same parameters).
        `ema` (timm's ModelEmaV3 of `self.model`) is updated after the step, as `--model_ema` does.
        """
        model = self.model if model is None else model
        with self._autocast(dtype):
            if self.ours:
                out = model(batch["images"])
                anchors, _ = self.anchor_gen(*batch["images"].shape[-2:], device=self.device)
                loss = retinanet_loss(out["cls_logits"], out["box_deltas"], anchors, batch["boxes"], batch["labels"],
                                      batch["crowd_boxes"], box_loss="l1")["loss"]
            else:
                loss = sum(model(batch["tv_images"], batch["tv_targets"]).values())
        if scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(self.optimizer)
            scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(self.model, step=1000)

    @torch.inference_mode()
    def infer(self, batch: dict, dtype: torch.dtype | None = None) -> list[int]:
        """Forward + decoding of `batch` (call with the model in eval mode); returns detections per image. Ours runs
        `decode_batch`, the one inference path of evaluation and predict (on a CPU it passes the images in
        channels_last)."""
        if not self.ours:
            with self._autocast(dtype):
                return [len(d["boxes"]) for d in self.model(batch["tv_images"])]
        dets = decode_batch(self.model, self.anchor_gen, batch, score_thresh=0.05, nms_thresh=0.5,
                            max_detections=DETECTIONS_PER_IMAGE,
                            autocast=(lambda: self._autocast(dtype)))
        return [len(d["boxes"]) for d in dets]
