"""The run folder and the run's processes: the start-up checks and the lock, how a run ends (`RunStop`, exit
codes, run_status.json), and the stop signals (training's and predict's).

Exit codes: 0 finished (or stopped by --time_limit with a checkpoint: run_status "time_limit"); 1 error; 2 bad
flags; EXIT_DIVERGED (3) non-finite steps in a row; EXIT_PREEMPTED (75, sysexits' "temporary failure, retry"): a
checkpoint was written, resume with `--resume_from_checkpoint latest`. run_status.json records the code too:
launchers report a worker's code each in their own way (slurm/ requeues on it). A stop is one line, last, from the
first process; the processes meet after it is out: one exiting first would have torchrun stop the first mid-line.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import psutil  # accelerate's dependency

from ..data.loaders import PREEMPT_SIGNALS
from ..files import write_json
from .flags import first_process
from .stopping import TIME_LIMIT, start_time_limit, time_limit_line, time_limit_up

logger = logging.getLogger(__name__)

EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75
EXIT_STATUS = {0: "finished", EXIT_DIVERGED: "diverged", EXIT_PREEMPTED: "preempted"}
LOCK_FILE = "run.lock"
# Any of these in a folder means it holds a run; --overwrite_output_dir removes them and OTHER_RUN_FILES.
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "best", "last")
OTHER_RUN_FILES = ("last_ema", "train.log", "predictions_val.json", "predictions_val.csv", "tensorboard", "wandb",
                   "run_status.json", "data_report.json", "plots", "samples")
# A Ctrl-C reaches a process twice at once (from the terminal and forwarded by the launcher): only a SIGINT a
# second or more after the first is the user's second Ctrl-C, which stops at once.
SECOND_SIGINT_AFTER_S = 1.0


class RunStop(Exception):
    """End the run with its last line (`stopped:` for EXIT_PREEMPTED, else `error:`) and exit `code`: raised on every
    process together, `running` turns it into the line, run_status.json and the exit."""

    def __init__(self, message: str, code: int = 1, status: str | None = None):
        super().__init__(message)
        self.code, self.word = code, "stopped" if code in (0, EXIT_PREEMPTED) else "error"
        self.status = status  # run_status.json's, when not the code's (EXIT_STATUS)


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


def wait_for_the_first_process() -> None:
    """Every process calls it once the first has printed a stop's line: they meet (a barrier on the launch's process
    group, made now if there is none yet), so none exits before the line is out. Meanwhile SIGINT and SIGTERM take
    their default action: a launcher stopping this process ends it without a line of its own."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
    _meet()


def _meet(timeout_s: float = 60.0) -> None:
    """The barrier, given up after `timeout_s` (a process that never comes) or when the group cannot be made."""
    def barrier():
        with contextlib.suppress(Exception):
            from accelerate import PartialState

            PartialState().wait_for_everyone()

    waiting = threading.Thread(target=barrier, daemon=True)
    waiting.start()
    waiting.join(timeout_s)


def stop(message: str, code: int = 2, word: str = "error"):
    """The one exit of an error every process finds alike outside a running run (flags, files named on the command
    line, a predict script's or export's inputs, a run folder refused) and of a predict script's stop signal: `message` goes to the log file, if there is
    one, and the first process prints `word: message`; every process meets after it and exits with `code`."""
    if any(isinstance(h, logging.FileHandler) for h in logging.getLogger().handlers):
        logger.error("%s", message, extra={"console": False})  # the console gets the line below
    if first_process():
        print(f"{word}: {message}", file=sys.stderr, flush=True)
    wait_for_the_first_process()
    raise SystemExit(code)


def stop_together(accelerator, error: str | None, code: int = 1) -> None:
    """Collective: raise RunStop(error) on every process when any process has one (the first one's message)."""
    from accelerate.utils import gather_object

    if errors := [e for e in gather_object([error]) if e]:
        raise RunStop(errors[0], code)


# ---- the folder

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
        with contextlib.suppress(OSError, ValueError, AttributeError), open(path) as f:
            old = json.load(f)
            previous = old if old.get("global_step") else old.get("previous")
    with contextlib.suppress(OSError):
        write_json({"status": status or EXIT_STATUS.get(code, "failed"), "exit_code": code, "message": message, **counters,
                    **({"previous": previous} if previous else {})}, path, indent=1)


