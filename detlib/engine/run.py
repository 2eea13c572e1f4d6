"""The run's bookkeeping both training scripts share: output folder, start-up checks, resume, the log window,
step checkpoints, preemption, evaluation's best/ and last/, end of run.

torchvision's detection references keep `engine.py` beside `train.py`; DETR does the same. Here the scripts keep
their step in plain sight (forward, loss, backward, clipping, the decision to step, `optimizer.step()`,
`zero_grad()`, `scheduler.step()`) and call a `Run` around it for the bookkeeping:

    run = Run(RunSettings.from_flags(args), metric="AP")   # output folder, lock, accelerator, logging, signals
    ... data, model, optimizer, accelerator.prepare(...)
    start = run.resume_point(train_loader)              # run length; a resumed checkpoint's counters
    scheduler, schedule = build_scheduler(optimizer, kind, start, ...)     # detlib.engine.schedules
    run.resume(model, optimizer, scheduler, schedule)   # load the checkpoint, trackers, disk space
    while run.next_epoch():
        for batch in run.batches(train_loader):
            with accelerator.accumulate(model):
                loss = ...
                accelerator.backward(loss * run.loss_weight)
                run.add_losses({"loss": loss}, num_images)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    finite = run.all_finite(loss, grad_norm)
                    if finite or accelerator.scaler is not None:
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    stepped = finite and not accelerator.optimizer_step_was_skipped
                    if stepped and run.ema is not None:
                        run.ema.update(run.bare(model), step=run.state.global_step + 1)
                    run.end_step(model, stepped)
        mean_loss = run.end_epoch()
        if run.evaluation_due(): run.report_evaluation(evaluate(...), model, ...)
        run.checkpoint_if_due(model)
    run.finish(model)

What a `Run` guarantees:
* Non-finite guard: `all_finite` sums the non-finite flags of the window's losses and of the gradient norm over
  processes (one all-reduce), so every rank steps or skips together; a skipped step leaves the weights as they
  were, and the BatchNorm running statistics, which the forward pass itself changes, are put back to their values
  from before the window. `--max_nonfinite_steps` in a row stop the run (EXIT_DIVERGED) naming the step, the LR and
  the last checkpoint. No weights with a non-finite value are ever written (detlib.engine.checkpoint_io). A loss that
  grows by orders of magnitude while staying finite is reported once per order of magnitude.
* Gradient accumulation: the last, partial window of an epoch is weighted by its real size (`loss_weight`),
  so its gradient is the mean over its batches like a full window's.
* Preemption (detlib.engine.run_folder): SIGTERM, SIGUSR1 and a first SIGINT only set a flag; all ranks agree through
  accelerate's `set_trigger` / `check_trigger` after each optimizer step and every few evaluation batches,
  write a step checkpoint and exit with EXIT_PREEMPTED. A second SIGINT stops at once.
* Resume (detlib.engine.checkpoint_io): from `latest` past damaged checkpoints, on another process count or batch size at the
  same position in samples seen, with another `--epochs` on from the current LR (detlib.engine.schedules).
* Start-up checks (detlib.engine.run_folder): folder writable, disk space, one live run per folder, never mixing into a
  finished run; flag values are checked by argparse (detlib.engine.flags).
* `--compile`: accelerate compiles the prepared model (detlib.engine.tracking.make_accelerator); saved weights carry no
  `_orig_mod.` prefix, evaluation runs the uncompiled module (`evaluation_models`), the summary counts the graphs.
* `--model_ema DECAY`: timm's ModelEmaV3 of the weights (`run.ema`, made by `resume`), which the script updates
  after every optimizer step that is not skipped, checkpointed beside the model (model_ema.safetensors) and
  resumed with it, evaluated beside the trained weights (`evaluation_models`, `report_evaluation(...,
  ema_stats=...)`: ema_* metrics, best/ from whichever scores higher), written to last_ema/ at the end.

Exit codes: 0 done, 1 error, 2 bad flag values, EXIT_DIVERGED (3), EXIT_PREEMPTED (75); `output_dir/run_status.json`
also records how the run ended, since launchers report exit codes each in their own way (detlib.engine.run_folder).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, fields

import torch

from ..data.loaders import stop_dataloader_workers
from ..weights import load_model_weights, load_state_dict_file
from . import checkpoint_io as ckpt
from .checkpoint_io import (EMA_WEIGHTS, Checkpointer, CheckpointError, ResumeError, check_same_classes,
                            convert_position, replaced_by_checkpoint, summary_lines)
from .flags import DEFAULT_REPORT_TO, EVALUATE_ONLY_SUBDIR, wait_for_the_first_process
from .run_folder import (EXIT_DIVERGED, EXIT_PREEMPTED, PreemptionSignals, Refusal, check_disk_space, prepare_output_dir,
                         release_lock, write_run_status)
from .schedules import RunPosition, set_position
from .tracking import (MetricsLogger, TrackerError, broadcast_object, compile_summary, finish_trackers, init_trackers,
                       log_run_setup, make_accelerator, min_over_processes, save_config, set_tracker_offset,
                       setup_logging)

logger = logging.getLogger(__name__)

EVAL_POLL_EVERY = 10  # evaluation batches between preemption checks
FIRST_EPOCH = 1
"""Epoch numbering, one rule for everything a user reads: epochs count from FIRST_EPOCH = 1. Epoch N is the N-th
pass over the training data: its log lines say "epoch N", its train and evaluation lines in metrics.jsonl have
"epoch": N, its evaluation writes plots/epoch_NNNN/ and samples/epoch_NNNN/, best/best.json records N, and
checkpoints/epoch_NNNN/ is written after it (N epochs done; `TrainState.epoch` = N). Inside the loop `Run.epoch`
is the 0-based index of the running epoch (the sampler's and the augmentation's seed), so the number shown is
`Run.epoch_number` = `Run.epoch + FIRST_EPOCH`."""

EXPLOSION_FACTOR = 100.0  # a finite loss this many times its lowest running level is reported
# After a report, the next one waits for a loss this many times the reported one: one line per order of
# magnitude of growth, not one per step of a run that stays high.
REWARN_FACTOR = 10.0
# Weight of the newest loss in the running level the explosion watch compares with: an EMA over about ten
# steps, so one noisy batch neither sets a low level nor trips the warning.
LOSS_EMA_WEIGHT = 0.1
LOSS_LEVEL_FLOOR = 1e-8  # a running level of 0 (a perfectly fit batch) must not make every later loss "explode"
# timm's EMA warm-up power: its docstring's choice for runs under a million steps (decay 0.999 at 10k steps).
EMA_WARMUP_POWER = 0.75


@dataclass
class RunSettings:
    """What a `Run` is told, in plain values: the run flags of `detlib.engine.flags.run_argument_parser`, same names."""

    output_dir: str
    epochs: int = 1
    per_device_batch_size: int = 1
    max_steps: int = 0
    gradient_accumulation_steps: int = 1
    mixed_precision: str | None = None
    seed: int = 0
    max_nonfinite_steps: int = 5
    log_interval: int = 10
    eval_interval: int = 1
    checkpoint_interval: int = 1
    checkpoint_steps: int = 0
    checkpoint_total_limit: int = 2
    evaluate_only: bool = False
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = False
    report_to: str = DEFAULT_REPORT_TO
    project: str | None = None
    run_name: str | None = None
    verbose: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str = "default"
    model_ema: float | None = None
    model_ema_warmup: bool = True

    @classmethod
    def from_flags(cls, args) -> RunSettings:
        """The settings of a script's parsed flags (`evaluate_only` PATH -> True)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        return cls(**{**values, "evaluate_only": bool(values["evaluate_only"])})


