"""RetinaNet as a self-contained inference graph for ONNX / torch.export, with or without the decoding.

The exported graph takes one image padded to a fixed square canvas of `canvas` x `canvas` pixels (the
anchors of that size are constants in the graph; the canvas is the training size rounded up to a multiple
of 32). Pre-processing stays outside, as in the evaluation: resize so the longer side is `image_size`
(`ResizeLongestSide`), pad at the bottom / right with `PAD_VALUE`. `prepare_input` does it.

Inputs (decoding inside):
    images:     [1, 3, canvas, canvas] float32 RGB in 0..255
    image_size: [2] float32 (height, width) of the resized image inside the canvas (boxes are clipped to it)
    scale:      [2] float32 (scale_y, scale_x) = resized / original size (boxes are divided by it)
Outputs (decoding inside): boxes [N, 4] float32 xyxy pixels of the original image, scores [N] float32 by
decreasing score, labels [N] int64 contiguous 0..K-1 (category id = model_config's category_ids[label]).
With the decoding outside, the graph takes `images` only and returns the raw head outputs cls_logits
[1, A, K] and box_deltas [1, A, 4]; `detlib.decode.decode_detections` (or a port of it) finishes the job.

The decoding is `detlib.decode.decode_detections` for a batch of one, written without the host-side
`.tolist()` loop so a graph can hold it: per-level top-k, decode, clip, threshold, class-wise NMS
(torchvision's `batched_nms`; ONNX `NonMaxSuppression`), cap.
"""

from __future__ import annotations

import math

import numpy as np

import torch
import torch.nn as nn

from . import box_coder
from .anchors import INPUT_DIVISIBILITY, AnchorGenerator
from torchvision.ops import nms

from .box_ops import clip_boxes_to_image
from .data import PAD_VALUE
from .transforms import build_transform, make_sample


def canvas_size(image_size: int, max_size: int | None = None) -> int:
    """Side of the square export canvas: the longest resized side, rounded up to a multiple of 32."""
    longest = max_size or image_size
    return int(math.ceil(longest / INPUT_DIVISIBILITY) * INPUT_DIVISIBILITY)


class ExportableRetinaNet(nn.Module):
    """A trained RetinaNet plus its anchors for one canvas size, and optionally the decoding.

    Args:
        model: the RetinaNet (eval mode).
        canvas: input side in pixels (multiple of 32).
        decode: include the decoding (top-k, NMS) in the graph.
        score_thresh, topk_per_level, nms_thresh, max_detections: as `decode_detections`.
    """

    def __init__(self, model: nn.Module, canvas: int, decode: bool = True, score_thresh: float = 0.05,
                 topk_per_level: int = 1000, nms_thresh: float = 0.5, max_detections: int = 100):
        super().__init__()
        self.model = model
        self.decode = decode
        anchors, counts = AnchorGenerator()(canvas, canvas)
        self.register_buffer("anchors", anchors, persistent=False)
        self.counts = [int(c) for c in counts]
        self.score_thresh, self.topk, self.nms_thresh, self.max_detections = score_thresh, topk_per_level, nms_thresh, max_detections

    def forward(self, images: torch.Tensor, image_size: torch.Tensor | None = None, scale: torch.Tensor | None = None):
        out = self.model(images)
        if not self.decode:
            return out["cls_logits"], out["box_deltas"]
        logits, deltas = out["cls_logits"][0], out["box_deltas"][0]  # [A, K], [A, 4]
        K = logits.shape[1]
        top_all, flat_all, start = [], [], 0
        for n in self.counts:
            lv = logits[start:start + n].reshape(-1)
            top, flat = lv.topk(min(self.topk, n * K))
            top_all.append(top)
            flat_all.append(flat + start * K)
            start += n
        flat = torch.cat(flat_all)
        anchor_idx = flat // K
        labels = flat % K
        boxes = box_coder.decode(deltas[anchor_idx], self.anchors[anchor_idx])
        scores = torch.cat(top_all).float().sigmoid()
        boxes = clip_boxes_to_image(boxes, image_size[0], image_size[1])
        boxes = boxes / torch.stack((scale[1], scale[0], scale[1], scale[0]))
        keep = scores > self.score_thresh
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
        # class-wise NMS by offsetting each class's boxes apart (torchvision's batched_nms does the same below
        # 4000 boxes on a CPU; its per-class loop above that cannot be traced)
        offsets = labels.to(boxes.dtype) * (boxes.max() + 1)
        order = nms(boxes + offsets[:, None], scores, self.nms_thresh)[: self.max_detections]
        return boxes[order], scores[order], labels[order]


