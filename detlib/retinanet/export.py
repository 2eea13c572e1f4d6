"""RetinaNet as a self-contained inference graph for ONNX / torch.export, with or without the decoding.

The exported graph takes one image padded to a fixed square canvas of `canvas` x `canvas` pixels (the
anchors of that size are constants in the graph; the canvas is the training size rounded up to a multiple
of 32). Pre-processing stays outside, as in the evaluation: resize so the longer side is `image_size`
(`ResizeKeepAspect`), pad at the bottom / right with `PAD_VALUE`. `prepare_input` does it.

Inputs (decoding inside):
    images:     [1, 3, canvas, canvas] float32 RGB in 0..255
    image_size: [2] float32 (height, width) of the resized image inside the canvas (boxes are clipped to it)
    scale:      [2] float32 (scale_y, scale_x) = resized / original size (boxes are divided by it)
Outputs (decoding inside): boxes [N, 4] float32 xyxy pixels of the original image, scores [N] float32 by
decreasing score, labels [N] int64 contiguous 0..K-1 (category id = model_config's category_ids[label]).
With the decoding outside, the graph takes `images` only and returns the raw head outputs cls_logits
[1, A, K] and box_deltas [1, A, 4]; `detlib.retinanet.decode.decode_detections` (or a port of it) finishes the job.
Its ONNX file takes any batch and any padded size (`dynamic_image_shapes`: images [B, 3, H, W], H and W multiples of
32, outputs [B, A(H, W), K] and [B, A(H, W), 4]), so it runs on the evaluation's batches without a canvas.

The decoding is `detlib.retinanet.decode.decode_detections` for a batch of one, written without the host-side
`.tolist()` loop so a graph can hold it: per-level top-k, decode, clip, threshold, class-wise NMS
(torchvision's `batched_nms`; ONNX `NonMaxSuppression`), cap.
"""

from __future__ import annotations

import math

import numpy as np

import torch
import torch.nn as nn

from torchvision.ops import nms

from ..boxes import clip_boxes_to_image
from ..data.transforms import INPUT_DIVISIBILITY, PAD_VALUE, build_transform, make_sample
from . import box_coder
from .anchors import AnchorGenerator


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


def dynamic_image_shapes(max_side: int = 4096) -> dict:
    """torch.export's `dynamic_shapes` of the `images` input of a graph without the decoding: any batch size, any
    height and width that are multiples of 32 up to `max_side`, so that the graph runs on the evaluation's batches as
    they are (no canvas). Export with an example of batch 2: torch.export fixes a size of 1 as a constant."""
    from torch.export import Dim

    side = max_side // INPUT_DIVISIBILITY
    return {0: Dim("batch", min=1, max=1024), 2: INPUT_DIVISIBILITY * Dim("h32", min=1, max=side),
            3: INPUT_DIVISIBILITY * Dim("w32", min=1, max=side)}


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