def run_length(batches_per_epoch: int, num_processes: int, per_device_batch_size: int, accumulation_steps: int,
               epochs: int, max_steps: int | None) -> tuple[int, int, int]:
    """Returns (optimizer steps per epoch, samples per step over all processes, total optimizer steps).

    `batches_per_epoch` is one process's; `max_steps` (when set) replaces `epochs` x steps per epoch.
    """
    # accumulate() also steps at the end of the loader, so a partial last window is one more step.
    steps_per_epoch = math.ceil(batches_per_epoch / accumulation_steps)
    samples_per_step = num_processes * per_device_batch_size * accumulation_steps
    return steps_per_epoch, samples_per_step, max_steps or epochs * steps_per_epoch


class StepWindow:
    """The step's bookkeeping, the part of `Run` that needs no run folder (`Run` is a StepWindow; its tests build one
    on a bare Accelerator): the losses of the micro-batches, the non-finite check, the divergence streak, the
    explosion watch, the BatchNorm buffers of the window and the logged values' sums since the last train line.
    Every collective method is called by all ranks together.

    Args:
        accelerator: the run's `accelerate.Accelerator` (device, process count, GradScaler, reduce).
        max_nonfinite_steps: non-finite optimizer steps in a row after which `record` reports divergence.
    """

    def __init__(self, accelerator, max_nonfinite_steps: int):
        self.accelerator = accelerator
        self.max_nonfinite_steps = max_nonfinite_steps
        self.streak = 0  # non-finite optimizer steps in a row
        self.last_grad_norm = math.nan  # mean over processes of the last step's pre-clip norm; nan when non-finite
        self.sums = (0.0, 0.0, 0.0, 0.0)  # `all_finite`'s, for `record`
        self._loss_ema = self._loss_low = None
        self._warned_loss = 0.0
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._bad = torch.zeros((), device=accelerator.device)  # non-finite micro-batch losses this window
        # this process's loss summed over the epoch's images, and their count (float64: a long epoch's sum)
        self._epoch_sums = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
        self.reset_window()

    def snapshot_buffers(self, model: torch.nn.Module) -> None:
        """Keep the floating-point buffers (BatchNorm running statistics) from before an accumulation window:
        they change in the forward pass itself, so a non-finite forward would poison them even though its
        optimizer step is skipped."""
        self._buffers = [(b, b.detach().clone()) for b in model.buffers() if b.is_floating_point()]

    def restore_buffers(self) -> None:
        with torch.no_grad():
            for b, saved in self._buffers:
                b.copy_(saved)

    def add_losses(self, values: dict[str, torch.Tensor], num_images: int) -> None:
        """One micro-batch's scalar losses (0-d tensors; "loss" is the one trained on, unweighted) into the log
        window (logged as means over images) and the epoch's mean loss."""
        loss = values["loss"].detach()
        stacked = torch.stack([v.detach().float() for v in values.values()])
        if self._values is None or self._values.numel() != stacked.numel():
            self._keys, self._values = list(values), torch.zeros_like(stacked)
        self._values += stacked * num_images
        self.window_images += num_images
        self._bad = self._bad + (~torch.isfinite(loss)).float()
        self._epoch_sums += torch.stack([loss.double() * num_images, torch.tensor(
            float(num_images), device=self._epoch_sums.device, dtype=torch.float64)])

    def all_finite(self, loss: torch.Tensor, grad_norm) -> bool:
        """Whether to take the optimizer step: every micro-batch loss of the window and the gradient norm finite on
        every process. Collective (one all-reduce), so every rank steps or skips together; call it on the last
        micro-batch of a window, before `optimizer.step()`.

        Args:
            loss: the last micro-batch's loss, 0-d tensor.
            grad_norm: the pre-clip gradient norm (`accelerator.clip_grad_norm_`'s, after the fp16 unscale).
        Keeps in `sums`, over processes: (non-finite micro-batch losses, processes with a non-finite gradient
        norm, the finite part of `loss`, the finite part of the norm), for `record`.
        """
        acc = self.accelerator
        grad_norm = torch.as_tensor(grad_norm, device=acc.device).float()
        flags = torch.stack([self._bad, (~torch.isfinite(grad_norm)).float(),
                             *(t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) for t in (loss.detach().float(), grad_norm))])
        self.sums = tuple(acc.reduce(flags, reduction="sum").tolist())
        self._bad = torch.zeros((), device=acc.device)
        return not (self.sums[0] or self.sums[1])

    def record(self, step: int, lr: float) -> bool:
        """After optimizer step `step` (1-based) at `lr`, with `all_finite`'s sums: count the streak, watch the
        loss, warn on a non-finite step. Returns True when the run has diverged (`max_nonfinite_steps` in a row)."""
        acc = self.accelerator
        bad_loss, bad_grad, loss_sum, norm_sum = self.sums
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
        self.window_steps += 1
        return self.streak >= self.max_nonfinite_steps

    def _watch_explosion(self, loss: float, lr: float, step: int) -> None:
        if self._loss_low is not None and loss > EXPLOSION_FACTOR * max(self._loss_low, LOSS_LEVEL_FLOOR) \
                and loss > REWARN_FACTOR * self._warned_loss:
            logger.warning("step %d: loss %.4g is over %dx its lowest running level %.4g (lr %.3g): the run may be "
                           "diverging; consider a lower --lr or --max_grad_norm", step, loss,
                           int(EXPLOSION_FACTOR), self._loss_low, lr)
            self._warned_loss = loss
        self._loss_ema = loss if self._loss_ema is None else (1 - LOSS_EMA_WEIGHT) * self._loss_ema + LOSS_EMA_WEIGHT * loss
        self._loss_low = self._loss_ema if self._loss_low is None else min(self._loss_low, self._loss_ema)

    def window_line(self, head: dict, lr: float, skipped_steps: int,
                    param_groups: list[dict]) -> tuple[dict, float] | None:
        """The train line of the window (collective; `reset_window` then starts the next one).

        Returns (line, images): `head` (epoch, step) followed by the means over the window's images, over all
        processes, of each logged value, then lr, grad_norm, images_per_s, data_time_fraction, skipped_steps,
        the other param groups' LRs (lr_1, ...), the fp16 loss scale and the CUDA peak memory (GiB); and the
        window's image count over all processes. None when no optimizer step was taken since the last line.
        """
        acc = self.accelerator
        if self._values is None or self.window_steps == 0:
            return None
        totals = acc.reduce(torch.cat([self._values, torch.tensor([float(self.window_images)], device=acc.device)]),
                            reduction="sum").tolist()
        images, elapsed = totals[-1], max(1e-9, time.time() - self.window_start)
        line = {**head, **{k: v / max(images, 1) for k, v in zip(self._keys, totals[:-1])}}
        line.update(lr=lr, grad_norm=self.last_grad_norm, images_per_s=images / elapsed,
                    data_time_fraction=min(1.0, self.data_time / elapsed), skipped_steps=skipped_steps)
        line.update({f"lr_{i}": g["lr"] for i, g in enumerate(param_groups[1:], 1)})
        if acc.scaler is not None:
            line["loss_scale"] = float(acc.scaler.get_scale())
        if torch.cuda.is_available():
            line["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return line, images

    def reset_window(self) -> None:
        """Start the next train line's window."""
        self._values: torch.Tensor | None = None  # the logged values summed over images (`_keys`), from add_losses on
        self.window_images = self.window_steps = 0
        self.data_time = 0.0
        self.window_start = time.time()


class Run(StepWindow):
    """One training (or evaluation-only) run of a script. See the module docstring for what it guarantees.

    Args:
        settings: the run's settings (`RunSettings.from_flags(args)`). An evaluation-only run writes into
            `settings.output_dir/evaluate_only` (`self.output_dir`), never over a training run's files.
        metric: the name of the validation metric that picks `best/` (higher is better), e.g. "AP".
        also_report: stats the summary's last line gives beside `metric` (of the last evaluation).
    Raises:
        SystemExit: when a start-up check fails (one line on the main process, code 1).
    """

    def __init__(self, settings: RunSettings, metric: str, also_report: tuple[str, ...] = ()):
        self.settings = s = settings
        self.metric, self.also_report = metric, also_report
        self.evaluate_only = s.evaluate_only
        self.output_dir = os.path.join(s.output_dir, EVALUATE_ONLY_SUBDIR) if s.evaluate_only else s.output_dir
        # evaluation runs uncompiled (evaluation_models), --evaluate_only too
        super().__init__(make_accelerator(s.mixed_precision, s.gradient_accumulation_steps, s.report_to,
                                          self.output_dir, seed=s.seed, verbose=s.verbose,
                                          compile_backend=s.compile_backend if s.compile and not s.evaluate_only
                                          else None, compile_mode=s.compile_mode), s.max_nonfinite_steps)
        self.state = ckpt.TrainState()
        self.config: dict = {}
        self.checkpointer = Checkpointer(self.accelerator, self.output_dir, metric, s.checkpoint_total_limit, self.fail)
        self.signals = PreemptionSignals()
        self.progress = None  # the tqdm bar of the training steps, from resume on
        self.optimizer = self.model = None
        self.last_stats: dict | None = None  # the last evaluation's stats (report_evaluation)
        self.last_evaluation: dict | None = None  # and its whole metrics.jsonl line (epoch, step, stats, extra)
        # appended to the line of a preempted (e.g. Ctrl-C) run: what its weights are worth at that point
        self.stop_note = ""
        self.ema = None  # timm's ModelEmaV3 of the trained weights (--model_ema), from resume on
        self.last_ema_evaluation: dict | None = None  # the EMA weights' evaluation line (unprefixed), with --model_ema
        self._best_candidate: dict | None = None  # the evaluation line of the weights keep_best may write to best/
        self._locked = self._closed = False
        self.t_start = time.time()

        error, notes = None, []
        if self.accelerator.is_main_process:
            error, notes, self._locked = prepare_output_dir(self.output_dir, self.evaluate_only,
                                                            s.resume_from_checkpoint, s.overwrite_output_dir)
        error = broadcast_object(self.accelerator, error)
        if error:
            self._close()
            if self.accelerator.is_main_process:  # a folder that holds or runs another run is a refusal, not a fault
                print(f"{'stopped' if isinstance(error, Refusal) else 'error'}: {error}", file=sys.stderr, flush=True)
            wait_for_the_first_process()
            raise SystemExit(1)
        setup_logging(self.output_dir, self.accelerator.is_main_process, verbose=s.verbose)
        atexit.register(self._close_at_exit)
        self.signals.install()
        log_run_setup(self.accelerator)
        if self.evaluate_only:  # training flags an evaluation cannot honour: said once, not silently dropped
            notes += [f"--{k} is not used: --evaluate_only {why}" for k, why in
                      (("compile", "runs the weights uncompiled, as every evaluation does"),
                       ("model_ema", "trains nothing to average; evaluate an EMA with --evaluate_only RUN/last_ema"))
                      if getattr(s, k)]
        for note in notes:
            logger.warning("%s", note)
        self.metrics = MetricsLogger(self.accelerator, self.output_dir)

    # ---- start-up
    def fail(self, message: str, code: int = 1):
        """One line on the main process (all ranks call it together), written to train.log and printed to stderr
        as the last thing the run prints: `error: ...`, or `stopped: ...` for an orderly stop (EXIT_PREEMPTED);
        then exit with `code`."""
        if self.accelerator.is_main_process:
            logger.error("%s", message, extra={"console": False})
            self._write_status(code, message)
        # close the trackers (and the loaders' workers) first: their own end-of-run lines come before ours, and at
        # interpreter exit wandb's own hook would shut its service down first
        self._close()
        if self.accelerator.is_main_process:
            print(f"{'stopped' if code == EXIT_PREEMPTED else 'error'}: {message}", file=sys.stderr, flush=True)
        wait_for_the_first_process()  # its line must be out before the launcher sees this process end
        raise SystemExit(code)

    def fail_together(self, error: str | None, code: int = 1) -> None:
        """`fail(error, code)` on every process when any process has an `error` (collective: all ranks call it, with
        None where all went well); the line is the main process's error, else the first other one's."""
        from accelerate.utils import gather_object

        if min_over_processes(self.accelerator, error is None):
            return
        errors = gather_object([error])
        self.fail(next(e for e in errors if e is not None), code)

    def _write_status(self, code: int, message: str = "") -> None:
        self._status_written = True
        write_run_status(self.output_dir, code, message, global_step=self.state.global_step, epoch=self.state.epoch)

    def save_config(self, config: dict, model_config: dict, given: str = "") -> None:
        """Keep the resolved config (written to config.yaml, passed to the trackers) and the model's
        description (written beside every weights file so evaluation and predict rebuild the model). The log
        gets one line: `given` (the flags the user set, as a command line: `detlib.engine.flags.format_given`), the
        rest being the defaults, all of it in config.yaml."""
        self.config, self.checkpointer.model_config = config, model_config
        if self.accelerator.is_main_process:
            save_config(config, self.output_dir)
            logger.info("config: %s; all %d settings in %s", f"the defaults and {given}" if given else "the defaults",
                        len(config), os.path.join(self.output_dir, "config.yaml"))

    def load_weights(self, model: torch.nn.Module, path: str) -> str:
        """Load `--evaluate_only` weights into the bare model; any failure is one line and exit 1."""
        try:
            f = load_model_weights(model, path)
        except (FileNotFoundError, RuntimeError, ValueError) as e:
            self.fail(str(e))
        logger.info("loaded weights from %s", f)
        return f

    def init_trackers(self) -> None:
        """Start the trackers (collective); one that cannot start stops the run with one line (`fail`)."""
        error, s = None, self.settings
        try:
            self.state.run_id = init_trackers(self.accelerator, s.project, self.config, self.output_dir,
                                              self.state.run_id, s.run_name, s.report_to)
        except TrackerError as e:  # main process only: the others learn it in fail_together
            error = str(e)
        self.fail_together(error)

    # ---- training set-up: resume_point, then the script builds its scheduler, then resume
    def resume_point(self, train_loader) -> RunPosition:
        """The run's length and, with `--resume_from_checkpoint`, the checkpoint's counters moved to this run's
        geometry (collective; call after `accelerator.prepare`). Its state is loaded by `resume`.

        Stops the run with one line when some process gets no full batch, when there is no checkpoint to resume,
        or when it was trained on other classes (`model_config` of `save_config`).
        """
        acc, s, st = self.accelerator, self.settings, self.state
        self.batches_per_epoch = len(train_loader)
        if min_over_processes(acc, self.batches_per_epoch) == 0:
            self.fail(f"{len(train_loader.dataset)} training images on {acc.num_processes} process(es) with "
                      f"--per_device_batch_size {s.per_device_batch_size} give no full batch on some process (the "
                      "incomplete last batch is dropped), so no optimizer step: use a smaller batch size or fewer "
                      "processes")
        self.steps_per_epoch, self.samples_per_step, self.total_steps = run_length(
            self.batches_per_epoch, acc.num_processes, s.per_device_batch_size, s.gradient_accumulation_steps,
            s.epochs, s.max_steps)
        self._resume, self._moved, saved = None, False, None
        if s.resume_from_checkpoint:  # the main process resolves `latest`, past damaged checkpoints
            error = None
            if acc.is_main_process:
                try:
                    self._resume = ckpt.resolve_resume(self.output_dir, s.resume_from_checkpoint)
                except CheckpointError as e:
                    error = f"--resume_from_checkpoint: {e}"
            error, self._resume = broadcast_object(acc, (error, self._resume))
            if error:
                self.fail(error)
        if self._resume:
            try:
                check_same_classes(self._resume, self.checkpointer.model_config)
            except ResumeError as e:
                self.fail(str(e))
            saved = ckpt.read_train_state(self._resume)
        if saved:
            st.load_state_dict(saved.state_dict())
            st.eval_pending = bool(saved.eval_pending)
            self._moved = convert_position(st, saved, acc.num_processes, self.samples_per_step, self.steps_per_epoch)
        self._saved_schedule = (saved.schedule or {}) if saved else None
        return RunPosition(self.steps_per_epoch, self.total_steps, st.global_step,
                           saved.global_step if saved else 0, self._saved_schedule)

    def resume(self, model, optimizer, scheduler, schedule: dict) -> None:
        """Register the scheduler for checkpointing, load the resumed checkpoint's states (model, optimizer,
        scheduler, RNG: `detlib.engine.checkpoint_io.load_checkpoint`, reading nothing but tensors and plain values), put a
        moved per-step schedule at its new position; then the trackers, the disk-space check and the counters.

        Args:
            schedule: the scheduler's resolved settings (`detlib.engine.schedules.build_scheduler`), checkpointed.
        With `--model_ema` it also makes `self.ema` (timm's ModelEmaV3) from the (resumed) weights, with the
        checkpoint's own EMA weights when it has them.
        Stops the run with one line when the checkpoint's schedule kind, model or optimizer is another one.
        """
        acc, s, st = self.accelerator, self.settings, self.state
        self.model, self.optimizer = model, optimizer
        old_kind = (self._saved_schedule or {}).get("kind")
        if old_kind not in (None, schedule["kind"]):
            self.fail(f"cannot resume from {self._resume} with --lr_scheduler {schedule['kind']}: its run used "
                      f"{old_kind}, whose state does not carry over; resume with --lr_scheduler {old_kind}, or start "
                      "a new run from its weights with --init_from")
        st.schedule = schedule
        acc.register_for_checkpointing(scheduler)
        if self._resume:
            asked = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            try:
                ckpt.load_checkpoint(acc, self._resume)
                for line in replaced_by_checkpoint(asked, optimizer.param_groups, self._saved_schedule, self._resume):
                    logger.warning("%s", line)
            except ckpt.CheckpointError as e:  # a pickle with code in it, planted after the verification
                self.fail(f"--resume_from_checkpoint: {e}")
            except ResumeError as e:
                self.fail(str(e))
            except (RuntimeError, KeyError, ValueError) as e:  # a checkpoint of another model or optimizer
                first = str(e).strip().splitlines()
                self.fail(f"cannot resume from {self._resume}: it does not fit this run (another --backbone, width, "
                          f"class list or optimizer?): {first[0][:200] if first else type(e).__name__}"
                          + (f"; {first[1].strip()[:200]}" if len(first) > 1 else ""))
            if self._moved and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                set_position(scheduler, st.global_step)
            logger.info("resumed from %s: epoch %d, step %d in epoch, global step %d, lr %.3g", self._resume,
                        st.epoch + 1, st.step_in_epoch, st.global_step, optimizer.param_groups[0]["lr"])
        if s.model_ema:
            self._start_ema(model, self._resume)
        st.num_processes, st.steps_per_epoch, st.samples_per_step = (acc.num_processes, self.steps_per_epoch,
                                                                     self.samples_per_step)
        self.init_trackers()
        error = None
        if acc.is_main_process:
            set_tracker_offset(st, self.metrics.path, bool(s.resume_from_checkpoint))
            self.metrics.step_offset = st.tracker_offset
            error = check_disk_space(self.output_dir, model, optimizer, s.checkpoint_total_limit or s.epochs)
        self.fail_together(error)  # every process stops: a lone main exit leaves the others waiting
        # epoch sums: restored (global) on the main rank only, so the reduce over ranks counts them once
        if acc.is_main_process and st.step_in_epoch:
            self._epoch_sums += torch.tensor([st.epoch_loss_sum, st.epoch_images], device=acc.device, dtype=torch.float64)
        self._ckpt_due = False
        self.epoch = st.epoch
        self.images_seen = 0
        from tqdm.auto import tqdm

        self.progress = tqdm(total=self.total_steps, initial=st.global_step, desc="train",
                             disable=not acc.is_local_main_process)
        if not st.eval_pending and (st.epoch >= s.epochs or st.global_step >= self.total_steps):
            logger.warning("nothing left to train: the run has done %d of %d epochs, step %d of %d; pass a larger "
                           "--epochs to train on", st.epoch, s.epochs, st.global_step, self.total_steps)

    def _start_ema(self, model, resumed: str | None) -> None:
        """`self.ema`: timm's ModelEmaV3 of `model`'s (resumed) weights, with the checkpoint `resumed`'s own EMA weights
        (`checkpoint/model_ema.safetensors`) when it has them; a checkpoint without them (its run had no --model_ema)
        leaves the average starting from the resumed weights, with a warning. Stops the run with one line when the
        file does not fit the model."""
        from timm.utils import ModelEmaV3

        s = self.settings
        # every process keeps its own copy: the weights are the same on every rank, and so is the average
        self.ema = ModelEmaV3(self.bare(model), decay=s.model_ema, use_warmup=s.model_ema_warmup,
                              warmup_power=EMA_WARMUP_POWER)
        path = resumed and os.path.join(resumed, f"{EMA_WEIGHTS}.safetensors")
        if path and not os.path.isfile(path):
            logger.warning("--model_ema: %s holds no EMA weights (%s.safetensors; its run had no --model_ema): the "
                           "average starts from the resumed weights", resumed, EMA_WEIGHTS)
        elif path:
            try:
                self.ema.module.load_state_dict(load_state_dict_file(path), strict=True)
            except (RuntimeError, ValueError) as e:
                first = str(e).strip().splitlines()
                self.fail(f"cannot resume the EMA weights {path}: {first[0][:200] if first else type(e).__name__}")
            logger.info("resumed the EMA weights from %s", path)
        self.checkpointer.ema = self.ema
        logger.info("--model_ema %g: an average of the weights is kept (warm-up %s), evaluated beside them as ema_%s",
                    s.model_ema, "1 - step ** -%.2f" % EMA_WARMUP_POWER if s.model_ema_warmup else "off", self.metric)

    def bare(self, model):
        """The module itself: without DDP's and torch.compile's wrappers (the same parameters)."""
        return self.accelerator.unwrap_model(model, keep_torch_compile=False)

    # ---- the epoch loop
    @property
    def epoch_number(self) -> int:
        """The running epoch as users read it (see FIRST_EPOCH): 1 for the first."""
        return self.epoch + FIRST_EPOCH

    def next_epoch(self) -> bool:
        """True while there is an epoch to train (or an interrupted evaluation to redo); sets `self.epoch`."""
        st = self.state
        if st.eval_pending:
            self.epoch = st.epoch - 1
            return True
        if self.last_epoch:
            return False
        self.epoch = st.epoch
        return True

    def batches(self, loader):
        """The training batches of the current epoch: its seeded shuffle on every rank (disjoint shards, a new
        order each epoch), minus those done before a mid-epoch resume. Sets `loss_weight` for each batch
        (see the module docstring), keeps the BatchNorm buffers at the start of each window, and stops at
        `--max_steps`."""
        st, G = self.state, self.settings.gradient_accumulation_steps
        if st.eval_pending:
            return
        loader.set_epoch(self.epoch)
        i = start = st.step_in_epoch * G
        it = iter(self.accelerator.skip_first_batches(loader, start) if start else loader)
        self.window_start = time.time()
        while st.global_step < self.total_steps:
            t = time.time()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.data_time += time.time() - t
            first = (i // G) * G  # the window's first batch
            self.loss_weight = G / min(G, self.batches_per_epoch - first)
            if i == first:
                self.snapshot_buffers(self.model)
                self._lr = self.optimizer.param_groups[0]["lr"]  # the LR of the window's optimizer step
            i += 1
            yield batch

    loss_weight = 1.0

    def end_step(self, model, stepped: bool) -> None:
        """The bookkeeping after an optimizer step (collective; after `zero_grad` and a per-step `scheduler.step`).

        `stepped`: False when the weights were left as they were (a non-finite window, or the fp16 GradScaler's
        skip). Counts the step, puts back the BatchNorm buffers after a non-finite window, logs the train line
        every `--log_interval` steps, stops the run when it diverged, writes a `--checkpoint_steps` checkpoint and
        polls for preemption.
        """
        s, st, lr = self.settings, self.state, self._lr
        st.global_step += 1
        st.step_in_epoch += 1
        self.progress.update(1)
        st.skipped_steps += not stepped
        if self.sums[0] or self.sums[1]:
            self.restore_buffers()
        diverged = self.record(st.global_step, lr)
        if st.global_step % s.log_interval == 0 or st.global_step == self.total_steps or diverged:
            self._log_window(lr)
        if diverged:
            last = ckpt.list_checkpoints(self.output_dir) if self.accelerator.is_main_process else []
            self.fail(f"training diverged: {self.streak} non-finite steps in a row up to step {st.global_step} "
                      f"(epoch {self.epoch_number}, lr {lr:.3g}); nothing non-finite was saved; the last good checkpoint is "
                      f"{last[-1] if last else 'none (no checkpoint written yet)'}: resume from it with a lower --lr "
                      "or --max_grad_norm", EXIT_DIVERGED)
        if s.checkpoint_steps and st.global_step % s.checkpoint_steps == 0:
            if st.step_in_epoch < self.steps_per_epoch and st.global_step < self.total_steps:
                self.save_checkpoint(model)
            else:  # the epoch (or the run) ends with this step: its own checkpoint follows
                self._ckpt_due = True
        self.poll_preemption(model)

    def _log_window(self, lr: float) -> None:
        """One train line: means over the images since the last line, over all processes."""
        st = self.state
        window = self.window_line({"epoch": self.epoch_number, "step": st.global_step}, lr, st.skipped_steps,
                                         self.optimizer.param_groups)
        if window is None:
            return
        line, images = window
        self.progress.set_postfix(loss=f"{line['loss']:.4f}", lr=f"{lr:.2e}")
        self.metrics.log(line, step=st.global_step, tracker_epoch=self.epoch + st.step_in_epoch / self.steps_per_epoch)
        self.images_seen += images
        self.reset_window()

    def end_epoch(self) -> float | None:
        """Close the epoch: flush its last train line, log the epoch line. Returns the epoch's mean loss over all
        its images and processes (the same value on every rank: what ReduceLROnPlateau steps on) when the epoch
        is done; None for a redone evaluation or an epoch cut short by `--max_steps`."""
        acc, st = self.accelerator, self.state
        if st.eval_pending:
            return None
        lr = self.optimizer.param_groups[0]["lr"]
        self._log_window(lr)
        sums = acc.reduce(self._epoch_sums, reduction="sum").tolist()
        mean_loss = sums[0] / max(sums[1], 1.0)
        finished = st.step_in_epoch >= self.steps_per_epoch or st.global_step < self.total_steps
        if finished:
            st.epoch, st.step_in_epoch = self.epoch + 1, 0
            self._epoch_sums.zero_()
        logger.info("epoch %d: mean loss %.4f, lr %.3g, %d skipped steps so far", self.epoch_number, mean_loss,
                    lr, st.skipped_steps)
        return mean_loss if finished else None

    @property
    def last_epoch(self) -> bool:
        st = self.state
        return st.epoch >= self.settings.epochs or st.global_step >= self.total_steps

    def evaluation_due(self) -> bool:
        return self.state.eval_pending or (self.epoch + 1) % self.settings.eval_interval == 0 or self.last_epoch

    def evaluation_models(self, model) -> dict[str, torch.nn.Module]:
        """What an evaluation scores, by the prefix of its metrics: {"": the model being trained} and, with
        --model_ema, {"ema_": the EMA weights}. Under --compile the trained model is evaluated uncompiled: compiling
        covers the training step; evaluation's no-grad mode and batch sizes would compile graphs of their own (and
        count towards dynamo's recompile limit) for a few percent of a run's time."""
        models = {"": self.bare(model) if self.settings.compile else model}
        if self.ema is not None:
            models["ema_"] = self.ema.module
        return models

    def report_evaluation(self, stats: dict, model, extra: dict | None = None, ema_stats: dict | None = None,
                          ema_extra: dict | None = None) -> bool:
        """Log an evaluation line and keep `best/` when `stats[metric]` beats every earlier one of this run,
        the best/ on disk included (so a resume from an older checkpoint never replaces it with a worse
        model). With `ema_stats` (the EMA weights' evaluation; `ema_extra`: its per-class AP and score thresholds)
        the line carries its numbers as ema_* too, and best/ takes the EMA weights when they score higher
        (best.json says which, and best/'s model card and score thresholds are the EMA weights'). Returns True when
        best/ was written."""
        st, value = self.state, float(stats[self.metric])
        ema_line, self.last_ema_evaluation = {}, None
        if ema_stats is not None:
            ema_line = {f"ema_{k}": v for k, v in ema_stats.items() if isinstance(v, (int, float))}
            self.last_ema_evaluation = {"epoch": self.epoch_number, "step": st.global_step, **ema_stats,
                                        **(ema_extra or {}), "weights": "ema"}
        line = {"epoch": self.epoch_number, "step": st.global_step, **stats, **ema_line, **(extra or {})}
        self.metrics.log(line, step=st.global_step, tracker_epoch=self.epoch + 1)
        self.last_stats, self.last_evaluation = stats, line
        st.eval_pending = False
        if ema_stats is not None and float(ema_stats[self.metric]) > value:
            self._best_candidate = self.last_ema_evaluation
            return self.checkpointer.keep_best(self.ema.module, float(ema_stats[self.metric]), st, self.epoch_number,
                                               "ema")
        self._best_candidate = line
        return self.checkpointer.keep_best(model, value, st, self.epoch_number)

    def evaluation_of(self, name: str) -> dict | None:
        """The evaluation (a metrics.jsonl line, unprefixed stats) of the weights written to `output_dir/name`
        ("best", "last", "last_ema"), for what a script writes beside them (model card, score thresholds); None when
        no evaluation of exactly those weights was run (last/ written after training on past the last
        evaluation)."""
        if name == "best":
            return self._best_candidate
        evaluation = self.last_ema_evaluation if name == "last_ema" else self.last_evaluation
        return evaluation if evaluation and evaluation["step"] == self.state.global_step else None

    def checkpoint_if_due(self, model) -> None:
        """The epoch-end checkpoint, every `--checkpoint_interval` epochs, at the end, and when a step
        checkpoint fell on the epoch's last step."""
        if (self.epoch + 1) % self.settings.checkpoint_interval == 0 or self.last_epoch or self._ckpt_due:
            self.save_checkpoint(model)
            self._ckpt_due = False

    def save_checkpoint(self, model) -> str:
        """Write a checkpoint of everything a resume needs (collective). Non-finite weights are never written;
        a failed save (disk full) stops the run with one line, keeping the older checkpoints."""
        return self.checkpointer.save_checkpoint(model, self.state, self._epoch_sums, self.optimizer)

    # ---- preemption
    def poll_preemption(self, model=None, batch_index: int | None = None) -> None:
        """Collective: every rank calls it at the same points (after each optimizer step; every few evaluation
        batches with `batch_index`). When any rank got a preemption signal, all write a checkpoint (training)
        and exit with EXIT_PREEMPTED."""
        if batch_index is not None and batch_index % EVAL_POLL_EVERY:
            return
        acc = self.accelerator
        name = self.signals.poll(acc)
        if name is None:
            return
        if self.evaluate_only or model is None:
            self.fail(f"stopped by {name} during evaluation", EXIT_PREEMPTED)
        if batch_index is not None:  # during an evaluation: redo it after the resume
            self.state.eval_pending = True
        t = time.time()
        path = self.save_checkpoint(model)
        where = f"in the evaluation after epoch {self.epoch_number}" if batch_index is not None else f"in epoch {self.epoch_number}"
        self.fail(f"preempted by {name} at step {self.state.global_step} ({where}): checkpoint {path} "
                  f"written in {time.time() - t:.1f} s; to continue, run the same command with --resume_from_checkpoint "
                  f"latest (exit code {EXIT_PREEMPTED}){self.stop_note}", EXIT_PREEMPTED)

    # ---- end
    def finish(self, model=None) -> None:
        """Write last/ (training), close the trackers and the lock, then print the end-of-run summary (after the
        trackers' own end-of-run lines, so the summary is the last thing the run prints)."""
        st = self.state
        lines = None
        if self.progress is not None:  # its last line before the summary, which ends with the verdict
            self.progress.close()
        if model is not None and not self.evaluate_only:
            self.checkpointer.save_weights(model, "last", st.global_step)
            if self.ema is not None:
                self.checkpointer.save_weights(self.ema.module, "last_ema", st.global_step)
            also = {k: self.last_stats[k] for k in self.also_report if k in (self.last_stats or {})}
            elapsed = time.time() - self.t_start
            best = self.checkpointer.best_record()
            final = self.last_stats[self.metric] if self.last_stats else None
            lines = summary_lines(self.output_dir, self.metrics.path, self.metric, elapsed, st.global_step,
                                  st.skipped_steps, st.best_metric, best, final, self.images_seen, also)
            if line := compile_summary():
                lines.insert(-1, line)  # before the verdict, which stays the last line
        if self.accelerator.is_main_process and not self.evaluate_only:
            self._write_status(0)
        self._close()
        if lines:
            logger.info("summary:\n  %s", "\n  ".join(lines))

    _status_written = False

    def _close_at_exit(self) -> None:
        """Interpreter exit: a run that ended by an exception of no line of ours (its traceback is above) still
        records how it ended, then closes."""
        if not self._closed and not self._status_written and self.accelerator.is_main_process:
            error = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught exception
            self._write_status(1, f"unhandled {type(error).__name__}: {error}" if error else "ended without finishing")
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # persistent workers would otherwise live on until interpreter exit
            stop_dataloader_workers(self.accelerator._dataloaders)
            if self.progress is not None:
                self.progress.close()
            finish_trackers(self.accelerator, self.output_dir)  # a tracker failing to close: one warning
            self.accelerator.end_training()
        finally:
            self.signals.restore()
            if self._locked:
                release_lock(self.output_dir)