def prepare_input(image: torch.Tensor, image_size: int, max_size: int | None, canvas: int) -> dict[str, torch.Tensor]:
    """One image -> the exported graph's inputs, resized exactly as the evaluation resizes.

    Args:
        image: [3, H, W] uint8 RGB, the original image.
    Returns:
        {"images": [1, 3, canvas, canvas] float32 0..255 padded with PAD_VALUE, "image_size": [2] float32 (h, w),
         "scale": [2] float32 (sy, sx)}.
    Raises:
        ValueError: the resized image does not fit the canvas (another --image_size than the export's).
    """
    empty = torch.zeros((0, 4))
    sample = build_transform(image_size, "none", max_size)(make_sample(image, empty, torch.zeros(0, dtype=torch.int64),
                                                                       torch.zeros(0, dtype=torch.bool)))
    resized = sample["image"].as_subclass(torch.Tensor)
    h, w = resized.shape[-2:]
    if h > canvas or w > canvas:
        raise ValueError(f"resized image {h}x{w} does not fit the {canvas}x{canvas} canvas of the export")
    padded = torch.tensor(PAD_VALUE, dtype=torch.uint8).view(3, 1, 1).repeat(1, canvas, canvas)
    padded[:, :h, :w] = resized
    return {"images": padded[None].float(), "image_size": torch.tensor([h, w], dtype=torch.float32),
            "scale": torch.tensor(sample["scale"], dtype=torch.float32)}


def compare_detections(ref: tuple, got: tuple, max_detections: int | None = None, score_thresh: float | None = None,
                       tie_atol: float = 1e-5) -> dict:
    """Pair two detection lists of one image and measure their differences.

    Each reference detection is paired with the unpaired detection of `got` of the same label whose box is
    nearest (largest absolute coordinate difference), so detections whose scores tie within rounding may come
    in another order without counting as a difference; one left unpaired is a difference, except at a cut: when
    a list holds `max_detections` (the lowest kept score is then a cut) or at `score_thresh`, which members of a
    run of scores tied within `tie_atol` make it is decided by float rounding, each runtime its own way.

    Args:
        ref, got: (boxes [N, 4] xyxy pixels, scores [N], labels [N]) as numpy arrays or tensors.
        max_detections, score_thresh: the cap and the threshold both lists were cut with (None: no such cut).
        tie_atol: scores this close to a cut count as tied with it.
    Returns:
        {"num_detections": [N_ref, N_got], "num_paired": int, "num_at_cut": unpaired detections tied with a cut,
         "labels_equal": every detection paired but those at a cut, "max_abs_box_px": float, "max_abs_score":
         float} (inf when a detection away from a cut is unpaired).
    """
    rb, rs, rl = (np.asarray(a) for a in ref)
    gb, gs, gl = (np.asarray(a) for a in got)
    used = np.zeros(len(gl), dtype=bool)
    box_d, score_d = 0.0, 0.0
    paired = 0
    unpaired = []
    for i in range(len(rl)):
        cand = np.nonzero((gl == rl[i]) & ~used)[0]
        if not len(cand):
            unpaired.append(float(rs[i]))
            continue
        d = np.abs(gb[cand] - rb[i]).max(axis=1)
        j = cand[int(np.argmin(d))]
        used[j] = True
        paired += 1
        box_d = max(box_d, float(d.min()))
        score_d = max(score_d, float(abs(gs[j] - rs[i])))
    unpaired += [float(s) for s in gs[~used]]
    cuts = [float(score_thresh)] if score_thresh is not None else []
    full = [float(s.min()) for s in (rs, gs) if max_detections and len(s) >= max_detections]
    cuts += [max(full)] if full else []
    at_cut = sum(any(abs(s - c) <= tie_atol for c in cuts) for s in unpaired)
    complete = at_cut == len(unpaired)
    return {"num_detections": [int(len(rl)), int(len(gl))], "num_paired": paired, "num_at_cut": int(at_cut),
            "labels_equal": bool(complete), "max_abs_box_px": box_d if complete else float("inf"),
            "max_abs_score": score_d if complete else float("inf")}
