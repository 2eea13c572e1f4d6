"""What both training scripts do around their step, written once; each script keeps its loop and its step (forward,
loss, backward, clip, the decision to step, `optimizer.step()`, `zero_grad()`, `scheduler.step()`).

A skipped step leaves the weights as they were, and the floating-point buffers (BatchNorm's running statistics, which
the forward itself moves) go back to their values at `snapshot`. Under fp16 a non-finite gradient with a finite loss
is the GradScaler's routine overflow (it skips and lowers the scale itself) and does not count towards divergence.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os

import torch

from .checkpoints import (EMA_WEIGHTS, best_record, best_weights, divergence, improves_best, save_checkpoint,
                          save_weights)
from .logs import TrainWindow, log_plan, make_accelerator, record_config, start_trackers, summary_lines
from .stopping import expect_save, stop_early
from .run_folder import EXIT_DIVERGED, EXIT_PREEMPTED, Preempted, RunStop, stop_if_preempted

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


def accelerator_for(args):
    """`make_accelerator` from the run machinery's flags; --compile only when training."""
    return make_accelerator(args.mixed_precision, args.gradient_accumulation_steps, args.report_to, args.output_dir,
                            args.seed, args.verbose, args.compile_backend if args.compile and not args.evaluate_only
                            else None, args.compile_mode)


def evaluate_only(accelerator, args, config: dict, given_line: str, evaluate):
    """--evaluate_only: config.yaml, the trackers, then `evaluate()`'s result; a preemption signal is RunStop."""
    record_config(accelerator, config, given_line, args.output_dir)
    start_trackers(accelerator, args.project, config, args.output_dir, None, args.run_name, args.report_to)
    try:
        return evaluate()
    except Preempted as p:
        raise RunStop(f"stopped by {p.signal_name} during evaluation", EXIT_PREEMPTED) from None


