"""The stop signals, one mechanism for training and predict: SIGTERM, SIGUSR1 and a first SIGINT are recorded, and the
loop acts on them at its next poll (a training run: `detlib.engine.bookkeeping.stop_if_preempted`, on every rank
together; a predict script between its batches); a second SIGINT a second or more after the first stops at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

from ..data.loaders import PREEMPT_SIGNALS

# A Ctrl-C reaches a process twice at once (from the terminal and forwarded by the launcher): only a SIGINT a
# second or more after the first is the user's second Ctrl-C, which stops at once.
SECOND_SIGINT_AFTER_S = 1.0

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
    its step boundaries (`stop_if_preempted`) and a predict script between its batches; a later second SIGINT raises
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
