"""A run from its start-up checks to its last line: `running`, the context every process of a training script's run
enters (the folder and its lock, the log, the stop signals, --time_limit's budget; at the end run_status.json, the
trackers closed, the line and the exit), and `lost_process`, which tells a collective's failure because another
process of the run ended from any other error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

import psutil  # accelerate's dependency

from .accelerator import log_run_setup
from .checkpoints import last_good_checkpoint
from .bookkeeping import Preempted
from .exits import EXIT_PREEMPTED, RunStop, last_line, stop
from .logs import setup_logging
from .run_folder import prepare_output_dir, release_lock, write_run_status
from .signals import catch_signals, release_signals
from .stopping import start_time_limit
from .trackers import finish_trackers

logger = logging.getLogger(__name__)

# Where a collective's error says that the other side's connection went (gloo, NCCL), a process on another host ended.
LOST_PEER_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


@contextlib.contextmanager
def running(accelerator, output_dir: str, state, evaluate_only: bool = False, resume: str | None = None,
            overwrite: bool = False, verbose: bool = False, time_limit: str | None = None):
    """The run in `output_dir`, from its start-up checks to its last line (every process enters it). On entry: the
    folder checks and the lock (`prepare_output_dir`), the log, the stop signals, --time_limit's budget. On exit:
    run_status.json, trackers closed, the process group ended, signals and lock given back. A `RunStop`, a
    `Preempted` the script did not catch (an evaluation alone: exit 75 with nothing to resume), or a
    collective's failure because another process ended (`lost_process`: run_status.json names the last good
    checkpoint), becomes its line (after the trackers' own end lines: `last_line`) and `SystemExit(code)`; any other
    exception is recorded as failed and propagates with its traceback."""
    from accelerate.utils import broadcast_object_list, gather_object

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
    except Preempted as p:  # an evaluation alone has nothing to checkpoint: the scripts catch it only in training
        stopped = RunStop(f"stopped by {p.signal_name} during evaluation", EXIT_PREEMPTED)
        code, message = stopped.code, str(stopped)
    except BaseException as e:
        if not (lost := lost_process(e, processes)):
            message = f"unhandled {type(e).__name__}: {e}"
            raise
        checkpoint = last_good_checkpoint(output_dir) if is_main else None
        stopped = RunStop(f"{lost} at step {state.global_step}: the run cannot go on without it; " + (
            f"the last good checkpoint is {checkpoint}: to continue, run the same command with "
            "--resume_from_checkpoint latest" if checkpoint else "no checkpoint was written: run the same command again"))
        code, message = stopped.code, str(stopped)
    finally:
        if is_main:
            write_run_status(output_dir, code, message, status, global_step=state.global_step, epoch=state.epoch,
                             **({"checkpoint": checkpoint} if checkpoint else {}))
        try:
            finish_trackers(accelerator, output_dir)
            if stopped is not None:  # the last line, after the trackers' own; a lost process never comes to meet
                last_line(str(stopped), stopped.code, stopped.word, meet=not lost)
            accelerator.end_training()
        finally:
            start_time_limit(None)
            release_signals(signals, stopped is not None)
            if is_main:
                release_lock(output_dir)
    if stopped is not None:
        raise SystemExit(stopped.code)


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
