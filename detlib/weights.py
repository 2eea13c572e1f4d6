"""Weights files: writing the bare model's weights, finding and reading them whatever wrote them, loading
them strictly into a model; `model_config.json` beside them says how to rebuild the model.

Layout of a weights folder (`last/`, `best/`, and inside every checkpoint folder):
  model.safetensors    the unwrapped model's state dict (no `module.` / `_orig_mod.` prefix)
  model_config.json    the model's description (`build_retinanet_from_config`, the classifier's builder)
  best.json            in best/: which metric, value, epoch and step these weights scored
  score_thresholds.json  the per-class score thresholds that maximised F1 in the evaluation of these weights
                       (`detlib.evaluation.metrics.best_f1_thresholds`), read by predict's `--score_thresh best_f1`
  README.md            the model card (`detlib.evaluation.model_card`)

Reading is built on timm's reader (`timm.models.load_state_dict`), so the classifier and the detector share
it without importing each other's model code.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import warnings

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from timm.models import load_state_dict as timm_load_state_dict

from .files import atomic_path, write_json

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth")
# torch's switches of torch.load's default, set and put back by `weights_only_loads`
_TORCH_FORCE = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")


class WeightsFileError(RuntimeError):
    """A weights file, or a JSON file beside it, that cannot be used (damaged, truncated, refused) or written (disk
    full); the message is one line. What a checkpoint folder raises is its subclass
    `detlib.engine.checkpoint_io.CheckpointError`."""


def read_json(path: str):
    """The JSON value in the file `path`. Raises WeightsFileError: it does not read or parse (one line naming it;
    nesting deeper than Python's recursion limit included)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise WeightsFileError(f"{path} is damaged ({type(e).__name__}: {e})") from None


def read_json_object(path: str) -> dict:
    """The JSON object (a dict) in the file `path`. Raises WeightsFileError: it does not read or parse, or holds
    another JSON value (a list, a string, a number, null)."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise WeightsFileError(f"{path} is damaged ({json.dumps(value)[:40]}, not a JSON object)")
    return value


def write_failure(error: BaseException, path: str, needed_bytes: int | None = None) -> str:
    """Why writing `path` failed, in one line: the OS's (or the writer's) error and the space free where it was
    written, beside `needed_bytes` (what was being written) when known; "no space left on device" when less is free."""
    existing = os.path.abspath(path)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    text = " ".join(str(error).split())[:200] or type(error).__name__
    full = "no space left on device: " if needed_bytes and free < needed_bytes else ""
    return (f"{full}{type(error).__name__}: {text} ({free / 2**20:.1f} MiB free in {existing}"
            + (f", ~{needed_bytes / 2**20:.1f} MiB needed)" if needed_bytes else ")"))


def verify_safetensors(path: str) -> None:
    """Check that a .safetensors file is whole: its header parses and the tensors it lists end exactly at
    the end of the file (a truncated copy fails; safetensors' own check of the header). Reads the header only.
    Raises WeightsFileError."""
    try:
        with safe_open(path, "pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise WeightsFileError(f"{path} is truncated or not a whole safetensors file ({e})") from None


def readable_as_umask_allows(path: str) -> None:
    """Give a written file the mode every other output of the run gets (0644 under the usual umask 022):
    safetensors writes through a private temporary file and leaves 0600, so a weights file was the one
    output a teammate or a serving job running as another user could not read. Best effort: a file system that
    refuses chmod (some network mounts) keeps the file as written, never failing the save."""
    if os.path.isfile(path):
        umask = os.umask(0)
        os.umask(umask)
        with contextlib.suppress(OSError):
            os.chmod(path, 0o666 & ~umask)


def refusal_reason(e: Exception) -> str:
    """torch's reason for refusing a pickle under `weights_only=True`, in one line (e.g. "Trying to load
    unsupported GLOBAL posix.system whose module posix is blocked."), without its advice to load it unsafely."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith(boilerplate)),
                type(e).__name__)


def refused(path: str, e: Exception, error: type[WeightsFileError] = WeightsFileError) -> WeightsFileError:
    """The `error` for a file `path` that `weights_only=True` refused (`e`, torch's UnpicklingError): one line with
    torch's reason (`refusal_reason`)."""
    return error(f"{path} holds pickled objects other than tensors and plain values ({refusal_reason(e)}): "
                 "refused, nothing in it was run")