def head_candidates(cls_logits: torch.Tensor, box_deltas: torch.Tensor, anchors: torch.Tensor, image_size: torch.Tensor,
                    scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Every detection the decoding could return for one image, from PyTorch's raw head outputs: (boxes [A, 4]
    float32 xyxy pixels of the original image, decoded, clipped and scaled as the graph does; scores [A, K]
    float32 sigmoid). `compare_detections` checks a detection paired only by a tied score against them.

    Args:
        cls_logits: [1, A, K]; box_deltas: [1, A, 4]; anchors: [A, 4] of the canvas; image_size: [2] (h, w) of
        the resized image; scale: [2] (sy, sx), as `prepare_input` gives them.
    """
    boxes = clip_boxes_to_image(box_coder.decode(box_deltas[0].float(), anchors), image_size[0], image_size[1])
    boxes = boxes / torch.stack((scale[1], scale[0], scale[1], scale[0]))
    return boxes.numpy(), cls_logits[0].float().sigmoid().numpy()


def compare_detections(ref: tuple, got: tuple, box_atol: float = 0.01, score_atol: float = 1e-5,
                       candidates: tuple[np.ndarray, np.ndarray] | None = None, score_thresh: float | None = None) -> dict:
    """Pair two detection lists of one image (the PyTorch reference and an export) and measure their differences.

    1. Each reference detection is paired with the unpaired detection of `got` of the same label whose box is
       nearest (largest absolute coordinate difference); the pair counts when that box is within `box_atol` px
       and the score within `score_atol`.
    2. Scores tied within `score_atol` make the order, and at the cut-offs (per-level top-k, NMS, the detection
       cap) the choice between equally scored candidates, a matter of rounding; so the detections left over on
       both sides are paired by score rank, and a pair whose scores are within `score_atol` counts as paired by
       a tie when the export's detection is one the reference could have returned: `candidates`
       (`head_candidates`) holds an anchor with that label, a score within `score_atol` and a box within
       `box_atol`. A detection left over within `score_atol` of `score_thresh` (on either side of the threshold
       by rounding) counts the same way. Without `candidates` nothing counts by a tie.
    Args:
        ref, got: (boxes [N, 4] xyxy pixels, scores [N], labels [N]) as numpy arrays or tensors.
    Returns:
        {"num_detections": [N_ref, N_got], "num_paired": pairs within the tolerance, "num_tie_paired": pairs by
         tied scores (and detections at the threshold), "num_unexplained": detections of either side left,
         "labels_equal": every detection paired one way or the other, "max_abs_box_px", "max_abs_score": over the
         pairs within the tolerance (inf when a detection is unexplained)}.
    """
    rb, rs, rl = (np.asarray(a) for a in ref)
    gb, gs, gl = (np.asarray(a) for a in got)
    used = np.zeros(len(gl), dtype=bool)
    ref_left = []
    box_d, score_d, paired = 0.0, 0.0, 0
    for i in range(len(rl)):
        cand = np.nonzero((gl == rl[i]) & ~used)[0]
        if len(cand):
            d = np.abs(gb[cand] - rb[i]).max(axis=1)
            j = cand[int(np.argmin(d))]
            if d.min() <= box_atol and abs(float(gs[j]) - float(rs[i])) <= score_atol:
                used[j] = True
                paired += 1
                box_d, score_d = max(box_d, float(d.min())), max(score_d, float(abs(gs[j] - rs[i])))
                continue
        ref_left.append(i)
    got_left = [j for j in range(len(gl)) if not used[j]]

    def reference_could_return(j: int) -> bool:
        boxes, scores = candidates
        near = np.abs(scores[:, int(gl[j])] - float(gs[j])) <= score_atol
        return bool(near.any() and (np.abs(boxes[near] - gb[j]).max(axis=1) <= box_atol).any())

    ties, unexplained = 0, len(ref_left) + len(got_left)
    if candidates is not None and (ref_left or got_left):
        def at_thresh(score) -> bool:
            return score_thresh is not None and abs(float(score) - score_thresh) <= score_atol

        r_order = sorted(ref_left, key=lambda i: -float(rs[i]))
        g_order = sorted(got_left, key=lambda j: -float(gs[j]))
        rest_r, rest_g = r_order[len(g_order):], g_order[len(r_order):]
        for i, j in zip(r_order, g_order):
            if abs(float(rs[i]) - float(gs[j])) <= score_atol and reference_could_return(j):
                ties += 1
            else:
                rest_r.append(i)
                rest_g.append(j)
        excused = [i for i in rest_r if at_thresh(rs[i])] + [j for j in rest_g if at_thresh(gs[j]) and reference_could_return(j)]
        ties += len(excused)
        unexplained = len(rest_r) + len(rest_g) - len(excused)
    ok = unexplained == 0
    return {"num_detections": [int(len(rl)), int(len(gl))], "num_paired": paired, "num_tie_paired": int(ties),
            "num_unexplained": int(unexplained), "labels_equal": bool(ok),
            "max_abs_box_px": box_d if ok else float("inf"), "max_abs_score": score_d if ok else float("inf")}
