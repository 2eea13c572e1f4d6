"""The step guard: one all-reduced decision per optimizer step, so that every rank steps or skips together.

    guard.snapshot(model)                       # at the first micro-batch of the window
    ... forward, backward, clip_grad_norm_ ...
    if guard.check(loss, grad_norm, step, lr):  # one all-reduce: finite on every process?
        optimizer.step()
    if guard.diverged: raise RunStop(..., EXIT_DIVERGED)

A skipped step leaves the weights as they were, and `check` puts the floating-point buffers (BatchNorm's running
statistics, which the forward pass itself moves) back to their values at `snapshot`, so a non-finite window leaves
nothing non-finite behind. Under fp16 a non-finite gradient with a finite loss is the GradScaler's routine overflow
(it skips the step and lowers the scale itself) and does not count towards divergence.
"""

from __future__ import annotations

import logging
import math

import torch

from .run_folder import RunStop

logger = logging.getLogger(__name__)

# A finite loss this many times its lowest running level (an EMA over about 1 / LOSS_EMA_WEIGHT steps, so one noisy
# batch neither sets a low level nor trips the warning) is reported, again only once it grows REWARN_FACTOR more.
EXPLOSION_FACTOR, REWARN_FACTOR, LOSS_EMA_WEIGHT, LOSS_LEVEL_FLOOR = 100.0, 10.0, 0.1, 1e-8


class StepGuard:
    """Args:
        accelerator: the run's `accelerate.Accelerator` (its reduce, its fp16 GradScaler).
        max_nonfinite_steps: non-finite steps in a row after which `diverged` is True.
    After `check`: `loss` and `grad_norm` are the means over processes (nan when non-finite), `streak` the
    non-finite steps in a row.
    """

    def __init__(self, accelerator, max_nonfinite_steps: int):
        self.accelerator, self.max_nonfinite_steps = accelerator, max_nonfinite_steps
        self.streak, self.loss, self.grad_norm = 0, math.nan, math.nan
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._level = self._warned = None
        self._low = math.inf

    def snapshot(self, model: torch.nn.Module) -> None:
        """Keep the model's floating-point buffers as they are before the accumulation window."""
        self._buffers = [(b, b.detach().clone()) for b in model.buffers() if b.is_floating_point()]

    def check(self, loss: torch.Tensor, grad_norm, step: int, lr: float) -> bool:
        """Whether to take optimizer step `step` (1-based) at `lr`: the window's last micro-batch `loss` (0-d) and the
        pre-clip gradient norm (`accelerator.clip_grad_norm_`'s) finite on every process. Collective: call on the
        last micro-batch of the window, before `optimizer.step()`. A non-finite gradient follows from any non-finite
        micro-batch loss of the window. Puts the buffers back when not finite; warns; counts the streak."""
        acc = self.accelerator
        values = torch.stack([loss.detach().float(), torch.as_tensor(grad_norm, device=acc.device).float()])
        bad = (~torch.isfinite(values)).float()
        bad_loss, bad_grad, loss_sum, norm_sum = acc.reduce(torch.cat([bad, values.nan_to_num(0, 0, 0)]), "sum").tolist()
        finite = not (bad_loss or bad_grad)
        if not finite:
            with torch.no_grad():
                for b, saved in self._buffers:
                    b.copy_(saved)
        counted = bad_loss > 0 or (bad_grad > 0 and acc.scaler is None)  # fp16: the GradScaler's routine skip
        self.streak = self.streak + 1 if counted else 0
        self.loss = loss_sum / acc.num_processes if not bad_loss else math.nan
        self.grad_norm = norm_sum / acc.num_processes if not bad_grad else math.nan
        if counted:
            logger.warning("step %d: non-finite %s (lr %.3g); the step is skipped on every process (%d in a row)",
                           step, "loss" if bad_loss else "gradient norm", lr, self.streak)
        elif bad_grad:
            logger.info("step %d: fp16 gradient overflow: the GradScaler skipped the step on every process and lowered "
                        "the loss scale to %g", step, acc.scaler.get_scale())
        if not bad_loss:
            self._watch(self.loss, step, lr)
        return finite

    @property
    def diverged(self) -> bool:
        return self.streak >= self.max_nonfinite_steps

    def _watch(self, loss: float, step: int, lr: float) -> None:
        if self._level is not None and loss > EXPLOSION_FACTOR * max(self._low, LOSS_LEVEL_FLOOR) \
                and loss > REWARN_FACTOR * (self._warned or 0.0):
            logger.warning("step %d: loss %.4g is over %dx its lowest running level %.4g (lr %.3g): the run may be "
                           "diverging; consider a lower --lr or --max_grad_norm", step, loss, EXPLOSION_FACTOR,
                           self._low, lr)
            self._warned = loss
        self._level = loss if self._level is None else (1 - LOSS_EMA_WEIGHT) * self._level + LOSS_EMA_WEIGHT * loss
        self._low = min(self._low, self._level)


def run_length(accelerator, loader, accumulation_steps: int, epochs: int, max_steps: int) -> tuple[int, int]:
    """(optimizer steps per epoch, steps of the run) of a prepared training `loader` (one process's batches; the
    partial last accumulation window is a step too); `max_steps` > 0 replaces `epochs` x steps per epoch. Collective.
    Raises RunStop when some process gets no full batch (so no step at all)."""
    if not bool(accelerator.gather(torch.tensor([len(loader)], device=accelerator.device)).min()):
        raise RunStop(f"{len(loader.dataset)} training images on {accelerator.num_processes} process(es) with "
                      f"--per_device_batch_size {loader.total_batch_size // accelerator.num_processes} give no full "
                      "batch on some process (the incomplete last batch is dropped), so no optimizer step: use a smaller "
                      "batch size or fewer processes")
    steps_per_epoch = math.ceil(len(loader) / accumulation_steps)
    return steps_per_epoch, max_steps or epochs * steps_per_epoch
