"""RetinaNet training loss: sigmoid focal loss plus a box regression loss, over a padded batch.

Focal loss: Lin et al., "Focal Loss for Dense Object Detection", eq. 5,
    FL(p_t) = -alpha_t (1 - p_t)^gamma log(p_t),  alpha = 0.25, gamma = 2,
summed over all non-ignored anchors and all K classes, divided by the number of positive anchors
(section 3.3: "normalized by the number of anchors assigned to a ground-truth box"), at least 1 so an
image without objects gives a finite loss. Computed by `torchvision.ops.sigmoid_focal_loss` from logits
(the BCE-with-logits form, stable where sigmoid saturates) in float32, also under fp16/bf16 autocast.

Box loss on positive anchors only, same normaliser (0 with no positive anchor), one of `BOX_LOSSES`:
- "l1" (the default): L1 of the encoded deltas of `detlib.retinanet.box_coder`, summed over the 4 coordinates. This is
  torchvision's RetinaNet (`bbox_reg_loss_type="l1"`) and detectron2's: its RetinaNet configs set
  `SMOOTH_L1_LOSS_BETA: 0.0`, and its smooth L1 with beta 0 is L1.
- "smooth_l1": smooth L1 of the same deltas with `smooth_l1_beta` (default 0.1), as the original Detectron's
  RetinaNet (beta 0.11) and detectron2's config default before its RetinaNet configs set 0.
- "giou": GIoU loss of the decoded boxes (torchvision's `bbox_reg_loss_type="giou"`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torchvision.ops import generalized_box_iou_loss, sigmoid_focal_loss

from ..labels import IGNORE
from . import box_coder
from .options import BOX_LOSSES  # beside the flags, where --help reads it without torch
from .matching import DEFAULT_MAX_ELEMENTS, match_anchors



def retinanet_loss(
    cls_logits: torch.Tensor,
    box_deltas: torch.Tensor,
    anchors: torch.Tensor,
    gt_boxes: torch.Tensor,
    gt_labels: torch.Tensor,
    crowd_boxes: torch.Tensor | None = None,
    *,
    alpha: float = 0.25,
    gamma: float = 2.0,
    box_loss: str = "l1",
    smooth_l1_beta: float = 0.1,
    box_loss_weight: float = 1.0,
    fg_iou: float = 0.5,
    bg_iou: float = 0.4,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    normalizer: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Focal + box loss of a batch.

    Args:
        cls_logits: [B, A, K] logits, any float dtype.
        box_deltas: [B, A, 4] predicted deltas, any float dtype.
        anchors: [A, 4] float32 xyxy pixels.
        gt_boxes: [B, M, 4] float32 xyxy pixels, padded.
        gt_labels: [B, M] int64 labels 0..K-1, -1 for padding.
        crowd_boxes: optional [B, C, 4] xyxy crowd regions (zero boxes as padding): anchors inside them
            are ignored instead of background.
        alpha, gamma: focal loss parameters (paper eq. 5).
        box_loss: "l1", "smooth_l1" (with `smooth_l1_beta`) or "giou".
        box_loss_weight: multiplier of the box loss in the total.
        fg_iou, bg_iou: matching thresholds (see `match_anchors`).
        max_elements: chunk budget of the IoU matrix.
        normalizer: maps the batch's positive-anchor count (0-d float tensor) to the divisor of both losses;
            default max(num_pos, 1). The training script's `StepLossNormalizer` counts the whole step (every
            micro-batch and process), optionally through `EmaLossNormalizer` (detectron2's running average).
    Returns:
        dict of float32 scalars: `loss` (= cls_loss + box_loss_weight * box_loss), `cls_loss`, `box_loss`,
        and `num_pos` (positive anchors in the batch, before the clamp to 1). No host sync happens here
        (except in an `EmaLossNormalizer`, which reads the count).
    Raises:
        ValueError: for an unknown `box_loss`.
    """
    if box_loss not in BOX_LOSSES:
        raise ValueError(f"box_loss must be one of {BOX_LOSSES}, got {box_loss!r}")
    B, A, K = cls_logits.shape
    if anchors.shape[0] != A or box_deltas.shape[:2] != (B, A):
        raise ValueError(f"{A} anchors predicted per image but {anchors.shape[0]} anchors given "
                         f"(box_deltas {tuple(box_deltas.shape)}): anchors made for another input size?")
    if gt_boxes.shape[1] == 0:  # no box in the whole batch: one padding slot keeps gather() well-defined
        gt_boxes = gt_boxes.new_zeros((B, 1, 4))
        gt_labels = gt_labels.new_full((B, 1), -1)

    matched = match_anchors(anchors, gt_boxes, gt_labels, crowd_boxes, fg_iou=fg_iou, bg_iou=bg_iou,
                            max_elements=max_elements)
    pos = matched >= 0  # [B, A]
    valid = matched != IGNORE
    idx = matched.clamp(min=0)
    num_pos = pos.sum().float()
    normaliser = num_pos.clamp(min=1.0) if normalizer is None else normalizer(num_pos)

    labels = gt_labels.gather(1, idx).clamp(min=0)  # [B, A]
    target = torch.zeros((B, A, K), dtype=torch.float32, device=cls_logits.device)
    target.scatter_(2, labels.unsqueeze(-1), pos.unsqueeze(-1).float())
    focal = sigmoid_focal_loss(cls_logits.float(), target, alpha=alpha, gamma=gamma, reduction="none")
    cls_loss = torch.where(valid.unsqueeze(-1), focal, torch.zeros_like(focal)).sum() / normaliser

    matched_gt = gt_boxes.gather(1, idx.unsqueeze(-1).expand(B, A, 4)).float()  # [B, A, 4]
    per_anchor = _box_loss_per_anchor(box_deltas.float(), matched_gt, anchors, box_loss, smooth_l1_beta)
    # where(), not a product: a non-positive anchor's target may be a padding box whose GIoU is NaN.
    box = torch.where(pos, per_anchor, torch.zeros_like(per_anchor)).sum() / normaliser

    return {"loss": cls_loss + box_loss_weight * box, "cls_loss": cls_loss, "box_loss": box, "num_pos": num_pos}


