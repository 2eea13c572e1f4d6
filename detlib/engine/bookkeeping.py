"""What a training loop asks and records at its step boundaries, in the order a step meets them: whether to take the
step (`StepGuard`: all-reduced, so every rank steps or skips together), the train line (`TrainWindow`), and after the
step, `step_done`: the EMA, the counters, the train line, a divergence stop, a --checkpoint_steps checkpoint and the
poll for a stop signal or the time budget (`stop_if_preempted`, which raises `Preempted`). Also `run_length`.

A skipped step leaves the weights as they were, and the floating-point buffers (BatchNorm's running statistics, which
the forward itself moves) go back to their values at `snapshot`. Under fp16 a non-finite gradient with a finite loss
is the GradScaler's routine overflow (it skips and lowers the scale itself) and does not count towards divergence.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from .checkpoints import divergence
from .exits import EXIT_DIVERGED, EXIT_PREEMPTED, RunStop
from .signals import signal_received
from .stopping import TIME_LIMIT, time_limit_line, time_limit_up

logger = logging.getLogger(__name__)


class StepGuard:
    """One all-reduced decision per optimizer step, so that every rank steps or skips together. After `check`: `loss`
    and `grad_norm`, the means over processes (nan when not finite); `streak`, the non-finite steps in a row."""

    def __init__(self, accelerator, max_nonfinite_steps: int):
        self.accelerator, self.max_nonfinite_steps = accelerator, max_nonfinite_steps
        self.streak, self.loss, self.grad_norm = 0, math.nan, math.nan
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def snapshot(self, model: torch.nn.Module) -> None:
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


class TrainWindow:
    """The train line: each value's mean over the images since the last line and all processes, images per second,
    the fraction of the time spent waiting for the loader."""

    def __init__(self, accelerator):
        self.accelerator, self.images_seen = accelerator, 0.0  # images over all processes in the lines so far
        self._reset()

    def _reset(self) -> None:
        self.keys, self.sums, self.images, self.data_time, self.start = None, None, 0, 0.0, time.time()

    def timed(self, batches):
        """`batches`, counting the time each one is waited for."""
        it = iter(batches)
        while True:
            t = time.time()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.data_time += time.time() - t
            yield batch

    def add(self, values: dict[str, torch.Tensor], num_images: int) -> None:
        """One micro-batch's 0-d values (means over its `num_images` images)."""
        stacked = torch.stack([v.detach().float() for v in values.values()]) * num_images
        self.keys, self.sums = list(values), stacked if self.sums is None else self.sums + stacked
        self.images += num_images

    def line(self) -> dict:
        """The window's means (collective: every rank calls it at the same steps), then a new window."""
        acc, elapsed = self.accelerator, max(1e-9, time.time() - self.start)
        totals = acc.reduce(torch.cat([self.sums, torch.tensor([float(self.images)], device=self.sums.device)]),
                            reduction="sum").tolist()
        line = {k: v / max(totals[-1], 1) for k, v in zip(self.keys, totals[:-1])}
        line.update(images_per_s=totals[-1] / elapsed, data_time_fraction=min(1.0, self.data_time / elapsed))
        self.images_seen += totals[-1]
        if acc.scaler is not None:
            line["loss_scale"] = float(acc.scaler.get_scale())
        if torch.cuda.is_available():
            line["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self._reset()
        return line

    def log(self, metrics, state, lrs: list[float], grad_norm: float, steps_per_epoch: int) -> None:
        """The train line after step `state.global_step` (collective): epoch (from 1), step, the window's means, the
        LRs the step used (`lrs`, per param group: lr, lr_1, ...), its pre-clip grad_norm, the skipped steps so far."""
        line = {"epoch": state.epoch + 1, "step": state.global_step, **self.line(), "lr": lrs[0], "grad_norm": grad_norm,
                "skipped_steps": state.skipped_steps, **{f"lr_{i}": lr for i, lr in enumerate(lrs[1:], 1)}}
        metrics.log(line, step=state.global_step, tracker_epoch=state.epoch + state.step_in_epoch / steps_per_epoch)
        # the console shows a group's lr_i only where it differs from lr (the groups without weight decay share it)
        shown = {k: v for k, v in line.items() if k not in ("epoch", "step", "data_time_fraction")
                 and not (k.startswith("lr_") and v == line["lr"])}
        logger.info("epoch %d step %d: %s", line["epoch"], line["step"],
                    ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))


def step_done(accelerator, state, finite: bool, lrs: list[float], guard: StepGuard, window: TrainWindow, metrics,
              steps_per_epoch: int, total_steps: int, log_interval: int, checkpoint_steps: int, output_dir: str,
              checkpoint, ema=None, model=None) -> bool:
    """After optimizer step `state.global_step + 1` (collective): `ema.update(model)` when the step was taken, the
    counters, the train line every `log_interval` steps and at the epoch's or run's end (`lrs`: the LRs the step
    used), RunStop on divergence, `checkpoint()` every `checkpoint_steps` (one on the epoch's last step is the
    epoch's), then Preempted on a stop signal or the time budget. Returns whether the run's last step is done."""
    stepped = finite and not accelerator.optimizer_step_was_skipped
    if stepped and ema is not None:
        ema.update(model, step=state.global_step + 1)
    state.step_done(stepped, guard.loss)
    end = state.step_in_epoch == steps_per_epoch or state.global_step == total_steps
    if state.global_step % log_interval == 0 or end or guard.diverged:
        window.log(metrics, state, lrs, guard.grad_norm, steps_per_epoch)
    if guard.diverged:
        raise RunStop(divergence(output_dir, state, guard.streak, lrs[0]), EXIT_DIVERGED)
    if checkpoint_steps and state.global_step % checkpoint_steps == 0 and not end:
        checkpoint()
    stop_if_preempted(accelerator)
    return state.global_step >= total_steps


class Preempted(Exception):
    """A stop signal or --time_limit, on every rank (`stop_if_preempted`): the script writes a checkpoint, then raises
    `stop(...)`."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name

    def stop(self, state, checkpoint: str, note: str = "") -> RunStop:
        """The stop once `checkpoint` (of `state`, the script's TrainState) is written: where, and how to go on; a
        --time_limit stop exits 0."""
        where = (f"in the evaluation after epoch {state.eval_pending}" if state.eval_pending else
                 f"in epoch {state.epoch + 1}")
        if self.signal_name == TIME_LIMIT:
            return RunStop(time_limit_line(state, checkpoint, where) + note, 0, status="time_limit")
        return RunStop(f"preempted by {self.signal_name} at step {state.global_step} ({where}): checkpoint {checkpoint} "
                       "written; to continue, run the same command with --resume_from_checkpoint latest (exit code "
                       f"{EXIT_PREEMPTED}){note}", EXIT_PREEMPTED)


def stop_if_preempted(accelerator) -> None:
    """Collective, at the same points on every rank: raise Preempted when any process got a stop signal (the first
    one's name, accelerate's trigger; "a signal to another process" where none came), or with TIME_LIMIT when
    --time_limit's budget is up on any process."""
    if signal_received():
        accelerator.set_trigger()
    if accelerator.check_trigger():
        raise Preempted(signal_received() or "a signal to another process")
    if (up := time_limit_up()) is None:  # no budget, on every rank alike
        return
    if accelerator.reduce(torch.tensor(float(up), device=accelerator.device), "sum") > 0:
        raise Preempted(TIME_LIMIT)


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
