"""What a run writes to resume from or to use, for `detlib.engine.run.Run`: its checkpoints (rotated; the format is
detlib.engine.checkpoint_io's), best/ when the validation metric beats every earlier value, last/ at the end, and the
end-of-run summary that points at them.

* Weights with a non-finite value are never written: the run stops instead (EXIT_DIVERGED), keeping the last
  good checkpoint.
* best/ must beat the best/ already on disk too, so a resume from an older checkpoint never replaces it with a
  worse model.
* A save that fails (disk full) stops the run with one line, keeping the older checkpoints.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import time
from typing import Callable

import torch

from ..weights import CheckpointError, all_finite, save_model_weights
from . import checkpoint_io as ckpt
from .run_folder import EXIT_DIVERGED, checkpoint_bytes
from .tracking import broadcast_object, min_over_processes

# The EMA weights' file in a checkpoint folder, beside accelerate's model.safetensors.
EMA_WEIGHTS = "model_ema"

# The run machinery logs under one name whichever of its modules writes the line (train.log shows the name).
logger = logging.getLogger("detlib.engine.run")


class Checkpointer:
    """Writes a run's checkpoints and weights folders (every method is collective: all ranks call it).

    Args:
        accelerator: the run's `accelerate.Accelerator`.
        output_dir: the run's folder (checkpoints/, best/, last/).
        metric: the validation metric best/ keeps the highest of, e.g. "AP".
        total_limit: checkpoints kept (0 or None: all).
        fail: the run's `fail(message, code)`: one error line, then exit (does not return).
    `model_config` (the model's description, written beside every weights file) is set once it is known, and
    `ema` (timm's ModelEmaV3 of the run's `--model_ema`, or None) once it is made: its weights go into every
    checkpoint as `model_ema.safetensors` and, at the end, into last_ema/.
    """

    def __init__(self, accelerator, output_dir: str, metric: str, total_limit: int | None,
                 fail: Callable[[str, int], None]):
        self.accelerator = accelerator
        self.output_dir = output_dir
        self.metric = metric
        self.total_limit = total_limit
        self.fail = fail
        self.model_config: dict | None = None
        # describe(folder, name): what a script writes beside the weights of best/ and last/ (main process), such
        # as a model card and the evaluation's score thresholds
        self.describe: Callable[[str, str], None] | None = None
        # the EMA of the weights (timm ModelEmaV3) whose state a checkpoint carries as model_ema.safetensors
        self.ema = None

    def _check_finite(self, model, what: str, step: int) -> None:
        ok = min_over_processes(self.accelerator, int(all_finite(self.accelerator.unwrap_model(model))))
        if not ok:
            self.fail(f"the model holds non-finite weights at step {step}: not writing {what}; "
                      f"the last good checkpoint is kept", EXIT_DIVERGED)

    def save_checkpoint(self, model, state: ckpt.TrainState, epoch_sums: torch.Tensor, optimizer=None) -> str:
        """Write a checkpoint of everything a resume needs; `epoch_sums` ([2] float64: this process's loss sum
        over images, image count) are summed over processes into `state` first. Returns its folder.
        `optimizer` sizes the checkpoint for the message of a failed save."""
        self._check_finite(model, "a checkpoint", state.global_step)
        extra = None
        if self.ema is not None:
            self._check_finite(self.ema.module, "a checkpoint (its EMA weights)", state.global_step)
            extra = {EMA_WEIGHTS: self.ema.module.state_dict()}
        state.epoch_loss_sum, state.epoch_images = self.accelerator.reduce(epoch_sums, reduction="sum").tolist()
        needed = checkpoint_bytes(model, optimizer)[1] if optimizer is not None else None
        t = time.time()
        try:
            path = ckpt.save_checkpoint(self.accelerator, self.output_dir, state, self.total_limit, self.model_config,
                                        needed_bytes=needed, extra_weights=extra)
        except ckpt.CheckpointError as e:
            self.fail(str(e), 1)
        logger.info("saved checkpoint %s (%.1f s)", path, time.time() - t)
        return path

    def save_weights(self, model, name: str, step: int, extra: dict | None = None) -> None:
        """`output_dir/name/model.safetensors` (+ model_config.json, + best.json from `extra`, + what `describe`
        writes); a failed write stops the run on every process with one line naming the file and the cause (the old
        file is kept)."""
        self._check_finite(model, f"{name}/", step)
        folder = os.path.join(self.output_dir, name)
        error = None
        try:
            save_model_weights(self.accelerator, model, folder, self.model_config, extra)
        except CheckpointError as e:  # main process only: the others learn it below
            error = f"{e}; the checkpoints in {ckpt.checkpoint_dir(self.output_dir)} are kept"
        error = broadcast_object(self.accelerator, error)
        if error:
            self.fail(error, 1)
        if self.describe is not None and self.accelerator.is_main_process:
            self.describe(folder, name)

    def keep_best(self, model, value: float, state: ckpt.TrainState, epoch: int, weights: str = "trained") -> bool:
        """Write best/ (best.json records `epoch`, the epoch number from 1, and `weights`: "trained" or "ema", which
        weights `model` holds) when `value` beats `state.best_metric` and the best/ on disk; raise
        `state.best_metric` to it (a non-finite value changes nothing). Returns True when best/ was written."""
        best = self.best_record()
        on_disk = float(best["value"]) if best else None
        improved = math.isfinite(value) and value > state.best_metric and (on_disk is None or value > on_disk)
        if math.isfinite(value):
            state.best_metric = max(state.best_metric, value)
        if improved:
            self.save_weights(model, "best", state.global_step, {"metric": self.metric, "value": value,
                                                                  "epoch": epoch, "step": state.global_step,
                                                                  "weights": weights})
            logger.info("new best %s %.4f (%s weights), saved %s/best/model.safetensors", self.metric, value, weights,
                        self.output_dir)
        return improved

    def best_record(self) -> dict | None:
        """best/best.json as the main process reads it, when it scores this run's metric: {"metric", "value",
        "epoch", "step"}; None when there is none, it is unreadable, or it scores another metric."""
        return broadcast_object(self.accelerator, read_best_record(self.output_dir, self.metric)
                                if self.accelerator.is_main_process else None)


def read_best_record(output_dir: str, metric: str) -> dict | None:
    """`output_dir/best/best.json` when it scores `metric` (see `Checkpointer.best_record`)."""
    try:
        with open(os.path.join(output_dir, "best", "best.json")) as f:
            best = json.load(f)
        float(best["value"])
        return best if best.get("metric") == metric else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def summary_lines(output_dir: str, metrics_path: str, metric: str, elapsed_s: float, global_step: int,
                  skipped_steps: int, best_metric: float, best: dict | None, final: float | None,
                  images_seen: float, final_also: dict[str, float] | None = None) -> list[str]:
    """The end-of-run summary: where the weights, checkpoints, metrics, the evaluation's files and the trackers'
    are (only those that exist), the mean throughput over `images_seen` images (all processes) when any were logged, and last, the
    verdict: time, steps, best `metric` (with best/'s epoch and step when `best` is its record), the `final` one and
    the last evaluation's `final_also` stats ({name: value})."""
    out = output_dir

    def existing(*names: str) -> list[str]:
        return [os.path.join(out, n) + ("/" if os.path.isdir(os.path.join(out, n)) else "") for n in names
                if os.path.exists(os.path.join(out, n))]

    weights = ([f"{p} (best)" for p in existing("best")] + [f"{p} (final)" for p in existing("last")]
               + [f"{p} (final EMA)" for p in existing("last_ema")])
    lines = []
    if weights or os.path.isdir(ckpt.checkpoint_dir(out)):
        lines.append("weights: " + (", ".join(weights) or "none") + (f"; checkpoints: {ckpt.checkpoint_dir(out)}"
                                                                     if os.path.isdir(ckpt.checkpoint_dir(out)) else ""))
    evaluation = existing("predictions_val.json", "predictions_val.csv", "plots", "samples")
    lines.append(f"metrics: {metrics_path}" + (f"; evaluation: {', '.join(evaluation)}" if evaluation else ""))
    trackers = ([f"tensorboard --logdir {os.path.join(out, 'tensorboard')}"] if os.path.isdir(os.path.join(out, "tensorboard"))
                else []) + ([f"wandb sync {os.path.join(out, 'wandb', 'offline-run-*')} (offline run)"]
                            if glob.glob(os.path.join(out, "wandb", "offline-run-*")) else [])
    if trackers:
        lines.append("trackers: " + "; ".join(trackers))
    if images_seen:
        lines.append(f"mean throughput {images_seen / elapsed_s:.1f} images/s (all processes)")
    lines.append(f"run finished in {elapsed_s / 60:.1f} min: {global_step} steps, {skipped_steps} skipped; "
                 f"best {metric} {best_metric:.4f}" + (f" (epoch {best['epoch']}, step {best['step']})" if best else "")
                 + (f", final {metric} {final:.4f}" if final is not None else "")
                 + "".join(f", {k} {v:.4f}" for k, v in (final_also or {}).items()))
    return lines
