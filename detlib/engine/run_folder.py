"""The run folder: the start-up checks (it can be made and written, it holds no other run unless resumed or
overwritten), the lock that keeps a second run out while the first lives, and run_status.json, how the run ended.
run_status.json records the exit code too: launchers report a worker's code each in their own way (slurm/ requeues
on it).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import pathlib
import shutil
import socket
import tempfile

from ..files import read_json, write_json
from .exits import EXIT_STATUS

LOCK_FILE = "run.lock"
# Any of these in a folder means it holds a run; --overwrite_output_dir removes them and OTHER_RUN_FILES.
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "best", "last")
OTHER_RUN_FILES = ("last_ema", "train.log", "predictions_val.json", "predictions_val.csv", "tensorboard", "wandb",
                   "run_status.json", "data_report.json", "plots", "samples")


def _in_the_way(folder: str) -> str | None:
    """What stops `folder` from being made: a file, or a link whose target does not exist, on its path."""
    path = os.path.abspath(folder)
    for p in [*reversed([str(q) for q in pathlib.Path(path).parents]), path]:
        if os.path.islink(p) and not os.path.exists(p):
            return f"{p} is a link to {os.readlink(p)}, which does not exist"
        if os.path.exists(p) and not os.path.isdir(p):
            return f"{p} is a file, not a folder"
    return None


_held: dict[str, int] = {}  # output folder -> the open lock file this process holds


def acquire_lock(output_dir: str) -> str | None:
    """Take the OS lock on `output_dir/run.lock` (`flock`): None, or a refusal naming the holder (its pid and host,
    written into the file for this line only). The kernel releases the lock when its holder ends, however it
    ends, so a killed run's folder is free at once; a file left behind by one holds nothing."""
    path = os.path.join(output_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # the folder was just written to (`prepare_output_dir`)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if not isinstance(e, BlockingIOError):  # ENOLCK: a network file system without a lock service
            os.close(fd)
            return f"could not lock {path}: {e.strerror or e}"
        with os.fdopen(fd) as f:
            named = f.read()
        with contextlib.suppress(ValueError, LookupError, TypeError):  # the holder has not named itself yet
            other = json.loads(named)
            return f"another run (pid {other['pid']} on {other['host']}) is writing to {output_dir}; use another --output_dir"
        return f"another run is writing to {output_dir}; use another --output_dir"
    with contextlib.suppress(OSError):  # a name that cannot be written (a full disk) leaves the lock held all the same
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    _held[os.path.abspath(output_dir)] = fd
    return None


def release_lock(output_dir: str) -> None:
    """Give back this process's lock on `output_dir` (the file stays: removing it would let a run that opened it
    just before lock a file that no longer has a name while a third locks a new one)."""
    if (fd := _held.pop(os.path.abspath(output_dir), None)) is not None:
        os.close(fd)


def _let_go_in_child() -> None:
    """A forked child (a DataLoader worker) shares the lock: closing its copy (never LOCK_UN, which would release it
    for the parent too) makes the lock end with the process that took it, not with its slowest worker."""
    while _held:
        os.close(_held.popitem()[1])


os.register_at_fork(after_in_child=_let_go_in_child)


def prepare_output_dir(out: str, evaluate_only: bool, resume: str | None, overwrite: bool) -> tuple[tuple | None, list[str]]:
    """The main process's start-up checks: the folder can be made and written, holds no other run (unless resumed or
    overwritten), no live run's lock; then the lock, an overwritten run's files and killed saves' `.tmp` removed.
    Returns ((message, is a refusal) or None, notes)."""
    notes = []
    if resume and overwrite and not evaluate_only:
        return ("--resume_from_checkpoint continues the run in the folder, --overwrite_output_dir deletes it: give one",
                False), notes
    if problem := _in_the_way(out):
        return (f"cannot make --output_dir {out}: {problem}", False), notes
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out) as f:  # a full disk still creates an empty file; it refuses the byte
            f.write(b"ok")
            f.flush()
    except OSError as e:
        return (f"cannot write to --output_dir {out}: {e.strerror or e}", False), notes
    present = [n for n in RUN_FILES if os.path.exists(os.path.join(out, n))
               and (n != "checkpoints" or os.listdir(os.path.join(out, n)))]
    if present and not (evaluate_only or resume or overwrite):
        return (f"{out} holds another run ({', '.join(present)}); to continue it pass --resume_from_checkpoint "
                "latest, to keep it choose a new --output_dir, to replace it pass --overwrite_output_dir", True), notes
    if error := acquire_lock(out):  # a live run's lock is a refusal; a lock that cannot be opened is a fault
        return (error, not error.startswith("could not")), notes
    if overwrite and present and not evaluate_only:
        for path in (os.path.join(out, n) for n in RUN_FILES + OTHER_RUN_FILES):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        notes.append(f"--overwrite_output_dir: removed the previous run's {', '.join(present)} from {out}")
    for tmp in glob.glob(os.path.join(out, "checkpoints", "*.tmp")):  # a save that was killed: never resumed from
        shutil.rmtree(tmp, ignore_errors=True)
        notes.append(f"removed the unfinished checkpoint folder {os.path.basename(tmp)} (a save that was interrupted)")
    return None, notes


def write_run_status(output_dir: str, code: int, message: str = "", status: str | None = None, **counters) -> None:
    """`output_dir/run_status.json`: {"status": finished | preempted | diverged | failed (`code`'s) or `status`,
    "exit_code", "message", ...}; a run that stopped before its first step keeps the earlier run's record as
    "previous"."""
    path, previous = os.path.join(output_dir, "run_status.json"), None
    if not counters.get("global_step") and os.path.isfile(path):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            old = read_json(path)
            previous = old if old.get("global_step") else old.get("previous")
    with contextlib.suppress(OSError):
        write_json({"status": status or EXIT_STATUS.get(code, "failed"), "exit_code": code, "message": message, **counters,
                    **({"previous": previous} if previous else {})}, path, indent=1)
