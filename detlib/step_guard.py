"""The optimizer step's guard and the training-health log window, held by `detlib.engine.Run`.

* Non-finite guard: the loss of every micro-batch and the (pre-clip) gradient norm are checked on the device;
  the flags are summed over processes (`check`), so every rank skips or steps together. BatchNorm running
  statistics, which the forward pass itself changes, are kept from before each accumulation window and put
  back after a non-finite one (`snapshot_buffers` / `restore_buffers`). `record` counts the non-finite steps
  in a row (the divergence streak) and says when `--max_nonfinite_steps` is reached.
* Explosion watch: a loss that grows by orders of magnitude while staying finite is reported once per
  order of magnitude, with the step and the LR.
* Log window: the logged values summed over the images since the last train line, with the data-loading
  time, the last gradient norm and the throughput; `window_line` turns them into one metrics line.
"""

from __future__ import annotations

import logging
import math
import time

import torch

# The run machinery logs under one name whichever of its modules writes the line (train.log shows the name).
logger = logging.getLogger("detlib.engine")

EXPLOSION_FACTOR = 100.0  # a finite loss this many times its lowest running level is reported
# After a report, the next one waits for a loss this many times the reported one: one line per order of
# magnitude of growth, not one per step of a run that stays high.
REWARN_FACTOR = 10.0
# Weight of the newest loss in the running level the explosion watch compares with: an EMA over about ten
# steps, so one noisy batch neither sets a low level nor trips the warning.
LOSS_EMA_WEIGHT = 0.1
LOSS_LEVEL_FLOOR = 1e-8  # a running level of 0 (a perfectly fit batch) must not make every later loss "explode"


