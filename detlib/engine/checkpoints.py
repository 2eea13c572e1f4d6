"""Checkpoints on accelerate's `save_state` / `load_state` that survive a killed run, a full disk and a damaged or
planted file (the layout: docs/outputs.md).

A checkpoint is written into `<name>.tmp` and renamed when whole, the oldest beyond the limit removed after. "The
last good checkpoint" is one function, `last_good_checkpoint`: the newest folder (by completion time: a resume from
an older one writes lower steps) that passes `verify_checkpoint`; `--resume_from_checkpoint latest`, the lines of a
divergence, a failed save and a lost process all name it. Every torch pickle is read with `weights_only=True`; a
resume names each flag that differs from the checkpoint's config.yaml (two paths to the same file are the same) and
refuses those its state fixes.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import time
import warnings
import zipfile
from dataclasses import asdict

import torch
import yaml
from accelerate.utils import broadcast_object_list
from accelerate.utils.other import TORCH_SAFE_GLOBALS
from safetensors.torch import save_file

from ..files import readable_as_umask_allows, write_failure, write_json
from ..weights import (WEIGHT_FILES, WeightsFileError, finite_weights, load_state_dict_file, read_json_object,
                       read_weights_json, refused, verify_safetensors, weights_only_loads)
from .exits import EXIT_DIVERGED, RunStop, on_every_process, stop_together
from .flags import FOLDER_ACTION_KEYS, RUN_RECORD_KEYS, save_config
from .stopping import note_save
from .train_state import TrainState

logger = logging.getLogger(__name__)

CLASS_KEYS = ("category_ids", "category_names", "classes")  # model_config.json's class lists, in label order
EMA_WEIGHTS = "model_ema"  # the EMA weights in a checkpoint: model_ema.safetensors
NOT_COMPARED = (*FOLDER_ACTION_KEYS, "config")
LAUNCH_FLAGS = ("num_processes",)  # recorded beside the flags, set by a flag of `accelerate launch`: named as it


class CheckpointError(WeightsFileError):
    """A checkpoint that cannot be used (damaged, incomplete, refused); the message is one line."""


def checkpoint_folders(output_dir: str) -> list[str]:
    """Every `epoch_NNNN` / `step_NNNNNNNN` folder of `output_dir/checkpoints`, oldest first (by completion time)."""
    root = os.path.join(output_dir, "checkpoints")
    names = [n for n in os.listdir(root) if re.match(r"^(epoch|step)_\d+$", n)] if os.path.isdir(root) else []
    return sorted((os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))), key=os.path.getmtime)


def divergence(output_dir: str, state: TrainState, streak: int, lr: float) -> str:
    """The line of a run stopped by `streak` non-finite steps in a row."""
    last = last_good_checkpoint(output_dir)
    return (f"training diverged: {streak} non-finite steps in a row up to step {state.global_step} (epoch "
            f"{state.epoch + 1}, lr {lr:.3g}); nothing non-finite was saved; the last good checkpoint is "
            f"{last or 'none (no checkpoint written yet)'}: resume from it with a lower --max_grad_norm, "
            "or start a new run from its weights with a lower --lr")


def read_state_file(path: str):
    """A torch state file read without running code (`weights_only=True`, numpy's RNG state allowed; a zip archive
    CRC-checked and memory-mapped). Raises CheckpointError: refused, or it does not load."""
    try:
        if zipped := zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                if (bad := z.testzip()) is not None:
                    raise ValueError(f"member {bad} fails its CRC")
        with warnings.catch_warnings(), torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
            warnings.simplefilter("ignore")  # torch warns about the pickle protocol of a foreign file
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as e:
        raise refused(path, e, CheckpointError) from None
    except Exception as e:  # any failure to read means the file cannot be resumed from
        raise CheckpointError(f"{path} does not load ({type(e).__name__}: {e})") from None


def verify_checkpoint(path: str) -> None:
    """Raise CheckpointError (one line naming the file) unless `path` resumes: every .json parses, a weights file is
    there, every .safetensors is whole, every state file reads back (`read_state_file`), no link points to nothing."""
    if not os.path.isfile(state := os.path.join(path, "trainer_state.json")):
        raise CheckpointError(f"{path} is not a complete checkpoint (no trainer_state.json)")
    files = [os.path.join(path, n) for n in sorted(os.listdir(path))]
    if dangling := next((f for f in files if os.path.islink(f) and not os.path.exists(f)), None):
        raise CheckpointError(f"{dangling} is a symlink whose target {os.path.realpath(dangling)} is missing")
    if not any(os.path.isfile(os.path.join(path, n)) for n in WEIGHT_FILES):
        raise CheckpointError(f"{path} holds no model weights ({' / '.join(WEIGHT_FILES)})")
    try:
        for f in (f for f in files if os.path.isfile(f)):
            if f.endswith(".json"):
                (read_json_object if f == state or f.endswith("model_config.json") else read_weights_json)(f)
            elif os.path.getsize(f) == 0:
                raise CheckpointError(f"{f} is empty")
            elif f.endswith(".safetensors"):
                verify_safetensors(f)
            elif f.endswith((".bin", ".pt", ".pth", ".pkl")):
                read_state_file(f)
    except CheckpointError:
        raise
    except WeightsFileError as e:
        raise CheckpointError(str(e)) from None


def last_good_checkpoint(output_dir: str, say: bool = False) -> str | None:
    """The newest checkpoint of `output_dir` that `verify_checkpoint` passes, or None (never raises; `say`: each
    damaged one passed over is logged)."""
    for path in reversed(checkpoint_folders(output_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            if say:
                logger.warning("skipping damaged checkpoint %s: %s", os.path.basename(path), e)
    return None


def find_checkpoint(output_dir: str, resume: str) -> str | None:
    """`--resume_from_checkpoint` ("latest" or a folder) -> the checkpoint, or None (latest found none: said). Raises
    CheckpointError for a named folder that is not a whole checkpoint."""
    if resume != "latest":
        verify_checkpoint(resume)
        return resume
    if (path := last_good_checkpoint(output_dir, say=True)) is None:
        logger.warning("--resume_from_checkpoint latest: no usable checkpoint in %s; starting from scratch",
                       os.path.join(output_dir, "checkpoints"))
    return path


def save_checkpoint(accelerator, output_dir: str, state: TrainState, models: list, limit: int = 0,
                    config: dict | None = None, model_config: dict | None = None,
                    ema_model=None) -> str:
    """Write a checkpoint of everything a resume needs (collective); returns its folder. `models`: checked finite
    first; `limit`: checkpoints kept (0: all); `ema_model`: the EMA's weights, as model_ema.safetensors.
    Raises RunStop: EXIT_DIVERGED on a non-finite weight (nothing written); 1 on a failed write (the partial folder
    removed, the older checkpoints kept)."""
    name = f"epoch_{state.epoch:04d}" if state.step_in_epoch == 0 else f"step_{state.global_step:08d}"
    final, started = os.path.join(output_dir, "checkpoints", name), time.time()
    # written at this state already (a preemption right after a save): kept as it is; the main process's answer,
    # since the others may not see the folder (another machine's disk)
    if broadcast_object_list([_holds(final, state) if accelerator.is_main_process else None])[0]:
        return final
    if not all(on_every_process(accelerator, finite_weights(m)) for m in models):
        raise RunStop(f"the model holds non-finite weights at step {state.global_step}: not writing a checkpoint; "
                      f"the last good checkpoint is {last_good_checkpoint(output_dir) or 'none'}", EXIT_DIVERGED)
    tmp, error = final + ".tmp", None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)  # every rank writes its RNG state, the main rank the rest
        if accelerator.is_main_process:
            write_json(asdict(state), os.path.join(tmp, "trainer_state.json"), indent=1)
            if model_config is not None:
                write_json(model_config, os.path.join(tmp, "model_config.json"), indent=1)
            if config is not None:
                save_config(config, os.path.join(tmp, "config.yaml"))
            if ema_model is not None:
                save_file({k: v.detach().contiguous().cpu() for k, v in ema_model.state_dict().items()},
                          os.path.join(tmp, f"{EMA_WEIGHTS}.safetensors"))
    except Exception as e:  # OSError; torch's zip writer a RuntimeError; safetensors its SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        previous = last_good_checkpoint(output_dir)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(previous) for f in fs) if previous else None
        error = (f"could not write checkpoint {tmp}: {write_failure(e, tmp, size)}; removed the partial folder, "
                 + (f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"))
    stop_together(accelerator, error)
    if accelerator.is_main_process:
        for entry in os.listdir(tmp):
            readable_as_umask_allows(os.path.join(tmp, entry))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        # the limit counts the checkpoints whose state reads: a damaged one never pushes a good one out
        for old in [p for p in checkpoint_folders(output_dir) if _state_of(p) is not None][:-limit] if limit else []:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    note_save(time.time() - started)  # what a --time_limit stop keeps for its own checkpoint
    logger.info("saved checkpoint %s", final)
    return final


def _state_of(folder: str) -> dict | None:
    """The trainer_state.json of checkpoint `folder`, or None where it does not read (never raises)."""
    try:
        return read_weights_json(os.path.join(folder, "trainer_state.json"))
    except WeightsFileError:
        return None


def _holds(folder: str, state: TrainState) -> bool:
    return os.path.isdir(folder) and _state_of(folder) == asdict(state)


def load_checkpoint(accelerator, path: str, state: TrainState) -> None:
    """`accelerator.load_state(path)` (collective), every torch file read by `weights_only=True` (one changed since the
    verification too), then `state`. Raises CheckpointError (a refused file, named), torch's for states that do not fit."""
    try:
        with weights_only_loads():
            accelerator.load_state(path)
    except pickle.UnpicklingError as e:
        verify_checkpoint(path)  # names the refused file
        raise refused(f"a state file of {path}", e, CheckpointError) from None
    state.load(read_weights_json(os.path.join(path, "trainer_state.json")))


