"""The run machinery both training scripts share: output folder, start-up checks, resume, the optimizer step's
bookkeeping and guards, checkpoints, preemption, end of run.

torchvision's detection references keep `engine.py` beside `train.py`; DETR does the same. Here the scripts
keep their forward pass, loss, backward and evaluation in plain sight and call a `Run` around them:

    args = run_argument_parser(__doc__, ...).parse_args()   # detlib.flags: the flags read here
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
* Non-finite guard: every optimizer step checks the loss of each micro-batch and the (pre-clip) gradient
  norm on the device; the decision is summed over processes, so all ranks skip or step together. A skipped
  step does not touch the weights; `--max_nonfinite_steps` in a row stop the run (exit code EXIT_DIVERGED)
  naming the step, the LR and the last checkpoint. Under fp16 the GradScaler's own skips are counted too.
  No weights with a non-finite value are ever written.
* A loss that grows by orders of magnitude while staying finite is reported (step and LR).
* Gradient accumulation: the last, partial window of an epoch is weighted by its real size (`loss_weight`),
  so its gradient is the mean over its batches like a full window's.
* Preemption: SIGTERM, SIGUSR1 and a first SIGINT only set a flag; all ranks agree through accelerate's
  `set_trigger` / `check_trigger` after each optimizer step and every few evaluation batches, write a step
  checkpoint and exit with EXIT_PREEMPTED. A second SIGINT stops at once. Under a launcher the processes get
  SIGTERM when the launcher dies (Linux parent-death signal), so none outlives it.
* Resume: `latest` skips damaged checkpoints; a checkpoint of another process count or batch size continues
  at the same position in samples seen; another `--epochs` continues a cosine schedule from its current LR.
* Start-up checks: folder writable, disk space, one live run per folder, never mixing into a finished run
  (detlib.rundir); flag values are checked by argparse (detlib.flags).

Exit codes of the training process: 0 done; 1 error (bad data, damaged checkpoint, disk full); 2 bad flag
values (argparse); EXIT_DIVERGED (3) non-finite steps in a row; EXIT_PREEMPTED (75, sysexits' "temporary
failure, retry") preempted, checkpoint written, resume with `--resume_from_checkpoint latest`. The launcher
reports them in its own way (accelerate's 1-process launcher: "returned non-zero exit status 75"; torchrun:
exit 1 with the worker's code in its summary), so `output_dir/run_status.json` also records how the run ended.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time

import torch

from . import checkpoint as ckpt
from .rundir import (EXIT_DIVERGED, EXIT_PREEMPTED, PREEMPT_SIGNALS, launched, prepare_output_dir, release_lock,
                     set_parent_death_signal, write_run_status)
from .runtime import MetricsLogger, init_trackers, log_run_setup, make_accelerator, save_config, setup_logging
from .schedules import SCHEDULES, build_lr_scheduler, lr_factor, set_position

logger = logging.getLogger("detlib.engine")

EXPLOSION_FACTOR = 100.0  # a finite loss this many times its lowest running level is reported
EVAL_POLL_EVERY = 10  # evaluation batches between preemption checks


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

    def __init__(self, args, metric: str):
        self.args = args
        self.metric = metric
        self.evaluate_only = bool(args.evaluate_only)
        if self.evaluate_only:  # never write over a training run's config.yaml / metrics.jsonl
            args.output_dir = os.path.join(args.output_dir, "evaluate_only")
        self.output_dir = args.output_dir
        self.accelerator = make_accelerator(args.mixed_precision, args.gradient_accumulation_steps, args.report_to,
                                            self.output_dir, seed=args.seed)
        self.state = ckpt.TrainState()
        self.model_config: dict | None = None
        self.config: dict = {}
        self._locked = False
        self._closed = False
        self._signal: int | None = None
        self._pid = os.getpid()
        self._first_sigint: float | None = None
        self._old_handlers: dict = {}
        self.t_start = time.time()

        error, notes = None, []
        if self.accelerator.is_main_process:
            error, notes, self._locked = prepare_output_dir(self.output_dir, self.evaluate_only,
                                                            args.resume_from_checkpoint, args.overwrite_output_dir)
        error = self._broadcast(error)
        if error:
            if self.accelerator.is_main_process:
                print(f"error: {error}", file=sys.stderr, flush=True)
            self._close()
            raise SystemExit(1)
        setup_logging(self.output_dir, self.accelerator.is_main_process)
        atexit.register(self._close)
        self._install_signal_handlers()
        log_run_setup(self.accelerator)
        for note in notes:
            logger.warning("%s", note)
        self.metrics = MetricsLogger(self.accelerator, self.output_dir)

    # ---- start-up
    def _broadcast(self, obj):
        from accelerate.utils import broadcast_object_list

        if self.accelerator.num_processes == 1:
            return obj
        box = [obj]
        broadcast_object_list(box)
        return box[0]

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in PREEMPT_SIGNALS:
            sig = getattr(signal, name)
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        if launched():
            set_parent_death_signal()

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # a forked child (a multiprocessing pool worker) inherited this handler: it must still die from
            # SIGTERM, or the pool's terminate() waits for it forever
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        # Only set a flag: the training loop acts on it at the next step, on every rank together.
        if signum == signal.SIGINT:
            # a Ctrl-C may reach a process twice at once (from the terminal's process group and forwarded by a
            # launcher): only a SIGINT a second or more after the first is the user's second Ctrl-C
            now = time.monotonic()
            if self._first_sigint is not None and now - self._first_sigint > 1.0:
                raise KeyboardInterrupt("second SIGINT: stopping at once, without a checkpoint")
            self._first_sigint = self._first_sigint or now
        if self._signal is None:
            self._signal = signum

    def fail(self, message: str, code: int = 1):
        """One error line on the main process (all ranks call it together): printed to stderr and written to
        train.log; then exit with `code`."""
        if self.accelerator.is_main_process:
            logger.error("%s", message, extra={"console": False})
            print(f"error: {message}", file=sys.stderr, flush=True)
            self._write_status(code, message)
        # close the trackers now: at interpreter exit wandb's own hook would shut its service down first
        self._close()
        raise SystemExit(code)

    def _write_status(self, code: int, message: str = "") -> None:
        write_run_status(self.output_dir, code, message, global_step=self.state.global_step, epoch=self.state.epoch)

    def save_config(self, config: dict, model_config: dict) -> None:
        """Keep the resolved config (written to config.yaml, passed to the trackers) and the model's
        description (written beside every weights file so evaluation and predict rebuild the model)."""
        self.config, self.model_config = config, model_config
        if self.accelerator.is_main_process:
            save_config(config, self.output_dir)
            logger.info("config: %s", json.dumps(config, default=str))

    def load_weights(self, model: torch.nn.Module, path: str) -> str:
        """Load `--evaluate_only` weights into the bare model; any failure is one line and exit 1."""
        try:
            f = ckpt.load_model_weights(model, path)
        except (FileNotFoundError, RuntimeError, ValueError) as e:
            self.fail(str(e))
        logger.info("loaded weights from %s", f)
        return f

    def init_trackers(self) -> None:
        self.state.run_id = init_trackers(self.accelerator, self.args.project, self.config, self.output_dir,
                                          self.state.run_id, self.args.run_name)

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
        G = args.gradient_accumulation_steps
        self.batches_per_epoch = len(train_loader)
        if self._min_over_ranks(self.batches_per_epoch) == 0:
            n = len(train_loader.dataset)
            self.fail(f"{n} training images on {acc.num_processes} process(es) with --per_device_batch_size "
                      f"{args.per_device_batch_size} give no full batch on some process (the incomplete last batch is "
                      "dropped), so no optimizer step: use a smaller batch size or fewer processes")
        # accumulate() also steps at the end of the loader, so a partial last window is one more step.
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / G)
        self.samples_per_step = acc.num_processes * args.per_device_batch_size * G
        self.total_steps = args.max_steps or args.epochs * self.steps_per_epoch
        self.optimizer, self.model = optimizer, model

        resume = None
        if args.resume_from_checkpoint:
            error = None
            if acc.is_main_process:
                try:
                    resume = ckpt.resolve_resume(self.output_dir, args.resume_from_checkpoint)
                except ckpt.CheckpointError as e:
                    error = f"--resume_from_checkpoint: {e}"
            error, resume = self._broadcast((error, resume))
            if error:
                self.fail(error)
        saved = ckpt.read_train_state(resume) if resume else None
        if saved:
            st.load_state_dict(saved.state_dict())
            st.eval_pending = bool(saved.eval_pending)
        moved = self._convert_position(saved) if saved else False
        scheduler = self._build_scheduler(optimizer, schedule, saved)
        acc.register_for_checkpointing(scheduler)
        if resume:
            try:
                acc.load_state(resume)
            except (RuntimeError, KeyError, ValueError) as e:  # a checkpoint of another model or optimizer
                first = str(e).strip().splitlines()
                self.fail(f"cannot resume from {resume}: it does not fit this run (another --backbone, width, class list "
                          f"or optimizer?): {first[0][:200] if first else type(e).__name__}"
                          + (f"; {first[1].strip()[:200]}" if len(first) > 1 else ""))
            if moved and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                set_position(scheduler, st.global_step)
            logger.info("resumed from %s: epoch %d, step %d in epoch, global step %d, lr %.3g", resume, st.epoch,
                        st.step_in_epoch, st.global_step, optimizer.param_groups[0]["lr"])
        st.num_processes, st.steps_per_epoch, st.samples_per_step = acc.num_processes, self.steps_per_epoch, self.samples_per_step
        self.init_trackers()
        self._set_tracker_offset()
        self._check_disk(model, optimizer)

        # epoch sums: restored (global) on the main rank only, so the reduce over ranks counts them once
        self._epoch_sums = torch.zeros(2, device=acc.device, dtype=torch.float64)
        if acc.is_main_process and st.step_in_epoch:
            self._epoch_sums += torch.tensor([st.epoch_loss_sum, st.epoch_images], device=acc.device, dtype=torch.float64)
        self._streak = 0
        self._ema_low = None
        self._warned_loss = 0.0
        self._window_bad = torch.zeros((), device=acc.device)
        self._window = None  # per-window sums of the logged values, times images
        self._window_images = 0
        self._window_steps = 0
        self._data_time = 0.0
        self._t_window = time.time()
        self._ckpt_due = False
        self.epoch = st.epoch
        self.images_seen = 0
        from tqdm.auto import tqdm

        self.progress = tqdm(total=self.total_steps, initial=st.global_step, desc="train",
                             disable=not acc.is_local_main_process)
        if not st.eval_pending and (st.epoch >= args.epochs or st.global_step >= self.total_steps):
            logger.warning("nothing left to train: the run is at epoch %d of %d, step %d of %d; pass a larger --epochs "
                           "to train on", st.epoch, args.epochs, st.global_step, self.total_steps)
        return scheduler

    def _min_over_ranks(self, value: int) -> int:
        acc = self.accelerator
        if acc.num_processes == 1:
            return int(value)
        return int(acc.gather(torch.tensor([float(value)], device=acc.device)).min())

    def _convert_position(self, saved: ckpt.TrainState) -> bool:
        """A checkpoint counted in another geometry (processes x batch x accumulation): move the counters to
        the same position in samples seen, in this run's steps. Returns True when they moved."""
        st = self.state
        old_spe = saved.steps_per_epoch
        if not old_spe or (saved.num_processes == self.accelerator.num_processes
                           and saved.samples_per_step == self.samples_per_step and old_spe == self.steps_per_epoch):
            return False
        in_epoch = min(self.steps_per_epoch - 1, round(saved.step_in_epoch * self.steps_per_epoch / old_spe))
        st.step_in_epoch = in_epoch if saved.step_in_epoch else 0
        st.global_step = saved.epoch * self.steps_per_epoch + st.step_in_epoch
        logger.warning(
            "the checkpoint was written by %s process(es) at %s samples per step (%d steps per epoch); this run has %d "
            "at %d (%d steps per epoch): epoch %d step %d -> step %d, global step %d -> %d, so the LR schedule keeps its "
            "position in samples seen.%s", saved.num_processes, saved.samples_per_step, old_spe,
            self.accelerator.num_processes, self.samples_per_step, self.steps_per_epoch, saved.epoch,
            saved.step_in_epoch, st.step_in_epoch, saved.global_step, st.global_step,
            " The rest of this epoch is read in the new process count's order (some of its images may be seen twice "
            "or not at all); later epochs are exact." if saved.step_in_epoch else "")
        return True

    def _build_scheduler(self, optimizer, schedule: dict, saved: ckpt.TrainState | None):
        args, st = self.args, self.state
        kind = schedule["kind"]
        if kind == "plateau":
            st.schedule = {"kind": kind}
            return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.1,
                                                              patience=schedule.get("plateau_patience", 3))
        if kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {kind!r}")
        old = saved.schedule if saved else {}
        warmup = schedule.get("warmup_steps")
        if warmup is None:  # resolved once, at the start of the run
            warmup = old.get("warmup_steps", int(round(schedule.get("warmup_fraction", 0.0) * self.total_steps)))
        spec = {"kind": kind, "total_steps": self.total_steps, "warmup_steps": int(warmup),
                "warmup_start": schedule.get("warmup_start", 0.001),
                "milestones": [e * self.steps_per_epoch for e in schedule.get("milestones_epochs", [])],
                "anchor": old.get("anchor"), "epochs": args.epochs}
        if old and kind == "cosine" and old.get("kind") == kind and old.get("epochs") != args.epochs \
                and not args.max_steps:
            # Another run length: go on down from the LR the run has, to 0 at the new end (no jump back up).
            factor = lr_factor(saved.global_step, kind, old["total_steps"], old["warmup_steps"],
                               old.get("warmup_start", 0.001), old.get("milestones", []),
                               anchor=tuple(old["anchor"]) if old.get("anchor") else None)
            spec["anchor"] = [st.global_step, factor]
            logger.warning("resumed with --epochs %d (the checkpoint's run had %s): the cosine schedule goes on from %.3g x "
                           "the base LR at step %d down to 0 at step %d, without a restart%s", args.epochs,
                           old.get("epochs"), factor, st.global_step, self.total_steps,
                           "; it had already reached 0, so the added epochs train at LR 0" if factor == 0 else "")
        st.schedule = spec
        return build_lr_scheduler(optimizer, kind, self.total_steps, spec["warmup_steps"], spec["warmup_start"],
                                  spec["milestones"], anchor=spec["anchor"])

    def _set_tracker_offset(self) -> None:
        """Trackers (wandb) drop a step lower than one already logged: after a resume from an older
        checkpoint, tracker steps continue after the last logged one; metrics.jsonl keeps the true step."""
        if not self.accelerator.is_main_process:
            return
        last = -1
        try:
            with open(self.metrics.path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                        last = max(last, int(row.get("tracker_step", row.get("step") or 0)))
                    except (ValueError, TypeError):
                        continue
        except OSError:
            pass
        st = self.state
        if st.global_step + 1 + st.tracker_offset <= last and self.args.resume_from_checkpoint:
            st.tracker_offset = last - st.global_step  # the next step, global_step + 1, is logged at last + 1
            logger.warning("resumed at step %d but the trackers already hold steps up to %d: tracker steps go on at %d "
                           "(step + %d); metrics.jsonl keeps the true step, and its lines after step %d are from the "
                           "abandoned part of the run", st.global_step, last, last + 1, st.tracker_offset, st.global_step)
        self.metrics.step_offset = st.tracker_offset

    def _check_disk(self, model, optimizer) -> None:
        if not self.accelerator.is_main_process:
            return
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        opt_state = 2 if isinstance(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer, torch.optim.Adam | torch.optim.AdamW) else 1
        per_ckpt = weights * (1 + opt_state)
        limit = self.args.checkpoint_total_limit or self.args.epochs
        needed = per_ckpt * (limit + 1) + 2 * weights  # + the one being written, best/ and last/
        free = shutil.disk_usage(self.output_dir).free
        line = (f"start-up checks: {self.output_dir} writable and locked; {free / 2**30:.1f} GiB free, "
                f"{needed / 2**30:.2f} GiB needed for {limit} checkpoints of ~{per_ckpt / 2**20:.0f} MiB + best/ + last/")
        if free < per_ckpt + 2 * weights:
            self.fail(f"not enough disk space in {self.output_dir}: {free / 2**20:.0f} MiB free, one checkpoint needs "
                      f"~{per_ckpt / 2**20:.0f} MiB")
        if free < needed:
            logger.warning("%s: less than needed, lower --checkpoint_total_limit or free space", line)
        else:
            logger.info("%s", line)

    # ---- the epoch loop
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
        self._t_window = time.time()
        i = start
        while st.global_step < self.total_steps:
            t = time.time()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._data_time += time.time() - t
            window_start = (i // G) * G
            self.loss_weight = G / min(G, self.batches_per_epoch - window_start)
            if i == window_start:
                self._snapshot_buffers()
            i += 1
            yield batch

    loss_weight = 1.0

    def _snapshot_buffers(self) -> None:
        # BatchNorm running statistics change in the forward pass itself: a non-finite forward would poison
        # them even though its optimizer step is skipped, so they are kept from before each window.
        self._buffers = [(b, b.detach().clone()) for b in self.model.buffers() if b.is_floating_point()]

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for b, saved in getattr(self, "_buffers", []):
                b.copy_(saved)

    def optimizer_step(self, model, optimizer, scheduler, values: dict[str, torch.Tensor], num_images: int) -> None:
        """Bookkeeping of one micro-batch, and on the last micro-batch of a window the optimizer step.

        Call inside `accelerator.accumulate(model)`, after `accelerator.backward`. `values` are this
        micro-batch's scalar losses (0-d tensors; "loss" is the one trained on, unweighted); they are logged
        as means over images.
        """
        acc, args, st = self.accelerator, self.args, self.state
        stacked = torch.stack([v.detach().float() for v in values.values()])
        if self._window is None or self._window.numel() != stacked.numel():
            self._window_keys = list(values)
            self._window = torch.zeros_like(stacked)
        self._window += stacked * num_images
        self._window_images += num_images
        self._window_bad = self._window_bad + (~torch.isfinite(values["loss"].detach())).float()
        self._epoch_sums += torch.stack([values["loss"].detach().double() * num_images,
                                         torch.tensor(float(num_images), device=acc.device, dtype=torch.float64)])
        if not acc.sync_gradients:
            return
        max_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else math.inf
        # the pre-clip norm, after the fp16 unscale; the same on every rank (gradients are already all-reduced)
        grad_norm = acc.clip_grad_norm_(model.parameters(), max_norm)
        grad_norm = torch.as_tensor(grad_norm, device=acc.device).float()
        flags = torch.stack([self._window_bad, (~torch.isfinite(grad_norm)).float(),
                             torch.nan_to_num(values["loss"].detach().float(), nan=0.0, posinf=0.0, neginf=0.0),
                             torch.nan_to_num(grad_norm, nan=0.0, posinf=0.0, neginf=0.0)])
        bad_loss, bad_grad, loss_sum, norm_sum = acc.reduce(flags, reduction="sum").tolist()
        self._window_bad = torch.zeros((), device=acc.device)
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
        if acc.scaler is not None:  # the GradScaler skips a step with non-finite gradients itself
            optimizer.step()
            skipped = acc.optimizer_step_was_skipped
        else:
            skipped = bool(bad_loss or bad_grad)
            if not skipped:
                optimizer.step()
        if bad_loss or bad_grad:
            self._restore_buffers()
        optimizer.zero_grad(set_to_none=True)
        st.global_step += 1
        st.step_in_epoch += 1
        self.progress.update(1)
        nonfinite = bad_loss > 0 or (bad_grad > 0 and acc.scaler is None)
        if skipped:
            st.skipped_steps += 1
        self._streak = self._streak + 1 if nonfinite else 0
        self.last_grad_norm = norm_sum / acc.num_processes if not bad_grad else math.nan
        if not bad_loss:
            self._watch_explosion(loss_sum / acc.num_processes, lr)
        if nonfinite:
            logger.warning("step %d: non-finite %s (lr %.3g); the step is skipped on every process (%d in a row)",
                           st.global_step, "loss" if bad_loss else "gradient norm", lr, self._streak)
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
        self._window_steps += 1
        diverged = self._streak >= args.max_nonfinite_steps
        if st.global_step % args.log_interval == 0 or st.global_step == self.total_steps or diverged:
            self._log_window(lr)
        if diverged:
            last = ckpt.list_checkpoints(self.output_dir) if acc.is_main_process else []
            self.fail(f"training diverged: {self._streak} non-finite steps in a row up to step {st.global_step} "
                      f"(epoch {self.epoch}, lr {lr:.3g}); nothing non-finite was saved; the last good checkpoint is "
                      f"{last[-1] if last else 'none (no checkpoint written yet)'}: resume from it with a lower --lr "
                      "or --max_grad_norm", EXIT_DIVERGED)
        if args.checkpoint_steps and st.global_step % args.checkpoint_steps == 0:
            if st.step_in_epoch < self.steps_per_epoch and st.global_step < self.total_steps:
                self.save_checkpoint(model)
            else:  # the epoch (or the run) ends with this step: its own checkpoint follows
                self._ckpt_due = True
        self.poll_preemption(model)

    def _watch_explosion(self, loss: float, lr: float) -> None:
        if not math.isfinite(loss):
            return
        if self._ema_low is not None and loss > EXPLOSION_FACTOR * max(self._ema_low, 1e-8) \
                and loss > 10 * self._warned_loss:
            logger.warning("step %d: loss %.4g is over %dx its lowest running level %.4g (lr %.3g): the run may be "
                           "diverging; consider a lower --lr or --max_grad_norm", self.state.global_step, loss,
                           int(EXPLOSION_FACTOR), self._ema_low, lr)
            self._warned_loss = loss
        self._ema = loss if getattr(self, "_ema", None) is None else 0.9 * self._ema + 0.1 * loss
        self._ema_low = self._ema if self._ema_low is None else min(self._ema_low, self._ema)

    def _log_window(self, lr: float) -> None:
        """One train line: means over the images since the last line, over all processes."""
        acc, st = self.accelerator, self.state
        if self._window is None or self._window_steps == 0:
            return
        totals = acc.reduce(torch.cat([self._window, torch.tensor([float(self._window_images)], device=acc.device)]),
                            reduction="sum").tolist()
        images = totals[-1]
        elapsed = max(1e-9, time.time() - self._t_window)
        line = {"epoch": self.epoch, "step": st.global_step}
        line.update({k: v / max(images, 1) for k, v in zip(self._window_keys, totals[:-1])})
        line.update(lr=lr, grad_norm=self.last_grad_norm, images_per_s=images / elapsed,
                    data_time_fraction=min(1.0, self._data_time / elapsed), skipped_steps=st.skipped_steps)
        for i, g in enumerate(self.optimizer.param_groups[1:], 1):
            line[f"lr_{i}"] = g["lr"]
        if acc.scaler is not None:
            line["loss_scale"] = float(acc.scaler.get_scale())
        if torch.cuda.is_available():
            line["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self.progress.set_postfix(loss=f"{line['loss']:.4f}", lr=f"{lr:.2e}")
        self.metrics.log(line, step=st.global_step, tracker_epoch=self.epoch + st.step_in_epoch / self.steps_per_epoch)
        self.images_seen += images
        self._window.zero_()
        self._window_images = self._window_steps = 0
        self._data_time = 0.0
        self._t_window = time.time()

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
        logger.info("epoch %d: mean loss %.4f, lr %.3g, %d skipped steps so far", self.epoch, mean_loss,
                    self.optimizer.param_groups[0]["lr"], st.skipped_steps)
        return mean_loss

    @property
    def last_epoch(self) -> bool:
        st = self.state
        return st.epoch >= self.args.epochs or st.global_step >= self.total_steps

    def evaluation_due(self) -> bool:
        return self.state.eval_pending or (self.epoch + 1) % self.args.eval_interval == 0 or self.last_epoch

    def report_evaluation(self, stats: dict, model, extra: dict | None = None) -> bool:
        """Log an evaluation line and keep `best/` when `stats[metric]` beats every earlier one of this run,
        the best/ on disk included (so a resume from an older checkpoint never replaces it with a worse
        model). Returns True when best/ was written."""
        st, value = self.state, float(stats[self.metric])
        self.metrics.log({"epoch": self.epoch, "step": st.global_step, **stats, **(extra or {})}, step=st.global_step,
                         tracker_epoch=self.epoch + 1)
        self.last_stats = stats
        st.eval_pending = False
        on_disk = self._broadcast(self._best_on_disk() if self.accelerator.is_main_process else None)
        improved = math.isfinite(value) and value > st.best_metric and (on_disk is None or value > on_disk)
        if math.isfinite(value):
            st.best_metric = max(st.best_metric, value)
        if improved:
            self._save_weights(model, "best", {"metric": self.metric, "value": value, "epoch": self.epoch,
                                                "step": st.global_step})
            logger.info("new best %s %.4f, saved %s/best/model.safetensors", self.metric, value, self.output_dir)
        return improved

    def _best_record(self) -> dict | None:
        """best/best.json of this folder when it scores this run's metric: {metric, value, epoch, step}."""
        try:
            with open(os.path.join(self.output_dir, "best", "best.json")) as f:
                best = json.load(f)
            float(best["value"])
            return best if best.get("metric") == self.metric else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _best_on_disk(self) -> float | None:
        best = self._best_record()
        return float(best["value"]) if best else None

    def checkpoint_if_due(self, model) -> None:
        """The epoch-end checkpoint, every `--checkpoint_interval` epochs, at the end, and when a step
        checkpoint fell on the epoch's last step."""
        if (self.epoch + 1) % self.args.checkpoint_interval == 0 or self.last_epoch or self._ckpt_due:
            self.save_checkpoint(model)
            self._ckpt_due = False

    def _check_finite(self, model, what: str) -> None:
        ok = ckpt.all_finite(self.accelerator.unwrap_model(model))
        ok = self._min_over_ranks(int(ok))
        if not ok:
            self.fail(f"the model holds non-finite weights at step {self.state.global_step}: not writing {what}; "
                      f"the last good checkpoint is kept", EXIT_DIVERGED)

    def save_checkpoint(self, model) -> str:
        """Write a checkpoint of everything a resume needs (collective). Non-finite weights are never written;
        a failed save (disk full) stops the run with one line, keeping the older checkpoints."""
        st = self.state
        self._check_finite(model, "a checkpoint")
        sums = self.accelerator.reduce(self._epoch_sums, reduction="sum").tolist()
        st.epoch_loss_sum, st.epoch_images = sums
        t = time.time()
        try:
            path = ckpt.save_checkpoint(self.accelerator, self.output_dir, st, self.args.checkpoint_total_limit,
                                        self.model_config)
        except ckpt.CheckpointError as e:
            self.fail(str(e))
        logger.info("saved checkpoint %s (%.1f s)", path, time.time() - t)
        return path

    def _save_weights(self, model, name: str, extra: dict | None = None) -> None:
        self._check_finite(model, f"{name}/")
        ckpt.save_model_weights(self.accelerator, model, os.path.join(self.output_dir, name), self.model_config, extra)

    # ---- preemption
    def poll_preemption(self, model=None, batch_index: int | None = None) -> None:
        """Collective: every rank calls it at the same points (after each optimizer step; every few evaluation
        batches with `batch_index`). When any rank got a preemption signal, all write a checkpoint (training)
        and exit with EXIT_PREEMPTED."""
        if batch_index is not None and batch_index % EVAL_POLL_EVERY:
            return
        acc = self.accelerator
        if self._signal is not None:
            acc.set_trigger()
        if not acc.check_trigger():
            return
        name = signal.Signals(self._signal).name if self._signal else "a signal to another process"
        if self.evaluate_only or model is None:
            self.fail(f"stopped by {name} during evaluation", EXIT_PREEMPTED)
        if batch_index is not None:  # during an evaluation: redo it after the resume
            self.state.eval_pending = True
        t = time.time()
        path = self.save_checkpoint(model)
        where = f"in the evaluation after epoch {self.epoch}" if batch_index is not None else f"in epoch {self.epoch}"
        self.fail(f"preempted by {name} at step {self.state.global_step} ({where}): checkpoint {path} "
                  f"written in {time.time() - t:.1f} s; continue with --resume_from_checkpoint latest", EXIT_PREEMPTED)

    # ---- end
    def finish(self, model=None) -> None:
        """Write last/ (training), print the end-of-run summary, close the trackers and the lock."""
        st = self.state
        if model is not None and not self.evaluate_only:
            self._save_weights(model, "last")
            stats = getattr(self, "last_stats", None)
            elapsed = time.time() - self.t_start
            best = self._broadcast(self._best_record() if self.accelerator.is_main_process else None) or {}
            out = self.output_dir
            summary = [f"run finished in {elapsed / 60:.1f} min: {st.global_step} steps, {st.skipped_steps} skipped",
                       f"best {self.metric} {st.best_metric:.4f}" + (f" (epoch {best['epoch']}, step {best['step']})" if best else "")
                       + (f", final {self.metric} {stats[self.metric]:.4f}" if stats else ""),
                       f"weights: {out}/best/ (best), {out}/last/ (final); checkpoints: {ckpt.checkpoint_dir(out)}",
                       f"metrics: {self.metrics.path}; predictions, plots, samples: {out}/predictions_val.*, {out}/plots/, "
                       f"{out}/samples/"]
            if self.images_seen:
                summary.append(f"mean throughput {self.images_seen / elapsed:.1f} images/s (all processes)")
            logger.info("summary:\n  %s", "\n  ".join(summary))
        if self.accelerator.is_main_process and not self.evaluate_only:
            self._write_status(0)
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if getattr(self, "progress", None) is not None:
                self.progress.close()
            self.accelerator.end_training()
        finally:
            for sig, handler in self._old_handlers.items():
                try:
                    signal.signal(sig, handler)
                except (ValueError, TypeError):
                    pass
            if self._locked:
                release_lock(self.output_dir)