def _box_loss_per_anchor(deltas: torch.Tensor, matched_gt: torch.Tensor, anchors: torch.Tensor, box_loss: str,
                         smooth_l1_beta: float) -> torch.Tensor:
    """The box loss of every anchor against its matched box (see the module docstring for the kinds).

    Args:
        deltas: [B, A, 4] float32 predicted deltas;  matched_gt: [B, A, 4] float32 xyxy pixels;
        anchors: [A, 4] float32 xyxy pixels;  box_loss: one of `BOX_LOSSES`.
    Returns:
        [B, A] float32 (any value where the anchor is not positive: the caller masks it).
    """
    B, A = deltas.shape[:2]
    if box_loss == "giou":
        pred = box_coder.decode(deltas, anchors[None])
        return generalized_box_iou_loss(pred.reshape(-1, 4), matched_gt.reshape(-1, 4), reduction="none").view(B, A)
    target_deltas = box_coder.encode(matched_gt, anchors[None])
    if box_loss == "l1":
        return F.l1_loss(deltas, target_deltas, reduction="none").sum(-1)
    return F.smooth_l1_loss(deltas, target_deltas, beta=smooth_l1_beta, reduction="none").sum(-1)


class EmaLossNormalizer:
    """The loss normaliser as a running average of the positive-anchor count (detectron2's RetinaNet:
    `loss_normalizer`, momentum 0.9, starting at 100): with 2 images per GPU the count of one batch swings
    widely and so would the loss scale; the average keeps the gradient scale steady. The training script feeds it
    once a step through `StepLossNormalizer` (the step's count per micro-batch and process, over all processes).

    Args:
        momentum: weight of the old value.
        initial: the value before the first batch.
        reduce: maps this process's count to the mean over processes (e.g. `lambda t: accelerator.reduce(t,
            "mean")`), so every process holds the same value and a checkpoint (main process) restores all.
    `state_dict` / `load_state_dict` make it a checkpointed object (`accelerator.register_for_checkpointing`).
    """

    def __init__(self, momentum: float = 0.9, initial: float = 100.0,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.momentum = momentum
        self.value = float(initial)
        self.reduce = reduce

    def __call__(self, num_pos: torch.Tensor) -> torch.Tensor:
        n = self.reduce(num_pos.detach()) if self.reduce is not None else num_pos.detach()
        self.value = self.momentum * self.value + (1 - self.momentum) * max(float(n), 1.0)
        return torch.tensor(self.value, dtype=torch.float32, device=num_pos.device)

    def state_dict(self) -> dict:
        return {"value": self.value, "momentum": self.momentum}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.momentum = float(state["value"]), float(state["momentum"])


class StepLossNormalizer:
    """The loss normaliser of one optimizer step: the positive anchors of every micro-batch of the gradient
    accumulation window on every process, so that k accumulated micro-batches of b images on W processes train
    exactly as one batch of k * W * b images on one process (docs/flags.md, "One step, one batch"). A per-micro-batch
    count would weight an image by how few positives its micro-batch shares it with: 2 micro-batches of 1 image
    are not a batch of 2, nor are 2 processes of 1 image each (DDP averages what each divided by its own count).

    Why a provisional divisor: the window's count is known only after its last micro-batch, when the others are
    backpropagated already. Each micro-batch's loss is divided by `divisor`, the same for every micro-batch and
    every process (the step's first micro-batch's count over all processes, divided by W; with `ema`, its value),
    and `finish` multiplies the summed gradients by W * divisor / N. Exact, since the gradient is linear in the
    loss, and the loss keeps its usual size meanwhile (fp16's loss scale sees what it saw). The divisor depends on
    the step alone, never on the steps before it, so a resumed run divides as the uninterrupted one did. Without
    accumulation the divisor is N / W already: the losses are divided by the step's count, as plain RetinaNet
    does, and `finish` changes nothing. A partial last window is counted over its own micro-batches.

    Args:
        reduce_sum: maps a 0-d tensor to its sum over processes (e.g. `lambda t: accelerator.reduce(t, "sum")`);
            None on one process.
        num_processes: W, the processes whose gradients DDP averages.
        ema: an `EmaLossNormalizer` (without `reduce`) for detectron2's running average: updated once a step
            with the window's mean count per micro-batch and process; N is its value times the window's
            micro-batches times W. None: N = max(count, 1).
    Use: as `retinanet_loss`'s `normalizer` for each micro-batch (backward its loss, undoing accelerate's 1/k),
    then `finish(model.parameters())` after the window's last backward, before clipping.
    """

    def __init__(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None, num_processes: int = 1,
                 ema: EmaLossNormalizer | None = None):
        self.reduce_sum, self.num_processes, self.ema = reduce_sum or (lambda t: t), num_processes, ema
        self.divisor: torch.Tensor | None = None
        self.count, self.micro_batches = None, 0

    def __call__(self, num_pos: torch.Tensor) -> torch.Tensor:
        num_pos = num_pos.detach().float()
        if self.ema is not None:
            self.divisor = torch.tensor(self.ema.value, dtype=torch.float32, device=num_pos.device)
        elif self.count is None:  # a step's first micro-batch; collective: every process makes this call together
            self.divisor = self.reduce_sum(num_pos).clamp(min=1.0) / self.num_processes
        self.count = num_pos if self.count is None else self.count + num_pos
        self.micro_batches += 1
        return self.divisor

    @torch.no_grad()
    def finish(self, parameters) -> torch.Tensor:
        """Divide the window's summed gradients by its count instead of the provisional divisor (collective: every
        process calls it at the same step). Returns the factor applied (0-d float32): this process's micro-batch
        losses summed and times it give its share of the step's loss, W * sum / N (their mean over processes is
        the loss of the one batch)."""
        if self.count is None:
            raise RuntimeError("StepLossNormalizer.finish before any micro-batch of the step")
        per_window = self.micro_batches * self.num_processes
        if self.ema is None and self.micro_batches == 1:  # the divisor was the step's count: nothing to correct
            factor = torch.ones((), dtype=torch.float32, device=self.count.device)
        else:
            total = self.reduce_sum(self.count)
            n = self.ema(total / per_window) * per_window if self.ema is not None else total.clamp(min=1.0)
            factor = self.num_processes * self.divisor / n
            grads = [p.grad for p in parameters if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor.to(grads[0].device))
        self.divisor, self.count, self.micro_batches = None, None, 0
        return factor