def resume(accelerator, output_dir: str, resume_from: str | None, state: TrainState, config: dict,
           model_config: dict, fixed: tuple[str, ...], init_flag: str = "--init_from",
           records: tuple[str, ...] = (), ema=None) -> str | None:
    """`_resume_state`, then the checkpoint's EMA weights into `ema` (timm's ModelEmaV3, None without --model_ema:
    `resume_ema`). Returns the checkpoint resumed, or None."""
    path = _resume_state(accelerator, output_dir, resume_from, state, config, model_config, fixed, init_flag, records)
    resume_ema(ema, path)
    return path


def _resume_state(accelerator, output_dir: str, resume_from: str | None, state: TrainState, config: dict,
                  model_config: dict, fixed: tuple[str, ...], init_flag: str = "--init_from",
                  records: tuple[str, ...] = ()) -> str | None:
    """Resume `--resume_from_checkpoint` (collective; after `prepare` and `register_for_checkpointing`): the main process
    finds it and compares its flags and classes with `config` and `model_config` (`_compare`; `records`: the
    script's keys of `config` that are not flags), then `load_checkpoint`. Returns the checkpoint or None. Raises
    RunStop (one line): damaged or refused, a `fixed` key or the classes changed (`init_flag`: the script's flag to
    start from weights instead), states that do not fit."""
    if not resume_from:
        return None
    path = error = None
    if accelerator.is_main_process:
        try:
            path = find_checkpoint(output_dir, resume_from)
            error = path and _compare(path, {**config, **{k: model_config[k] for k in CLASS_KEYS if k in model_config}},
                                      fixed, init_flag, records)
        except CheckpointError as e:
            error = f"--resume_from_checkpoint: {e}"
    path, error = broadcast_object_list([path, error])
    if error:
        raise RunStop(error)
    if path is None:
        return None
    try:
        load_checkpoint(accelerator, path, state)
    except CheckpointError as e:
        raise RunStop(f"--resume_from_checkpoint: {e}") from None
    except (RuntimeError, KeyError, ValueError, FileNotFoundError) as e:
        raise RunStop(f"cannot resume from {path}: it does not fit this run: "
                      f"{(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}") from None
    logger.info("resumed from %s: epoch %d, step %d in epoch, global step %d", path, state.epoch + 1,
                state.step_in_epoch, state.global_step)
    return path