@contextlib.contextmanager
def weights_only_loads():
    """Within the block, every `torch.load` reads with `weights_only=True` (tensors and plain values, never
    code), even one that asks for `weights_only=False`: accelerate 1.15's `load_state` does for the registered
    objects (custom_checkpoint_*.pkl), torch.hub's `load_state_dict_from_url` by default (torchvision's
    pretrained weights). torch's own switch, the environment variable TORCH_FORCE_WEIGHTS_ONLY_LOAD; a
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD of the user's is set aside meanwhile. A refused file raises
    `pickle.UnpicklingError`."""
    # only these two variables are touched and put back (not the whole environment: other threads may set theirs)
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
    Raises:
        WeightsFileError: the write failed (main process): one line with the file and the cause
        (`describe_write_failure`); the half-written file is removed, the old one is kept.
    """
    path = os.path.join(folder, "model.safetensors")
    if accelerator.is_main_process:
        # get_state_dict unwraps DDP but keeps torch.compile's wrapper (its `_orig_mod.` prefix): stripped here
        sd = {k: v.detach().contiguous().cpu()
              for k, v in _strip_wrapper_prefixes(accelerator.get_state_dict(model)).items()}
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


SCORE_THRESHOLDS = "score_thresholds.json"


def write_score_thresholds(folder: str, best_f1: dict, evaluation: dict) -> str:
    """`folder/score_thresholds.json`: `best_f1` (`detlib.evaluation.metrics.best_f1_thresholds`, without its curves) and the
    epoch and step of the `evaluation` (a metrics.jsonl line) it comes from. Returns the path."""
    path = os.path.join(folder, SCORE_THRESHOLDS)
    out = {k: v for k, v in best_f1.items() if k != "curves"}
    out.update(epoch=evaluation.get("epoch"), step=evaluation.get("step"))
    return write_json(out, path, indent=1)


def read_score_thresholds(weights: str) -> tuple[dict[int, float], float, str]:
    """The best-F1 score thresholds beside the weights `weights_path(weights)` finds.

    Returns:
        ({category id: threshold} of the classes that have one, the pooled threshold for the others, the file).
    Raises:
        FileNotFoundError: no score_thresholds.json there (an older run, or weights never evaluated), naming it.
        WeightsFileError: the file does not parse or has no pooled threshold.
    """
    path = os.path.join(os.path.dirname(weights_path(weights)), SCORE_THRESHOLDS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {SCORE_THRESHOLDS} beside the weights ({path}): it is written into best/ and last/ "
                                "by the training run's evaluations; give a number instead")
    try:
        with open(path) as f:
            data = json.load(f)
        pooled = data["all"]["score_thresh"]
        per_class = {int(v["category_id"]): float(v["score_thresh"]) for v in data["per_class"].values()
                     if v.get("score_thresh") is not None}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsFileError(f"{path} is damaged ({type(e).__name__}: {e})") from None
    if pooled is None:  # best_f1_thresholds found no true detection at any score: F1 is 0 everywhere
        raise WeightsFileError(f"no threshold was found in {path}: the evaluation of these weights had no true "
                               "detection (IoU 0.5), so no score maximises F1; give --score_thresh a number")
    pooled = float(pooled)
    return per_class, pooled, path


def weights_path(path: str) -> str:
    """A weights file from a path that may be a file, a checkpoint folder or a last/ or best/ folder, or a Hugging
    Face Hub repo id (`owner/name[@revision]`, `hf://...`: its snapshot in the Hub cache, `detlib.hub`).

    Raises:
        FileNotFoundError: naming the path, when it holds no weights file (or the Hub repo cannot be had).
    """
    if os.path.isfile(path):
        return path
    from .hub import local_weights

    path = local_weights(path)
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
        WeightsFileError: when the file is there but does not parse or holds no JSON object.
    """
    f = model_config_file(path)
    return None if f is None else read_json_object(f)


def run_config_of(path: str) -> tuple[dict, str | None]:
    """The `config.yaml` of the run the weights `weights_path(path)` finds come from: in their folder or up to two
    levels above (RUN/best/, RUN/checkpoints/epoch_0003/), and its path; ({}, None) when there is none or it does
    not parse."""
    import yaml

    try:
        folder = os.path.dirname(os.path.abspath(weights_path(path)))
    except FileNotFoundError:
        return {}, None
    for _ in range(3):
        f = os.path.join(folder, "config.yaml")
        if os.path.isfile(f):
            try:
                with open(f) as fh:
                    cfg = yaml.safe_load(fh)
            except (OSError, yaml.YAMLError):
                return {}, None
            return (cfg, f) if isinstance(cfg, dict) else ({}, None)
        folder = os.path.dirname(folder)
    return {}, None


