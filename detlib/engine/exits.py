"""How a process of detlib ends: the exit codes, `RunStop`, and the one exit (`stop`) that prints a line once on N
processes. The engine's bottom module: it imports no other.

Exit codes: 0 finished (or stopped by --time_limit with a checkpoint: run_status "time_limit"); 1 error; 2 bad
flags; EXIT_DIVERGED (3) non-finite steps in a row; EXIT_PREEMPTED (75, sysexits' "temporary failure, retry"): a
checkpoint was written, resume with `--resume_from_checkpoint latest`. A stop is one line, last, from the first
process; the processes meet after it is out: one exiting first would have torchrun stop the first mid-line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75
EXIT_STATUS = {0: "finished", EXIT_DIVERGED: "diverged", EXIT_PREEMPTED: "preempted"}


class RunStop(Exception):
    """End the run with its last line (`stopped:` for 0 and EXIT_PREEMPTED, else `error:`) and exit `code`: raised on
    every process together; `detlib.engine.run.running` records it (run_status.json) and calls `stop`."""

    def __init__(self, message: str, code: int = 1, status: str | None = None):
        super().__init__(message)
        self.code, self.word = code, "stopped" if code in (0, EXIT_PREEMPTED) else "error"
        self.status = status  # run_status.json's, when not the code's (EXIT_STATUS)


def first_process() -> bool:
    """Rank 0 of a launch (torchrun / accelerate set RANK), or a plain `python` run: the one that prints a stop."""
    return os.environ.get("RANK", "0") == "0"


def print_once(text: str, file=None) -> None:
    """`text` printed (stderr by default) by the first process only: what every process of a launch would print alike."""
    if first_process():
        print(text, end="" if text.endswith("\n") else "\n", file=file or sys.stderr, flush=True)


def stop(message: str, code: int = 2, word: str = "error"):
    """The one exit with a line, on any number of processes: flags, files named on the command line, a predict
    script's or export's inputs, a run folder refused (a run's `RunStop` takes the same `last_line` at the end of
    `detlib.engine.run.running`). Raises SystemExit(`code`) on every process once the line is out."""
    last_line(message, code, word)
    raise SystemExit(code)


def last_line(message: str, code: int, word: str, meet: bool = True) -> None:
    """A stop's line: `message` to the log file, if there is one (not to the console: it gets the line), the first
    process prints `word: message` to stderr, every process meets after it (`wait_for_the_first_process`; not
    `meet`: a process of the run is gone and would never come)."""
    if any(isinstance(h, logging.FileHandler) for h in logging.getLogger().handlers):
        (logger.info if code == 0 else logger.error)("%s", message, extra={"console": False})
    print_once(f"{word}: {message}")
    if meet:
        wait_for_the_first_process()


def stop_together(accelerator, error: str | None, code: int = 1) -> None:
    """Collective: raise RunStop(error) on every process when any process has one (the first one's message)."""
    from accelerate.utils import gather_object

    if errors := [e for e in gather_object([error]) if e]:
        raise RunStop(errors[0], code)


def on_every_process(accelerator, value: bool) -> bool:
    """Whether `value` holds on every process (collective)."""
    import torch

    return bool(accelerator.reduce(torch.tensor(float(not value), device=accelerator.device), "sum") == 0)


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