class StepGuard:
    """Non-finite guard, divergence streak, explosion watch and log window of one training run.

    Args:
        accelerator: the run's `accelerate.Accelerator` (device, process count, GradScaler, reduce).
        max_grad_norm: clip the gradient norm to this; None or <= 0: no clipping (the norm is still checked).
        max_nonfinite_steps: non-finite optimizer steps in a row after which `record` reports divergence.
    """

    def __init__(self, accelerator, max_grad_norm: float | None, max_nonfinite_steps: int):
        self.accelerator = accelerator
        self.max_norm = max_grad_norm if max_grad_norm and max_grad_norm > 0 else math.inf
        self.max_nonfinite_steps = max_nonfinite_steps
        self.streak = 0  # non-finite optimizer steps in a row
        self.last_grad_norm = math.nan  # mean over processes of the last step's pre-clip norm; nan when non-finite
        self._ema: float | None = None
        self._ema_low: float | None = None
        self._warned_loss = 0.0
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._window_bad = torch.zeros((), device=accelerator.device)  # non-finite micro-batch losses this window
        self._window: torch.Tensor | None = None  # per-window sums of the logged values, times images
        self._window_keys: list[str] = []
        self._window_images = 0
        self._window_steps = 0
        self._data_time = 0.0
        self._t_window = time.time()

    # ---- the clock of the log window
    def start_clock(self) -> None:
        """The log window's time starts now (start of training and of every epoch's batches)."""
        self._t_window = time.time()

    def add_data_time(self, seconds: float) -> None:
        """Time spent waiting for a batch, reported as `data_time_fraction` of the window."""
        self._data_time += seconds

    # ---- BatchNorm buffers
    def snapshot_buffers(self, model: torch.nn.Module) -> None:
        """Keep the floating-point buffers (BatchNorm running statistics) from before an accumulation window."""
        # BatchNorm running statistics change in the forward pass itself: a non-finite forward would poison
        # them even though its optimizer step is skipped, so they are kept from before each window.
        self._buffers = [(b, b.detach().clone()) for b in model.buffers() if b.is_floating_point()]

    def restore_buffers(self) -> None:
        """Put back the buffers of the last snapshot (after a non-finite window)."""
        with torch.no_grad():
            for b, saved in self._buffers:
                b.copy_(saved)

    # ---- one micro-batch, one optimizer step
    def add(self, values: dict[str, torch.Tensor], num_images: int) -> None:
        """Add one micro-batch's scalar losses (0-d tensors, "loss" the one trained on) to the window."""
        stacked = torch.stack([v.detach().float() for v in values.values()])
        if self._window is None or self._window.numel() != stacked.numel():
            self._window_keys = list(values)
            self._window = torch.zeros_like(stacked)
        self._window += stacked * num_images
        self._window_images += num_images
        self._window_bad = self._window_bad + (~torch.isfinite(values["loss"].detach())).float()

    def check(self, model, loss: torch.Tensor) -> tuple[float, float, float, float]:
        """Clip the gradients and check the window (collective: every rank calls it at each optimizer step).

        Args:
            model: the prepared model, its gradients all-reduced (and unscaled by `clip_grad_norm_` under fp16).
            loss: the last micro-batch's loss, 0-d tensor.
        Returns, summed over processes: (non-finite micro-batch losses, processes with a non-finite gradient
        norm, the finite part of `loss`, the finite part of the pre-clip gradient norm).
        """
        acc = self.accelerator
        # the pre-clip norm, after the fp16 unscale; the same on every rank (gradients are already all-reduced)
        grad_norm = acc.clip_grad_norm_(model.parameters(), self.max_norm)
        grad_norm = torch.as_tensor(grad_norm, device=acc.device).float()
        flags = torch.stack([self._window_bad, (~torch.isfinite(grad_norm)).float(),
                             torch.nan_to_num(loss.detach().float(), nan=0.0, posinf=0.0, neginf=0.0),
                             torch.nan_to_num(grad_norm, nan=0.0, posinf=0.0, neginf=0.0)])
        bad_loss, bad_grad, loss_sum, norm_sum = acc.reduce(flags, reduction="sum").tolist()
        self._window_bad = torch.zeros((), device=acc.device)
        return bad_loss, bad_grad, loss_sum, norm_sum

    def step(self, model, optimizer, loss: torch.Tensor) -> tuple[bool, tuple[float, float, float, float]]:
        """The optimizer step, or its skip (collective; on the last micro-batch of a window).

        Args:
            model, optimizer: the prepared ones; the gradients are clipped to `max_grad_norm` and zeroed after.
            loss: the last micro-batch's loss, 0-d tensor.
        Returns (skipped, sums): skipped when the weights were left as they were (non-finite, or the fp16
        GradScaler's own skip); sums, `check`'s, for `record`.
        """
        acc = self.accelerator
        sums = bad_loss, bad_grad, _, _ = self.check(model, loss)
        if acc.scaler is not None:  # the GradScaler skips a step with non-finite gradients itself
            optimizer.step()
            skipped = acc.optimizer_step_was_skipped
        else:
            skipped = bool(bad_loss or bad_grad)
            if not skipped:
                optimizer.step()
        if bad_loss or bad_grad:
            self.restore_buffers()
        optimizer.zero_grad(set_to_none=True)
        return skipped, sums

    def record(self, step: int, lr: float, bad_loss: float, bad_grad: float, loss_sum: float, norm_sum: float) -> bool:
        """After optimizer step `step` (1-based) at `lr`, with `check`'s sums: count the streak, watch the loss,
        warn on a non-finite step. Returns True when the run has diverged (`max_nonfinite_steps` in a row)."""
        acc = self.accelerator
        # under fp16 a non-finite gradient alone is the GradScaler's business (it lowers the scale and skips)
        nonfinite = bad_loss > 0 or (bad_grad > 0 and acc.scaler is None)
        self.streak = self.streak + 1 if nonfinite else 0
        self.last_grad_norm = norm_sum / acc.num_processes if not bad_grad else math.nan
        if not bad_loss:
            self._watch_explosion(loss_sum / acc.num_processes, lr, step)
        if nonfinite:
            logger.warning("step %d: non-finite %s (lr %.3g); the step is skipped on every process (%d in a row)",
                           step, "loss" if bad_loss else "gradient norm", lr, self.streak)
        elif bad_grad:  # fp16: an overflow of the scaled gradients is routine while the scaler finds its level
            logger.info("step %d: fp16 gradient overflow: the GradScaler skipped the step on every process and "
                        "lowered the loss scale to %g", step, acc.scaler.get_scale())
        self._window_steps += 1
        return self.streak >= self.max_nonfinite_steps

    def _watch_explosion(self, loss: float, lr: float, step: int) -> None:
        if not math.isfinite(loss):
            return
        if self._ema_low is not None and loss > EXPLOSION_FACTOR * max(self._ema_low, LOSS_LEVEL_FLOOR) \
                and loss > REWARN_FACTOR * self._warned_loss:
            logger.warning("step %d: loss %.4g is over %dx its lowest running level %.4g (lr %.3g): the run may be "
                           "diverging; consider a lower --lr or --max_grad_norm", step, loss,
                           int(EXPLOSION_FACTOR), self._ema_low, lr)
            self._warned_loss = loss
        self._ema = loss if self._ema is None else (1 - LOSS_EMA_WEIGHT) * self._ema + LOSS_EMA_WEIGHT * loss
        self._ema_low = self._ema if self._ema_low is None else min(self._ema_low, self._ema)

    # ---- the train line
    def window_line(self, head: dict, lr: float, skipped_steps: int,
                    param_groups: list[dict]) -> tuple[dict, float] | None:
        """The train line of the log window (collective; `reset_window` then starts the next window).

        Returns (line, images): `head` (epoch, step) followed by the means over the window's images, over all
        processes, of each logged value, then lr, grad_norm, images_per_s, data_time_fraction, skipped_steps,
        the other param groups' LRs (lr_1, ...), the fp16 loss scale and the CUDA peak memory (GiB); and the
        window's image count over all processes. None when no optimizer step was taken since the last line.
        """
        acc = self.accelerator
        if self._window is None or self._window_steps == 0:
            return None
        totals = acc.reduce(torch.cat([self._window, torch.tensor([float(self._window_images)], device=acc.device)]),
                            reduction="sum").tolist()
        images = totals[-1]
        elapsed = max(1e-9, time.time() - self._t_window)
        line = dict(head)
        line.update({k: v / max(images, 1) for k, v in zip(self._window_keys, totals[:-1])})
        line.update(lr=lr, grad_norm=self.last_grad_norm, images_per_s=images / elapsed,
                    data_time_fraction=min(1.0, self._data_time / elapsed), skipped_steps=skipped_steps)
        for i, g in enumerate(param_groups[1:], 1):
            line[f"lr_{i}"] = g["lr"]
        if acc.scaler is not None:
            line["loss_scale"] = float(acc.scaler.get_scale())
        if torch.cuda.is_available():
            line["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return line, images

    def reset_window(self) -> None:
        """Start the next log window (after its line was logged)."""
        self._window.zero_()
        self._window_images = self._window_steps = 0
        self._data_time = 0.0
        self._t_window = time.time()
