"""RetinaNet inference: head outputs -> final detections per image.

RetinaNet paper, section 4 ("Inference"): per level keep the top 1000 (anchor, class) candidates whose
score exceeds 0.05, decode their boxes, merge the levels and apply class-wise NMS at IoU 0.5, then keep
the 100 highest-scoring detections per image. Here the whole batch goes through one `batched_nms` call
(the NMS groups are (image, class) pairs), so there is no Python loop over images.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import box_coder
from .box_ops import batched_nms, clip_boxes_to_image


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
        cls_logits: [B, A, K] logits.
        box_deltas: [B, A, 4] deltas.
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
    """
    B, A, K = cls_logits.shape
    device = cls_logits.device
    scores_all, labels_all, boxes_all, img_all = [], [], [], []
    start = 0
    for n in num_anchors_per_level:
        logits = cls_logits[:, start:start + n].reshape(B, n * K)
        k = min(topk_per_level, n * K)
        # top-k before the threshold keeps the shape static; the candidates above the threshold are the
        # same as thresholding first (top-k of everything contains every survivor of a top-k after it).
        top_logits, flat = logits.topk(k, dim=1)  # [B, k]
        anchor_idx = flat // K + start
        deltas = box_deltas.gather(1, anchor_idx.unsqueeze(-1).expand(B, k, 4))
        boxes_all.append(box_coder.decode(deltas, anchors[anchor_idx]))
        scores_all.append(top_logits.float().sigmoid())
        labels_all.append(flat % K)
        img_all.append(torch.arange(B, device=device).unsqueeze(1).expand(B, k))
        start += n
    scores = torch.cat(scores_all, dim=1)
    labels = torch.cat(labels_all, dim=1)
    img = torch.cat(img_all, dim=1)
    sizes = image_sizes.to(device=device, dtype=torch.float32)
    boxes = clip_boxes_to_image(torch.cat(boxes_all, dim=1), sizes[:, 0, None], sizes[:, 1, None])
    if scales is not None:
        s = scales.to(device=device, dtype=torch.float32)
        boxes = boxes / torch.stack((s[:, 1], s[:, 0], s[:, 1], s[:, 0]), dim=-1)[:, None, :]

    keep = scores > score_thresh
    scores, labels, img, boxes = scores[keep], labels[keep], img[keep], boxes[keep]
    # NMS groups are (image, class) pairs, so the batch is one call; `keep` comes back by decreasing score.
    kept = batched_nms(boxes, scores, img * K + labels, nms_thresh)
    # Stable sort by image keeps the score order within each image; then cap each image's count.
    order = kept[torch.sort(img[kept], stable=True).indices]
    img_sorted = img[order]
    first = torch.searchsorted(img_sorted, img_sorted, right=False)
    rank = torch.arange(order.numel(), device=device) - first
    order = order[rank < max_detections]
    return Detections(boxes[order], scores[order], labels[order], img[order])
