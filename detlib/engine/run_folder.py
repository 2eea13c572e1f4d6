"""A run's output folder and processes: the lock, the start-up checks, how the run ended, and the signals.

* `output_dir/run.lock` (PID, host, start time, command) lets one live run write to a folder; a stale lock of
  a process that no longer runs on this host is replaced with a note.
* A folder that holds another run (`RUN_FILES`) is never mixed into: a new run there must resume it or be
  told to overwrite it.
* `output_dir/run_status.json` records how the run ended (finished, preempted, diverged, failed), because
  launchers report a worker's exit code each in their own way.
  Exit codes of the training process: 0 done; 1 error (bad data, damaged checkpoint, disk full); 2 bad flag
  values (argparse); EXIT_DIVERGED (3) non-finite steps in a row; EXIT_PREEMPTED (75, sysexits' "temporary
  failure, retry") preempted, checkpoint written, resume with `--resume_from_checkpoint latest`. The launcher
  reports them in its own way (accelerate's 1-process launcher: "returned non-zero exit status 75"; torchrun:
  exit 1 with the worker's code in its summary), hence run_status.json.
* The disk-space check: room for the checkpoints the run keeps, best/ and last/.
* The preemption signals only set a flag the training loop polls (`PreemptionSignals`); DataLoader workers
  leave them to their training process and end with it (`detlib.data.loaders`), and
  under a launcher each training process asks the kernel for SIGTERM when its launcher dies, so no process of
  a run outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import tempfile
import time

import psutil  # accelerate's dependency
import torch

from ..data.loaders import PREEMPT_SIGNALS
from ..files import write_json

logger = logging.getLogger(__name__)

EXIT_DIVERGED = 3  # non-finite optimizer steps in a row
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL, "temporary failure, retry": a checkpoint was written, resume
LOCK_FILE = "run.lock"
# Files a run leaves in its output folder: any of them means the folder already holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "best", "last")
# What --overwrite_output_dir removes besides RUN_FILES.
OTHER_RUN_FILES = ("train.log", "predictions_val.json", "predictions_val.csv", "tensorboard", "wandb",
                   "run_status.json", "data_report.json", "plots", "samples")
EXIT_STATUS = {0: "finished", EXIT_DIVERGED: "diverged", EXIT_PREEMPTED: "preempted"}
# A Ctrl-C may reach a process twice at once (from the terminal's process group and forwarded by a launcher):
# only a SIGINT this many seconds or more after the first is the user's second Ctrl-C.
SECOND_SIGINT_AFTER_S = 1.0


class Refusal(str):
    """A start-up check's message that is a refusal (the folder holds or is running another run), not a fault:
    printed as `stopped: ...`."""


def acquire_lock(output_dir: str) -> tuple[str | None, str | None]:
    """Take `output_dir/run.lock` for this process. Returns (error, note): error when another live run holds
    it (or one on another host: we cannot tell), note when a stale lock of a dead process was replaced."""
    path = os.path.join(output_dir, LOCK_FILE)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "argv": sys.argv}
    note = None
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    other = json.load(f)
            except (OSError, ValueError):
                other = None
            if not isinstance(other, dict) or other.get("pid") is None and other.get("host") is None:
                # a run killed as it took the lock, or one that has just taken it and not yet written it
                return Refusal(f"{path} does not say which run holds {output_dir} (empty or damaged); if no run is "
                               "writing there, delete it"), None
            pid, host = other.get("pid"), other.get("host")
            if host == me["host"] and isinstance(pid, int) and not psutil.pid_exists(pid):
                note = f"replaced a stale lock of process {pid} (no longer running) in {output_dir}"
                os.remove(path)
                continue
            if host not in (None, me["host"]):
                return Refusal(f"{output_dir} is locked by a run on host {host} (pid {pid}, since {other.get('started')}); "
                               f"if that run is dead, delete {path}"), None
            return Refusal(f"another run (pid {pid} on {host}, since {other.get('started')}) is writing to {output_dir}; "
                           "use another --output_dir"), None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as e:  # the disk filled since the folder check: an empty lock would refuse the next run
            with contextlib.suppress(OSError):
                os.remove(path)
            return f"could not write the lock {path}: {e.strerror or e}", None
        return None, note
    return f"could not take the lock {path}", None


def release_lock(output_dir: str) -> None:
    """Remove `output_dir/run.lock` if this process holds it."""
    path = os.path.join(output_dir, LOCK_FILE)
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        held = json.load(f)
        if isinstance(held, dict) and held.get("pid") == os.getpid():
            os.remove(path)


def prepare_output_dir(out: str, evaluate_only: bool, resume: str | None, overwrite: bool) -> tuple[str | None, list[str], bool]:
    """Start-up checks of the main process: the folder is writable, holds no other run (unless resumed or
    overwritten), is not locked by a live run; then the lock is taken, an overwritten run's files and killed
    saves' `.tmp` folders are removed. Returns (error or None, notes to log, lock taken)."""
    notes = []
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out) as f:  # created, written and removed: the folder takes files
            f.write(b"ok")  # a full disk still creates an empty file; it refuses the byte
            f.flush()
    except OSError as e:
        return f"cannot write to --output_dir {out}: {e.strerror or e}", notes, False
    present = [n for n in RUN_FILES if os.path.exists(os.path.join(out, n))
               and (n != "checkpoints" or os.listdir(os.path.join(out, n)))]
    if present and not evaluate_only and not resume and not overwrite:
        return Refusal(f"{out} holds another run ({', '.join(present)}); to continue it pass --resume_from_checkpoint "
                       "latest, to keep it choose a new --output_dir, to replace it pass --overwrite_output_dir"), notes, False
    error, note = acquire_lock(out)
    if error:
        return error, notes, False
    if note:
        notes.append(note)
    if overwrite and present and not evaluate_only:
        for name in RUN_FILES + OTHER_RUN_FILES:
            path = os.path.join(out, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        notes.append(f"--overwrite_output_dir: removed the previous run's {', '.join(present)} from {out}")
    root = os.path.join(out, "checkpoints")
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.endswith(".tmp"):  # a save that was killed half-way
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            notes.append(f"removed the unfinished checkpoint folder {name} (a save that was interrupted)")
    return None, notes, True


def checkpoint_bytes(model: torch.nn.Module, optimizer) -> tuple[int, int]:
    """Returns (bytes of the model's weights, bytes of one checkpoint: weights and optimizer state) for the
    disk-space check (`check_disk_space`). `optimizer` may be accelerate's wrapper."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    bare = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    # Adam keeps two tensors per weight (exp_avg, exp_avg_sq), SGD one (its momentum buffer)
    opt_state = 2 if isinstance(bare, torch.optim.Adam | torch.optim.AdamW) else 1
    return weights, weights * (1 + opt_state)


def check_disk_space(output_dir: str, model, optimizer, num_checkpoints: int) -> str | None:
    """Free space in `output_dir` for `num_checkpoints` checkpoints of `model` and `optimizer` (accelerate's
    wrapper or a bare one) plus the one being written, best/ and last/. Main process.

    Returns an error (one line) when not even one checkpoint with best/ and last/ fits; otherwise logs the
    start-up checks' line (free and needed GiB), as a warning when there is less than needed, and returns None.
    """
    weights, per_ckpt = checkpoint_bytes(model, optimizer)
    needed = per_ckpt * (num_checkpoints + 1) + 2 * weights  # + the one being written, best/ and last/
    free = shutil.disk_usage(output_dir).free
    line = (f"start-up checks: {output_dir} writable and locked; {free / 2**30:.1f} GiB free, "
            f"{needed / 2**30:.2f} GiB needed for {num_checkpoints} checkpoints of ~{per_ckpt / 2**20:.0f} MiB "
            "+ best/ + last/")
    if free < per_ckpt + 2 * weights:
        return (f"not enough disk space in {output_dir}: {free / 2**20:.0f} MiB free, one checkpoint needs "
                f"~{per_ckpt / 2**20:.0f} MiB")
    if free < needed:
        logger.warning("%s: less than needed, lower --checkpoint_total_limit or free space", line)
    else:
        logger.info("%s", line)
    return None


def write_run_status(output_dir: str, code: int, message: str = "", **counters) -> None:
    """`output_dir/run_status.json`: {"status": finished | preempted | diverged | failed, "exit_code", "message",
    and the counters given (global_step, epoch)}, for schedulers and scripts (slurm/ reads it to requeue)."""
    with contextlib.suppress(OSError):
        write_json({"status": EXIT_STATUS.get(code, "failed"), "exit_code": code, "message": message, **counters},
                   os.path.join(output_dir, "run_status.json"), indent=1)


def set_parent_death_signal() -> None:
    """Linux: SIGTERM this process when its parent (the launcher) dies, even by kill -9, so no training
    process outlives its launcher; the SIGTERM then takes the preemption path (checkpoint, exit)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() == 1:  # the launcher died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


def launched() -> bool:
    """True under `accelerate launch` / torchrun (the parent is a launcher, not an interactive shell, whose exit
    must not stop a `nohup python train.py`)."""
    return "LOCAL_RANK" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ


class PreemptionSignals:
    """SIGTERM, SIGUSR1 and a first SIGINT only set `received` (the signal number); the training loop acts on
    it at its next poll, on every rank together (`detlib.engine.run.Run.poll_preemption`). A second SIGINT, a second
    or more after the first, raises KeyboardInterrupt at once. Under a launcher the process also asks for
    SIGTERM when the launcher dies (`set_parent_death_signal`).
    """

    def __init__(self):
        self.received: int | None = None
        self._pid = os.getpid()
        self._first_sigint: float | None = None
        self._old_handlers: dict = {}

    def install(self) -> None:
        """Handle the preemption signals in this process (main thread only: Python allows no other)."""
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
            now = time.monotonic()
            if self._first_sigint is not None and now - self._first_sigint > SECOND_SIGINT_AFTER_S:
                raise KeyboardInterrupt("second SIGINT: stopping at once, without a checkpoint")
            self._first_sigint = self._first_sigint or now
        if self.received is None:
            self.received = signum

    def poll(self, accelerator) -> str | None:
        """Collective (every rank calls it at the same points): the name of the signal when any process got
        one, through accelerate's trigger ("a signal to another process" on the ranks that got none); else None."""
        if self.received is not None:
            accelerator.set_trigger()
        if not accelerator.check_trigger():
            return None
        return signal.Signals(self.received).name if self.received else "a signal to another process"

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
