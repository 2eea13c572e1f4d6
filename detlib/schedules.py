"""The per-step learning-rate schedules of both training scripts, one rule: a linear warm-up, then multistep, cosine
or constant. The detector's plateau schedule (per epoch, on the mean loss) is torch's ReduceLROnPlateau, built in its
script.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)


def lr_factor(step: int, kind: str, total_steps: int, warmup_steps: int = 0, milestones=(),
              warmup_start: float = 0.0) -> float:
    """The LR factor of optimizer step `step` (0-based): a linear warm-up from `warmup_start` over `warmup_steps`
    (Goyal et al. 2017, section 2.2: step s takes warmup_start + (1 - warmup_start) * (s + 1) / warmup_steps, so that
    step warmup_steps - 1 is the first at the full LR), then `kind`: multistep (x0.1 at each of `milestones`, in
    steps), cosine (a half cosine to 0 at `total_steps`) or constant. A run shorter than its warm-up never reaches the
    base LR."""
    warm = warmup_start + (1 - warmup_start) * (step + 1) / warmup_steps if step < warmup_steps else 1.0
    if kind == "multistep":
        return warm * 0.1 ** sum(step >= m for m in milestones)
    if kind == "cosine":
        return warm * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))))
    return warm


def step_scheduler(optimizer, kind: str, total_steps: int, warmup_steps: int = 0, milestones=(),
                   warmup_start: float = 0.0, done_steps: int = 0):
    """A LambdaLR of `lr_factor`, stepped once per optimizer step. A function of the step alone: built after a resume
    at `done_steps`, it gives that step the LR of this run's schedule. Not for `accelerator.prepare`, which would step
    it once per process per call. A warm-up not shorter than the run is a warning."""
    import torch

    if warmup_steps >= total_steps:
        logger.warning("--warmup_steps %d is not shorter than the run's %d optimizer steps: the LR never reaches its "
                       "base value; lower --warmup_steps", warmup_steps, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, kind, total_steps, warmup_steps, milestones, warmup_start),
        last_epoch=done_steps - 1)
