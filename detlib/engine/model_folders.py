"""The weights folders a run leaves for predict and export (docs/outputs.md): best/ (the best evaluation's weights,
the trained ones or their EMA, with best.json) and last/, last_ema/ (the weights at the end). Each holds
model.safetensors, model_config.json and the script's files beside them (its model card).
"""

from __future__ import annotations

import logging
import math
import os

from accelerate.utils import broadcast_object_list

from ..weights import WeightsFileError, finite_weights, read_json_object, save_model_weights
from .exits import EXIT_DIVERGED, RunStop, on_every_process, stop_together
from .train_state import TrainState

logger = logging.getLogger(__name__)


def save_weights(accelerator, model, output_dir: str, name: str, model_config: dict | None,
                 extra: dict | None = None) -> str:
    """`output_dir/name/` (collective): model.safetensors, model_config.json, `extra` as best.json; returns the folder.
    Raises RunStop: a non-finite weight (EXIT_DIVERGED, nothing written) or a failed write (the old files kept)."""
    folder, error = os.path.join(output_dir, name), None
    if not on_every_process(accelerator, finite_weights(accelerator.unwrap_model(model))):
        raise RunStop(f"the model holds non-finite weights: not writing {name}/; the last good checkpoint is kept",
                      EXIT_DIVERGED)
    try:
        save_model_weights(accelerator, model, folder, model_config, extra)
    except WeightsFileError as e:  # main process only
        error = f"{e}; the checkpoints in {os.path.join(output_dir, 'checkpoints')} are kept"
    stop_together(accelerator, error)
    return folder


def best_record(accelerator, output_dir: str, metric: str) -> dict | None:
    """best/best.json as the main process reads it ({"metric", "value", "epoch", "step", "weights"}) when it scores
    `metric`, else None (collective)."""
    record = None
    if accelerator.is_main_process:
        try:
            record = read_json_object(os.path.join(output_dir, "best", "best.json"))
            record = record if record.get("metric") == metric and math.isfinite(float(record["value"])) else None
        except (WeightsFileError, KeyError, TypeError, ValueError):
            record = None
    return broadcast_object_list([record])[0]


def best_weights(evaluations: dict[str, dict], metric: str) -> str:
    """Which of one evaluation's weights ({"": the trained, "ema_": their EMA}) best/ would take: the higher `metric`,
    the trained weights on a tie or a non-finite EMA score."""
    return "ema_" if evaluations.get("ema_", {}).get(metric, -math.inf) > evaluations[""][metric] else ""


def improves_best(accelerator, output_dir: str, metric: str, value: float, state: TrainState) -> bool:
    """Whether `value` beats every earlier evaluation of the run and the best/ on disk (a resume from an older
    checkpoint never replaces best/ with a worse model); raises `state.best_metric` to it and counts
    `state.evals_without_improvement` (0 when better). Collective."""
    best = best_record(accelerator, output_dir, metric)
    better = math.isfinite(value) and value > state.best_metric and (best is None or value > float(best["value"]))
    if math.isfinite(value):
        state.best_metric = max(state.best_metric, value)
    state.evals_without_improvement = 0 if better else state.evals_without_improvement + 1
    return better


def keep_best(accelerator, output_dir: str, metric: str, evaluations: dict[str, dict], models: dict, state,
              model_config: dict, write_files) -> None:
    """best/ takes the better weights of one evaluation (`evaluations` and `models`: {"": the trained, "ema_": their
    EMA}, each evaluation holding its epoch and `metric`) when they beat every earlier evaluation (`improves_best`,
    which also counts `state.evals_without_improvement`); `write_files(folder, name, evaluation)`: the script's files
    beside the weights (main process). Collective."""
    prefix = best_weights(evaluations, metric)
    value = evaluations[prefix][metric]
    if not improves_best(accelerator, output_dir, metric, value, state):
        return
    folder = save_weights(accelerator, models[prefix], output_dir, "best", model_config, {
        "metric": metric, "value": value, "epoch": evaluations[prefix]["epoch"], "step": state.global_step,
        "weights": "ema" if prefix else "trained"})
    if accelerator.is_main_process:
        write_files(folder, "best", evaluations[prefix])
    logger.info("new best %s %.4f (%s weights), saved %s/best/", metric, value, "EMA" if prefix else "trained", output_dir)


def finish_run(accelerator, output_dir: str, metric: str, models: dict, evaluations: dict[str, dict], trained: bool,
               model_config: dict, write_files) -> dict | None:
    """The end of a training run: last/ (`models[""]`, the weights at the end) when the run `trained` or has no last/
    yet, and last_ema/ (`models["ema_"]`, absent without --model_ema) when it trained, each with its evaluation in
    `evaluations` when that was of these very weights (else None). Returns best/'s record (`best_record`) for the
    summary. Collective."""
    for prefix, name in (("", "last"), ("ema_", "last_ema")):
        if prefix in models and (trained or (not prefix and not os.path.isdir(os.path.join(output_dir, name)))):
            folder = save_weights(accelerator, models[prefix], output_dir, name, model_config)
            if accelerator.is_main_process:
                write_files(folder, name, evaluations.get(prefix))
    return best_record(accelerator, output_dir, metric)
