"""Weights files: writing the bare model's weights, finding and reading them whatever wrote them, loading
them strictly into a model; `model_config.json` beside them says how to rebuild the model.

Layout of a weights folder (`last/`, `best/`, and inside every checkpoint folder):
  model.safetensors    the unwrapped model's state dict (no `module.` / `_orig_mod.` prefix)
  model_config.json    the model's description (`build_retinanet_from_config`, the classifier's builder)
  best.json            in best/: which metric, value, epoch and step these weights scored

Reading is built on timm's reader (`timm.models.load_state_dict`), so the classifier and the detector share
it without importing each other's model code.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
import warnings

import torch
from timm.models import load_state_dict as timm_load_state_dict

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth")
_TORCH_FORCE = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (damaged, incomplete) or written (disk full); the message is one line."""


def verify_safetensors(path: str) -> None:
    """Check that a .safetensors file is whole: its header parses and the tensors it lists end exactly at
    the end of the file (a truncated copy fails). Reads the header only. Raises CheckpointError."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise CheckpointError(f"{path} is truncated or not a safetensors file (its header says {n} bytes, "
                                      f"the file has {size})")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a whole safetensors file ({e})") from None
    if 8 + n + end != size:
        raise CheckpointError(f"{path} is truncated or padded: {size} bytes, its header says {8 + n + end}")


def readable_as_umask_allows(path: str) -> None:
    """Give a written file the mode every other output of the run gets (0644 under the usual umask 022):
    safetensors writes through a private temporary file and leaves 0600, so a weights file was the one
    output a teammate or a serving job running as another user could not read. Best effort: a file system that
    refuses chmod (some network mounts) keeps the file as written, never failing the save."""
    if os.path.isfile(path):
        umask = os.umask(0)
        os.umask(umask)
        try:
            os.chmod(path, 0o666 & ~umask)
        except OSError:
            pass


def refusal_reason(e: Exception) -> str:
    """torch's reason for refusing a pickle under `weights_only=True`, in one line (e.g. "Trying to load
    unsupported GLOBAL posix.system whose module posix is blocked."), without its advice to load it unsafely."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith(boilerplate)),
                type(e).__name__)


@contextlib.contextmanager
def weights_only_loads():
    """Within the block, every `torch.load` reads with `weights_only=True` (tensors and plain values, never
    code), even one that asks for `weights_only=False`: accelerate 1.15's `load_state` does for the registered
    objects (custom_checkpoint_*.pkl), torch.hub's `load_state_dict_from_url` by default (torchvision's
    pretrained weights). torch's own switch, the environment variable TORCH_FORCE_WEIGHTS_ONLY_LOAD; a
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD of the user's is set aside meanwhile. A refused file raises
    `pickle.UnpicklingError`."""
    saved = {k: os.environ.pop(k, None) for k in _TORCH_FORCE}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def save_model_weights(accelerator, model, folder: str, model_config: dict | None = None, extra: dict | None = None) -> str:
    """Write the unwrapped model's weights as `folder/model.safetensors` (main process; others return).

    Keys carry no `module.` / `_orig_mod.` prefix because the model is unwrapped first. The file is
    written beside and renamed over the old one, with `model_config.json` and, when given, `extra` as
    `best.json` (which metric, epoch, step these weights scored).
    """
    path = os.path.join(folder, "model.safetensors")
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        # get_state_dict unwraps DDP but keeps torch.compile's wrapper (its `_orig_mod.` prefix): stripped here
        sd = {k: v.detach().contiguous().cpu() for k, v in _strip_wrapper_prefixes(accelerator.get_state_dict(model)).items()}
        save_file(sd, path + ".tmp")
        os.replace(path + ".tmp", path)
        readable_as_umask_allows(path)
        for fname, obj in (("model_config.json", model_config), ("best.json", extra)):
            if obj is not None:
                with open(os.path.join(folder, fname), "w") as f:
                    json.dump(obj, f, indent=1)
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
        for name in WEIGHT_FILES:
            f = os.path.join(folder, name)
            if os.path.isfile(f):
                return f
    raise FileNotFoundError(f"no model weights at {path} (expected a file, a folder with model.safetensors, "
                            "or a run folder with best/ or last/)")


