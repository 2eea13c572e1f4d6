"""The step guard: one all-reduced decision per optimizer step, so that every rank steps or skips together.

A skipped step leaves the weights as they were, and the floating-point buffers (BatchNorm's running statistics, which
the forward itself moves) go back to their values at `snapshot`: a non-finite window leaves nothing non-finite. Under
fp16 a non-finite gradient with a finite loss is the GradScaler's routine overflow (it skips and lowers the scale
itself) and does not count towards divergence.
"""

from __future__ import annotations

import logging
import math

import torch

from .run_folder import RunStop

logger = logging.getLogger(__name__)

class StepGuard:
    """After `check`: `loss` and `grad_norm`, the means over processes (nan when not finite); `streak`, the non-finite
    steps in a row; `diverged`, `streak` >= `max_nonfinite_steps`."""

    def __init__(self, accelerator, max_nonfinite_steps: int):
        self.accelerator, self.max_nonfinite_steps = accelerator, max_nonfinite_steps
        self.streak, self.loss, self.grad_norm = 0, math.nan, math.nan
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def snapshot(self, model: torch.nn.Module) -> None:
        """Keep the model's floating-point buffers as they are before the accumulation window."""
        self._buffers = [(b, b.detach().clone()) for b in model.buffers() if b.is_floating_point()]

    def check(self, loss: torch.Tensor, grad_norm, step: int, lr: float) -> bool:
        """Whether to take optimizer step `step` (1-based) at `lr`: the last micro-batch's `loss` (0-d; a non-finite
        one earlier in the window makes the gradient non-finite) and the pre-clip gradient norm
        (`accelerator.clip_grad_norm_`'s) finite on every process. Collective, before `optimizer.step()`."""
        acc = self.accelerator
        values = torch.stack([loss.detach().float(), torch.as_tensor(grad_norm, device=acc.device).float()])
        bad = (~torch.isfinite(values)).float()
        bad_loss, bad_grad, loss_sum, norm_sum = acc.reduce(torch.cat([bad, values.nan_to_num(0, 0, 0)]), "sum").tolist()
        if bad_loss or bad_grad:
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
        return not (bad_loss or bad_grad)

    @property
    def diverged(self) -> bool:
        return self.streak >= self.max_nonfinite_steps


def run_length(accelerator, loader, accumulation_steps: int, epochs: int, max_steps: int) -> tuple[int, int]:
    """(optimizer steps per epoch, steps of the run) of a prepared training `loader` (the partial last accumulation
    window is a step too; `max_steps` > 0 stops the run earlier, never later, than `epochs`: said when it is past
    them). Collective. Raises RunStop when some process gets no full batch, so no step at all."""
    if not bool(accelerator.gather(torch.tensor([len(loader)], device=accelerator.device)).min()):
        raise RunStop(f"{len(loader.dataset)} training images on {accelerator.num_processes} process(es) with "
                      f"--per_device_batch_size {loader.total_batch_size // accelerator.num_processes} give no full "
                      "batch on some process (the incomplete last batch is dropped), so no optimizer step: use a smaller "
                      "batch size or fewer processes")
    steps_per_epoch = math.ceil(len(loader) / accumulation_steps)
    if max_steps > epochs * steps_per_epoch:
        logger.warning("--max_steps %d is past --epochs %d (%d steps): the run ends after its %d epochs", max_steps,
                       epochs, epochs * steps_per_epoch, epochs)
    return steps_per_epoch, min(max_steps or math.inf, epochs * steps_per_epoch)
