"""Learning-rate schedules stepped once per optimizer step, shared by the training scripts.

They are plain `LambdaLR`s and are NOT passed to `accelerator.prepare`: a prepared scheduler steps once per
process on every call (so N times per step with N processes unless the batches are split), which would
run the schedule N times too fast. The scripts step them after each optimizer step instead and register
them for checkpointing, so a resumed run continues at the same LR.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

SCHEDULES = ("multistep", "cosine", "constant")


def lr_factor(step: int, kind: str, total_steps: int, warmup_steps: int = 0, warmup_start: float = 0.001,
              milestones: Sequence[int] = (), gamma: float = 0.1, anchor: tuple[int, float] | None = None) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based).

    Linear warmup over the first `warmup_steps` steps (Goyal et al., "Accurate, Large Minibatch SGD", section
    2.2; Detectron starts at 0.001): the factor of step s < warmup_steps is
    `warmup_start + (1 - warmup_start) * (s + 1) / warmup_steps`, so the first step already takes one step of
    the ramp (not `warmup_start` itself) and step warmup_steps - 1 is the first at the full LR. Every kind
    warms up, `constant` included; a run shorter than its warmup never reaches the base LR. Then:
      multistep  x gamma at each of `milestones` (optimizer steps)
      cosine     half-cosine from 1 to 0 over the steps after the warmup
      constant   1
    `anchor` = (step a, factor f), cosine only: from step a on, a half-cosine from f to 0 at `total_steps`.
    A run resumed with another length sets it at the resume step with the factor it had, so the LR goes
    on down from where it was instead of jumping to the new schedule's value.
    Raises ValueError for an unknown kind.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    if kind == "cosine" and anchor is not None and step >= anchor[0]:
        progress = (step - anchor[0]) / max(1, total_steps - anchor[0])
        return anchor[1] * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    warm = 1.0
    if warmup_steps > 0 and step < warmup_steps:
        warm = warmup_start + (1.0 - warmup_start) * (step + 1) / warmup_steps
    if kind == "multistep":
        return warm * gamma ** sum(step >= m for m in milestones)
    if kind == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return warm * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return warm


def build_lr_scheduler(optimizer: torch.optim.Optimizer, kind: str, total_steps: int, warmup_steps: int = 0,
                       warmup_start: float = 0.001, milestones: Sequence[int] = (), gamma: float = 0.1,
                       anchor: Sequence | None = None):
    """A `LambdaLR` following `lr_factor` (see there for the arguments)."""
    ms = tuple(int(m) for m in milestones)
    anc = (int(anchor[0]), float(anchor[1])) if anchor else None
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, kind, total_steps, warmup_steps, warmup_start, ms, gamma, anc))


def set_position(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Move a `LambdaLR` to optimizer step `step` and set each param group's LR to its value there (used
    when a resumed run counts steps differently, e.g. on another number of processes)."""
    scheduler.last_epoch = step
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
