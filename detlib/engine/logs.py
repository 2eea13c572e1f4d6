"""What a run shows: the Accelerator it runs on, its log (detlib's INFO lines, every library's warnings, on the main
process; --verbose: all), metrics.jsonl and the trackers at the global step, the train line, the summary.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import netrc
import os
import sys
import time
import uuid

import torch
import yaml

from ..files import CacheNotWritable, atomic_write, check_cache
from ..logtext import escape_unencodable
from .flags import REPORT_TO
from .run_folder import stop_together

logger = logging.getLogger(__name__)

OWN_LOGGERS = ("detlib", "train_retinanet", "train_catsdogs", "predict_retinanet", "predict_catsdogs",
               "export_retinanet", "check_dataset", "convert_weights", "compare_predictions")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def make_accelerator(mixed_precision: str | None = None, gradient_accumulation_steps: int = 1,
                     report_to: str = "none", output_dir: str = ".", seed: int = 0, verbose: bool = False,
                     compile_backend: str | None = None, compile_mode: str = "default", cpu: bool = False):
    """The scripts' `Accelerator`: the CPU without CUDA or with `cpu` (DDP over gloo on 2+ processes); seedable
    samplers (epoch e's order a function of (seed, e): disjoint shards, the same after a resume); `mixed_precision`
    None: the accelerate config's; `report_to`'s trackers; `compile_backend`: the prepared model compiled."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration, TorchDynamoPlugin, set_seed

    accelerator = Accelerator(
        cpu=cpu or not torch.cuda.is_available(), mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps, log_with=resolve_trackers(report_to, verbose) or None,
        project_config=ProjectConfiguration(project_dir=output_dir, logging_dir=os.path.join(output_dir, "tensorboard")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        step_scheduler_with_optimizer=False,
        **({"dynamo_plugin": TorchDynamoPlugin(backend=compile_backend, mode=compile_mode)} if compile_backend else {}))
    set_seed(seed, device_specific=False)
    return accelerator


def log_run_setup(accelerator) -> None:
    """The process count, device and precision; a warning where accelerate does not apply the precision."""
    logger.info("%d process(es), device %s, mixed precision %s", accelerator.num_processes, accelerator.device,
                accelerator.mixed_precision)
    if accelerator.mixed_precision != "no" and not accelerator.native_amp:
        logger.warning("mixed precision %s is not applied on %s by accelerate: the run computes in fp32 (bf16 "
                       "autocasts on CPUs)", accelerator.mixed_precision, accelerator.device.type)


def set_log_levels(is_main: bool = True, verbose: bool = False) -> None:
    """The main process: our INFO lines; the others: our errors (our warnings, alike on every rank, come once)."""
    logging.getLogger().setLevel(logging.INFO if is_main and verbose else logging.WARNING)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if is_main else logging.ERROR)


def setup_console_logging(verbose: bool = False) -> None:
    """The console log of a one-process tool (export, data check)."""
    escape_unencodable()
    logging.basicConfig(format=LOG_FORMAT)  # not force=True: that would remove handlers others attached (caplog)
    set_log_levels(True, verbose)


def setup_logging(output_dir: str, is_main: bool, filename: str = "train.log", verbose: bool = False) -> None:
    """The console (stdout on the main process, stderr elsewhere) and the main process's `output_dir/filename`; a
    record logged with extra={"console": False} goes to the file only (its text is printed elsewhere)."""
    escape_unencodable()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    console.setFormatter(fmt)
    console.addFilter(lambda record: getattr(record, "console", True))
    root.addHandler(console)
    if is_main:
        os.makedirs(output_dir, exist_ok=True)
        file = logging.FileHandler(os.path.join(output_dir, filename), encoding="utf-8")
        file.setFormatter(fmt)
        root.addHandler(file)
    set_log_levels(is_main, verbose)


def save_config(config: dict, path: str) -> None:
    """`config` as YAML at `path` (a run's config.yaml: `--config` reads it back)."""
    with atomic_write(path) as f:
        yaml.safe_dump(config, f, sort_keys=False)


def record_config(accelerator, config: dict, given: str, output_dir: str) -> None:
    """`output_dir/config.yaml` (main process) and one log line: `given`, the flags the user set as a command line
    (`detlib.engine.flags.format_given`), the rest being the defaults."""
    if accelerator.is_main_process:
        save_config(config, os.path.join(output_dir, "config.yaml"))
    logger.info("config: %s; all %d settings in %s", f"the defaults and {given}" if given else "the defaults",
                len(config), os.path.join(output_dir, "config.yaml"))


# ---- trackers

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


class TrainWindow:
    """The train line: each value's mean over the images since the last line and all processes, images per second,
    the fraction of the time spent waiting for the loader."""

    def __init__(self, accelerator):
        self.accelerator, self.images_seen = accelerator, 0.0  # images over all processes in the lines so far
        self._reset()

    def _reset(self) -> None:
        self.keys, self.sums, self.images, self.data_time, self.start = None, None, 0, 0.0, time.time()

    def timed(self, batches):
        """`batches`, counting the time each one is waited for."""
        it = iter(batches)
        while True:
            t = time.time()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.data_time += time.time() - t
            yield batch

    def add(self, values: dict[str, torch.Tensor], num_images: int) -> None:
        """One micro-batch's 0-d values (means over its `num_images` images)."""
        stacked = torch.stack([v.detach().float() for v in values.values()]) * num_images
        self.keys, self.sums = list(values), stacked if self.sums is None else self.sums + stacked
        self.images += num_images

    def line(self) -> dict:
        """The window's means (collective: every rank calls it at the same steps), then a new window."""
        acc, elapsed = self.accelerator, max(1e-9, time.time() - self.start)
        totals = acc.reduce(torch.cat([self.sums, torch.tensor([float(self.images)], device=self.sums.device)]),
                            reduction="sum").tolist()
        line = {k: v / max(totals[-1], 1) for k, v in zip(self.keys, totals[:-1])}
        line.update(images_per_s=totals[-1] / elapsed, data_time_fraction=min(1.0, self.data_time / elapsed))
        self.images_seen += totals[-1]
        if acc.scaler is not None:
            line["loss_scale"] = float(acc.scaler.get_scale())
        if torch.cuda.is_available():
            line["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self._reset()
        return line

    def log(self, metrics: MetricsLog, state, lrs: list[float], grad_norm: float, steps_per_epoch: int) -> None:
        """The train line after step `state.global_step` (collective): epoch (from 1), step, the window's means, the
        LRs the step used (`lrs`, per param group: lr, lr_1, ...), its pre-clip grad_norm, the skipped steps so far."""
        line = {"epoch": state.epoch + 1, "step": state.global_step, **self.line(), "lr": lrs[0], "grad_norm": grad_norm,
                "skipped_steps": state.skipped_steps, **{f"lr_{i}": lr for i, lr in enumerate(lrs[1:], 1)}}
        metrics.log(line, step=state.global_step, tracker_epoch=state.epoch + state.step_in_epoch / steps_per_epoch)
        # the console shows a group's lr_i only where it differs from lr (the groups without weight decay share it)
        shown = {k: v for k, v in line.items() if k not in ("epoch", "step", "data_time_fraction")
                 and not (k.startswith("lr_") and v == line["lr"])}
        logger.info("epoch %d step %d: %s", line["epoch"], line["step"],
                    ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))


def log_plan(state, epochs: int, total_steps: int, steps_per_epoch: int, images_per_step: int, lr: float,
             max_grad_norm: float | None = None) -> None:
    """The training's one start line (what a progress bar would say, the LR it starts at: a resume with another
    --epochs moves a schedule, and the gradient clipping), or that nothing is left to train."""
    if state.epoch >= epochs or state.global_step >= total_steps:
        logger.warning("nothing left to train: the run has done %d of %d epochs, step %d of %d; pass a larger %s to "
                       "train on", state.epoch, epochs, state.global_step, total_steps,
                       "--epochs" if state.epoch >= epochs else "--max_steps")
    else:
        logger.info("training: %d optimizer steps (%d per epoch, %d images each over all processes), from step %d at "
                    "lr %.3g, %s", total_steps, steps_per_epoch, images_per_step, state.global_step, lr,
                    f"gradients clipped to norm {max_grad_norm:g} (--max_grad_norm)" if max_grad_norm else
                    "no gradient clipping (--max_grad_norm 0)")


def summary_lines(output_dir: str, metric: str, elapsed_s: float, state, best: dict | None, final: dict | None,
                  images_seen: float, ema: bool = False, also: tuple[str, ...] = ()) -> list[str]:
    """The end-of-run summary: where the weights (`ema`: this run kept last_ema/ to its end), checkpoints, metrics,
    evaluation files and trackers' files are, the throughput; last, the verdict: time, steps, best `metric` (with
    best/'s epoch and step from its record `best`), the `final` evaluation's `metric` and `also` stats."""
    def there(names: dict) -> list[str]:  # {name: what it is} -> "path (what)" of those in the run folder
        return [os.path.join(output_dir, n) + "/" * os.path.isdir(os.path.join(output_dir, n)) + f" ({what})" * bool(what)
                for n, what in names.items() if os.path.exists(os.path.join(output_dir, n))]

    weights = there({"best": "best", "last": "final", "last_ema": "final EMA" if ema else "the EMA of an earlier part "
                     "of the run, not of its end", "checkpoints": "checkpoints"})
    files = there(dict.fromkeys(("predictions_val.json", "predictions_val.csv", "plots", "samples", "label_errors.json"), ""))
    lines = ["weights: " + (", ".join(weights) or "none"),
             f"metrics: {os.path.join(output_dir, 'metrics.jsonl')}" + f"; evaluation: {', '.join(files)}" * bool(files)]
    trackers, offline = [], os.path.join(output_dir, "wandb", "offline-run-*")
    if os.path.isdir(os.path.join(output_dir, "tensorboard")):
        trackers.append(f"tensorboard --logdir {os.path.join(output_dir, 'tensorboard')}")
    if glob.glob(offline):
        trackers.append(f"wandb sync {offline} (offline run)")
    if trackers:
        lines.append("trackers: " + "; ".join(trackers))
    if images_seen:
        lines.append(f"mean throughput {images_seen / elapsed_s:.1f} images/s (all processes)")
    lines.append(f"run finished in {elapsed_s / 60:.1f} min: {state.global_step} steps, {state.skipped_steps} skipped; "
                 f"best {metric} {state.best_metric:.4f}" + (f" (epoch {best['epoch']}, step {best['step']})" if best else "")
                 + "".join(f", {'final ' * (k == metric)}{k} {final[k]:.4f}" for k in (metric, *also) if k in (final or {})))
    return lines
