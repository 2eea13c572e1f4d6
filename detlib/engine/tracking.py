"""What both training scripts need around the model: the Accelerator, logs, metrics, trackers, shm.

Logging happens on the main process only: it writes `output_dir/train.log` and the console; the other
processes print warnings and errors only. `MetricsLogger` writes `output_dir/metrics.jsonl` (one JSON
object per line) and forwards the same values to the trackers (wandb, tensorboard) through accelerate,
which creates one tracker run on the main process only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import netrc
import os
import re
import sys
import time
import uuid

import torch
import yaml

from ..files import atomic_write
from .flags import REPORT_TO

logger = logging.getLogger(__name__)

# The loggers whose INFO lines are the run's story: detlib's and its scripts'. Every other library logs at WARNING
# and above unless --verbose (onnxscript writes 80 "initializer_deduplication" lines per export, accelerate and
# faster-coco-eval one per checkpoint or evaluation).
OWN_LOGGERS = ("detlib", "train_retinanet", "train_catsdogs", "predict_retinanet", "predict_catsdogs",
               "export_retinanet", "check_dataset", "convert_weights")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def make_accelerator(mixed_precision: str | None, gradient_accumulation_steps: int, report_to: str,
                     output_dir: str, cpu: bool = False, seed: int = 0, verbose: bool = False,
                     compile_backend: str | None = None, compile_mode: str = "default"):
    """An `Accelerator` with the settings both scripts share.

    * On a machine without CUDA it runs on the CPU; launched with 2+ processes (e.g.
      `accelerate_configs/cpu_2proc.yaml`) that is real DDP over gloo.
    * Samplers are seedable: the shuffle order of epoch e is a function of (seed, e) on every rank, so
      epochs differ, shards stay disjoint and a resumed run sees the same order.
    * `mixed_precision=None` takes the value of the accelerate config / `accelerate launch` flags.
    * An offline wandb prints nothing of its own unless `verbose` (see `resolve_trackers`).
    * `compile_backend` ("inductor", "aot_eager", "eager"): `accelerator.prepare` compiles the model with
      `torch.compile(model, backend=..., mode=compile_mode)` around its DDP wrapper (accelerate's TorchDynamoPlugin),
      shapes dynamic after the first recompile (torch's automatic dynamic shapes). None: the accelerate config's.
    """
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration, TorchDynamoPlugin, set_seed

    log_with = resolve_trackers(report_to, verbose)
    accelerator = Accelerator(
        cpu=cpu or not torch.cuda.is_available(),
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=log_with or None,
        project_config=ProjectConfiguration(project_dir=output_dir, logging_dir=os.path.join(output_dir, "tensorboard")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        step_scheduler_with_optimizer=False,  # DDP keeps its default find_unused_parameters=False
        **({"dynamo_plugin": TorchDynamoPlugin(backend=compile_backend, mode=compile_mode)} if compile_backend else {}),
    )
    set_seed(seed, device_specific=False)
    return accelerator


def broadcast_object(accelerator, obj):
    """The main process's `obj` (any picklable value) on every process. Collective; a plain return on one process."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([obj])[0]  # a no-op without torch.distributed


def min_over_processes(accelerator, value: int) -> int:
    """The smallest of every process's `value`, e.g. a 0/1 flag that must hold on all of them. Collective."""
    return int(accelerator.gather(torch.tensor([float(value)], device=accelerator.device)).min())


def compile_summary() -> str | None:
    """One line on what torch.compile did in this process (`torch._dynamo.utils.counters`): the graphs compiled
    and the frames that fell back to eager; None when nothing was compiled."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"].get("unique_graphs", 0)
    if not graphs:
        return None
    failed = counters["frames"].get("total", 0) - counters["frames"].get("ok", 0)
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or getattr(torch._dynamo.config, "cache_size_limit", 8)
    line = f"torch.compile: {graphs} graph(s) compiled"
    if failed:
        line += f", {failed} frame(s) left to eager"
    if graphs >= limit:
        line += (f"; at torch._dynamo's recompile limit ({limit}): shapes past it run eagerly (torch._logs: run with "
                 "TORCH_LOGS=recompiles to see why each recompile happened)")
    return line


def enable_cpu_fp16(accelerator) -> None:
    """Make an Accelerator on the CPU run fp16 as it does on a GPU, for tests: the prepared model's forward under
    `torch.autocast("cpu", torch.float16)` (outputs cast back to float32, as accelerate does on a GPU) and a
    `torch.amp.GradScaler("cpu")` for `backward` (the loss scaled), `clip_grad_norm_` (unscaled first) and the
    optimizer step (skipped, and the scale halved, on a non-finite gradient). Call before `accelerator.prepare`.

    Why: accelerate runs `mixed_precision: fp16` on a CPU with no autocast and no GradScaler, in plain fp32, so a
    CPU run of the scripts would test nothing of fp16. This switches on the two pieces accelerate leaves out; the
    rest (the prepared model's autocast wrapper, `backward`, `unscale_gradients`, the optimizer's skip detection,
    the scaler in checkpoints) is accelerate's own GPU code path.
    Raises:
        ValueError: unless the accelerator is on the CPU with mixed precision "fp16".
    """
    if accelerator.device.type != "cpu" or accelerator.mixed_precision != "fp16":
        raise ValueError(f"enable_cpu_fp16 needs a CPU accelerator with mixed_precision fp16, got "
                         f"{accelerator.device.type} / {accelerator.mixed_precision}")
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu")


def log_run_setup(accelerator) -> None:
    """One line with the process count, device and precision (tests and users read the count from it),
    and a warning when the requested mixed precision is not applied (accelerate runs "fp16" on a CPU in fp32)."""
    logger.info("%d process(es), device %s, mixed precision %s", accelerator.num_processes, accelerator.device,
                accelerator.mixed_precision)
    if accelerator.mixed_precision != "no" and not accelerator.native_amp:
        logger.warning("mixed precision %s is not applied on %s by accelerate: the run computes in fp32 "
                       "(bf16 autocasts on CPUs)", accelerator.mixed_precision, accelerator.device.type)


def resolve_trackers(report_to: str, verbose: bool = False) -> list[str]:
    """Tracker names for `--report_to`; a tracker whose package is missing is dropped with a warning.

    wandb runs offline (WANDB_MODE=offline) when no credentials are set, so a run never stalls at a login
    prompt; `wandb sync output_dir/wandb/offline-run-*` uploads it later. Offline it says nothing on the console
    (WANDB_SILENT, unless set or `verbose`): the run's own log line says where it went and how to upload it.

    Raises:
        ValueError: for an unknown name.
    """
    if report_to not in REPORT_TO:
        raise ValueError(f"--report_to must be one of {REPORT_TO}, got {report_to!r}")
    out = []
    for name in {"all": ["wandb", "tensorboard"], "none": []}.get(report_to, [report_to]):
        try:
            __import__(name)  # the tracker's package has its name
        except ImportError:
            logger.warning("--report_to %s: the %s package is not installed (pip install %s); not logging to it",
                           report_to, name, name)
            continue
        except Exception as e:  # an installed package that fails to import (a protobuf or numpy version clash)
            logger.warning("--report_to %s: the %s package does not import (%s: %s); not logging to it", report_to,
                           name, type(e).__name__, _one_line(e))
            continue
        if name == "wandb" and "WANDB_MODE" not in os.environ and not wandb_has_credentials():
            os.environ["WANDB_MODE"] = "offline"
        if name == "wandb" and os.environ.get("WANDB_MODE") == "offline" and not verbose:
            os.environ.setdefault("WANDB_SILENT", "true")
        out.append(name)
    return out


def wandb_has_credentials() -> bool:
    """True when WANDB_API_KEY is set or ~/.netrc holds a key for the wandb host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class TrackerError(RuntimeError):
    """A tracker that cannot start; the message is one line that says what to do."""


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split())
    return text[:limit] + (" ..." if len(text) > limit else "")


def _start_failure(name: str, error: BaseException, report_to: str | None, output_dir: str, logging_dir: str) -> str:
    """The one line for a tracker `name` whose start raised `error`: what happened and the ways on."""
    flag = f"--report_to {report_to}" if report_to else "the tracker"
    offline = f"log offline with WANDB_MODE=offline (upload later with `wandb sync {output_dir}/wandb/offline-run-*`)"
    text = f"{type(error).__name__}: {_one_line(error).rstrip('.')}"
    if name == "wandb":
        mode = os.environ.get("WANDB_MODE", "online")
        low = text.lower()
        if "api key" in low or "api_key" in low or "authenticat" in low or re.search(r"\b401\b", low):
            todo = f"log in (`wandb login`, or set WANDB_API_KEY), or {offline}"
        elif any(w in low for w in ("connect", "timed out", "timeout", "deadline", "resolve", "network", "unreachable")):
            host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
            todo = f"check the network and the wandb host ({host}), or {offline}"
        else:
            todo = offline
        return f"{flag}: wandb could not start a run (WANDB_MODE={mode}): {text}; {todo}, or pass --report_to none"
    if name == "tensorboard" and isinstance(error, OSError):
        from ..weights import describe_write_failure

        text = describe_write_failure(error, logging_dir)
    return f"{flag}: {name} could not start ({text}); fix that, or pass --report_to none"


def init_trackers(accelerator, project: str, config: dict, output_dir: str, run_id: str | None, run_name: str | None = None,
                  report_to: str | None = None) -> str:
    """Start the tracker runs (main process only, done by accelerate) and return the wandb run id.

    The run id is kept in the checkpoints, so a resumed training continues the same wandb run.
    Raises:
        TrackerError: (main process) a tracker did not start (no credentials, no network, a folder it cannot
        write): one line naming the tracker, the error and what to do (`report_to` names the flag in it). The
        trackers that did start are closed again and none is left registered, so the end of the run does not
        fail a second time on a half-started tracker.
    """
    run_id = run_id or uuid.uuid4().hex[:12]
    name = run_name or os.path.basename(os.path.abspath(output_dir))
    init_kwargs = {"wandb": {"id": run_id, "resume": "allow", "dir": output_dir, "name": name}}
    try:
        # the trackers take int / float / str / bool values
        flat = {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in config.items()}
        accelerator.init_trackers(project, config=flat, init_kwargs=init_kwargs)
    except Exception as e:  # wandb raises UsageError, CommError, timeouts ...; tensorboard OSError
        started = [t for t in accelerator.trackers if getattr(t, "run", None) or getattr(t, "writer", None)]
        failed = next((t.name for t in accelerator.trackers if t not in started), "a tracker")
        for t in started:
            with contextlib.suppress(Exception):  # closing what started is a courtesy; the start failure is the message
                t.finish()
        accelerator.trackers.clear()
        raise TrackerError(_start_failure(failed, e, report_to, output_dir, accelerator.logging_dir)) from None
    if accelerator.is_main_process and os.environ.get("WANDB_MODE") == "offline" and any(
            getattr(t, "name", "") == "wandb" for t in accelerator.trackers):
        logger.info("wandb: no credentials found, logging offline under %s/wandb (upload later with `wandb sync`)", output_dir)
    return run_id


def finish_trackers(accelerator, output_dir: str) -> None:
    """Close every tracker run (main process; a no-op elsewhere). One that fails to close (network gone at the
    end, a full disk under its folder) is one warning line, not a traceback at exit: everything the run wrote to
    `output_dir` is complete. The trackers are unregistered, so `accelerator.end_training()` closes none again."""
    for tracker in list(accelerator.trackers):
        try:
            tracker.finish()
        except Exception as e:
            where = f"; its local copy is in {output_dir}/wandb (`wandb sync` uploads it)" if tracker.name == "wandb" else ""
            logger.warning("the %s tracker did not close cleanly (%s: %s); the run's own files in %s are complete%s",
                           tracker.name, type(e).__name__, _one_line(e), output_dir, where)
    accelerator.trackers.clear()


def set_log_levels(is_main: bool = True, verbose: bool = False) -> None:
    """INFO from OWN_LOGGERS on the main process, WARNING and above from everyone else (other processes, other
    libraries); `verbose`: INFO from every library too."""
    logging.getLogger().setLevel(logging.INFO if is_main and verbose else logging.WARNING)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if is_main else logging.WARNING)


