"""Learning-rate schedules, built by the training scripts beside the optimizer (`build_scheduler`).

The per-step ones are plain `LambdaLR`s and are NOT passed to `accelerator.prepare`: a prepared scheduler steps
once per process on every call (so N times per step with N processes unless the batches are split), which would
run the schedule N times too fast. The scripts step them after each optimizer step instead; the run registers
them for checkpointing (`detlib.engine.run.Run.resume`), so a resumed run continues at the same LR.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from accelerate import PartialState

logger = logging.getLogger(__name__)

SCHEDULES = ("multistep", "cosine", "constant")
# ReduceLROnPlateau divides the LR by 10 when the loss stalls: the 10x drop of the classic step schedules.
PLATEAU_FACTOR = 0.1
WARMUP_START = 0.001  # the warm-up's first factor when the schedule does not give one: Detectron's 1/1000


@dataclass
class RunPosition:
    """Where a run starts (`detlib.engine.run.Run.resume_point`), in plain values.

    steps_per_epoch, total_steps: this run's length in optimizer steps.
    global_step: the optimizer steps done (a resumed checkpoint's, moved to this run's geometry; 0 on a fresh start).
    checkpoint_step: the resumed checkpoint's own global step, counted in the steps of its schedule.
    checkpoint_schedule: the resumed checkpoint's resolved schedule settings (`build_scheduler`'s second return);
        None on a fresh start ({} for a checkpoint written before they were recorded).
    """

    steps_per_epoch: int
    total_steps: int
    global_step: int = 0
    checkpoint_step: int = 0
    checkpoint_schedule: dict | None = None


def lr_factor(step: int, kind: str, total_steps: int, warmup_steps: int = 0, warmup_start: float = WARMUP_START,
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
                       warmup_start: float = WARMUP_START, milestones: Sequence[int] = (), gamma: float = 0.1,
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


def build_scheduler(optimizer, kind: str, start: RunPosition, epochs: int, max_steps: int = 0,
                    warmup_steps: int | None = None, warmup_fraction: float = 0.0, warmup_start: float = WARMUP_START,
                    milestones_epochs: Sequence[int] = (), plateau_patience: int = 3):
    """The run's LR scheduler and its resolved settings (for `detlib.engine.run.Run.resume`, which checkpoints them).

    Args:
        kind: "plateau" (ReduceLROnPlateau on the epoch's mean loss, stepped per epoch, no warm-up) or one of
            SCHEDULES (a per-step LambdaLR, `lr_factor`).
        start: where the run starts. A resumed run keeps its checkpoint's warm-up length, and a cosine schedule
            resumed with another `epochs` goes on from the LR it had down to 0 at the new end (an anchor, not a jump);
            a plateau run keeps its base LR (`base_lrs`, which the groups' lr loses at the first drop).
        epochs, max_steps: the run's flags (`max_steps` set: no anchor).
        warmup_steps: None: `warmup_fraction` of the run, resolved once at its start.
        milestones_epochs: multistep: the epochs where the LR drops by 10x.
    Returns (scheduler, settings: {"kind", ...} plain values).
    Raises ValueError for an unknown kind.
    """
    old = start.checkpoint_schedule
    if kind == "plateau":
        base = (old or {}).get("base_lrs")
        settings = {"kind": kind, "base_lrs": base or [g["lr"] for g in optimizer.param_groups]}
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=PLATEAU_FACTOR,
                                                          patience=plateau_patience), settings
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}")
    total = start.total_steps
    old = old or {}
    if warmup_steps is None:
        warmup_steps = old.get("warmup_steps", int(round(warmup_fraction * total)))
    spec = {"kind": kind, "total_steps": total, "warmup_steps": int(warmup_steps), "warmup_start": warmup_start,
            "milestones": [e * start.steps_per_epoch for e in milestones_epochs], "anchor": old.get("anchor"),
            "epochs": epochs}
    if old.get("kind") == kind == "cosine" and old.get("epochs") != epochs and not max_steps:
        factor = lr_factor(start.checkpoint_step, kind, old["total_steps"], old["warmup_steps"],
                           old.get("warmup_start", WARMUP_START), old.get("milestones", []),
                           anchor=tuple(old["anchor"]) if old.get("anchor") else None)
        spec["anchor"] = [start.global_step, factor]
        logger.warning("resumed with --epochs %d (the checkpoint's run had %s): the cosine schedule goes on from %.3g x "
                       "the base LR at step %d down to 0 at step %d, without a restart%s", epochs, old.get("epochs"),
                       factor, start.global_step, total,
                       "; it had already reached 0, so the added epochs train at LR 0" if factor == 0 else "")
    if spec["warmup_steps"] >= total > 0 and start.checkpoint_schedule is None and PartialState().is_main_process:
        logger.warning("--warmup_steps %d is not shorter than the run's %d optimizer steps: the LR never reaches "
                       "its base value (%s warms up too); lower --warmup_steps", spec["warmup_steps"], total, kind)
    return build_lr_scheduler(optimizer, kind, total, spec["warmup_steps"], spec["warmup_start"], spec["milestones"],
                              anchor=spec["anchor"]), spec