class TrainLoop:
    """The bookkeeping of a training run around the script's step. Made after `resume` (it writes config.yaml, starts
    the trackers, logs the plan). `args`: the run machinery's flags; `evaluate(models, epoch, final)`: the script's
    evaluation of {"": the trained weights, "ema_": their EMA} -> {prefix: stats holding `metric`};
    `write_files(folder, name, evaluation)`: the script's files beside a weights folder's weights (its model card)."""

    def __init__(self, accelerator, args, state, model, ema, steps_per_epoch: int, total_steps: int, config: dict,
                 model_config: dict, given_line: str, metrics, lr: float, metric: str, evaluate, write_files):
        self.acc, self.args, self.state, self.model, self.ema, self.metrics = accelerator, args, state, model, ema, metrics
        self.steps_per_epoch, self.total_steps, self.config, self.model_config = steps_per_epoch, total_steps, config, model_config
        self.metric, self.evaluate_fn, self.write_files = metric, evaluate, write_files
        self.bare = accelerator.unwrap_model(model, keep_torch_compile=False)  # evaluated uncompiled, saved without prefixes
        self.guard, self.window = StepGuard(accelerator, args.max_nonfinite_steps), TrainWindow(accelerator)
        # a checkpoint holds the weights (and the EMA's) and the optimizer's state: up to 2 more copies (AdamW's moments)
        expect_save(3 * sum(t.numel() * t.element_size() for m in (self.bare, *([ema.module] if ema else []))
                            for t in (*m.parameters(), *m.buffers())))
        self.evaluated, self.saved, self.start_step, self.final, self.best = {}, {}, state.global_step, {}, None
        record_config(accelerator, config, given_line, args.output_dir)
        state.run_id = start_trackers(accelerator, args.project, config, args.output_dir, state.run_id, args.run_name,
                                      args.report_to)
        log_plan(state, args.epochs, total_steps, steps_per_epoch, args.per_device_batch_size * accelerator.num_processes
                 * args.gradient_accumulation_steps, lr, args.max_grad_norm)

    def epochs(self):
        """The epochs to train (0-based), from the resumed state to --epochs or the run's last step; an evaluation a
        preemption cut short is run first."""
        if self.state.eval_pending:
            self.evaluate(self.state.eval_pending, self.state.global_step >= self.total_steps)
        for epoch in range(self.state.epoch, self.args.epochs):
            if (self.state.global_step >= self.total_steps
                    or stop_early(self.state, self.args.early_stopping_patience, self.metric)):
                return
            yield epoch

    def batches(self, loader, model, optimizer):
        """(index, batch) of the epoch from the state's position (a mid-epoch resume skips the batches trained), timed
        for the train line; at each accumulation window's first batch the step's LRs are kept and the model's buffers
        snapshotted (a skipped step puts them back). The epoch goes to the sampler and to the data set (its
        augmentation stream, `detlib.data.seeds`; accelerate's `set_epoch` skips a data set whose sampler has one)."""
        G = self.args.gradient_accumulation_steps
        done = self.state.step_in_epoch * G
        loader.set_epoch(self.state.epoch)
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(self.state.epoch)
        for i, batch in enumerate(self.window.timed(self.acc.skip_first_batches(loader, done) if done else loader), done):
            if i % G == 0:
                self.guard.snapshot(model)
                self.lrs, self.window_loss, self.micro_batches = [g["lr"] for g in optimizer.param_groups], 0.0, 0
            yield i, batch

    def add(self, values: dict[str, torch.Tensor], num_images: int) -> None:
        """A micro-batch's 0-d values for the train line (means over its images), values["loss"] among them."""
        self.window.add(values, num_images)
        self.window_loss, self.micro_batches = self.window_loss + values["loss"].detach(), self.micro_batches + 1

    def finite(self, grad_norm) -> bool:
        """Whether to take the step: the window's mean loss and the pre-clip `grad_norm` finite on every process."""
        return self.guard.check(self.window_loss / self.micro_batches, grad_norm, self.state.global_step + 1, self.lrs[0])

    def step_done(self, finite: bool) -> bool:
        """After the step: the EMA, the counters, the train line, then RunStop on divergence, a --checkpoint_steps
        checkpoint (one on the epoch's last step is the epoch's), Preempted on a preemption signal. Returns whether
        the run's last step is done."""
        acc, args, state, guard = self.acc, self.args, self.state, self.guard
        stepped = finite and not acc.optimizer_step_was_skipped
        if stepped and self.ema is not None:
            self.ema.update(self.bare, step=state.global_step + 1)
        state.step_done(stepped, guard.loss)
        end = state.step_in_epoch == self.steps_per_epoch or state.global_step == self.total_steps
        if state.global_step % args.log_interval == 0 or end or guard.diverged:
            self.window.log(self.metrics, state, self.lrs, guard.grad_norm, self.steps_per_epoch)
        if guard.diverged:
            raise RunStop(divergence(args.output_dir, state, guard.streak, self.lrs[0]), EXIT_DIVERGED)
        if args.checkpoint_steps and state.global_step % args.checkpoint_steps == 0 and not end:
            self.checkpoint()
        stop_if_preempted(acc)
        return state.global_step >= self.total_steps

    def end_epoch(self, epoch: int, optimizer) -> float | None:
        """The epoch's mean loss (the same on every rank), logged, when it ran to its end; None when the run's last
        step came first."""
        if self.state.step_in_epoch < self.steps_per_epoch:
            return None
        mean = self.state.end_epoch()
        logger.info("epoch %d: mean loss %.4f, lr %.3g, %d skipped steps so far", epoch + 1, mean,
                    optimizer.param_groups[0]["lr"], self.state.skipped_steps)
        return mean

    def evaluate_and_checkpoint(self, epoch: int) -> None:
        """After epoch `epoch` (0-based): the evaluation every --eval_interval epochs and at the end, the checkpoint
        every --checkpoint_interval epochs, on a --checkpoint_steps step and at the end."""
        args, state = self.args, self.state
        last = state.global_step >= self.total_steps or epoch + 1 == args.epochs
        if (epoch + 1) % args.eval_interval == 0 or last:
            self.evaluate(epoch + 1, last)
        if ((epoch + 1) % args.checkpoint_interval == 0 or last or stop_early(state, args.early_stopping_patience, self.metric)
                or args.checkpoint_steps and state.global_step % args.checkpoint_steps == 0):  # an early stop: a finished run's end
            self.checkpoint()

    def evaluate(self, epoch: int, final: bool) -> None:
        """Evaluate the weights after `epoch` (from 1); best/ takes them when they beat every earlier evaluation.
        `final`: the run's last evaluation (the script writes its final outputs, e.g. label_errors.json); so is one
        that ends the run by --early_stopping_patience unless it brings a better best, known only after it."""
        state, ema = self.state, self.ema
        final = final or 0 < self.args.early_stopping_patience <= state.evals_without_improvement + 1
        state.eval_pending = epoch  # a preemption's checkpoint says the evaluation is to be run
        stats = self.evaluate_fn({"": self.bare if self.args.compile else self.model,
                                  **({"ema_": ema.module} if ema else {})}, epoch, final)
        self.evaluated.update({p: {"epoch": epoch, "step": state.global_step, **v} for p, v in stats.items()})
        prefix = best_weights(stats, self.metric)
        if improves_best(self.acc, self.args.output_dir, self.metric, value := stats[prefix][self.metric], state):
            self.save("best", ema.module if prefix else self.model, self.evaluated[prefix], {
                "metric": self.metric, "value": value, "epoch": epoch, "step": state.global_step,
                "weights": "ema" if prefix else "trained"})
            logger.info("new best %s %.4f (%s weights), saved %s/best/", self.metric, value,
                        "EMA" if prefix else "trained", self.args.output_dir)
        state.eval_pending = 0

    def checkpoint(self) -> str:
        """The state's checkpoint, written once (a preemption right after one reuses it); returns its folder."""
        if repr(self.state) not in self.saved:
            ema = self.ema.module if self.ema else None
            self.saved = {repr(self.state): save_checkpoint(
                self.acc, self.args.output_dir, self.state, [self.model, *([ema] if ema else [])],
                self.args.checkpoint_total_limit, self.config, self.model_config,
                {EMA_WEIGHTS: ema.state_dict()} if ema else None)}
            logger.info("saved checkpoint %s", self.saved[repr(self.state)])
        return self.saved[repr(self.state)]

    def save(self, name: str, model, evaluation: dict | None, extra: dict | None = None) -> None:
        folder = save_weights(self.acc, model, self.args.output_dir, name, self.model_config, extra)
        if self.acc.is_main_process:
            self.write_files(folder, name, evaluation)

    @contextlib.contextmanager
    def checkpoint_on_preemption(self, note: str = ""):
        """A preemption signal inside: the state's checkpoint, then RunStop (EXIT_PREEMPTED) naming it; `note` ends
        the line."""
        try:
            yield
        except Preempted as p:
            raise p.stop(self.state, self.checkpoint(), note) from None

    def finish(self) -> dict | None:
        """The end of the run: last/ (the weights at the end, with their evaluation if it was of them) when it trained
        or has none, last_ema/. Returns that evaluation of the trained weights, or None."""
        state, out = self.state, self.args.output_dir
        self.final = {p: e for p, e in self.evaluated.items() if e["step"] == state.global_step}
        if state.global_step > self.start_step or not os.path.isdir(os.path.join(out, "last")):
            self.save("last", self.model, self.final.get(""))
        if self.ema is not None and state.global_step > self.start_step:
            self.save("last_ema", self.ema.module, self.final.get("ema_"))
        self.best = best_record(self.acc, out, self.metric)
        return self.final.get("")

    def log_summary(self, elapsed_s: float, also: tuple[str, ...] = ()) -> None:
        logger.info("summary:\n  %s", "\n  ".join(summary_lines(
            self.args.output_dir, self.metric, elapsed_s, self.state, self.best, self.final.get(""),
            self.window.images_seen, self.ema is not None, also)))
