"""Assignment of anchors to ground-truth boxes by IoU, for a whole batch at once.

RetinaNet paper, section 4 ("Inference and Training"): an anchor is positive when its IoU with a
ground-truth box is >= 0.5, negative (background) when its best IoU is < 0.4, and ignored in between.
As in Detectron and torchvision ("allow_low_quality_matches"), every ground-truth box also keeps the
anchor(s) with its highest IoU, so a tiny or oddly shaped object always has a positive.

Crowd regions (COCO `iscrowd=1`) are not targets: an anchor that would be background but lies mostly
inside a crowd box (intersection over the anchor's area >= `crowd_ioa`) is ignored instead, so the model
is not taught that a crowd of people is "no person".

The IoU matrix [B, M, A] can be large (3,000 boxes x 120,000 anchors = 1.4 GB in float32), so it is
computed over chunks of anchors holding at most `max_elements` entries each; the result is the same
for every chunk size (tested).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..boxes import box_area, box_ioa
from ..labels import BACKGROUND, IGNORE

# Default chunk budget: 2^25 IoU entries (128 MiB of float32, about 0.6 GiB with the temporaries).
DEFAULT_MAX_ELEMENTS = 1 << 25
# An IoU never exceeds 1, so this target is reached by no anchor: the best IoU of a box that must force no
# low-quality match (a padding slot, or a box that overlaps no anchor at all) is replaced by it.
NO_MATCH_IOU = 2.0
# IoU written into padding slots: below every real IoU (>= 0), so a padding slot never wins a max.
PADDING_IOU = -1.0


def pairwise_iou(boxes: torch.Tensor, anchor_columns: torch.Tensor, boxes_area: torch.Tensor,
                 anchor_area: torch.Tensor) -> torch.Tensor:
    """IoU of every box with every anchor, bit for bit the value of `torchvision.ops.box_iou` (tested).

    `box_iou` broadcasts [N, 1, 2] against [A, 2], so its innermost loop runs over 2 coordinates and
    does not vectorise on a CPU; here each coordinate is a contiguous row of `anchor_columns`, every op
    runs over contiguous anchors, and the temporaries are reused in place. The arithmetic is the same
    sequence of float32 operations, so the values are identical.

    Args:
        boxes: [N, 4] float32 xyxy pixels.
        anchor_columns: [4, C] float32, the anchors' x1, y1, x2, y2 as rows (`anchors.T.contiguous()`).
        boxes_area: [N, 1] `box_area(boxes)`;  anchor_area: [C] `box_area(anchors)`.
    Returns:
        [N, C] float32.
    """
    inter = torch.minimum(boxes[:, 2:3], anchor_columns[2]).sub_(torch.maximum(boxes[:, 0:1], anchor_columns[0]))
    inter.clamp_(min=0)
    ih = torch.minimum(boxes[:, 3:4], anchor_columns[3]).sub_(torch.maximum(boxes[:, 1:2], anchor_columns[1]))
    inter.mul_(ih.clamp_(min=0))
    union = torch.add(boxes_area, anchor_area, out=ih).sub_(inter)  # (area1 + area2) - inter, as box_iou
    return inter.div_(union)


@torch.no_grad()
def match_anchors(
    anchors: torch.Tensor,
    gt_boxes: torch.Tensor,
    gt_labels: torch.Tensor,
    crowd_boxes: torch.Tensor | None = None,
    fg_iou: float = 0.5,
    bg_iou: float = 0.4,
    allow_low_quality: bool = True,
    crowd_ioa: float = 0.5,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    *,
    keep_ties: bool | None = None,
) -> torch.Tensor:
    """Assign each anchor of each image to a ground-truth box, to background, or to ignore.

    Args:
        anchors: [A, 4] float32 xyxy pixels (shared by the batch).
        gt_boxes: [B, M, 4] float32 xyxy pixels, padded per image.
        gt_labels: [B, M] int64, class labels >= 0, `PAD_LABEL` (-1) for padding slots.
        crowd_boxes: optional [B, C, 4] xyxy pixels of crowd regions, padded with all-zero boxes
            (a zero box has no intersection with any anchor, so padding needs no mask).
        fg_iou: IoU at or above which an anchor is positive.
        bg_iou: IoU below which an anchor is background; in [bg_iou, fg_iou) it is ignored.
        allow_low_quality: give every ground-truth box its best-IoU anchor(s) as positives.
        crowd_ioa: fraction of an anchor's area inside a crowd box above which a background anchor is ignored.
        max_elements: largest number of IoU entries computed at once (B * M * chunk of anchors).
        keep_ties: how the low-quality pass finds each box's best anchors over several chunks: from the
            (box, anchor) pairs kept per chunk (True) or by computing the IoU again (False); None picks the
            first on a CPU, the second on an accelerator (see `_best_ious`). The assignment is the same.
    Returns:
        [B, A] int64: index into M of the matched box (>= 0), `BACKGROUND` (-1) or `IGNORE` (-2).
    Raises:
        ValueError: if fg_iou < bg_iou or the shapes disagree.
    """
    if fg_iou < bg_iou:
        raise ValueError(f"fg_iou ({fg_iou}) must be >= bg_iou ({bg_iou})")
    if gt_boxes.dim() != 3 or gt_labels.shape != gt_boxes.shape[:2]:
        raise ValueError(f"gt_boxes [B, M, 4] and gt_labels [B, M] expected, got {tuple(gt_boxes.shape)} "
                         f"and {tuple(gt_labels.shape)}")
    B, M = gt_labels.shape
    A = anchors.shape[0]
    matched = torch.full((B, A), BACKGROUND, dtype=torch.int64, device=anchors.device)
    if M > 0:
        iou_of = _ChunkedIoU(anchors, gt_boxes, gt_labels >= 0, max_elements)
        if keep_ties is None:
            keep_ties = anchors.device.type == "cpu"
        keep_ties = keep_ties and allow_low_quality and iou_of.chunk < A
        best = _best_ious(iou_of, keep_ties)
        matched = _by_thresholds(matched, best.anchor_best, best.anchor_arg, fg_iou, bg_iou)
        if allow_low_quality:
            matched = _with_low_quality_matches(matched, iou_of, best)
    if crowd_boxes is not None and crowd_boxes.numel() > 0:
        matched = _ignore_in_crowds(matched, anchors, crowd_boxes, crowd_ioa, max_elements)
    return matched


def _chunks(total: int, size: int):
    """(start, end) of consecutive chunks of `size` (the last one shorter) covering range(total)."""
    for start in range(0, total, size):
        yield start, min(total, start + size)


class _ChunkedIoU:
    """The IoU of a padded batch of boxes with the anchors, one chunk of anchors at a time.

    Args:
        anchors: [A, 4] xyxy pixels.
        gt_boxes: [B, M, 4] xyxy pixels;  valid: [B, M] bool, False for padding slots.
        max_elements: the chunk holds at most this many IoU entries (B * M * chunk), at least one anchor.
    """

    def __init__(self, anchors: torch.Tensor, gt_boxes: torch.Tensor, valid: torch.Tensor, max_elements: int):
        self.B, self.M = valid.shape
        self.A = anchors.shape[0]
        self.valid = valid
        self.flat_gt = gt_boxes.reshape(-1, 4).float()  # [B * M, 4]
        self.gt_area = box_area(self.flat_gt)[:, None]
        self.anchor_columns = anchors.float().T.contiguous()  # [4, A]
        self.anchor_area = box_area(anchors.float())
        self.chunk = max(1, max_elements // max(1, self.B * self.M))

    def chunks(self):
        """(start, end) of each chunk of anchors."""
        return _chunks(self.A, self.chunk)

    def __call__(self, start: int, end: int) -> torch.Tensor:
        """[B, M, end - start] float32 IoU of every box with anchors start:end; `PADDING_IOU` in padding slots."""
        iou = pairwise_iou(self.flat_gt, self.anchor_columns[:, start:end], self.gt_area, self.anchor_area[start:end])
        return iou.view(self.B, self.M, end - start).masked_fill_(~self.valid[:, :, None], PADDING_IOU)


class _BestIoUs(NamedTuple):
    anchor_best: torch.Tensor  # [B, A] float32, each anchor's best IoU over the boxes
    anchor_arg: torch.Tensor  # [B, A] int64, the box (index into M) reaching it
    gt_best: torch.Tensor  # [B, M] float32, each box's best IoU over all anchors (PADDING_IOU for padding)
    ties: list | None  # with keep_ties: per chunk (box in B * M, anchor, IoU) reaching the box's chunk best
    kept_iou: torch.Tensor | None  # [B, M, A] IoU when a single chunk covers all anchors (reused, not recomputed)


def _best_ious(iou_of: _ChunkedIoU, keep_ties: bool) -> _BestIoUs:
    """Each anchor's best box and each box's best IoU, over the chunks of anchors.

    With several chunks the low-quality pass needs each box's best IoU over ALL anchors, known only after the
    last chunk. With `keep_ties` (the CPU's way) each chunk keeps the (box, anchor) pairs that reach the box's
    best within the chunk (a few per box, found with nonzero()); the global best can only be among them, so
    the IoU is never computed twice. On an accelerator nonzero() would wait for the device, so there the
    second pass recomputes the IoU instead. Both give the same assignment (tested).
    """
    B, M, A = iou_of.B, iou_of.M, iou_of.A
    device = iou_of.anchor_columns.device
    anchor_best = torch.empty((B, A), dtype=torch.float32, device=device)
    anchor_arg = torch.empty((B, A), dtype=torch.int64, device=device)
    gt_best = torch.full((B, M), PADDING_IOU, dtype=torch.float32, device=device)
    ties = [] if keep_ties else None
    kept_iou = None
    for start, end in iou_of.chunks():
        iou = iou_of(start, end)
        anchor_best[:, start:end], anchor_arg[:, start:end] = iou.max(dim=1)
        chunk_best = iou.max(dim=2).values  # [B, M]
        gt_best = torch.maximum(gt_best, chunk_best)
        if keep_ties:
            # A box with no overlap in this chunk (best <= 0) can force no match here.
            target = torch.where(chunk_best > 0, chunk_best, torch.full_like(chunk_best, NO_MATCH_IOU)).view(B * M, 1)
            box, anchor = (iou.view(B * M, -1) == target).nonzero(as_tuple=True)
            ties.append((box, anchor + start, target[box, 0]))
        if end - start == A:
            kept_iou = iou  # one chunk: keep it for the low-quality pass instead of recomputing
    return _BestIoUs(anchor_best, anchor_arg, gt_best, ties, kept_iou)


def _by_thresholds(matched: torch.Tensor, anchor_best: torch.Tensor, anchor_arg: torch.Tensor, fg_iou: float,
                   bg_iou: float) -> torch.Tensor:
    """[B, A] int64: the best box where its IoU >= fg_iou, `IGNORE` in [bg_iou, fg_iou), else `matched`."""
    matched = torch.where(anchor_best >= fg_iou, anchor_arg, matched)
    return torch.where((anchor_best >= bg_iou) & (anchor_best < fg_iou), torch.full_like(matched, IGNORE), matched)


def _with_low_quality_matches(matched: torch.Tensor, iou_of: _ChunkedIoU, best: _BestIoUs) -> torch.Tensor:
    """[B, A] int64: `matched` with every anchor that reaches a box's best IoU made positive for its best box.

    Ties count: every anchor reaching the best becomes positive. A box with no overlap at all (best IoU 0)
    and a padding slot get `NO_MATCH_IOU` as target, so they force no match.
    """
    B, M = iou_of.B, iou_of.M
    gt_best = best.gt_best
    target = torch.where(iou_of.valid & (gt_best > 0), gt_best, torch.full_like(gt_best, NO_MATCH_IOU))[:, :, None]
    if best.ties is not None:
        box, anchor, value = (torch.cat(t) for t in zip(*best.ties))
        hit = value == target.view(-1)[box]
        is_best = torch.zeros((B, iou_of.A), dtype=torch.bool, device=matched.device)
        is_best[box[hit] // M, anchor[hit]] = True
        return torch.where(is_best, best.anchor_arg, matched)
    for start, end in iou_of.chunks():
        iou = best.kept_iou if best.kept_iou is not None else iou_of(start, end)
        is_best = (iou == target).any(dim=1)  # [B, chunk]
        matched[:, start:end] = torch.where(is_best, best.anchor_arg[:, start:end], matched[:, start:end])
    return matched


def _ignore_in_crowds(matched: torch.Tensor, anchors: torch.Tensor, crowd_boxes: torch.Tensor, crowd_ioa: float,
                      max_elements: int) -> torch.Tensor:
    """[B, A] int64: `matched` (changed in place) with background anchors lying inside a crowd box
    (intersection over the anchor's area >= `crowd_ioa`; crowd_boxes [B, C, 4] xyxy) set to `IGNORE`."""
    B, C = matched.shape[0], crowd_boxes.shape[1]
    flat_crowd = crowd_boxes.reshape(-1, 4).float()
    for start, end in _chunks(anchors.shape[0], max(1, max_elements // max(1, B * C))):
        ioa = box_ioa(anchors[start:end], flat_crowd).view(end - start, B, C)
        in_crowd = (ioa.max(dim=2).values >= crowd_ioa).T  # [B, chunk]
        rows = matched[:, start:end]
        matched[:, start:end] = torch.where(in_crowd & (rows == BACKGROUND), torch.full_like(rows, IGNORE), rows)
    return matched
