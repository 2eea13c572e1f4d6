"""Weights files: the bare model's weights written (model.safetensors, no wrapper prefix), found and read whatever
wrote them (timm's reader; torch files with `weights_only=True`: nothing read runs code), loaded strictly; the
model_config.json beside them, which rebuilds the model. A weights folder's files: docs/outputs.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import warnings

from . import files
from .files import JsonFileError, atomic_path, readable_as_umask_allows, write_failure, write_json

# torch, safetensors and timm are imported where used: a script's start (its flags, a missing file) needs none of them

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's key prefixes


class WeightsFileError(RuntimeError):
    """A weights file, or a JSON file beside it, that cannot be used (damaged, truncated, refused) or written; the
    message is one line. A checkpoint folder's is `detlib.engine.checkpoints.CheckpointError`."""


def read_weights_json(path: str):
    """The JSON value in `path` (`detlib.files.read_json`), a file of a weights or checkpoint folder. Raises
    WeightsFileError (one line naming it): it does not read or parse (nesting past the recursion limit included)."""
    try:
        return files.read_json(path)
    except JsonFileError as e:
        raise WeightsFileError(f"{path} is damaged ({e.reason})") from None
    except OSError as e:
        raise WeightsFileError(f"{path} is damaged ({type(e).__name__}: {e})") from None


def read_json_object(path: str) -> dict:
    """The JSON object in the file `path`. Raises WeightsFileError: no JSON, or another JSON value (a list, null)."""
    if not isinstance(value := read_weights_json(path), dict):
        raise WeightsFileError(f"{path} is damaged ({json.dumps(value)[:40]}, not a JSON object)")
    return value


def verify_safetensors(path: str) -> None:
    """Raise WeightsFileError unless the .safetensors file is whole: its header parses and its tensors end at the
    end of the file (safetensors' own check; reads the header only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise WeightsFileError(f"{path} is truncated or not a whole safetensors file ({e})") from None


def refused(path: str, e: Exception, error: type[WeightsFileError] = WeightsFileError) -> WeightsFileError:
    """The `error` of a file that `weights_only=True` refused (torch's UnpicklingError `e`): one line with torch's
    reason (e.g. "Trying to load unsupported GLOBAL posix.system"), without its advice to load the file unsafely."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    reason = next((ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith(boilerplate)),
                  type(e).__name__)
    return error(f"{path} holds pickled objects other than tensors and plain values ({reason}): refused, nothing in "
                 "it was run")


@contextlib.contextmanager
def weights_only_loads():
    """Within the block every `torch.load` reads with `weights_only=True`, even one that asks otherwise (accelerate's
    `load_state` for registered objects, torch.hub's cached downloads): torch's own switch, the environment variable
    TORCH_FORCE_WEIGHTS_ONLY_LOAD, with a TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD of the user's set aside meanwhile; the
    environment is put back as it was after the block (`mock.patch.dict`). A refused file raises
    `pickle.UnpicklingError`."""
    from unittest import mock

    with mock.patch.dict(os.environ, {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}):
        os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        yield


def save_model_weights(accelerator, model, folder: str, model_config: dict | None = None, extra: dict | None = None) -> str:
    """`folder/model.safetensors` (main process): the unwrapped model's weights, no wrapper prefixes, renamed over the
    old file; `model_config.json`, `extra` as best.json. Raises WeightsFileError: a failed write (the old file kept)."""
    from safetensors.torch import save_file

    path = os.path.join(folder, "model.safetensors")
    if accelerator.is_main_process:
        # get_state_dict unwraps DDP but keeps torch.compile's `_orig_mod.` prefix: stripped here
        sd = {k: v.detach().contiguous().cpu() for k, v in _strip_wrapper_prefixes(accelerator.get_state_dict(model)).items()}
        try:
            with atomic_path(path) as tmp:
                save_file(sd, tmp)
            readable_as_umask_allows(path)
            for fname, obj in (("model_config.json", model_config), ("best.json", extra)):
                if obj is not None:
                    write_json(obj, os.path.join(folder, fname), indent=1)
        except Exception as e:  # OSError; safetensors' SafetensorError ("I/O error ... os error 28")
            needed = sum(t.numel() * t.element_size() for t in sd.values())
            raise WeightsFileError(f"could not write {path}: {write_failure(e, folder, needed)}") from None
    return path


def weights_path(path: str) -> str:
    """The weights file of `path`: a file, a folder with one (a checkpoint, best/, last/), a run folder (its best/,
    else its last/), or a Hub repo id (`owner/name[@rev]`, `hf://...`: its snapshot, `detlib.hub`).
    Raises FileNotFoundError naming the path."""
    if os.path.isfile(path):
        return path
    from .hub import local_weights

    path = local_weights(path)
    for f in (os.path.join(d, n) for d in (path, os.path.join(path, "best"), os.path.join(path, "last")) for n in WEIGHT_FILES):
        if os.path.isfile(f):
            return f
    raise FileNotFoundError(f"no model weights at {path} (expected a file, a folder with model.safetensors, or a run "
                            "folder with best/ or last/)")


def model_config_file(path: str) -> str | None:
    """The model_config.json beside the weights of `path` (or in their folder's parent), or None."""
    try:
        folder = os.path.dirname(weights_path(path))
    except FileNotFoundError:
        return None
    return next((f for f in (os.path.join(folder, "model_config.json"),
                             os.path.join(os.path.dirname(folder.rstrip("/")), "model_config.json")) if os.path.isfile(f)),
                None)


