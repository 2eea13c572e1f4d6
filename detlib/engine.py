"""The run machinery both training scripts share: output folder, start-up checks, resume, the optimizer step's
bookkeeping and guards, checkpoints, preemption, end of run.

torchvision's detection references keep `engine.py` beside `train.py`; DETR does the same. Here the scripts
keep their forward pass, loss, backward and evaluation in plain sight and call a `Run` around them:

    args = parse_with_config(build_parser(), argv, RECORD_KEYS)   # detlib.flags: --config, then the flags
    run = Run(args)                                  # output folder, lock, accelerator, logging, signals
    ... data, model, optimizer, accelerator.prepare(...)
    scheduler = run.start_training(model, optimizer, train_loader, schedule)   # resume, trackers
    while run.next_epoch():
        for batch in run.batches(train_loader):
            with accelerator.accumulate(model):
                loss = ...
                accelerator.backward(loss * run.loss_weight)
                run.optimizer_step(model, optimizer, scheduler, {"loss": loss}, num_images)
        run.end_epoch(scheduler)
        if run.evaluation_due(): run.report_evaluation(evaluate(...), model, ...)
        run.checkpoint_if_due(model)
    run.finish(model)

What a `Run` guarantees:
* Non-finite guard (detlib.step_guard): a step with a non-finite loss or gradient norm is skipped on every rank
  together and leaves the weights as they were; `--max_nonfinite_steps` in a row stop the run (EXIT_DIVERGED)
  naming the step, the LR and the last checkpoint. No weights with a non-finite value are ever written. A loss
  that grows by orders of magnitude while staying finite is reported.
* Gradient accumulation: the last, partial window of an epoch is weighted by its real size (`loss_weight`),
  so its gradient is the mean over its batches like a full window's.
* Preemption (detlib.rundir): SIGTERM, SIGUSR1 and a first SIGINT only set a flag; all ranks agree through
  accelerate's `set_trigger` / `check_trigger` after each optimizer step and every few evaluation batches,
  write a step checkpoint and exit with EXIT_PREEMPTED. A second SIGINT stops at once.
* Resume (detlib.resume): from `latest` past damaged checkpoints, on another process count or batch size at the
  same position in samples seen, with another `--epochs` on from the current LR.
* Start-up checks (detlib.rundir): folder writable, disk space, one live run per folder, never mixing into a
  finished run; flag values are checked by argparse (detlib.flags).
* `--compile`: accelerate compiles the prepared model (detlib.runtime.make_accelerator); saved weights carry no
  `_orig_mod.` prefix, evaluation runs the uncompiled module (`evaluation_models`), the summary counts the graphs.
* `--model_ema DECAY`: timm's ModelEmaV3 of the weights, updated after every optimizer step that is not skipped,
  checkpointed beside the model (model_ema.safetensors) and resumed with it, evaluated beside the trained weights
  (`evaluation_models`, `report_evaluation(..., ema_stats=...)`: ema_* metrics, best/ from whichever scores
  higher), written to last_ema/ at the end.

Exit codes: 0 done, 1 error, 2 bad flag values, EXIT_DIVERGED (3), EXIT_PREEMPTED (75); `output_dir/run_status.json`
also records how the run ended, since launchers report exit codes each in their own way (detlib.rundir).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time

import torch

from . import checkpoint as ckpt
from .checkpointer import EMA_WEIGHTS, Checkpointer, summary_lines
from .collectives import broadcast_object, min_over_processes
from .flags import EVALUATE_ONLY_SUBDIR
from .resume import ResumeError, load_ema_weights, restore, run_length, set_tracker_offset
from .rundir import (EXIT_DIVERGED, EXIT_PREEMPTED, PreemptionSignals, Refusal, check_disk_space, prepare_output_dir,
                     release_lock, stop_dataloader_workers, write_run_status)
from .runtime import (MetricsLogger, TrackerError, compile_summary, finish_trackers, init_trackers, log_run_setup,
                      make_accelerator, save_config, setup_logging)
from .step_guard import StepGuard
from .weights import load_model_weights

logger = logging.getLogger("detlib.engine")

EVAL_POLL_EVERY = 10  # evaluation batches between preemption checks
FIRST_EPOCH = 1
"""Epoch numbering, one rule for everything a user reads: epochs count from FIRST_EPOCH = 1. Epoch N is the N-th
pass over the training data: its log lines say "epoch N", its train and evaluation lines in metrics.jsonl have
"epoch": N, its evaluation writes plots/epoch_NNNN/ and samples/epoch_NNNN/, best/best.json records N, and
checkpoints/epoch_NNNN/ is written after it (N epochs done; `TrainState.epoch` = N). Inside the loop `Run.epoch`
is the 0-based index of the running epoch (the sampler's and the augmentation's seed), so the number shown is
`Run.epoch_number` = `Run.epoch + FIRST_EPOCH`."""
# timm's EMA warm-up power: its docstring's choice for runs under a million steps (decay 0.999 at 10k steps).
EMA_WARMUP_POWER = 0.75


# ---------------------------------------------------------------------------------------------- the run
class Run:
    """One training (or evaluation-only) run of a script. See the module docstring for what it guarantees.

    Args:
        args: the script's parsed flags (the `add_run_arguments` ones are read; nothing is stored back except
            `output_dir`, which becomes `OUTPUT_DIR/evaluate_only` in evaluation-only mode).
        metric: the name of the validation metric that picks `best/` (higher is better), e.g. "AP".
    Raises:
        SystemExit: when a start-up check fails (one line on the main process, code 1).
    """

    def __init__(self, args, metric: str, also_report: tuple[str, ...] = ()):
        """`metric`: the stat that picks best/ and leads the summary; `also_report`: stats the summary's last line
        gives beside it (of the last evaluation)."""
        self.args = args
        self.metric = metric
        self.also_report = also_report
        self.evaluate_only = bool(args.evaluate_only)
        if self.evaluate_only:  # never write over a training run's config.yaml / metrics.jsonl
            args.output_dir = os.path.join(args.output_dir, EVALUATE_ONLY_SUBDIR)
        self.output_dir = args.output_dir
        self.accelerator = make_accelerator(args.mixed_precision, args.gradient_accumulation_steps, args.report_to,
                                            self.output_dir, seed=args.seed, verbose=args.verbose,
                                            # evaluation runs uncompiled (evaluation_models), --evaluate_only too
                                            compile_backend=args.compile_backend if args.compile and
                                            not self.evaluate_only else None,
                                            compile_mode=args.compile_mode)
        self.state = ckpt.TrainState()
        self.config: dict = {}
        self.checkpointer = Checkpointer(self.accelerator, self.output_dir, metric, args.checkpoint_total_limit,
                                         self.fail)
        self.signals = PreemptionSignals()
        self.progress = None  # the tqdm bar of the training steps, from start_training on
        self.last_stats: dict | None = None  # the last evaluation's stats (report_evaluation)
        self.last_evaluation: dict | None = None  # and its whole metrics.jsonl line (epoch, step, stats, extra)
        # appended to the line of a preempted (e.g. Ctrl-C) run: what its weights are worth at that point
        self.stop_note = ""
        self.ema = None  # timm's ModelEmaV3 of the trained weights (--model_ema), from start_training on
        self.last_ema_evaluation: dict | None = None  # the EMA weights' evaluation line (unprefixed), with --model_ema
        self._best_candidate: dict | None = None  # the evaluation line of the weights keep_best may write to best/
        self._locked = False
        self._closed = False
        self.t_start = time.time()

        error, notes = None, []
        if self.accelerator.is_main_process:
            error, notes, self._locked = prepare_output_dir(self.output_dir, self.evaluate_only,
                                                            args.resume_from_checkpoint, args.overwrite_output_dir)
        error = broadcast_object(self.accelerator, error)
        if error:
            self._close()
            if self.accelerator.is_main_process:  # a folder that holds or runs another run is a refusal, not a fault
                print(f"{'stopped' if isinstance(error, Refusal) else 'error'}: {error}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        setup_logging(self.output_dir, self.accelerator.is_main_process, verbose=args.verbose)
        atexit.register(self._close_at_exit)
        self.signals.install()
        log_run_setup(self.accelerator)
        if self.evaluate_only:  # training flags an evaluation cannot honour: said once, not silently dropped
            notes += [f"--{k} is not used: --evaluate_only {why}" for k, why in
                      (("compile", "runs the weights uncompiled, as every evaluation does"),
                       ("model_ema", "trains nothing to average; evaluate an EMA with --evaluate_only RUN/last_ema"))
                      if getattr(args, k, None)]
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
        raise SystemExit(code)

    def _write_status(self, code: int, message: str = "") -> None:
        self._status_written = True
        write_run_status(self.output_dir, code, message, global_step=self.state.global_step, epoch=self.state.epoch)

    def save_config(self, config: dict, model_config: dict, given: str = "") -> None:
        """Keep the resolved config (written to config.yaml, passed to the trackers) and the model's
        description (written beside every weights file so evaluation and predict rebuild the model). The log
        gets one line: `given` (the flags the user set, as a command line: `detlib.flags.format_given`), the
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
        error = None
        try:
            self.state.run_id = init_trackers(self.accelerator, self.args.project, self.config, self.output_dir,
                                              self.state.run_id, self.args.run_name, self.args.report_to)
        except TrackerError as e:  # main process only: the others learn it below
            error = str(e)
        error = broadcast_object(self.accelerator, error)
        if error:
            self.fail(error)

    # ---- training set-up
    def start_training(self, model, optimizer, train_loader, schedule: dict):
        """Checks and resume before the first step. Call after `accelerator.prepare`.

        Args:
            schedule: {"kind": "plateau" | "multistep" | "cosine" | "constant", "warmup_steps": int or None,
                "warmup_fraction": float (when warmup_steps is None), "warmup_start": float,
                "milestones_epochs": [int], "plateau_patience": int}.
        Returns the LR scheduler: ReduceLROnPlateau (stepped per epoch by `end_epoch`) or a per-step
        LambdaLR (stepped by `optimizer_step`), registered for checkpointing and positioned after a resume.
        """
        acc, args, st = self.accelerator, self.args, self.state
        self.batches_per_epoch = len(train_loader)
        if min_over_processes(acc, self.batches_per_epoch) == 0:
            self.fail(f"{len(train_loader.dataset)} training images on {acc.num_processes} process(es) with "
                      f"--per_device_batch_size {args.per_device_batch_size} give no full batch on some process (the "
                      "incomplete last batch is dropped), so no optimizer step: use a smaller batch size or fewer "
                      "processes")
        self.steps_per_epoch, self.samples_per_step, self.total_steps = run_length(
            self.batches_per_epoch, acc.num_processes, args.per_device_batch_size, args.gradient_accumulation_steps,
            args.epochs, args.max_steps)
        self.optimizer, self.model = optimizer, model
        try:
            scheduler, resumed = restore(acc, st, self.output_dir, args.resume_from_checkpoint, optimizer, schedule,
                                         self.steps_per_epoch, self.samples_per_step, self.total_steps, args.epochs,
                                         args.max_steps, self.checkpointer.model_config)
            if args.model_ema:
                self._start_ema(model, resumed)
        except ResumeError as e:
            self.fail(str(e))
        self.init_trackers()
        error = None
        if acc.is_main_process:
            set_tracker_offset(st, self.metrics.path, bool(args.resume_from_checkpoint))
            self.metrics.step_offset = st.tracker_offset
            error = check_disk_space(self.output_dir, model, optimizer, args.checkpoint_total_limit or args.epochs)
        error = broadcast_object(acc, error)  # every process stops: a lone main exit leaves the others waiting
        if error:
            self.fail(error)
        self._start_counters()
        return scheduler

    def _start_ema(self, model, resumed: str | None) -> None:
        """The EMA of `--model_ema` (timm's ModelEmaV3), a copy of the (resumed) weights on their device, with the
        resumed checkpoint's own EMA weights when it has them (detlib.resume.load_ema_weights)."""
        from timm.utils import ModelEmaV3

        args = self.args
        # every process keeps its own copy: the weights are the same on every rank, and so is the average
        self.ema = ModelEmaV3(self._bare(model), decay=args.model_ema, use_warmup=args.model_ema_warmup,
                              warmup_power=EMA_WARMUP_POWER)
        load_ema_weights(self.ema, resumed, EMA_WEIGHTS)
        self.checkpointer.ema = self.ema
        logger.info("--model_ema %g: an average of the weights is kept (warm-up %s), evaluated beside them as ema_%s",
                    args.model_ema, "1 - step ** -%.2f" % EMA_WARMUP_POWER if args.model_ema_warmup else "off",
                    self.metric)

    def _bare(self, model):
        """The module itself: without DDP's and torch.compile's wrappers (the same parameters)."""
        return self.accelerator.unwrap_model(model, keep_torch_compile=False)

    def _start_counters(self) -> None:
        """The epoch sums, the step guard, the progress bar; a warning when nothing is left to train."""
        acc, args, st = self.accelerator, self.args, self.state
        # epoch sums: restored (global) on the main rank only, so the reduce over ranks counts them once
        self._epoch_sums = torch.zeros(2, device=acc.device, dtype=torch.float64)
        if acc.is_main_process and st.step_in_epoch:
            self._epoch_sums += torch.tensor([st.epoch_loss_sum, st.epoch_images], device=acc.device, dtype=torch.float64)
        self.guard = StepGuard(acc, args.max_grad_norm, args.max_nonfinite_steps)
        self._ckpt_due = False
        self.epoch = st.epoch
        self.images_seen = 0
        from tqdm.auto import tqdm

        self.progress = tqdm(total=self.total_steps, initial=st.global_step, desc="train",
                             disable=not acc.is_local_main_process)
        if not st.eval_pending and (st.epoch >= args.epochs or st.global_step >= self.total_steps):
            logger.warning("nothing left to train: the run has done %d of %d epochs, step %d of %d; pass a larger "
                           "--epochs to train on", st.epoch, args.epochs, st.global_step, self.total_steps)

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
        if st.epoch >= self.args.epochs or st.global_step >= self.total_steps:
            return False
        self.epoch = st.epoch
        return True

    def batches(self, loader):
        """The training batches of the current epoch: its seeded shuffle on every rank (disjoint shards, a new
        order each epoch), minus those done before a mid-epoch resume. Sets `loss_weight` for each batch
        (see the module docstring) and stops at `--max_steps`."""
        st, G = self.state, self.args.gradient_accumulation_steps
        if st.eval_pending:
            return
        loader.set_epoch(self.epoch)
        start = st.step_in_epoch * G
        it = iter(self.accelerator.skip_first_batches(loader, start) if start else loader)
        self.guard.start_clock()
        i = start
        while st.global_step < self.total_steps:
            t = time.time()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.guard.add_data_time(time.time() - t)
            window_start = (i // G) * G
            self.loss_weight = G / min(G, self.batches_per_epoch - window_start)
            if i == window_start:
                self.guard.snapshot_buffers(self.model)
            i += 1
            yield batch

    loss_weight = 1.0

    def optimizer_step(self, model, optimizer, scheduler, values: dict[str, torch.Tensor], num_images: int) -> None:
        """Bookkeeping of one micro-batch, and on the last micro-batch of a window the optimizer step.

        Call inside `accelerator.accumulate(model)`, after `accelerator.backward`. `values` are this
        micro-batch's scalar losses (0-d tensors; "loss" is the one trained on, unweighted); they are logged
        as means over images.
        """
        acc, args, st = self.accelerator, self.args, self.state
        self.guard.add(values, num_images)
        self._epoch_sums += torch.stack([values["loss"].detach().double() * num_images,
                                         torch.tensor(float(num_images), device=acc.device, dtype=torch.float64)])
        if not acc.sync_gradients:
            return
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
        skipped, sums = self.guard.step(model, optimizer, values["loss"])
        st.global_step += 1
        st.step_in_epoch += 1
        self.progress.update(1)
        if skipped:
            st.skipped_steps += 1
        elif self.ema is not None:  # a skipped step left the weights as they were: nothing to average in
            self.ema.update(self._bare(model), step=st.global_step)
        diverged = self.guard.record(st.global_step, lr, *sums)
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
        if st.global_step % args.log_interval == 0 or st.global_step == self.total_steps or diverged:
            self._log_window(lr)
        if diverged:
            last = ckpt.list_checkpoints(self.output_dir) if acc.is_main_process else []
            self.fail(f"training diverged: {self.guard.streak} non-finite steps in a row up to step {st.global_step} "
                      f"(epoch {self.epoch_number}, lr {lr:.3g}); nothing non-finite was saved; the last good checkpoint is "
                      f"{last[-1] if last else 'none (no checkpoint written yet)'}: resume from it with a lower --lr "
                      "or --max_grad_norm", EXIT_DIVERGED)
        if args.checkpoint_steps and st.global_step % args.checkpoint_steps == 0:
            if st.step_in_epoch < self.steps_per_epoch and st.global_step < self.total_steps:
                self.save_checkpoint(model)
            else:  # the epoch (or the run) ends with this step: its own checkpoint follows
                self._ckpt_due = True
        self.poll_preemption(model)

    def _log_window(self, lr: float) -> None:
        """One train line: means over the images since the last line, over all processes."""
        st = self.state
        window = self.guard.window_line({"epoch": self.epoch_number, "step": st.global_step}, lr, st.skipped_steps,
                                        self.optimizer.param_groups)
        if window is None:
            return
        line, images = window
        self.progress.set_postfix(loss=f"{line['loss']:.4f}", lr=f"{lr:.2e}")
        self.metrics.log(line, step=st.global_step, tracker_epoch=self.epoch + st.step_in_epoch / self.steps_per_epoch)
        self.images_seen += images
        self.guard.reset_window()

    def end_epoch(self, scheduler) -> float | None:
        """Close the epoch: flush its last train line, step ReduceLROnPlateau on the epoch's mean loss (the
        same value on every rank), log the epoch line. Returns the mean loss (None for a redone evaluation)."""
        acc, st = self.accelerator, self.state
        if st.eval_pending:
            return None
        self._log_window(self.optimizer.param_groups[0]["lr"])
        sums = acc.reduce(self._epoch_sums, reduction="sum").tolist()
        mean_loss = sums[0] / max(sums[1], 1.0)
        finished = st.step_in_epoch >= self.steps_per_epoch or st.global_step < self.total_steps
        if finished:
            st.epoch, st.step_in_epoch = self.epoch + 1, 0
            self._epoch_sums.zero_()
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(mean_loss)
        logger.info("epoch %d: mean loss %.4f, lr %.3g, %d skipped steps so far", self.epoch_number, mean_loss,
                    self.optimizer.param_groups[0]["lr"], st.skipped_steps)
        return mean_loss

    @property
    def last_epoch(self) -> bool:
        st = self.state
        return st.epoch >= self.args.epochs or st.global_step >= self.total_steps

    def evaluation_due(self) -> bool:
        return self.state.eval_pending or (self.epoch + 1) % self.args.eval_interval == 0 or self.last_epoch

    def evaluation_models(self, model) -> dict[str, torch.nn.Module]:
        """What an evaluation scores, by the prefix of its metrics: {"": the model being trained} and, with
        --model_ema, {"ema_": the EMA weights}. Under --compile the trained model is evaluated uncompiled: compiling
        covers the training step; evaluation's no-grad mode and batch sizes would compile graphs of their own (and
        count towards dynamo's recompile limit) for a few percent of a run's time."""
        models = {"": self._bare(model) if self.args.compile else model}
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
        if (self.epoch + 1) % self.args.checkpoint_interval == 0 or self.last_epoch or self._ckpt_due:
            self.save_checkpoint(model)
            self._ckpt_due = False

    def save_checkpoint(self, model) -> str:
        """Write a checkpoint of everything a resume needs (collective). Non-finite weights are never written;
        a failed save (disk full) stops the run with one line, keeping the older checkpoints."""
        optimizer = getattr(self, "optimizer", None)  # sizes the checkpoint for the message of a failed save
        return self.checkpointer.save_checkpoint(model, self.state, self._epoch_sums, optimizer)

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
            elapsed = time.time() - self.t_start
            best = self.checkpointer.best_record()
            final = self.last_stats[self.metric] if self.last_stats else None
            also = {k: self.last_stats[k] for k in self.also_report if k in (self.last_stats or {})}
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
