"""What a run records: the trackers (tensorboard, wandb through accelerate; started, failing in one line, closed) and
metrics.jsonl, one JSON line per train line and evaluation, written beside the trackers at the global step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import netrc
import os
import time
import uuid

from ..files import CacheNotWritable, check_cache
from .exits import stop_together
from .flags import REPORT_TO

logger = logging.getLogger(__name__)


def resolve_trackers(report_to: str, verbose: bool = False) -> list[str]:
    """The trackers of `report_to` whose package imports (a warning for each that does not); wandb offline without
    credentials (never a login prompt), silent offline unless `verbose`. Raises ValueError for an unknown name."""
    if report_to not in REPORT_TO:
        raise ValueError(f"--report_to must be one of {REPORT_TO}, got {report_to!r}")
    out = []
    for name in {"all": ["wandb", "tensorboard"], "none": []}.get(report_to, [report_to]):
        try:
            __import__(name)
        except Exception as e:  # missing, or installed and broken (a protobuf or numpy version clash)
            logger.warning("--report_to %s: the %s package %s; not logging to it", report_to, name,
                           "is not installed (pip install %s)" % name if isinstance(e, ImportError)
                           else f"does not import ({type(e).__name__}: {_one_line(e)})")
            continue
        if name == "wandb" and "WANDB_MODE" not in os.environ and not _wandb_credentials():
            os.environ["WANDB_MODE"] = "offline"
        if name == "wandb" and os.environ.get("WANDB_MODE") == "offline" and not verbose:
            os.environ.setdefault("WANDB_SILENT", "true")
        out.append(name)
    return out


def _wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split())
    return text[:limit] + (" ..." if len(text) > limit else "")


def start_trackers(accelerator, project: str, config: dict, output_dir: str, run_id: str | None = None,
                   run_name: str | None = None, report_to: str = "") -> str:
    """Start the tracker runs (collective) and return the wandb run id (kept in the checkpoints: a resumed run logs
    into the same wandb run). Raises RunStop on every process when one did not start (no credentials, no network, a
    folder it cannot write): one line naming it, the error and the ways on; the others are closed."""
    run_id, error = run_id or uuid.uuid4().hex[:12], None
    name = run_name or os.path.basename(os.path.abspath(output_dir))
    if accelerator.is_main_process and "wandb" in [str(t) for t in accelerator.log_with]:
        error = _wandb_caches(report_to)
    stop_together(accelerator, error)
    flat = {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in config.items()}
    try:
        accelerator.init_trackers(project, config=flat, init_kwargs={"wandb": {"id": run_id, "resume": "allow",
                                                                              "dir": output_dir, "name": name}})
    except Exception as e:  # wandb raises UsageError, CommError, timeouts ...; tensorboard OSError
        started = [t for t in accelerator.trackers if getattr(t, "run", None) or getattr(t, "writer", None)]
        failed = next((t.name for t in accelerator.trackers if t not in started), "a tracker")
        for t in started:
            with contextlib.suppress(Exception):
                t.finish()
        accelerator.trackers.clear()
        offline = f"log offline with WANDB_MODE=offline (upload later with `wandb sync {output_dir}/wandb/offline-run-*`)"
        todo = (f"log in (`wandb login`, or set WANDB_API_KEY), check the network and WANDB_BASE_URL, or {offline}"
                if failed == "wandb" else "fix that")
        error = (f"--report_to {report_to}: {failed} could not start ({type(e).__name__}: {_one_line(e).rstrip('.')}); "
                 f"{todo}, or pass --report_to none")
    stop_together(accelerator, error)
    return run_id


def _wandb_caches(report_to: str) -> str | None:
    """The line of a wandb folder outside the run folder that cannot be written (its artifacts' staging folder, in
    WANDB_DATA_DIR, failed at the first logged image, mid-run), else None."""
    import wandb.env

    try:
        for folder, kind in ((wandb.env.get_data_dir(), "DATA"), (wandb.env.get_cache_dir(), "CACHE")):
            check_cache(str(folder), f"{kind.lower()} folder of wandb", f"set WANDB_{kind}_DIR to a writable folder, or "
                        "pass --report_to tensorboard")
    except CacheNotWritable as e:
        return f"--report_to {report_to}: {e}"
    return None


def finish_trackers(accelerator, output_dir: str) -> None:
    """Close every tracker run (one that fails to: a warning, not a traceback at exit) and unregister them."""
    for tracker in list(accelerator.trackers):
        try:
            tracker.finish()
        except Exception as e:
            logger.warning("the %s tracker did not close cleanly (%s: %s); the run's own files in %s are complete",
                           tracker.name, type(e).__name__, _one_line(e), output_dir)
    accelerator.trackers.clear()


class MetricsLog:
    """`output_dir/metrics.jsonl` (main process; non-finite floats as "nan" / "inf": every line stays JSON) and the
    trackers at `step`, with the fractional `tracker_epoch` as their "epoch"."""

    def __init__(self, accelerator, output_dir: str):
        self.accelerator, self.path = accelerator, os.path.join(output_dir, "metrics.jsonl")

    def log(self, values: dict, step: int, tracker_epoch: float | None = None) -> None:
        if not self.accelerator.is_main_process:
            return
        line = {k: v if not isinstance(v, float) or math.isfinite(v) else str(v) for k, v in values.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({**line, "time": round(time.time(), 3)}) + "\n")
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if tracker_epoch is not None:
            numbers["epoch"] = float(tracker_epoch)
        if self.accelerator.trackers:
            self.accelerator.log(numbers, step=step)