def read_model_config(path: str) -> dict | None:
    """`model_config_file(path)`'s contents, or None. Raises WeightsFileError: it does not parse or is no object."""
    return None if (f := model_config_file(path)) is None else read_json_object(f)


def require_model_keys(config: dict, path: str, keys: dict[str, str]) -> None:
    """Stop on a model_config.json that lacks a key the model needs; `keys` maps each to the flag that supplies it
    ("" when no flag does). Nothing is filled in from elsewhere (there is no earlier release to stay compatible with).
    Raises WeightsFileError: one line naming the file, the missing keys and their flags."""
    missing = [k for k in keys if k not in config]
    if missing:
        flags = [keys[k] for k in missing if keys[k]]
        raise WeightsFileError(f"{model_config_file(path) or 'model_config.json'} lacks {', '.join(missing)}"
                               + (f": pass {' and '.join(dict.fromkeys(flags))}" if flags else "")
                               + " (the training script writes every key into best/, last/ and each checkpoint)")


def load_model_weights(model, path: str) -> str:
    """Load the weights of `path` strictly into the bare model, whatever wrapper prefixes they carry; returns the file.
    Raises FileNotFoundError (none there), WeightsFileError (truncated, damaged, refused, not weights), RuntimeError
    (missing or unexpected keys, other shapes: another model, width or class list)."""
    f = weights_path(path)
    if f.endswith(".safetensors"):
        verify_safetensors(f)
    sd = load_state_dict_file(f)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        details = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        raise RuntimeError(f"weights in {f} do not fit this model (trained with another model, width or class list? its "
                           f"model_config.json says how it was built): {'; '.join(d[:160] for d in details[:2])}"
                           + " ..." * (len(details) > 2)) from None
    return f


def finite_weights(model) -> bool:
    """True when every floating-point parameter and buffer of `model` is finite (one device sync)."""
    import torch

    flags = [torch.isfinite(t).all() for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def _strip_wrapper_prefixes(state_dict: dict) -> dict:
    """Keys without wrapper prefixes, however deep (timm strips each once; DDP around DDP gives `module.module.`)."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(WRAPPER_PREFIXES):
            k = k.removeprefix("module.").removeprefix("_orig_mod.")
        out[k] = v
    return out


# What timm's `load_state_dict` / `load_checkpoint` take from a checkpoint dict, in its order: the EMA copies first
# when `use_ema` (their default), then the raw weights (timm's train.py writes `state_dict`, `state_dict_ema`,
# `optimizer`, `args`, ...; other trainers `model`)
EMA_PARTS = ("state_dict_ema", "model_ema")
RAW_PARTS = ("state_dict", "model")


def load_state_dict_file(path: str | os.PathLike) -> dict:
    """{name: CPU tensor} of a `.safetensors` or torch file (`weights_only=True`): a `{"state_dict": ...}` or
    `{"model": ...}` container unwrapped, wrapper prefixes stripped, a training checkpoint's raw (not EMA) weights
    (`read_weights_file` with `use_ema=False`). Raises as `read_weights_file`."""
    return read_weights_file(path)[0]


def read_weights_file(path: str | os.PathLike, use_ema: bool = False) -> tuple[dict, str, bool]:
    """The weights of a `.safetensors` or torch file and which part of it they are, read as timm's `load_state_dict`
    reads a checkpoint (the same parts in the same order, `EMA_PARTS` first when `use_ema`; `torch.load` with
    `weights_only=True` and an `argparse.Namespace` allowed, as timm allows it for its train.py's `args`; timm's
    `clean_state_dict`), wrapper prefixes stripped.

    Returns:
        ({name: CPU tensor}, part, has_ema): part "" for a file that is a state dict itself, else one phrase naming
        the part taken and the checkpoint's contents, e.g. "state_dict_ema (the EMA copy) of a checkpoint holding
        epoch, arch, optimizer, version, args, state_dict, state_dict_ema, metric"; has_ema: the file has an EMA copy.
    Raises:
        FileNotFoundError (naming the path), ValueError (no state dict of tensors), WeightsFileError (damaged or
        foreign; pickled objects other than tensors, plain values and a Namespace: refused, nothing run).
    """
    import argparse

    import torch
    from safetensors.torch import load_file
    from timm.models import clean_state_dict

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals([argparse.Namespace]):
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a foreign pickle: refused below
            checkpoint = (load_file(path) if path.endswith(".safetensors")
                          else torch.load(path, map_location="cpu", weights_only=True))
    except pickle.UnpicklingError as e:  # torch's refusal
        raise refused(path, e) from None
    except Exception as e:  # safetensors / pickle / zip errors of a damaged or foreign file
        raise WeightsFileError(f"{path} is not a readable weights file ({type(e).__name__}: {e})") from None
    part, has_ema = "", isinstance(checkpoint, dict) and any(isinstance(checkpoint.get(k), dict) for k in EMA_PARTS)
    if isinstance(checkpoint, dict):
        if key := next((k for k in (EMA_PARTS if use_ema else ()) + RAW_PARTS if isinstance(checkpoint.get(k), dict)),
                       None):
            keys = list(checkpoint)
            what = "the EMA copy" if key in EMA_PARTS else "the raw weights" + ("" if has_ema else "; no EMA copy in it")
            part = f"{key} ({what}) of a checkpoint holding {', '.join(keys[:10])}{' ...' if len(keys) > 10 else ''}"
            checkpoint = checkpoint[key]
    sd = clean_state_dict(checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(sd, dict) or not any(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors")
    return _strip_wrapper_prefixes(sd), part, has_ema
