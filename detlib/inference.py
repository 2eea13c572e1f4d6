"""Prediction on image files with a trained model: what `scripts/predict_*.py` share.

Sources: an image file, a folder (searched recursively, hidden entries skipped), or a glob pattern; the
files are sorted, so image i is the same file on every process. Work is split by whole batches: the batches
are formed once over the sorted list, exactly as one process forms them, and process r takes batches
r, r + n, r + 2n, ... So no image is seen twice and the results of n processes are those of one. A detection
batch holds images of one padded input shape (`input_shapes`, `detlib.data.EvaluationBatchSampler`), as the
evaluation's: an image's detections are those of the image alone, whatever the batch size and process count.

Orientation: image files are turned upright by their EXIF tag (a phone photo is predicted as it is shown),
unless `exif_transpose=False`; labelled sources (COCO json, VOC, YOLO) are read as in evaluation, by the data's
EXIF rule (`detlib.datacheck.orientation`).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable

from PIL import ExifTags, Image

from .files import atomic_write

# torch, and the modules that import it, are imported where used: a predict script's --help needs none of them

logger = logging.getLogger(__name__)


def list_image_files(source: str, exclude: tuple[str, ...] = (), extensions: tuple[str, ...] | None = None
                     ) -> tuple[str, list[str]]:
    """The image files of `source` and the folder their names are relative to.

    Args:
        source: an existing file (taken whatever its extension), a folder (every file with an image extension
            below it, hidden files and folders skipped), or a glob pattern (`**` recurses; every match that is
            a file).
        exclude: folders whose files are left out: a predict script's per-input output folders (OUT/images ...),
            so with the output folder inside the source the drawn images and copies of an earlier run are
            neither read again as inputs nor written over; how many is logged.
        extensions: the file name extensions a folder's files are listed by (default: the image extensions).
    Returns:
        (root, sorted absolute paths); `os.path.relpath(path, root)` names each file in the outputs.
    Raises:
        FileNotFoundError: nothing matches (names the source), or everything that matches lies in `exclude`.
    """
    from .data.imagefolder import IMG_EXTENSIONS, is_hidden

    extensions = extensions or IMG_EXTENSIONS
    if os.path.isfile(source):
        root, found = os.path.dirname(os.path.abspath(source)), [os.path.abspath(source)]
    elif os.path.isdir(source):
        root, found = os.path.abspath(source), []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
            found += [os.path.join(dirpath, f) for f in filenames
                      if not is_hidden(f) and f.lower().endswith(extensions)]
        if not found:
            raise FileNotFoundError(f"no {'image or video' if extensions != IMG_EXTENSIONS else 'image'} file "
                                    f"({', '.join(extensions)}) below {source}")
    else:
        found = [os.path.abspath(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p)]
        if not found:
            raise FileNotFoundError(f"no file matches {source} (not a file, a folder or a glob pattern that matches)")
        root = os.path.commonpath([os.path.dirname(p) for p in found])
    below = tuple(os.path.realpath(f) + os.sep for f in exclude)
    kept = [p for p in sorted(found) if not os.path.realpath(p).startswith(below)] if below else sorted(found)
    if not kept:
        raise FileNotFoundError(f"every image file of {source} lies in an output folder of this prediction "
                                f"({', '.join(exclude)}; the outputs of an earlier one?): choose an --output_dir "
                                "outside the source")
    if len(kept) < len(found):
        logger.info("left out %d files of %s that lie in this prediction's output folders %s (outputs of an earlier "
                    "prediction)", len(found) - len(kept), source, ", ".join(exclude))
    return root, kept


def list_media_files(source: str, exclude: tuple[str, ...] = ()) -> tuple[str, list[str], list[str], list[str]]:
    """The image and video files of `source` (see `list_image_files`; a folder's videos are found like its images),
    and the files it names that are neither.

    A file with an image or video extension is taken as one (a damaged one is found when it is read: unreadable);
    any other file a source names (a single file, a glob's match) is an image when PIL reads its header, else
    unsupported.
    Returns:
        (root, images, videos, unsupported: "path (unsupported file type: ...)" lines), each sorted.
    Raises:
        FileNotFoundError: nothing matches, or nothing is left outside `exclude` (names the source).
    """
    from .data.imagefolder import IMG_EXTENSIONS
    from .data.video import VIDEO_EXTENSIONS, is_video_file
    from .datacheck.report import read_image_header

    root, found = list_image_files(source, exclude, extensions=IMG_EXTENSIONS + VIDEO_EXTENSIONS)
    images, videos, unsupported = [], [], []
    for p in found:
        if is_video_file(p):
            videos.append(p)
        elif p.lower().endswith(IMG_EXTENSIONS) or read_image_header(p)[0] == "ok":
            images.append(p)
        else:
            unsupported.append(f"{p} (unsupported file type {os.path.splitext(p)[1] or 'no extension'}: neither an "
                               "image nor a video)")
    return root, images, videos, unsupported


def output_names(names: list[str], keep_extension: bool = False) -> list[str]:
    """One distinct output name per input, for the files a script writes per input (drawn image, json, copy).

    Args:
        names: the inputs' names relative to their root (`list_image_files`), distinct.
        keep_extension: False: the name without its extension (`photos/a.jpg` -> `photos/a`; the caller adds its
            own, `.jpg` for a drawn image, `.json`), except for inputs whose name without extension another input
            shares (`a.jpg`, `a.png`, `a.JPG`): those keep their whole name (`a.jpg`, `a.png`, `a.JPG`, drawn as
            `a.png.jpg` ...). True: the whole name (a copy of the file).
    Returns:
        the names in input order, distinct ignoring case (so a case-insensitive file system cannot merge two
        either), each inside the output folder (a `..` part becomes `__`, an absolute name is made relative); a
        clash left after that (the input `a.png.jpg` beside `a.png` and `a.jpg`) gets `~2`, `~3` ... (before the
        extension with `keep_extension`), the first input in order keeping the plain name. A function of
        `names` only, so every process computes the same names.
    """
    def inside(name: str) -> str:
        parts = [p for p in name.replace(os.sep, "/").split("/") if p not in ("", ".")]
        return "/".join("__" if p == ".." else p for p in parts) or "_"

    names = [inside(n) for n in names]
    if keep_extension:
        preferred = names
    else:
        stems = [os.path.splitext(n)[0] for n in names]
        count = Counter(s.casefold() for s in stems)
        preferred = [s if count[s.casefold()] == 1 else n for s, n in zip(stems, names)]
    wanted = {p.casefold() for p in preferred}
    used: set[str] = set()
    out = []
    for p in preferred:
        name, k = p, 1
        root, ext = os.path.splitext(p) if keep_extension else (p, "")
        # taken by an earlier input, or (for a renamed one) another input's own name
        while name.casefold() in used or (name != p and name.casefold() in wanted):
            k += 1
            name = f"{root}~{k}{ext}"
        used.add(name.casefold())
        out.append(name)
    return out


def shard_batches(num_items: int, batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """The batches (lists of item indices, in order) that process `rank` of `world_size` runs: batch b covers
    items [b * batch_size, (b + 1) * batch_size), and process r takes batches r, r + world_size, ..."""
    batches = [list(range(i, min(i + batch_size, num_items))) for i in range(0, num_items, batch_size)]
    return batches[rank::world_size]


def input_shapes(paths: list[str], exif_transpose: bool, image_size: int, max_size: int | None = None,
                 resize_mode: str = "antialias") -> list:
    """The padded input shape (H, W) px of each image file, from its header alone (size, EXIF orientation when
    `exif_transpose`: orientations 5-8 turn it a quarter, so width and height swap); the keys of
    `EvaluationBatchSampler`. A file whose header cannot be read gets a key of its own ("unread", i): it is
    predicted alone (it is most likely unreadable: its placeholder is what the batch holds)."""
    from .data.images import IMAGE_ERRORS
    from .data.transforms import padded_input_shape

    shapes = []
    for i, path in enumerate(paths):
        try:
            w, h = image_size_as_shown(path, exif_transpose)
        except IMAGE_ERRORS:
            shapes.append(("unread", i))
            continue
        shapes.append(padded_input_shape(h, w, image_size, max_size, resize_mode))
    return shapes


def image_size_as_shown(path: str, exif_transpose: bool) -> tuple[int, int]:
    """(width, height) px of an image file from its header, turned by its EXIF orientation when `exif_transpose`
    (orientations 5-8 swap them): the pixels predict's boxes refer to. Raises what PIL raises on a bad file
    (`detlib.data.images.IMAGE_ERRORS`)."""
    with warnings.catch_warnings(), Image.open(path) as im:
        warnings.simplefilter("ignore")  # EXIF chatter from PIL
        w, h = im.size
        if exif_transpose and im.getexif().get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8):
            w, h = h, w
    return w, h


def predict_videos(paths: list[str], predict: Callable[[int], tuple[list[dict], str | None]], rank: int,
                   world_size: int) -> tuple[dict[int, list[dict]], dict[int, str]]:
    """This process's videos, each whole on one process (video v on process v % `world_size`), as `shard_batches`
    splits the images.

    `predict(v)`: (the rows of video `paths[v]`, None or why not every frame was read: `VideoFrames.problem()`),
    raising ValueError when the file yields no frame (unreadable, no video stream, no frame decoded).
    Returns ({v: rows} of this process's videos with a frame, {v: skipped.txt line} of the others and of those that
    ended early, each logged once as a warning; keyed by v, so the merged lines keep the input order whatever the
    number of processes).
    """
    rows: dict[int, list[dict]] = {}
    skipped: dict[int, str] = {}
    for v in range(rank, len(paths), world_size):
        try:
            rows[v], problem = predict(v)
        except ValueError as e:  # no frame to predict: listed like an unreadable image
            logger.warning("skipping unreadable video: %s", e)
            skipped[v] = f"{paths[v]} (unreadable video)"
            continue
        if problem:  # its frames are predicted; the rest of the file is not
            logger.warning("video %s %s: its frames up to there are predicted", paths[v], problem)
            skipped[v] = f"{paths[v]} (video {problem})"
    return rows, skipped


def write_skipped(output_dir: str, skipped: list[str]) -> str | None:
    """`output_dir/skipped.txt`: one line per input a prediction left out or did not read in full ("path (why)":
    unreadable, unsupported, a video that ended early), and a warning line that counts them and names the first
    (main process). None skipped: no file (an earlier prediction's in the folder is removed, so the folder never
    lists files this one read). Returns the file's path, or None."""
    path = os.path.join(output_dir, "skipped.txt")
    if not skipped:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return None
    with atomic_write(path) as f:
        f.write("".join(f"{p}\n" for p in skipped))
    logger.warning("skipped %d files, unreadable, unsupported or read in part (listed in %s/skipped.txt), e.g. %s",
                   len(skipped), output_dir, skipped[:3])
    return path


def load_retinanet(weights: str) -> tuple[torch.nn.Module, dict, CategoryMap]:
    """Rebuild a trained RetinaNet from its weights and model_config.json, in eval mode on the CPU.

    Args:
        weights: a run folder (its best/, else last/), best/ or last/, a checkpoint folder, or a weights file
            with model_config.json beside it or in its parent folder.
    Returns:
        (model, model_config, CategoryMap of the config's `category_ids` named by its `category_names`). Both keys
        are optional in a hand-written config (a model brought from elsewhere): ids 1..num_classes, named by id.
    Raises:
        FileNotFoundError: no weights, or no model_config.json next to them (names the path).
        KeyError: the config lacks a key the model needs (`build_retinanet_from_config`: one line naming it).
        RuntimeError: the weights do not fit the config's model.
    """
    from .labels import CategoryMap
    from .retinanet.model import build_retinanet_from_config
    from .weights import read_model_config, weights_path

    f, config = weights_path(weights), read_model_config(weights)
    if config is None:
        raise FileNotFoundError(f"no model_config.json next to {f} (nor in its parent folder): the model cannot be "
                                "rebuilt; the training script writes one into best/, last/ and every checkpoint")
    model = _rebuild(weights, build_retinanet_from_config(config))
    ids = config.get("category_ids") or list(range(1, int(config["num_classes"]) + 1))
    return model, config, CategoryMap(ids, config.get("category_names"))


def _rebuild(weights: str, model: torch.nn.Module) -> torch.nn.Module:
    """`model` with the weights of `weights` loaded, in eval mode: both loaders'."""
    from .weights import load_model_weights

    load_model_weights(model, weights)
    return model.eval()


def retinanet_input_size(config: dict, weights: str, image_size: int | None = None,
                         max_size: int | None = None) -> tuple[int, int | None]:
    """The resize of a trained RetinaNet (`build_transform(image_size, "none", max_size)`): `image_size` / `max_size`
    (the --image_size / --max_size flags) when given, else the model's own from its model_config.json.
    Raises WeightsFileError: neither gives the image size (one line naming the file and the flag)."""
    from .weights import require_model_keys

    if image_size:
        return image_size, max_size
    require_model_keys(config, weights, {"image_size": "--image_size (and --max_size) with the size the model was "
                                                        "trained at"})
    return int(config["image_size"]), max_size or config.get("max_size")


def load_classifier(weights: str) -> tuple[torch.nn.Module, dict]:
    """Rebuild a trained classifier from its weights and model_config.json (`model`, `classes`), eval mode.
    Raises:
        FileNotFoundError: no weights or no model_config.json (names the path).
        RuntimeError: the weights do not fit the config's model; WeightsFileError, its subclass: the config lacks
            `model` (one line).
    """
    from .classification import build_classifier
    from .weights import read_model_config, require_model_keys, weights_path

    f, config = weights_path(weights), read_model_config(weights)
    if config is None or "classes" not in config:
        raise FileNotFoundError(f"no classifier model_config.json (with 'classes') next to {f}: the model cannot be rebuilt")
    require_model_keys(config, weights, {"model": ""})
    return _rebuild(weights, build_classifier(config["model"], len(config["classes"]))), config


def prediction_parser(description: str, batch_size: int) -> tuple[argparse.ArgumentParser, dict]:
    """The parser of a predict script with the flags every one reads (`start_prediction`, the file loop), and its
    groups {"data", "model", "output"} for the script's own flags. Data: `--no_exif_transpose`, `--batch_size`
    (images per process and forward pass), `--num_workers`; model: `--weights`, `--mixed_precision`, `--cpu`;
    output: `--output_dir`, `--verbose`. `--help` shows every default."""
    from .engine.flags import ArgumentParser, HelpFormatter, int_at_least

    p = ArgumentParser(description=description, formatter_class=HelpFormatter)
    groups = {name: p.add_argument_group(name) for name in ("data", "model", "output")}
    groups["data"].add_argument("--no_exif_transpose", action="store_true",
                                help="read image files as stored instead of turning them upright by their EXIF tag")
    groups["data"].add_argument("--batch_size", type=int_at_least(1), default=batch_size, help="images per process and forward pass")
    groups["data"].add_argument("--num_workers", type=int_at_least(0), default=2, help="data loader workers per process")
    groups["model"].add_argument("--weights", required=True,
                                 help="a run folder, best/, last/, a checkpoint folder or a model.safetensors")
    groups["model"].add_argument("--mixed_precision", choices=["no", "fp16", "bf16"],
                                 help="precision of the forward pass (default None: the accelerate config's)")
    groups["model"].add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    groups["output"].add_argument("--output_dir", required=True, help="where the predictions and predict.log go")
    groups["output"].add_argument("--verbose", action="store_true", help="also the INFO lines of the libraries")
    return p, groups


def earlier_outputs(output_dir: str, folders: tuple[str, ...]) -> str | None:
    """A warning line when `output_dir`'s per-input folders (`images`, `json`, `by_class`) already hold files (an
    earlier prediction): files of the same name are replaced, the others stay. None when they are empty."""
    counts = {name: sum(len(files) for _, _, files in os.walk(os.path.join(output_dir, name))) for name in folders}
    held = ", ".join(f"{n} in {name}/" for name, n in counts.items() if n)
    if not held:
        return None
    return (f"{output_dir} already holds the outputs of an earlier prediction ({held}): files of the same name are "
            "replaced, the others stay; use a new --output_dir for a set of this run's files only")


def start_prediction(args):
    """The Accelerator of a predict script (CPU or GPU, any number of processes) and its log,
    `OUTPUT_DIR/predict.log` on the main process. Reads `args.output_dir`, `args.mixed_precision`, `args.cpu`,
    `args.verbose`."""
    from .engine import make_accelerator, setup_logging

    os.makedirs(args.output_dir, exist_ok=True)
    accelerator = make_accelerator(args.mixed_precision, 1, "none", args.output_dir, cpu=args.cpu)
    setup_logging(args.output_dir, accelerator.is_main_process, filename="predict.log", verbose=args.verbose)
    return accelerator


def stop_if_signalled() -> None:
    """A predict script's poll between its batches and video chunks: raise KeyboardInterrupt (which no `except
    Exception` on its way out swallows) when a stop signal came (`detlib.engine.signals.catch_signals`, training's
    handlers: they only record it); `run_prediction` turns it into the stop."""
    from .engine.signals import signal_received

    if signal_received():
        raise KeyboardInterrupt


def run_prediction(main) -> None:
    """A predict script's entry point: SIGINT, SIGTERM or SIGUSR1 is recorded (`catch_signals`, as in training) and
    stops it at its next poll (`stop_if_signalled`; a second SIGINT a second or more after the first: at once) with
    one `stopped:` line, last, no traceback, exit code 128 + the signal's number (SIGINT 130, SIGTERM 143); the files
    written per image so far stay, the merged outputs only come from a run that ends. A signal after the last poll
    lets the prediction end, then exits with its code and a line saying the outputs are complete. From a stop on,
    signals are ignored; a prediction that ends with none leaves them to their default action (no KeyboardInterrupt
    in the interpreter's shutdown)."""
    import signal

    from .data.loaders import quiet_resource_sharer_errors
    from .engine.exits import stop
    from .engine.signals import catch_signals, release_signals, signal_received

    handlers, stopped = dict.fromkeys(catch_signals(), signal.SIG_DFL), None
    quiet_resource_sharer_errors()  # a batch in flight at the stop must not print a traceback after our line
    try:
        main()
    except KeyboardInterrupt:
        release_signals(handlers, stopped=True)  # before the loader's workers shut down as the exception is dropped
        stopped = signal_received() or "SIGINT"
    finally:
        release_signals(handlers, stopped=signal_received() is not None)
    if name := stopped or signal_received():  # the one exit of a stop outside a training run: one line, every process
        stop(f"{name} before the end; the per-image outputs written so far are kept, the merged ones were not written: "
             "run the same command again" if stopped else f"{name} came as the prediction ended; it ran to its end and "
             "its outputs are complete", 128 + getattr(signal, name), "stopped")