def read_model_config(path: str) -> dict | None:
    """model_config.json next to the weights `weights_path(path)` finds (or in their parent folder), if any.

    Raises:
        CheckpointError: when the file is there but does not parse.
    """
    try:
        folder = os.path.dirname(weights_path(path))
    except FileNotFoundError:
        return None
    for f in (os.path.join(folder, "model_config.json"), os.path.join(os.path.dirname(folder.rstrip("/")), "model_config.json")):
        if os.path.isfile(f):
            try:
                with open(f) as fh:
                    return json.load(fh)
            except ValueError as e:
                raise CheckpointError(f"{f} is damaged ({e})") from None
    return None


def load_model_weights(model: torch.nn.Module, path: str) -> str:
    """Strictly load weights into the bare model, whatever wrapper prefixes the file's keys carry.

    Returns the weights file read.
    Raises:
        FileNotFoundError: no weights at `path`.
        CheckpointError: the file is truncated, damaged or not a weights file.
        RuntimeError: missing or unexpected keys, or shape mismatches (the model built with other settings).
    """
    f = weights_path(path)
    if f.endswith(".safetensors"):
        verify_safetensors(f)
    try:
        sd = load_state_dict_file(f)
    except (FileNotFoundError, CheckpointError):
        raise
    except Exception as e:  # safetensors / pickle / zip errors of a damaged or foreign file
        raise CheckpointError(f"{f} is not a readable weights file ({type(e).__name__}: {e})") from None
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        details = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        short = "; ".join(d[:160] for d in details[:2]) + (" ..." if len(details) > 2 else "")
        raise RuntimeError(f"weights in {f} do not fit this model (trained with another model, width or class "
                           f"list? its model_config.json says how it was built): {short}") from None
    return f


def all_finite(model: torch.nn.Module) -> bool:
    """True when every parameter and buffer of `model` is finite (one device sync)."""
    flags = [torch.isfinite(t).all() for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


# ---- reading weights files

# Key prefixes that wrappers add: DDP's `module.` and torch.compile's `_orig_mod.`.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _strip_wrapper_prefixes(state_dict: dict) -> dict:
    """Remove wrapper prefixes from the keys until none is left.

    timm's reader already removes each prefix once, in a fixed order that depends on the timm version; a key
    wrapped more deeply (`module.module.`: DDP around a DDP-wrapped model) or in another order keeps the
    rest, so this repeats until no prefix is left (what detlib did before it used timm's reader).
    """
    out = {}
    for k, v in state_dict.items():
        while k.startswith(WRAPPER_PREFIXES):
            k = k.removeprefix("module.").removeprefix("_orig_mod.")
        out[k] = v
    return out


def load_state_dict_file(path: str | os.PathLike) -> dict:
    """Read a state dict {name: tensor on the CPU} from `.safetensors` or a torch file (`weights_only=True`).

    Built on timm's reader (`timm.models.load_state_dict`): it unwraps a `{"state_dict": ...}` or
    `{"model": ...}` container and strips the wrapper prefixes `module.` and `_orig_mod.`. `use_ema=False`:
    a timm training checkpoint that also holds EMA weights gives its raw weights, as before.

    Raises:
        FileNotFoundError: naming the path, if it does not exist.
        ValueError: if the file holds no state dict of tensors.
        CheckpointError (a RuntimeError): a torch file that `weights_only=True` refuses (pickled objects other
            than tensors and plain values, such as code planted with `__reduce__`); nothing in it runs.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):  # checked here: timm's FileNotFoundError does not name the path
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a foreign pickle: refused below
            sd = timm_load_state_dict(path, use_ema=False, weights_only=True)
    except AttributeError:  # timm's prefix cleaning calls `.items()` on what the file holds: not a dict
        sd = None
    except RuntimeError as e:  # timm's, raised from torch's refusal, with advice to load the file unsafely
        if not isinstance(e.__cause__, pickle.UnpicklingError):
            raise
        raise CheckpointError(f"{path} holds pickled objects other than tensors and plain values "
                              f"({refusal_reason(e.__cause__)}): refused, nothing in it was run") from None
    if not isinstance(sd, dict) or not any(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors")
    return _strip_wrapper_prefixes(sd)