def _same(a, b) -> bool:
    """Equal values; two paths are equal when they name the same file or folder (`./x/`, `x/./y`, an absolute path or
    a link to it)."""
    return a == b or (isinstance(a, str) and isinstance(b, str) and os.path.exists(a) and os.path.exists(b)
                      and os.path.samefile(a, b))


def _compare(path: str, ours: dict, fixed: tuple[str, ...], init_flag: str, records: tuple[str, ...] = ()) -> str | None:
    """A warning naming each flag that differs from the checkpoint's run (old -> new); the refusal (one line) when a
    `fixed` key or a class list differs, else None. `records` (what the run found: data paths, counts) are compared
    only where the state fixes them (the class count), and named without `--`: they are no flags."""
    theirs = {}
    if os.path.isfile(config := os.path.join(path, "config.yaml")):
        with open(config) as f:
            theirs = yaml.safe_load(f) or {}
    if os.path.isfile(os.path.join(path, "model_config.json")):
        saved = read_json_object(os.path.join(path, "model_config.json"))
        theirs.update({k: saved[k] for k in CLASS_KEYS if k in saved})
    ours = yaml.safe_load(yaml.safe_dump(ours))  # the values as config.yaml holds them (tuples as lists)
    records = {*records, *RUN_RECORD_KEYS} - set(LAUNCH_FLAGS)  # a changed record follows from a changed flag
    changed = {k: (theirs[k], ours[k]) for k in ours if k in theirs and k not in NOT_COMPARED
               and (k not in records or k in fixed) and not _same(theirs[k], ours[k])}

    def show(k, a, b):
        if k in CLASS_KEYS:
            return f"{k} ({len(a)} -> {len(b)}; first difference: " + next(
                (f"{x!r} -> {y!r}" for x, y in zip(a, b) if x != y), "a longer list") + ")"
        return f"{'' if k in records else '--'}{k} {a} -> {b}"

    if refused_keys := [k for k in changed if k in fixed or k in CLASS_KEYS]:
        return (f"cannot resume from {path}: it does not fit this run: {', '.join(show(k, *changed[k]) for k in refused_keys)}"
                f" (fixed by the checkpoint's state); resume with its values, or start a new run from its weights with "
                f"{init_flag} {path}")
    if changed:
        logger.warning("resuming %s with other flags than its run's: %s", path, ", ".join(show(k, *v) for k, v in changed.items()))
    return None


def resume_ema(ema, checkpoint: str | None) -> None:
    """The resumed `checkpoint`'s EMA weights into `ema` (timm's ModelEmaV3, None without --model_ema); said when a side
    has none (before this run's checkpoints rotate a dropped average away). Raises RunStop: weights that do not fit."""
    path = checkpoint and os.path.join(checkpoint, f"{EMA_WEIGHTS}.safetensors")
    if not path or (ema is None and not os.path.isfile(path)):
        return
    if ema is None or not os.path.isfile(path):
        logger.warning("--model_ema: %s", f"{checkpoint} holds EMA weights but this run has no --model_ema: the average "
                       "is dropped, this run's checkpoints hold none, and last_ema/ stays the average of the earlier part"
                       if ema is None else f"{checkpoint} holds no EMA weights (its run had no --model_ema): the average "
                       "starts from the resumed weights")
        return
    try:
        ema.module.load_state_dict(load_state_dict_file(path), strict=True)
    except (RuntimeError, ValueError) as e:
        raise RunStop(f"cannot resume the EMA weights {path}: {(str(e).strip().splitlines() or [''])[0][:200]}") from None
    logger.info("resumed the EMA weights from %s", path)
