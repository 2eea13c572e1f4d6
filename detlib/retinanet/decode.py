"""RetinaNet inference: head outputs -> final detections per image.

RetinaNet paper, section 4 ("Inference"): per level keep the top 1000 (anchor, class) candidates whose
score exceeds 0.05, decode their boxes, merge the levels and apply class-wise NMS at IoU 0.5, then keep
the 100 highest-scoring detections per image. The top-k runs per level, everything up to the threshold
runs once over all levels and images, and NMS runs per image (its classes kept apart by `batched_nms`),
as torchvision does. One NMS call over the whole batch would be slower, not faster: `batched_nms` then
loops in Python over every (image, class) pair (it does above 1,000 boxes on a CPU, 25,000 on a GPU),
or with its coordinate offsets builds the CUDA kernel's N x N/64 mask for N = all boxes of the batch.

Ties are broken by a fixed key, so an image's detections are a function of its head outputs alone (issue 36): of
equal logits the lower flat index (anchor index * K + class, anchors in level -> y -> x -> anchor order) wins, at a
level's top-k boundary, in NMS (which keeps the first of two overlapping boxes) and at the detection cap.
`torch.topk` and NMS's score sort leave the order of equal values to their kernels, whose choice changed with the
thread count (5 of 30 images of a near-prior model differed between 1 process of 2 threads and 2 of 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..boxes import batched_nms, clip_boxes_to_image
from . import box_coder


@dataclass
class Detections:
    """Detections of a batch, flattened over images.

    boxes:     [N, 4] float32 xyxy, pixels of the original (un-resized) image when `scales` was given
    scores:    [N] float32 in (score_thresh, 1]
    labels:    [N] int64 contiguous class labels 0..K-1
    batch_idx: [N] int64 index of the image in the batch; rows of an image are sorted by decreasing score
    """

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    batch_idx: torch.Tensor

    def per_image(self, batch_size: int) -> list[dict[str, torch.Tensor]]:
        """Split into one dict per image (`boxes`, `scores`, `labels`), in batch order."""
        counts = torch.bincount(self.batch_idx, minlength=batch_size).tolist()
        parts = zip(self.boxes.split(counts), self.scores.split(counts), self.labels.split(counts))
        return [{"boxes": b, "scores": s, "labels": l} for b, s, l in parts]


@torch.no_grad()
def decode_candidates(
    cls_logits: torch.Tensor,
    box_deltas: torch.Tensor,
    anchors: torch.Tensor,
    num_anchors_per_level: list[int],
    image_sizes: torch.Tensor,
    scales: torch.Tensor | None = None,
    topk_per_level: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first, static-shape part of `decode_detections`: per-level top-k, decode, clip, rescale. No host sync
    and no data-dependent shape (so it runs under FakeTensorMode and in a graph).

    Args: as `decode_detections`.
    Returns:
        boxes [B, N, 4] float32 xyxy pixels (of the original image when `scales` is given), scores [B, N] float32
        sigmoid, labels [B, N] int64, img [B, N] int64 batch index; N = sum over levels of min(topk, A_l * K);
        all on the logits' device. Each image's rows are ordered by decreasing logit, equal logits by lower flat index
        (so by decreasing score), and are a function of that image's outputs alone.
    """
    B, A, K = cls_logits.shape
    device = cls_logits.device
    # top-k, sigmoid and threshold in float32 whatever dtype the logits come in (bf16 logits near -4.6 step by 0.03:
    # the ranking would be ties); the model's own head gives float32 in eval mode (`RetinaNetHead._output`), and for
    # float32 logits this is no copy
    cls_logits = cls_logits.float()
    # Only the top-k runs per level (a level's candidates compete among themselves); then the candidates of all levels
    # are put in one order, by (logit, lower flat index first).
    flat_all = []
    start = 0
    for n in num_anchors_per_level:
        logits = cls_logits[:, start:start + n].reshape(B, n * K)
        k = min(topk_per_level, n * K)
        # top-k before the threshold keeps the shape static; the candidates above the threshold are the
        # same as thresholding first (top-k of everything contains every survivor of a top-k after it).
        flat_all.append(topk_lowest_index(logits, k) + start * K)  # [B, k]
        start += n
    flat = torch.cat(flat_all, dim=1)  # [B, N] indices into the flattened [A * K] of each image
    keys = ranking_keys(cls_logits.reshape(B, A * K).gather(1, flat), flat)
    flat = flat.gather(1, keys.argsort(dim=1, descending=True))  # the keys are distinct: one order on every kernel
    img = torch.arange(B, device=device).unsqueeze(1).expand_as(flat)
    # Each image's candidates are decoded by themselves: on a CPU an elementwise kernel runs vectorised and its last
    # few elements (per thread) scalar, and the two round the sigmoid differently (measured: 789 of 20000 values one
    # ulp apart), so a score would depend on where the image sits in the batch and on the thread count.
    parts = [_decode_image(cls_logits[b].reshape(-1), box_deltas[b], anchors, flat[b], K, image_sizes[b],
                           None if scales is None else scales[b]) for b in range(B)]
    boxes, scores = (torch.stack(t) for t in zip(*parts))
    return boxes, scores, flat % K, img


