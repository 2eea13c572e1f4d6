"""The DataLoader set-up both training scripts and both predict scripts share: workers that end with their
training process, the /dev/shm check, and the loader arguments built from them.

DataLoader workers leave the preemption signals (SIGTERM, SIGUSR1, SIGINT) to their training process and end
with it (`worker_init_fn`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading

logger = logging.getLogger(__name__)

# The signals that preempt a run (detlib.engine.signals' handlers); workers leave them to it.
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


def worker_init_fn(worker_id: int) -> None:
    """DataLoader workers outlive no one and die for no one but their training process.

    A Ctrl-C reaches the terminal's whole process group, and SLURM / torchrun send SIGTERM (or SIGUSR1) to every
    process of the job: a worker killed by it would make its training process raise ("DataLoader worker is
    killed by signal") in the middle of the preemption checkpoint, or fail the next evaluation batch. So SIGINT,
    SIGTERM and SIGUSR1 are blocked in the worker and read by one thread (`sigwaitinfo`, Linux), which ends the
    worker (exit 0) on a SIGTERM sent by its own training process (multiprocessing's exit handler and the
    DataLoader's shutdown send exactly that); the others are dropped. A worker whose training process is gone (even
    by kill -9) is ended by torch's own watchdog within its status interval (5 s). Elsewhere (no `sigwaitinfo`)
    only SIGINT is ignored.
    """
    quiet_resource_sharer_errors()
    signals = {getattr(signal, name) for name in PREEMPT_SIGNALS}
    if not hasattr(signal, "sigwaitinfo"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)  # blocked by WorkerProcess.start
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return
    # blocked since the fork (WorkerProcess), so every later thread (OpenMP's) inherits the mask
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    threading.Thread(target=_worker_signal_loop, args=(os.getppid(), signals), name="detlib-worker-signals",
                     daemon=True).start()


def quiet_resource_sharer_errors() -> None:
    """Drop the traceback multiprocessing's fd-passing thread prints when its listener is closed under it.

    Batches leave DataLoader workers as file descriptors passed through `multiprocessing.resource_sharer`; when a
    run stops while a batch is in flight (a Ctrl-C to a predict script on a busy machine), that thread's `accept`
    can fail, and it reports that through `sys.excepthook` after the run's last line: on its closed listener
    ("ValueError: I/O operation on closed file"), or in the handshake with a receiving process that died
    (`BrokenPipeError` / `ConnectionError` before it read the challenge, `EOFError` after). Only those
    exceptions of that thread are dropped; every other uncaught exception still reaches the previous hook."""
    previous = sys.excepthook
    if getattr(previous, "_detlib_quiet", False):
        return

    def hook(kind, value, tb):
        frames, t = [], tb
        while t is not None:
            frames.append((t.tb_frame.f_code.co_filename, t.tb_frame.f_code.co_name))
            t = t.tb_next
        if issubclass(kind, (ValueError, OSError, EOFError)) and frames and frames[0][1] == "_serve" \
                and frames[0][0].endswith(os.path.join("multiprocessing", "resource_sharer.py")):
            return
        previous(kind, value, tb)

    hook._detlib_quiet = True
    sys.excepthook = hook


def _worker_signal_loop(parent: int, signals: set) -> None:
    while True:
        info = signal.sigwaitinfo(signals)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # 0, not killed by a signal: the DataLoader's SIGCHLD check then raises nothing


class WorkerProcess(multiprocessing.get_context().Process):
    """A DataLoader worker process started with the preemption signals blocked, so that a Ctrl-C or SIGTERM
    arriving between the fork and `worker_init_fn` waits for the worker's own handling instead of killing it."""

    def start(self):
        signals = {getattr(signal, name) for name in PREEMPT_SIGNALS}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _WorkerContext(type(multiprocessing.get_context())):
    Process = WorkerProcess


def worker_loader_kwargs(num_workers: int) -> dict:
    """The DataLoader arguments of a training script's loaders with `num_workers` workers: `worker_init_fn` and
    a multiprocessing context whose workers start with the preemption signals blocked (none for 0 workers)."""
    if num_workers == 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "worker_init_fn": worker_init_fn, "multiprocessing_context": _WorkerContext()}


def check_shared_memory(num_workers: int, bytes_per_batch: int, prefetch_factor: int = 2,
                        shm_path: str = "/dev/shm") -> tuple[int, str | None]:
    """Check that /dev/shm can hold the batches the DataLoader workers keep in flight.

    Docker's default /dev/shm is 64 MB; workers pass batches through it and die with "Bus error" when it
    fills. Returns (num_workers to use, a one-line message or None). When it is too small, the workers fall
    back to 0 (batches built in the main process, no shared memory).
    """
    if num_workers <= 0:
        return num_workers, None
    try:
        free = shutil.disk_usage(shm_path).free
    except OSError:
        return num_workers, None
    needed = num_workers * prefetch_factor * bytes_per_batch * 2  # x2: the batch and its pinned / collated copy
    if free >= needed:
        return num_workers, None
    msg = (f"{shm_path} has {free / 2**20:.0f} MiB free but {num_workers} DataLoader workers need about "
           f"{needed / 2**20:.0f} MiB: using num_workers=0. In Docker, start the container with "
           f"--shm-size=8g (or --ipc=host) to use workers.")
    return 0, msg


def loader_settings(num_workers: int, bytes_per_batch: int, persistent: bool = False) -> dict:
    """The DataLoader arguments of a training script's loaders: `num_workers` capped at the CPU count and at what
    /dev/shm holds (`check_shared_memory`, its one-line warning logged), the workers of `worker_loader_kwargs`,
    pinned memory on CUDA, and persistent workers when `persistent` (and there are any)."""
    import torch

    workers, message = check_shared_memory(min(num_workers, os.cpu_count() or 1), bytes_per_batch)
    if message:
        logger.warning("%s", message)
    kwargs = dict(pin_memory=torch.cuda.is_available(), **worker_loader_kwargs(workers))
    if persistent and workers > 0:
        kwargs["persistent_workers"] = True
    return kwargs
