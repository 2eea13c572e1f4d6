"""What a run records at its start and says at its end: config.yaml with its one line and the tracker runs
(`start_run`), the plan line (`log_plan`), and the summary (`log_summary`).
"""

from __future__ import annotations

import glob
import logging
import os

from .flags import save_config
from .stopping import expect_save
from .trackers import start_trackers

logger = logging.getLogger(__name__)


def start_run(accelerator, state, config: dict, given: str, output_dir: str, project: str, run_name: str | None,
              report_to: str, checkpointed: list | None = None) -> None:
    """config.yaml and its line (`record_config`), then the tracker runs (collective), their wandb id kept in
    `state.run_id` so that a resumed run logs into the same run. `checkpointed`: the models a checkpoint will hold,
    whose size --time_limit keeps for the first save before one is timed."""
    record_config(accelerator, config, given, output_dir)
    state.run_id = start_trackers(accelerator, project, config, output_dir, state.run_id, run_name, report_to)
    if checkpointed:  # the weights, and up to 2 more copies in the optimizer's state (AdamW's moments)
        expect_save(3 * sum(t.numel() * t.element_size() for m in checkpointed for t in (*m.parameters(), *m.buffers())))


def record_config(accelerator, config: dict, given: str, output_dir: str) -> None:
    """`output_dir/config.yaml` (main process) and one log line: `given`, the flags the user set as a command line
    (`detlib.engine.flags.format_given`), the rest being the defaults."""
    if accelerator.is_main_process:
        save_config(config, os.path.join(output_dir, "config.yaml"))
    logger.info("config: %s; all %d settings in %s", f"the defaults and {given}" if given else "the defaults",
                len(config), os.path.join(output_dir, "config.yaml"))


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


def log_summary(output_dir: str, metric: str, elapsed_s: float, state, best: dict | None, final: dict | None,
                images_seen: float, ema: bool = False, also: tuple[str, ...] = ()) -> None:
    """The summary (`summary_lines`) as one log entry."""
    logger.info("summary:\n  %s", "\n  ".join(summary_lines(output_dir, metric, elapsed_s, state, best, final,
                                                             images_seen, ema, also)))