def topk_lowest_index(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] int64 of the k largest of `values` [B, M] per row; of values equal to the k-th largest, those
    of the lowest indices. (`torch.topk` returns some k of them, which ones depending on its kernel and threads.)"""
    top, index = values.topk(k, dim=1)  # sorted: the values above the k-th come first, then those equal to it
    kth = top[:, -1:]
    above = (top > kth).sum(dim=1, keepdim=True)
    # the first k positions of each row equal to the k-th value, in index order (static shape, padded with -1)
    tied = torch.stack([torch.nonzero_static(row == v, size=k).squeeze(1) for row, v in zip(values, kth)])
    position = torch.arange(k, device=values.device).expand_as(index)
    return torch.where(position < above, index, tied.gather(1, (position - above).clamp(min=0)))


# `ranking_keys`: the low 32 bits hold FLAT_INDEX_MASK - the flat index (a lower index ranks higher among equal logits).
FLAT_INDEX_MASK = 0xFFFFFFFF


def ranking_keys(logits: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """int64 keys [...] that order `logits` [...] float32 by value, equal values by lower `flat` index [...] first.

    Key = (the float's bits as an int32 that sorts as the float does) * 2^32 + FLAT_INDEX_MASK - flat: distinct for
    distinct indices, so a sort of the keys gives one order on every kernel. (-0.0 ranks just below +0.0.) Needs
    0 <= flat < 2^32.
    """
    bits = logits.contiguous().view(torch.int32)
    # IEEE 754 is sign-magnitude: flipping the magnitude bits of a negative float makes its int32 order the float's
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return (ordered << 32) | (FLAT_INDEX_MASK - flat)


def _decode_image(logits: torch.Tensor, deltas: torch.Tensor, anchors: torch.Tensor, flat: torch.Tensor, K: int,
                  image_size: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's candidates: logits [A * K], deltas [A, 4], flat [N] -> boxes [N, 4], scores [N] float32."""
    anchor_idx = flat // K
    boxes = box_coder.decode(deltas[anchor_idx], anchors[anchor_idx])
    size = image_size.to(device=boxes.device, dtype=torch.float32)
    boxes = clip_boxes_to_image(boxes, size[0], size[1])
    if scale is not None:
        s = scale.to(device=boxes.device, dtype=torch.float32)
        boxes = boxes / torch.stack((s[1], s[0], s[1], s[0]))
    return boxes, logits[flat].sigmoid()


@torch.no_grad()
def decode_detections(
    cls_logits: torch.Tensor,
    box_deltas: torch.Tensor,
    anchors: torch.Tensor,
    num_anchors_per_level: list[int],
    image_sizes: torch.Tensor,
    scales: torch.Tensor | None = None,
    score_thresh: float = 0.05,
    topk_per_level: int = 1000,
    nms_thresh: float = 0.5,
    max_detections: int = 100,
) -> Detections:
    """Decode a batch of head outputs into detections.

    Args:
        cls_logits: [B, A, K] logits, any float dtype (decoded in float32).
        box_deltas: [B, A, 4] deltas, any float dtype (decoded in float32).
        anchors: [A, 4] float32 xyxy pixels of the padded input, ordered level -> y -> x -> anchor.
        num_anchors_per_level: A_l of each level (from `AnchorGenerator`), summing to A.
        image_sizes: [B, 2] (height, width) of each resized image before padding; boxes are clipped to it.
        scales: optional [B, 2] (scale_y, scale_x) = resized / original size; boxes are divided by it so
            they come back in the original image's pixels.
        score_thresh: minimum sigmoid score of a candidate.
        topk_per_level: candidates kept per level and image before NMS.
        nms_thresh: IoU of class-wise NMS.
        max_detections: detections kept per image.
    Returns:
        `Detections` (empty tensors when nothing passes the threshold).
    The candidates come from `decode_candidates`; the threshold and the per-image NMS after it read the counts
    per image on the host (one sync per batch).
    """
    device = cls_logits.device
    boxes, scores, labels, img = decode_candidates(cls_logits, box_deltas, anchors, num_anchors_per_level, image_sizes,
                                                   scales, topk_per_level)
    keep = scores > score_thresh  # [B, N]; rows stay in image order, and in `decode_candidates`' order, after the mask
    counts = keep.sum(dim=1).tolist()
    scores, labels, img, boxes = scores[keep], labels[keep], img[keep], boxes[keep]
    kept, start = [], 0
    for n in counts:
        if n:
            # NMS ranks by the candidates' order, not by their scores (equal scores would be ordered by NMS's sort):
            # it keeps the first of two overlapping boxes, and returns indices in that order; the cap keeps the first.
            rank = torch.arange(n, 0, -1, device=device, dtype=torch.float32)
            kept.append(batched_nms(boxes[start:start + n], rank, labels[start:start + n],
                                    nms_thresh)[:max_detections] + start)
        start += n
    order = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int64, device=device)
    return Detections(boxes[order], scores[order], labels[order], img[order])