def setup_console_logging(verbose: bool = False) -> None:
    """The console log of a one-process tool (export, data check): our INFO lines, the libraries' with `verbose`."""
    logging.basicConfig(format=LOG_FORMAT)  # not force=True: that would remove handlers others attached (pytest caplog)
    set_log_levels(True, verbose)


def setup_logging(output_dir: str, is_main: bool, filename: str = "train.log", verbose: bool = False) -> None:
    """Log to the console and `output_dir/train.log` on the main process (levels: `set_log_levels`); the other
    processes print warnings and errors only."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    console.setFormatter(fmt)
    # a record logged with extra={"console": False} goes to train.log only (its text is printed elsewhere)
    console.addFilter(lambda record: getattr(record, "console", True))
    root.addHandler(console)
    if is_main:
        os.makedirs(output_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(output_dir, filename))
        fh.setFormatter(fmt)
        root.addHandler(fh)
    set_log_levels(is_main, verbose)


def save_config(config: dict, output_dir: str) -> None:
    """Write the resolved config as `output_dir/config.yaml` (call on the main process)."""
    with atomic_write(os.path.join(output_dir, "config.yaml")) as f:
        yaml.safe_dump(config, f, sort_keys=False)


def last_logged_step(metrics_path: str) -> int:
    """The highest tracker step in `metrics.jsonl` ("tracker_step", else "step"); -1 when none or no file."""
    last = -1
    try:
        with open(metrics_path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    last = max(last, int(row.get("tracker_step", row.get("step") or 0)))
                except (ValueError, TypeError):
                    continue
    except OSError:
        pass
    return last


def set_tracker_offset(state, metrics_path: str, resumed: bool) -> None:
    """Trackers (wandb) drop a step lower than one already logged: after a resume from an older checkpoint,
    tracker steps continue after the last logged one (`state.tracker_offset`, of the run's
    `detlib.engine.checkpoint_io.TrainState`); metrics.jsonl keeps the true step. Main process only (it reads
    `metrics_path`)."""
    last = last_logged_step(metrics_path)
    if state.global_step + 1 + state.tracker_offset <= last and resumed:
        state.tracker_offset = last - state.global_step  # the next step, global_step + 1, is logged at last + 1
        logger.warning("resumed at step %d but the trackers already hold steps up to %d: tracker steps go on at %d "
                       "(step + %d); metrics.jsonl keeps the true step, and its lines after step %d are from the "
                       "abandoned part of the run", state.global_step, last, last + 1, state.tracker_offset,
                       state.global_step)


class MetricsLogger:
    """Appends metric dicts to `metrics.jsonl` and sends them to the trackers (main process only).

    Non-finite floats are written as the strings "nan" / "inf" so every line stays valid JSON. The trackers
    also get `epoch` as a fractional epoch (`tracker_epoch`), and wandb plots every scalar against it
    (`define_metric`), so the curves of a resumed run line up with the first part's.
    """

    def __init__(self, accelerator, output_dir: str):
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.step_offset = 0  # tracker step = step + offset (`set_tracker_offset`: a resume from an older checkpoint)
        self._defined: set[str] = set()

    def log(self, values: dict, step: int, tracker_epoch: float | None = None) -> None:
        if not self.accelerator.is_main_process:
            return
        line = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in values.items()}
        if self.step_offset:
            line["tracker_step"] = step + self.step_offset
        line["time"] = round(time.time(), 3)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        numeric = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if tracker_epoch is not None:
            numeric["epoch"] = float(tracker_epoch)
        if self.accelerator.trackers:
            self._define_epoch_axis(numeric)
            self.accelerator.log(numeric, step=step + self.step_offset)

    def _define_epoch_axis(self, numeric: dict) -> None:
        new = [k for k in numeric if k not in self._defined and k != "epoch"]
        if not new:
            return
        self._defined.update(new)
        for tracker in self.accelerator.trackers:
            if getattr(tracker, "name", "") == "wandb":
                run = tracker.tracker
                if "epoch" not in self._defined:
                    run.define_metric("epoch")
                    self._defined.add("epoch")
                for k in new:
                    run.define_metric(k, step_metric="epoch")
