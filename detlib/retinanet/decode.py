"""RetinaNet inference: head outputs -> final detections per image.

RetinaNet paper, section 4 ("Inference"): per level keep the top 1000 (anchor, class) candidates whose
score exceeds 0.05, decode their boxes, merge the levels and apply class-wise NMS at IoU 0.5, then keep
the 100 highest-scoring detections per image. The top-k runs per level, everything up to the threshold
runs once over all levels and images, and NMS runs per image (its classes kept apart by `batched_nms`),
as torchvision does. One NMS call over the whole batch would be slower, not faster: `batched_nms` then
loops in Python over every (image, class) pair (it does above 1,000 boxes on a CPU, 25,000 on a GPU),
or with its coordinate offsets builds the CUDA kernel's N x N/64 mask for N = all boxes of the batch.
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
        all on the logits' device.
    """
    B, A, K = cls_logits.shape
    device = cls_logits.device
    # top-k, sigmoid and threshold in float32 whatever dtype the logits come in (bf16 logits near -4.6 step by 0.03:
    # the ranking would be ties); the model's own head gives float32 in eval mode (`RetinaNetHead._output`), and for
    # float32 logits this is no copy
    cls_logits = cls_logits.float()
    # Only the top-k runs per level (a level's candidates compete among themselves); gather, decode and
    # sigmoid then run once over the candidates of all levels.
    top_all, flat_all = [], []
    start = 0
    for n in num_anchors_per_level:
        logits = cls_logits[:, start:start + n].reshape(B, n * K)
        k = min(topk_per_level, n * K)
        # top-k before the threshold keeps the shape static; the candidates above the threshold are the
        # same as thresholding first (top-k of everything contains every survivor of a top-k after it).
        top_logits, flat = logits.topk(k, dim=1)  # [B, k]
        top_all.append(top_logits)
        flat_all.append(flat + start * K)
        start += n
    flat = torch.cat(flat_all, dim=1)  # [B, N] indices into the flattened [A * K] of each image
    anchor_idx = flat // K
    deltas = box_deltas.gather(1, anchor_idx.unsqueeze(-1).expand(-1, -1, 4))
    boxes = box_coder.decode(deltas, anchors[anchor_idx])
    scores = torch.cat(top_all, dim=1).sigmoid()
    labels = flat % K
    img = torch.arange(B, device=device).unsqueeze(1).expand_as(flat)
    sizes = image_sizes.to(device=device, dtype=torch.float32)
    boxes = clip_boxes_to_image(boxes, sizes[:, 0, None], sizes[:, 1, None])
    if scales is not None:
        s = scales.to(device=device, dtype=torch.float32)
        boxes = boxes / torch.stack((s[:, 1], s[:, 0], s[:, 1], s[:, 0]), dim=-1)[:, None, :]
    return boxes, scores, labels, img


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
    keep = scores > score_thresh  # [B, N]; rows stay in image order after the mask
    counts = keep.sum(dim=1).tolist()
    scores, labels, img, boxes = scores[keep], labels[keep], img[keep], boxes[keep]
    kept, start = [], 0
    for n in counts:
        if n:
            # `batched_nms` returns indices by decreasing score; the first max_detections are the cap.
            kept.append(batched_nms(boxes[start:start + n], scores[start:start + n], labels[start:start + n],
                                    nms_thresh)[:max_detections] + start)
        start += n
    order = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int64, device=device)
    return Detections(boxes[order], scores[order], labels[order], img[order])