# Keys of model_config.json that name the model; a run config.yaml that disagrees on one is another model's.
MODEL_IDENTITY_KEYS = ("num_classes", "backbone", "fpn_channels", "model")


REQUIRED = object()  # a key of complete_model_config without a default


def complete_model_config(config: dict, path: str, keys: dict, hint: str = "") -> tuple[dict, str | None]:
    """Fill in the keys of `keys` that a model_config.json lacks (written before they existed, or by hand), never
    silently: from the run's config.yaml (`run_config_of`) when it is there and describes this model (the
    `MODEL_IDENTITY_KEYS` both hold agree), else with the default `keys` gives.

    Args:
        config: the model_config.json's contents.
        path: what `weights_path` takes (the run, best/, a checkpoint, a file).
        keys: {key: default}; `REQUIRED` for a key without a default (left missing when the run's config.yaml
            does not have it either: the caller refuses).
        hint: appended to the line when a default is used (e.g. which flag to pass).
    Returns:
        (a completed copy, the one line that says what was missing and what is used; None when nothing was
        missing).
    """
    missing = [k for k in keys if k not in config]
    if not missing:
        return config, None
    run, run_file = run_config_of(path)
    if run and any(k in config and k in run and run[k] != config[k] for k in MODEL_IDENTITY_KEYS):
        run, run_file = {}, None  # a config.yaml of another model beside copied weights
    # a None in config.yaml is a value only for a key whose default is None (max_size: no cap)
    found = {k: run[k] for k in missing if k in run and (run[k] is not None or keys[k] is None)}
    defaults = {k: keys[k] for k in missing if k not in found and keys[k] is not REQUIRED}
    unknown = [k for k in missing if k not in found and k not in defaults]
    out = {**config, **found, **defaults}
    used = []
    if found:
        used.append(", ".join(f"{k} {v}" for k, v in found.items()) + f" from the run's {run_file}")
    if defaults:
        used.append(", ".join(f"{k} {v}" for k, v in defaults.items()) + " (recorded nowhere: the defaults"
                    + (f"; {hint}" if hint else "") + ")")
    if unknown:
        used.append(f"nothing for {', '.join(unknown)} (no run config.yaml of this model holds it)")
    f = model_config_file(path) or "model_config.json"
    return out, f"{f} has no {', '.join(missing)} (written by an older version?): using {'; '.join(used)}"


def model_config_file(path: str) -> str | None:
    """The model_config.json `read_model_config` reads for `path`, or None."""
    try:
        folder = os.path.dirname(weights_path(path))
    except FileNotFoundError:
        return None
    for f in (os.path.join(folder, "model_config.json"), os.path.join(os.path.dirname(folder.rstrip("/")), "model_config.json")):
        if os.path.isfile(f):
            return f
    return None


def load_model_weights(model: torch.nn.Module, path: str) -> str:
    """Strictly load weights into the bare model, whatever wrapper prefixes the file's keys carry.

    Returns the weights file read.
    Raises:
        FileNotFoundError: no weights at `path`.
        WeightsFileError: the file is truncated, damaged or not a weights file.
        RuntimeError: missing or unexpected keys, or shape mismatches (the model built with other settings).
    """
    f = weights_path(path)
    if f.endswith(".safetensors"):
        verify_safetensors(f)
    try:
        sd = load_state_dict_file(f)
    except (FileNotFoundError, WeightsFileError):
        raise
    except Exception as e:  # safetensors / pickle / zip errors of a damaged or foreign file
        raise WeightsFileError(f"{f} is not a readable weights file ({type(e).__name__}: {e})") from None
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        details = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        short = "; ".join(d[:160] for d in details[:2]) + (" ..." if len(details) > 2 else "")
        raise RuntimeError(f"weights in {f} do not fit this model (trained with another model, width or class "
                           f"list? its model_config.json says how it was built): {short}") from None
    return f


def finite_weights(model: torch.nn.Module) -> bool:
    """True when every floating-point parameter and buffer of `model` is finite (one device sync)."""
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
        WeightsFileError (a RuntimeError): a torch file that `weights_only=True` refuses (pickled objects other
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
        raise refused(path, e.__cause__) from None
    if not isinstance(sd, dict) or not any(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors")
    return _strip_wrapper_prefixes(sd)
