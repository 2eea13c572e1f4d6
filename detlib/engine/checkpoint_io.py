"""Checkpoints that survive a killed run, a full disk and a damaged file (weights files: `detlib.weights`).

Layout under `output_dir`:
  checkpoints/epoch_0003/       `accelerator.save_state` (model, optimizer, scheduler, GradScaler, RNG states)
  checkpoints/step_00001200/    plus `trainer_state.json` (TrainState) and `model_config.json`
                                (and `model_ema.safetensors`, the EMA weights, with --model_ema)
  last/, best/                  weights files (detlib.weights)

A checkpoint is written into `<name>.tmp` and renamed when complete, so a run killed while saving never
leaves a half-written checkpoint that `--resume_from_checkpoint latest` would pick. A save that fails (disk
full) removes its `.tmp` folder and raises `CheckpointError`; the older checkpoints stay. The oldest
complete checkpoints beyond `total_limit` are removed only after the new one is in place, so the newest
complete one is never removed. `latest` verifies each candidate (`verify_checkpoint`), newest first, and
skips a damaged one with a warning that says what is wrong.

Nothing read from a checkpoint folder runs code (folders are shared on clusters and downloaded from colleagues):
the state files are torch pickles, and every one is read with `torch.load(weights_only=True)`, which accepts
tensors and plain values only (plus numpy's RNG state, `RNG_STATE_GLOBALS`); the verification reads each one
so, and `load_checkpoint` makes accelerate's `load_state` do the same (`weights_only_loads`). A file that
names any other global (a planted `__reduce__` calling os.system) is refused before any of it runs.

Whether a checkpoint fits the run that resumes it (for `detlib.engine.run.Run.resume_point` / `Run.resume`): its
classes (`check_same_classes`), its optimizer and the flags its state replaces (`replaced_by_checkpoint`), and its
counters moved to this run's geometry (`convert_position`). `latest` skips damaged checkpoints; a checkpoint of
another process count or batch size continues at the same position in samples seen; another `--epochs` continues a
cosine schedule from its current LR (`detlib.engine.schedules.build_scheduler`).

What a run writes (`Checkpointer`, for `detlib.engine.run.Run`): its checkpoints (rotated), best/ when the
validation metric beats every earlier value, last/ at the end, and the end-of-run summary that points at them.

* Weights with a non-finite value are never written: the run stops instead (EXIT_DIVERGED), keeping the last
  good checkpoint.
* best/ must beat the best/ already on disk too, so a resume from an older checkpoint never replaces it with a
  worse model.
* A save that fails (disk full) stops the run with one line, keeping the older checkpoints.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import pathlib
import pickle
import re
import shutil
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch
from accelerate.utils.other import TORCH_SAFE_GLOBALS
from safetensors.torch import save_file

from ..files import write_json
from ..weights import (WEIGHT_FILES, WRITE_ERRORS, WeightsFileError, all_finite, describe_write_failure, read_json,
                       read_json_object, readable_as_umask_allows, refused, save_model_weights, verify_safetensors,
                       weights_only_loads)
from .run_folder import EXIT_DIVERGED, checkpoint_bytes
from .tracking import broadcast_object, min_over_processes

logger = logging.getLogger(__name__)

_CKPT_RE = re.compile(r"^(epoch|step)_(\d+)$")

# What `np.random.get_state()` pickles to in accelerate's random_states_*.pkl (a uint32 ndarray, its dtype, bytes
# through codecs.encode): data, not code, so weights_only=True may build it; accelerate's own reader's list.
# Every other state file is tensors and plain values, which weights_only=True reads without a list.
RNG_STATE_GLOBALS = TORCH_SAFE_GLOBALS


class CheckpointError(WeightsFileError):
    """A checkpoint that cannot be used (damaged, incomplete) or written (disk full); the message is one line."""


@contextlib.contextmanager
def _checkpoint_file_errors():
    """What the weights-file readers raise (`WeightsFileError`) for a file in a checkpoint folder is a
    CheckpointError, with the same line."""
    try:
        yield
    except CheckpointError:
        raise
    except WeightsFileError as e:
        raise CheckpointError(str(e)) from None


@dataclass
class TrainState:
    """The run's own counters, saved with every checkpoint as `trainer_state.json`.

    epoch: the epochs done, = the 0-based index of the epoch to run next (or of the one in progress when
        `step_in_epoch` > 0); checkpoints/epoch_NNNN has NNNN = epoch (detlib.engine.run.FIRST_EPOCH).
    step_in_epoch: optimizer steps already done in `epoch` (0 at an epoch boundary).
    global_step: optimizer steps done since the start of training (skipped non-finite steps included).
    best_metric: best validation metric so far (AP or accuracy), -1 before the first evaluation.
    run_id: the tracker run id, so a resumed run logs into the same wandb run.
    num_processes, steps_per_epoch, samples_per_step: the geometry the counters were counted in, so a
        resume on another process count or batch size can convert them (`convert_position`).
    schedule: the per-step LR schedule's resolved settings (kind, total_steps, warmup_steps, anchor).
    epoch_loss_sum, epoch_images: the epoch's loss summed over its images and the image count, over all
        processes, so the epoch mean that drives ReduceLROnPlateau covers the whole epoch after a resume.
    skipped_steps: optimizer steps skipped as non-finite (or by the fp16 GradScaler) since the start.
    eval_pending: the epoch ended but its evaluation was interrupted (preemption): run it first on resume.
    tracker_offset: added to `global_step` for tracker steps after a resume from an older checkpoint.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    best_metric: float = -1.0
    run_id: str | None = None
    num_processes: int | None = None
    steps_per_epoch: int | None = None
    samples_per_step: int | None = None
    schedule: dict = field(default_factory=dict)
    epoch_loss_sum: float = 0.0
    epoch_images: float = 0.0
    skipped_steps: int = 0
    eval_pending: bool = False
    tracker_offset: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Set the fields found in `state`; keys of other versions are ignored, missing ones keep defaults."""
        names = {f.name for f in fields(self)}
        for k, v in state.items():
            if k in names:
                setattr(self, k, v)


def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def _candidates(output_dir: str) -> list[str]:
    root = checkpoint_dir(output_dir)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in os.listdir(root) if _CKPT_RE.match(n) and os.path.isdir(os.path.join(root, n))]


def _order_key(path: str) -> tuple:
    """Newest written last: the folder's time (set when its last file was written, kept by the rename), then
    the global step. Time, not step alone: after a resume from an older checkpoint the new checkpoints have
    lower steps than the abandoned ones, and a damaged trainer_state.json has no step at all (-1)."""
    try:
        return (os.path.getmtime(path), read_train_state(path).global_step)
    except CheckpointError:
        return (os.path.getmtime(path), -1)


def list_checkpoints(output_dir: str) -> list[str]:
    """Checkpoint folders whose trainer_state.json reads, oldest first (see `_order_key`). Never raises for a
    damaged folder: it is left out (see `verify_checkpoint` for the full check)."""
    keys = {p: _order_key(p) for p in _candidates(output_dir)}  # each trainer_state.json read once
    return sorted((p for p, key in keys.items() if key[1] >= 0), key=keys.__getitem__)


def read_train_state(path: str) -> TrainState:
    """TrainState of a checkpoint folder.

    Raises:
        CheckpointError: (a FileNotFoundError too when the file is absent) naming the path and the fault.
    """
    f = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(f):
        raise _NotACheckpoint(f"{path} is not a complete checkpoint (no trainer_state.json)")
    with _checkpoint_file_errors():
        raw = read_json(f)
    if not isinstance(raw, dict) or not isinstance(raw.get("global_step"), int):
        raise CheckpointError(f"{f} is damaged (ValueError: no integer global_step)")
    state = TrainState()
    state.load_state_dict(raw)
    return state


class _NotACheckpoint(CheckpointError, FileNotFoundError):
    pass


def read_state_file(path: str):
    """Read a torch state file (optimizer.bin, scheduler, GradScaler, sampler, RNG, custom_checkpoint_*.pkl)
    without running code: `torch.load(weights_only=True)`, numpy's RNG state allowed (`RNG_STATE_GLOBALS`);
    a zip archive is memory-mapped, so its tensors are not read.

    Raises:
        CheckpointError: one line naming the file: it holds other pickled objects (refused before anything in
        it runs), or it does not load (truncated, damaged, not a torch file).
    """
    try:
        zipped = zipfile.is_zipfile(path)
        if zipped:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            if bad is not None:
                raise ValueError(f"member {bad} fails its CRC")
        with warnings.catch_warnings(), torch.serialization.safe_globals(RNG_STATE_GLOBALS):
            warnings.simplefilter("ignore")  # torch warns about the pickle protocol of a foreign file
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        raise refused(path, e, CheckpointError) from None
    except Exception as e:  # any failure to read means the file cannot be resumed from
        raise CheckpointError(f"{path} does not load ({type(e).__name__}: {e})") from None


def load_checkpoint(accelerator, path: str) -> None:
    """`accelerator.load_state(path)` (collective) with every state file read by `weights_only=True`
    (`weights_only_loads`): the model from model.safetensors, the optimizer, the registered objects and the
    RNG states; nothing in the folder runs code, even a file changed after `verify_checkpoint` passed it.

    Raises:
        CheckpointError: a state file holds pickled objects other than tensors and plain values (one line).
        RuntimeError, KeyError, ValueError: accelerate's and torch's, for states that do not fit this run.
    """
    try:
        with weights_only_loads():
            accelerator.load_state(path)
    except pickle.UnpicklingError as e:
        verify_checkpoint(path)  # names the refused file (changed after the verification passed the folder)
        raise refused(f"a state file of {path}", e, CheckpointError) from None


def verify_checkpoint(path: str) -> None:
    """Check that a checkpoint folder can be resumed from, without loading it into a model.

    Checks: every .json file parses (trainer_state.json with a global step); a model weights file is there;
    every .safetensors file is whole; every other state file (optimizer, scheduler, GradScaler, sampler, RNG,
    registered objects) reads back with `read_state_file`, so without unpickling anything but tensors and
    plain values. Other files are never read by a resume and are not checked.
    Raises:
        CheckpointError: one line naming the file and what is wrong with it.
    """
    read_train_state(path)
    names = os.listdir(path)
    for name in sorted(names):  # a link to nothing is no file: accelerate's load_state fails on it
        f = os.path.join(path, name)
        if os.path.islink(f) and not os.path.exists(f):
            raise CheckpointError(f"{f} is a symlink whose target {os.path.realpath(f)} is missing")
    if not any(os.path.isfile(os.path.join(path, n)) for n in WEIGHT_FILES):
        raise CheckpointError(f"{path} holds no model weights ({' / '.join(WEIGHT_FILES)})")
    for name in sorted(names):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            continue
        with _checkpoint_file_errors():
            if name.endswith(".json"):
                (read_json_object if name == "model_config.json" else read_json)(f)
                continue
            if os.path.getsize(f) == 0:
                raise CheckpointError(f"{f} is empty")
            if name.endswith(".safetensors"):
                verify_safetensors(f)
            elif name.endswith((".bin", ".pt", ".pth", ".pkl")):
                read_state_file(f)


def resolve_resume(output_dir: str, resume: str) -> str | None:
    """A `--resume_from_checkpoint` value ("latest" or a PATH) -> checkpoint folder, or None to start fresh.

    "latest": the newest checkpoint of `output_dir` that passes `verify_checkpoint`; damaged newer ones are
    skipped with a warning naming what is wrong. None, with a warning naming the folder, when there is none.
    An explicit PATH must pass `verify_checkpoint`.
    Raises:
        CheckpointError: for an explicit path that is damaged or not a checkpoint (a FileNotFoundError too
        when it holds no trainer_state.json).
    """
    if resume != "latest":
        verify_checkpoint(resume)
        return resume
    candidates = sorted(_candidates(output_dir), key=_order_key)
    for path in reversed(candidates):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            logger.warning("skipping damaged checkpoint %s: %s", os.path.basename(path), e)
    logger.warning("--resume_from_checkpoint latest: no usable checkpoint in %s; starting from scratch",
                   checkpoint_dir(output_dir))
    return None


# ---- resume: whether a checkpoint fits this run (its classes, its optimizer), and where it puts the run

class ResumeError(Exception):
    """No checkpoint to resume, or one that does not fit this run (another model or optimizer); one line."""


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
    except WeightsFileError as e:
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


def folder_size(path: str) -> int:
    """Bytes of the files under `path`."""
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


def save_checkpoint(accelerator, output_dir: str, state: TrainState, total_limit: int | None = None,
                    model_config: dict | None = None, needed_bytes: int | None = None,
                    extra_weights: dict[str, dict] | None = None) -> str:
    """Save the full training state atomically. Collective: call on every process.

    Writes `<name>.tmp`, then renames it; then removes the oldest checkpoints beyond `total_limit` (0 or
    None: keep all). Returns the checkpoint folder, named after the epoch at an epoch boundary, else after
    the global step. `needed_bytes`: the expected size of a checkpoint (for the message of a failed save;
    default: the previous checkpoint's size). `extra_weights` {name: state dict}: written beside the model as
    `name.safetensors` by the main process (the EMA weights, `model_ema`).
    Raises:
        CheckpointError: on every process when any process failed to write, naming the cause
        (`describe_write_failure`: no space left with the free and the needed space, permission, a symlink
        whose target is missing, a file where a folder has to be); the partial folder is removed, older
        checkpoints are kept.
    """
    name = f"epoch_{state.epoch:04d}" if state.step_in_epoch == 0 else f"step_{state.global_step:08d}"
    final = os.path.join(checkpoint_dir(output_dir), name)
    tmp = final + ".tmp"
    error = None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp, exist_ok=True)
        except OSError as e:  # save_state below fails the same way on every rank, so the ranks stay together
            error = e
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)  # every rank writes its RNG state; the main rank the rest
        if accelerator.is_main_process:
            for fname, obj in (("trainer_state.json", state.state_dict()), ("model_config.json", model_config)):
                if obj is not None:
                    write_json(obj, os.path.join(tmp, fname), indent=1)
            for fname, sd in (extra_weights or {}).items():
                save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()}, os.path.join(tmp, f"{fname}.safetensors"))
    except WRITE_ERRORS as e:
        error = error or e
    if not min_over_processes(accelerator, error is None):
        if accelerator.is_main_process and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_save_failure_message(output_dir, tmp, error, needed_bytes))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for entry in os.listdir(tmp):
            readable_as_umask_allows(os.path.join(tmp, entry))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if total_limit and total_limit > 0:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _save_failure_message(output_dir: str, tmp: str, error: BaseException | None, needed_bytes: int | None) -> str:
    previous = list_checkpoints(output_dir)
    kept = f"the previous checkpoint {previous[-1]} is kept" if previous else "no earlier checkpoint exists"
    if error is None:
        return f"another process failed to write checkpoint {tmp}; {kept}"
    needed = max(needed_bytes or 0, folder_size(previous[-1]) if previous else 0) or None
    cause = describe_write_failure(error, tmp, needed)
    return f"could not write checkpoint {tmp}: {cause}; removed the partial folder, {kept}"


# ---- what a run writes: checkpoints, best/, last/, the summary

# The EMA weights' file in a checkpoint folder, beside accelerate's model.safetensors.
EMA_WEIGHTS = "model_ema"

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

    def save_checkpoint(self, model, state: TrainState, epoch_sums: torch.Tensor, optimizer) -> str:
        """Write a checkpoint of everything a resume needs; `epoch_sums` ([2] float64: this process's loss sum
        over images, image count) are summed over processes into `state` first. Returns its folder.
        `optimizer` sizes the checkpoint for the message of a failed save."""
        self._check_finite(model, "a checkpoint", state.global_step)
        extra = None
        if self.ema is not None:
            self._check_finite(self.ema.module, "a checkpoint (its EMA weights)", state.global_step)
            extra = {EMA_WEIGHTS: self.ema.module.state_dict()}
        state.epoch_loss_sum, state.epoch_images = self.accelerator.reduce(epoch_sums, reduction="sum").tolist()
        t = time.time()
        try:
            path = save_checkpoint(self.accelerator, self.output_dir, state, self.total_limit, self.model_config,
                                   needed_bytes=checkpoint_bytes(model, optimizer)[1], extra_weights=extra)
        except CheckpointError as e:
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
        except WeightsFileError as e:  # main process only: the others learn it below
            error = f"{e}; the checkpoints in {checkpoint_dir(self.output_dir)} are kept"
        error = broadcast_object(self.accelerator, error)
        if error:
            self.fail(error, 1)
        if self.describe is not None and self.accelerator.is_main_process:
            self.describe(folder, name)

    def keep_best(self, model, value: float, state: TrainState, epoch: int, weights: str = "trained") -> bool:
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
        best = read_json(os.path.join(output_dir, "best", "best.json"))
        float(best["value"])
        return best if best.get("metric") == metric else None
    except (WeightsFileError, ValueError, KeyError, TypeError):
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
    if weights or os.path.isdir(checkpoint_dir(out)):
        lines.append("weights: " + (", ".join(weights) or "none") + (f"; checkpoints: {checkpoint_dir(out)}"
                                                                     if os.path.isdir(checkpoint_dir(out)) else ""))
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
