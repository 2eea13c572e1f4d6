"""Box format conversions, named after what they convert.

Formats (all in absolute pixels, float):
  xyxy   [x1, y1, x2, y2], top-left and bottom-right corners. detlib's one internal format.
  xywh   [x, y, w, h], top-left corner plus size. COCO's format: converted on load and on export only.
  cxcywh [cx, cy, w, h], centre plus size. Used by the box coder.

Width is x2 - x1 (no "+1"): a box [10, 10, 20, 20] is 10 px wide, as in COCO and torchvision.
IoU and NMS come from torchvision.ops and are re-exported here so callers have one place to look.
"""

from __future__ import annotations

import torch
from torchvision.ops import batched_nms, box_area, box_iou  # noqa: F401  (re-exported)

__all__ = [
    "box_xywh_to_xyxy",
    "box_xyxy_to_xywh",
    "box_xyxy_to_cxcywh",
    "box_cxcywh_to_xyxy",
    "clip_boxes_to_image",
    "box_ioa",
    "box_iou",
    "box_area",
    "batched_nms",
]


def box_xywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    """[..., 4] xywh -> [..., 4] xyxy, same dtype and device."""
    x, y, w, h = boxes.unbind(-1)
    return torch.stack((x, y, x + w, y + h), dim=-1)


def box_xyxy_to_xywh(boxes: torch.Tensor) -> torch.Tensor:
    """[..., 4] xyxy -> [..., 4] xywh, same dtype and device."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack((x1, y1, x2 - x1, y2 - y1), dim=-1)


def box_xyxy_to_cxcywh(boxes: torch.Tensor) -> torch.Tensor:
    """[..., 4] xyxy -> [..., 4] cxcywh, same dtype and device."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack(((x1 + x2) * 0.5, (y1 + y2) * 0.5, x2 - x1, y2 - y1), dim=-1)


def box_cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    """[..., 4] cxcywh -> [..., 4] xyxy, same dtype and device."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack((cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h), dim=-1)


def clip_boxes_to_image(boxes: torch.Tensor, height, width) -> torch.Tensor:
    """Clamp xyxy boxes into the image [0, width] x [0, height].

    Args:
        boxes: [..., 4] xyxy, pixels.
        height, width: python numbers, or tensors broadcastable to boxes[..., 0] (e.g. [B, 1] for a
            batch of per-image sizes when boxes is [B, N, 4]).
    Returns:
        [..., 4] xyxy, a new tensor.
    """
    x1, y1, x2, y2 = boxes.unbind(-1)
    zero = torch.zeros((), dtype=boxes.dtype, device=boxes.device)
    w = torch.as_tensor(width, dtype=boxes.dtype, device=boxes.device)
    h = torch.as_tensor(height, dtype=boxes.dtype, device=boxes.device)
    x1 = torch.minimum(torch.maximum(x1, zero), w)
    x2 = torch.minimum(torch.maximum(x2, zero), w)
    y1 = torch.minimum(torch.maximum(y1, zero), h)
    y2 = torch.minimum(torch.maximum(y2, zero), h)
    return torch.stack((x1, y1, x2, y2), dim=-1)


def box_ioa(boxes: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """Intersection over the area of `boxes` (not a symmetric IoU).

    Used to find anchors that lie mostly inside a crowd region: a small anchor inside a large crowd box
    has a small IoU but an IoA near 1 (Detectron's crowd handling uses the same measure).

    Args:
        boxes: [N, 4] xyxy, pixels (anchors).
        regions: [M, 4] xyxy, pixels (crowd boxes).
    Returns:
        [N, M] float, intersection(boxes[i], regions[j]) / area(boxes[i]); 0 where boxes[i] has no area.
    """
    lt = torch.maximum(boxes[:, None, :2], regions[None, :, :2])
    rb = torch.minimum(boxes[:, None, 2:], regions[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(dim=-1)
    area = box_area(boxes)[:, None]
    return torch.where(area > 0, inter / area.clamp(min=1e-12), torch.zeros_like(inter))
