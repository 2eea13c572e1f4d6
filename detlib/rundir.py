"""A run's output folder and processes: the lock, the start-up checks, how the run ended, and the signals.

* `output_dir/run.lock` (PID, host, start time, command) lets one live run write to a folder; a stale lock of
  a process that no longer runs on this host is replaced with a note.
* A folder that holds another run (`RUN_FILES`) is never mixed into: a new run there must resume it or be
  told to overwrite it.
* `output_dir/run_status.json` records how the run ended (finished, preempted, diverged, failed), because
  launchers report a worker's exit code each in their own way.
* DataLoader workers ignore the preemption signals, and under a launcher each training process asks the
  kernel for SIGTERM when its launcher dies, so no training process outlives it.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import sys
import time
import uuid

PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
EXIT_DIVERGED = 3  # non-finite optimizer steps in a row
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL, "temporary failure, retry": a checkpoint was written, resume
LOCK_FILE = "run.lock"
# Files a run leaves in its output folder: any of them means the folder already holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "best", "last")
# What --overwrite_output_dir removes besides RUN_FILES.
OTHER_RUN_FILES = ("train.log", "predictions_val.json", "predictions_val.csv", "tensorboard", "wandb",
                   "run_status.json", "data_report.json", "plots", "samples")
EXIT_STATUS = {0: "finished", EXIT_DIVERGED: "diverged", EXIT_PREEMPTED: "preempted"}


def worker_init_fn(worker_id: int) -> None:
    """DataLoader workers ignore the preemption signals: the training process decides when to stop, and a
    Ctrl-C to the terminal's process group must not kill the workers under it mid-save."""
    for name in PREEMPT_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
                other = {}
            pid, host = other.get("pid"), other.get("host")
            if host == me["host"] and isinstance(pid, int) and not _pid_alive(pid):
                note = f"replaced a stale lock of process {pid} (no longer running) in {output_dir}"
                os.remove(path)
                continue
            if host not in (None, me["host"]):
                return (f"{output_dir} is locked by a run on host {host} (pid {pid}, since {other.get('started')}); "
                        f"if that run is dead, delete {path}"), None
            return (f"another run (pid {pid} on {host}, since {other.get('started')}) is writing to {output_dir}; "
                    "use another --output_dir"), None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return None, note
    return f"could not take the lock {path}", None


def release_lock(output_dir: str) -> None:
    """Remove `output_dir/run.lock` if this process holds it."""
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        with open(path) as f:
            if json.load(f).get("pid") == os.getpid():
                os.remove(path)
    except (OSError, ValueError):
        pass


def prepare_output_dir(out: str, evaluate_only: bool, resume: str | None, overwrite: bool) -> tuple[str | None, list[str], bool]:
    """Start-up checks of the main process: the folder is writable, holds no other run (unless resumed or
    overwritten), is not locked by a live run; then the lock is taken, an overwritten run's files and killed
    saves' `.tmp` folders are removed. Returns (error or None, notes to log, lock taken)."""
    notes = []
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write_test_{uuid.uuid4().hex[:8]}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        return f"cannot write to --output_dir {out}: {e.strerror or e}", notes, False
    present = [n for n in RUN_FILES if os.path.exists(os.path.join(out, n))
               and (n != "checkpoints" or os.listdir(os.path.join(out, n)))]
    if present and not evaluate_only and not resume and not overwrite:
        return (f"{out} holds another run ({', '.join(present)}); to continue it pass --resume_from_checkpoint "
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


def write_run_status(output_dir: str, code: int, message: str = "", **counters) -> None:
    """`output_dir/run_status.json`: {"status": finished | preempted | diverged | failed, "exit_code", "message",
    and the counters given (global_step, epoch)}, for schedulers and scripts (slurm/ reads it to requeue)."""
    try:
        with open(os.path.join(output_dir, "run_status.json"), "w") as f:
            json.dump({"status": EXIT_STATUS.get(code, "failed"), "exit_code": code, "message": message, **counters},
                      f, indent=1)
    except OSError:
        pass


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
