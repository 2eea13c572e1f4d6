"""Where a run starts, for `detlib.engine.run.Run.resume_point` / `Run.resume`: its length in optimizer steps, the
checkpoint it resumes and whether that fits this run (its classes, its optimizer), the counters of a checkpoint
written in another geometry (process count x batch size x accumulation), and the tracker steps after a resume
from an older checkpoint. The LR schedule's part is `detlib.engine.schedules.build_scheduler`.

Resume guarantees: `latest` skips damaged checkpoints (detlib.engine.checkpoint_io); a checkpoint of another process
count or batch size continues at the same position in samples seen; another `--epochs` continues a cosine
schedule from its current LR. The functions take the run's `TrainState` and plain values, and write the
state's fields they name.
"""

from __future__ import annotations

import json
import logging
import math
import os

from ..weights import read_json_object
from .checkpoint_io import CheckpointError, TrainState, resolve_resume
from .tracking import broadcast_object

logger = logging.getLogger(__name__)


class ResumeError(Exception):
    """No checkpoint to resume, or one that does not fit this run (another model or optimizer); one line."""


def run_length(batches_per_epoch: int, num_processes: int, per_device_batch_size: int, accumulation_steps: int,
               epochs: int, max_steps: int | None) -> tuple[int, int, int]:
    """Returns (optimizer steps per epoch, samples per step over all processes, total optimizer steps).

    `batches_per_epoch` is one process's; `max_steps` (when set) replaces `epochs` x steps per epoch.
    """
    # accumulate() also steps at the end of the loader, so a partial last window is one more step.
    steps_per_epoch = math.ceil(batches_per_epoch / accumulation_steps)
    samples_per_step = num_processes * per_device_batch_size * accumulation_steps
    return steps_per_epoch, samples_per_step, max_steps or epochs * steps_per_epoch


def resolve_checkpoint(accelerator, output_dir: str, resume_from: str) -> str:
    """The checkpoint folder `--resume_from_checkpoint` names (collective: the main process resolves `latest`,
    past damaged checkpoints). Raises ResumeError (on every process) when there is none to resume."""
    error = resume = None
    if accelerator.is_main_process:
        try:
            resume = resolve_resume(output_dir, resume_from)
        except CheckpointError as e:
            error = f"--resume_from_checkpoint: {e}"
    error, resume = broadcast_object(accelerator, (error, resume))
    if error:
        raise ResumeError(error)
    return resume


# model_config.json keys that list the classes in label order. Resumed onto data whose list differs only in names
# or order, the weights still load and label i silently trains as another class; another count fails at load.
CLASS_LIST_KEYS = ("category_ids", "category_names", "classes")


def check_same_classes(checkpoint: str, model_config: dict | None) -> None:
    """Raise ResumeError when the checkpoint's `model_config.json` lists other classes (ids, names or their
    order) than this run's data (`model_config`); a checkpoint without the lists passes."""
    path = os.path.join(checkpoint, "model_config.json")
    if not os.path.exists(path):
        return
    try:
        saved = read_json_object(path)  # a list or a number in it is damaged too, not an AttributeError below
    except CheckpointError as e:
        raise ResumeError(f"cannot resume from {checkpoint}: {e}") from None
    for key in CLASS_LIST_KEYS:
        ours, theirs = (model_config or {}).get(key), saved.get(key)
        if ours is None or theirs is None or list(ours) == list(theirs):
            continue
        first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        raise ResumeError(
            f"cannot resume from {checkpoint}: its classes differ from this run's data ({key}: {len(theirs)} in the "
            f"checkpoint, {len(ours)} here; first difference at label {first}: "
            f"{theirs[first] if first < len(theirs) else 'none'!r} vs {ours[first] if first < len(ours) else 'none'!r}), "
            "so labels would change meaning; to train on these classes start a new run with --init_from")


def load_ema_weights(ema, checkpoint: str | None, file_name: str) -> None:
    """Put the EMA weights of `checkpoint` (`checkpoint/file_name.safetensors`) into `ema.module` (timm's ModelEmaV3,
    made from the resumed weights). A checkpoint without the file (its run had no --model_ema) leaves the average
    starting from the resumed weights, with a warning. Raises ResumeError when the file does not fit the model."""
    if checkpoint is None:
        return
    path = os.path.join(checkpoint, f"{file_name}.safetensors")
    if not os.path.isfile(path):
        logger.warning("--model_ema: %s holds no EMA weights (%s.safetensors; its run had no --model_ema): the average "
                       "starts from the resumed weights", checkpoint, file_name)
        return
    from ..weights import load_state_dict_file

    try:
        ema.module.load_state_dict(load_state_dict_file(path), strict=True)
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()
        raise ResumeError(f"cannot resume the EMA weights {path}: {first[0][:200] if first else type(e).__name__}") from None
    logger.info("resumed the EMA weights from %s", path)


# Optimizer settings (param-group keys) that a checkpoint's optimizer state brings back over this run's flags.
RECIPE_FLAGS = {"initial_lr": "--lr", "weight_decay": "--weight_decay", "momentum": "--momentum"}


