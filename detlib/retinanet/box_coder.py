"""Encoding of boxes as regression targets relative to anchors, and the inverse.

The R-CNN parameterisation (Girshick et al., "Rich feature hierarchies", appendix C; Fast R-CNN eq. 2),
with unit weights as in RetinaNet (torchvision's `BoxCoder(weights=(1, 1, 1, 1))`):

    dx = (cx_gt - cx_a) / w_a     dy = (cy_gt - cy_a) / h_a
    dw = log(w_gt / w_a)          dh = log(h_gt / h_a)

Boxes are xyxy pixels. `decode(encode(gt, a), a) == gt` for every box with positive width and height.
"""

from __future__ import annotations

import math

import torch

from ..boxes import box_cxcywh_to_xyxy, box_xyxy_to_cxcywh

# Cap on dw / dh before exp(): a box at most 1000/16 times its anchor. Keeps an untrained head (or fp16
# noise) from producing inf boxes; the same bound torchvision and Detectron use.
BBOX_XFORM_CLIP = math.log(1000.0 / 16)

# Smallest width / height used inside log(): a degenerate target never reaches here (the data set drops
# boxes under 1 px), but padding slots and clipped boxes can be 0 wide.
_MIN_SIZE = 1e-6


def encode(gt_boxes: torch.Tensor, anchors: torch.Tensor, weights=(1.0, 1.0, 1.0, 1.0)) -> torch.Tensor:
    """Regression targets of `gt_boxes` relative to `anchors`.

    Args:
        gt_boxes: [..., 4] xyxy pixels.
        anchors: [..., 4] xyxy pixels, broadcastable to gt_boxes.
        weights: (wx, wy, ww, wh) multipliers of the four deltas.
    Returns:
        [..., 4] float32 deltas (dx, dy, dw, dh).
    """
    g = box_xyxy_to_cxcywh(gt_boxes.float())
    a = box_xyxy_to_cxcywh(anchors.float())
    wx, wy, ww, wh = weights
    aw = a[..., 2].clamp(min=_MIN_SIZE)
    ah = a[..., 3].clamp(min=_MIN_SIZE)
    dx = wx * (g[..., 0] - a[..., 0]) / aw
    dy = wy * (g[..., 1] - a[..., 1]) / ah
    dw = ww * torch.log(g[..., 2].clamp(min=_MIN_SIZE) / aw)
    dh = wh * torch.log(g[..., 3].clamp(min=_MIN_SIZE) / ah)
    return torch.stack((dx, dy, dw, dh), dim=-1)


def decode(deltas: torch.Tensor, anchors: torch.Tensor, weights=(1.0, 1.0, 1.0, 1.0)) -> torch.Tensor:
    """Boxes from regression deltas, the inverse of `encode`.

    Args:
        deltas: [..., 4] (dx, dy, dw, dh), any float dtype (computed in float32).
        anchors: [..., 4] xyxy pixels, broadcastable to deltas.
        weights: the same multipliers that were given to `encode`.
    Returns:
        [..., 4] float32 xyxy pixels (not clipped to the image).
    """
    a = box_xyxy_to_cxcywh(anchors.float())
    d = deltas.float()
    wx, wy, ww, wh = weights
    dw = (d[..., 2] / ww).clamp(max=BBOX_XFORM_CLIP)
    dh = (d[..., 3] / wh).clamp(max=BBOX_XFORM_CLIP)
    cx = d[..., 0] / wx * a[..., 2] + a[..., 0]
    cy = d[..., 1] / wy * a[..., 3] + a[..., 1]
    w = torch.exp(dw) * a[..., 2]
    h = torch.exp(dh) * a[..., 3]
    return box_cxcywh_to_xyxy(torch.stack((cx, cy, w, h), dim=-1))