@contextlib.contextmanager
def running(accelerator, output_dir: str, state, evaluate_only: bool = False, resume: str | None = None,
            overwrite: bool = False, verbose: bool = False, time_limit: str | None = None):
    """The run in `output_dir`, from its start-up checks to its last line (every process enters it). On entry: the
    folder checks and the lock (`prepare_output_dir`), the log, the stop signals, --time_limit's budget. On exit:
    run_status.json, trackers closed, the process group ended, signals and lock given back. A `RunStop`, or a
    collective's failure because another process ended (`lost_process`: run_status.json names the newest intact
    checkpoint), becomes its line (after the trackers' own end lines) and `SystemExit(code)`; any other exception is
    recorded as failed and propagates with its traceback."""
    from accelerate.utils import broadcast_object_list, gather_object

    from .logs import finish_trackers, log_run_setup, setup_logging

    is_main = accelerator.is_main_process
    refused, notes = prepare_output_dir(output_dir, evaluate_only, resume, overwrite) if is_main else (None, [])
    refused = broadcast_object_list([refused])[0]
    if refused:
        stop(refused[0], 1, "stopped" if refused[1] else "error")
    setup_logging(output_dir, is_main, verbose=verbose)
    for note in notes:
        logger.warning("%s", note)
    log_run_setup(accelerator)
    processes = gather_object([(socket.gethostname(), os.getpid())]) if accelerator.num_processes > 1 else []
    signals = catch_signals()
    start_time_limit(None if evaluate_only else time_limit)  # an evaluation alone is not resumed
    code, message, stopped, lost, checkpoint, status = 1, "", None, None, None, None
    try:
        yield
        code, message = 0, getattr(state, "stop_reason", "")
    except RunStop as e:
        code, message, stopped, status = e.code, str(e), e, e.status
        if is_main:
            (logger.info if e.code == 0 else logger.error)("%s", message, extra={"console": False})
    except BaseException as e:
        if not (lost := lost_process(e, processes)):
            message = f"unhandled {type(e).__name__}: {e}"
            raise
        from .checkpoints import newest_checkpoint

        checkpoint = newest_checkpoint(output_dir) if is_main else None
        stopped = RunStop(f"{lost} at step {state.global_step}: the run cannot go on without it; " + (
            f"the newest intact checkpoint is {checkpoint}: to continue, run the same command with "
            "--resume_from_checkpoint latest" if checkpoint else "no checkpoint was written: run the same command again"))
        code, message = stopped.code, str(stopped)
        if is_main:
            logger.error("%s", message, extra={"console": False})
    finally:
        if is_main:
            write_run_status(output_dir, code, message, status, global_step=state.global_step, epoch=state.epoch,
                             **({"checkpoint": checkpoint} if checkpoint else {}))
        try:
            finish_trackers(accelerator, output_dir)
            if stopped is not None:  # the last line, after the trackers' own end lines
                if is_main:
                    print(f"{stopped.word}: {stopped}", file=sys.stderr, flush=True)
                if not lost:  # a lost process never comes to the meeting
                    wait_for_the_first_process()
            accelerator.end_training()
        finally:
            start_time_limit(None)
            release_signals(signals, stopped is not None)
            if is_main:
                release_lock(output_dir)
    if stopped is not None:
        raise SystemExit(stopped.code)


# Where a collective's error says that the other side's connection went (gloo, NCCL), a process on another host ended.
LOST_PEER_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def lost_process(error: BaseException, processes: list[tuple[str, int]]) -> str | None:
    """What ended, when `error` is a collective's failure because another process of the run ended: "another process
    of the run ended (rank 1, pid 123)" (the ranks of this host whose process is gone: `processes`, each rank's (host,
    pid)), or "(on another host)" when the error names a lost connection; else None."""
    from torch.distributed import DistNetworkError

    if len(processes) < 2 or not isinstance(error, RuntimeError):
        return None
    here = socket.gethostname()
    gone = [f"rank {rank}, pid {pid}" for rank, (host, pid) in enumerate(processes)
            if host == here and pid != os.getpid() and _gone(pid)]
    if gone:
        return f"another process of the run ended ({'; '.join(gone)})"
    if isinstance(error, DistNetworkError) or any(w in str(error) for w in LOST_PEER_WORDS):
        return "another process of the run ended (on another host, or its connection broke)"
    return None


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie its launcher has not reaped yet has)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:  # no such process
        return True


# ---- stop signals: one mechanism for training and predict

_received: list[int] = []  # the stop signals this process got, first first
_first_sigint: list[float] = []
_handler_pid: list[int] = []  # the process that installed the handlers


def _on_signal(signum, frame) -> None:
    if os.getpid() != _handler_pid[0]:  # a forked child (a pool worker) inherited the handler: it must still die
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    # Only a flag: the loop acts on it at its next poll (a training run on every rank together).
    if signum == signal.SIGINT:
        if _first_sigint and time.monotonic() - _first_sigint[0] > SECOND_SIGINT_AFTER_S:
            raise KeyboardInterrupt("second SIGINT: stopping at once")
        _first_sigint[:] = _first_sigint or [time.monotonic()]
    _received.append(signum)


def catch_signals() -> dict:
    """SIGTERM, SIGUSR1 and a first SIGINT only record the signal (`signal_received`), which a training run polls at
    its step boundaries (`preempted`) and a predict script between its batches; a later second SIGINT raises
    KeyboardInterrupt. Under a launcher the kernel sends SIGTERM when the launcher dies, even by kill -9. Returns the
    handlers replaced."""
    _received.clear()
    _first_sigint.clear()
    _handler_pid[:] = [os.getpid()]
    if threading.current_thread() is not threading.main_thread():  # Python sets handlers there only
        return {}
    old = {getattr(signal, n): signal.signal(getattr(signal, n), _on_signal) for n in PREEMPT_SIGNALS}
    if ("LOCAL_RANK" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ) and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:  # the launcher died before the call
                os.kill(os.getpid(), signal.SIGTERM)
    return old


def release_signals(handlers: dict, stopped: bool) -> None:
    """Put back the `handlers` `catch_signals` replaced, or after a stop (`stopped`) ignore the signals: a second one
    must not change the stop's exit code."""
    for sig, handler in handlers.items():
        signal.signal(sig, signal.SIG_IGN if stopped else handler)


def signal_received() -> str | None:
    """The name of the first stop signal this process got since `catch_signals`, or None."""
    return signal.Signals(_received[0]).name if _received else None


def stop_if_preempted(accelerator) -> None:
    """Collective, at the same points on every rank: raise Preempted when any process got a stop signal (the first
    one's name, accelerate's trigger; "a signal to another process" where none came), or with TIME_LIMIT when
    --time_limit's budget is up on any process."""
    if _received:
        accelerator.set_trigger()
    if accelerator.check_trigger():
        raise Preempted(signal_received() or "a signal to another process")
    if (up := time_limit_up()) is None:  # no budget, on every rank alike
        return
    import torch

    if accelerator.reduce(torch.tensor(float(up), device=accelerator.device), "sum") > 0:
        raise Preempted(TIME_LIMIT)
