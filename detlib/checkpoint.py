"""Checkpoints that survive a killed run, and weights files that load into the bare model.

Layout under `output_dir`:
  checkpoints/epoch_0003/   `accelerator.save_state` (model, optimizer, scheduler, GradScaler, RNG states)
                            plus `trainer_state.json` (epoch, global step, best metric, wandb run id)
  last/model.safetensors    final weights of the unwrapped model (+ model_config.json)
  best/model.safetensors    weights with the best validation metric

A checkpoint is written into `<name>.tmp` and renamed when complete, so a run killed while saving
never leaves a half-written checkpoint that `--resume_from_checkpoint latest` would pick; the oldest
complete checkpoints beyond `total_limit` are removed only after the new one is in place.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass

import torch

from .model import load_state_dict_file

logger = logging.getLogger(__name__)

_CKPT_RE = re.compile(r"^(epoch|step)_(\d+)$")


@dataclass
class TrainState:
    """The script's own counters, saved with every checkpoint.

    epoch: the epoch to run next (or the one in progress when `step_in_epoch` > 0).
    step_in_epoch: optimizer steps already done in `epoch` (0 at an epoch boundary).
    global_step: optimizer steps done since the start of training.
    best_metric: best validation metric so far (AP or accuracy), -1 before the first evaluation.
    run_id: the tracker run id, so a resumed run logs into the same wandb run.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    best_metric: float = -1.0
    run_id: str | None = None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints, oldest first (by global step)."""
    root = checkpoint_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if _CKPT_RE.match(name) and os.path.isfile(os.path.join(path, "trainer_state.json")):
            found.append((read_train_state(path).global_step, name, path))
    return [p for _, _, p in sorted(found)]


def read_train_state(path: str) -> TrainState:
    """TrainState of a checkpoint folder. Raises FileNotFoundError naming the path."""
    f = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer_state.json)")
    with open(f) as fh:
        return TrainState(**json.load(fh))


def resolve_resume(output_dir: str, resume: str | None) -> str | None:
    """`--resume_from_checkpoint` value -> checkpoint folder, or None to start fresh.

    "latest" picks the newest complete checkpoint of `output_dir` (None, with a log line, if there is none).
    Raises FileNotFoundError for an explicit path that is not a complete checkpoint.
    """
    if not resume:
        return None
    if resume == "latest":
        ckpts = list_checkpoints(output_dir)
        if not ckpts:
            logger.info("--resume_from_checkpoint latest: no checkpoint in %s yet, starting from scratch", checkpoint_dir(output_dir))
            return None
        return ckpts[-1]
    read_train_state(resume)
    return resume


def save_checkpoint(accelerator, output_dir: str, state: TrainState, total_limit: int | None = None) -> str:
    """Save the full training state atomically. Collective: call on every process.

    Returns the checkpoint folder (named after the epoch, or the step for a mid-epoch save).
    """
    name = f"epoch_{state.epoch:04d}" if state.step_in_epoch == 0 else f"step_{state.global_step:08d}"
    final = os.path.join(checkpoint_dir(output_dir), name)
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)  # every rank writes its RNG state; the main rank the rest
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state.state_dict(), f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if total_limit and total_limit > 0:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def save_model_weights(accelerator, model, folder: str, model_config: dict | None = None) -> str:
    """Write the unwrapped model's weights as `folder/model.safetensors` (main process; others return).

    Keys carry no `module.` / `_orig_mod.` prefix because the model is unwrapped first (case B18).
    """
    path = os.path.join(folder, "model.safetensors")
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        bare = accelerator.unwrap_model(model)
        sd = {k: v.detach().contiguous().cpu() for k, v in bare.state_dict().items()}
        save_file(sd, path + ".tmp")
        os.replace(path + ".tmp", path)
        if model_config is not None:
            with open(os.path.join(folder, "model_config.json"), "w") as f:
                json.dump(model_config, f, indent=1)
    return path


def weights_path(path: str) -> str:
    """A weights file from a path that may be a file, a checkpoint folder or a last/ or best/ folder.

    Raises:
        FileNotFoundError: naming the path, when it holds no weights file.
    """
    if os.path.isfile(path):
        return path
    # a run's output folder: its best, else its last weights
    for folder in (path, os.path.join(path, "best"), os.path.join(path, "last")):
        for name in ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth"):
            f = os.path.join(folder, name)
            if os.path.isfile(f):
                return f
    raise FileNotFoundError(f"no model weights at {path} (expected a file, a folder with model.safetensors, "
                            "or a run folder with best/ or last/)")


def read_model_config(path: str) -> dict | None:
    """model_config.json next to the weights `weights_path(path)` finds (or in their parent folder), if any."""
    try:
        folder = os.path.dirname(weights_path(path))
    except FileNotFoundError:
        return None
    for f in (os.path.join(folder, "model_config.json"), os.path.join(os.path.dirname(folder.rstrip("/")), "model_config.json")):
        if os.path.isfile(f):
            with open(f) as fh:
                return json.load(fh)
    return None


def load_model_weights(model: torch.nn.Module, path: str) -> None:
    """Strictly load weights into the bare model, whatever wrapper prefixes the file's keys carry.

    Raises:
        FileNotFoundError: no weights at `path`.
        RuntimeError: missing or unexpected keys, or shape mismatches (the model built with other settings).
    """
    f = weights_path(path)
    sd = load_state_dict_file(f)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"weights in {f} do not fit this model (built with other --backbone / "
                           f"--fpn_channels / classes?): {e}") from e