def replaced_by_checkpoint(asked: list[dict], loaded: list[dict], saved_schedule: dict | None, checkpoint: str) -> list[str]:
    """The flags of this run whose values a resumed checkpoint's optimizer state replaced, one line each (flag,
    value asked for, value used): a resume continues the checkpoint's recipe, and another --lr is said, not
    silently dropped.

    Args:
        asked: this run's param groups (without "params") before the checkpoint was loaded.
        loaded: the param groups after `accelerator.load_state`.
        saved_schedule: the checkpoint's `TrainState.schedule`; a plateau run's base LR is its `base_lrs` (the
            groups' `lr` has its drops in it; a checkpoint written before base_lrs was recorded is not compared).
    Raises:
        ResumeError: this run's optimizer has settings the checkpoint's lacks (another --optimizer: SGD's momentum
            against AdamW's betas), which would fail at the first step.
    """
    lacking = set(asked[0]) - set(loaded[0]) - {"initial_lr"} if asked and loaded else set()
    if lacking:
        raise ResumeError(f"cannot resume from {checkpoint}: its optimizer is another one than this run's (its state "
                          f"has no {', '.join(sorted(lacking))}: another --optimizer?); resume with the checkpoint's "
                          "optimizer, or start a new run from its weights with --init_from")
    lines = []
    base = (saved_schedule or {}).get("base_lrs")
    for key, flag in RECIPE_FLAGS.items():
        for i, (a, g) in enumerate(zip(asked, loaded)):
            if key == "initial_lr":  # the base LR: the scheduler's, else (plateau) the recorded one
                ours = a.get("initial_lr", a.get("lr"))
                theirs = g["initial_lr"] if "initial_lr" in g else (base[i] if base and i < len(base) else None)
            else:
                ours, theirs = a.get(key), g.get(key)
            if not isinstance(ours, (int, float)) or not isinstance(theirs, (int, float)) or ours == theirs:
                continue
            lines.append(f"{flag} {ours:g} is not used: the resumed checkpoint's optimizer state brings back its run's "
                         f"{theirs:g} (a resume continues that recipe; to train with another, start a new run with "
                         f"--init_from {checkpoint})")
            break  # one line per flag
    return lines


def convert_position(state: TrainState, saved: TrainState, num_processes: int, samples_per_step: int,
                     steps_per_epoch: int) -> bool:
    """Move the counters of a checkpoint counted in another geometry to the same position in samples seen,
    in this run's steps (`state.step_in_epoch`, `state.global_step`); logs what moved.

    Args:
        state: this run's counters, already loaded from `saved`.
        saved: the checkpoint's counters, with the geometry they were counted in.
        num_processes, samples_per_step, steps_per_epoch: this run's geometry (samples over all processes
            and accumulation micro-batches per optimizer step).
    Returns True when the counters moved (the geometry differs), False otherwise.
    """
    old_spe = saved.steps_per_epoch
    if not old_spe or (saved.num_processes == num_processes and saved.samples_per_step == samples_per_step
                       and old_spe == steps_per_epoch):
        return False
    in_epoch = min(steps_per_epoch - 1, round(saved.step_in_epoch * steps_per_epoch / old_spe))
    state.step_in_epoch = in_epoch if saved.step_in_epoch else 0
    state.global_step = saved.epoch * steps_per_epoch + state.step_in_epoch
    logger.warning(
        "the checkpoint was written by %s process(es) at %s samples per step (%d steps per epoch); this run has %d "
        "at %d (%d steps per epoch): epoch %d step %d -> step %d, global step %d -> %d, so the LR schedule keeps its "
        "position in samples seen.%s", saved.num_processes, saved.samples_per_step, old_spe,
        num_processes, samples_per_step, steps_per_epoch, saved.epoch + 1,  # the epoch it was in, from 1
        saved.step_in_epoch, state.step_in_epoch, saved.global_step, state.global_step,
        " The rest of this epoch is read in the new process count's order (some of its images may be seen twice "
        "or not at all); later epochs are exact." if saved.step_in_epoch else "")
    return True


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


def set_tracker_offset(state: TrainState, metrics_path: str, resumed: bool) -> None:
    """Trackers (wandb) drop a step lower than one already logged: after a resume from an older checkpoint,
    tracker steps continue after the last logged one (`state.tracker_offset`); metrics.jsonl keeps the true
    step. Main process only (it reads `metrics_path`)."""
    last = last_logged_step(metrics_path)
    if state.global_step + 1 + state.tracker_offset <= last and resumed:
        state.tracker_offset = last - state.global_step  # the next step, global_step + 1, is logged at last + 1
        logger.warning("resumed at step %d but the trackers already hold steps up to %d: tracker steps go on at %d "
                       "(step + %d); metrics.jsonl keeps the true step, and its lines after step %d are from the "
                       "abandoned part of the run", state.global_step, last, last + 1, state.tracker_offset,
                       state.global_step)
