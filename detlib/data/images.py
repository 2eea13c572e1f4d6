"""Reading image files the way real data sets need: every colour mode to RGB, damaged files survived; and image
files as the samples of a prediction (`DetectionImageFiles`, `ClassificationImageFiles`).

Real folders hold grayscale, CMYK, RGBA and palette images next to RGB ones, JPEGs cut short by an
interrupted download, zero-byte files and non-images with an image extension.
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager
from typing import Callable, TypeVar

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from ..datacheck.orientation import exif_orientation, labels_on_shown_image
from .transforms import make_sample

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Images tried in a row before a training sample gives up: one bad file is skipped, a run of them means the
# folder is wrong and the run must stop with a message instead of cycling through the data set.
MAX_UNREADABLE_IN_A_ROW = 10

# Errors that mean "this file is not a usable image", as opposed to programming errors.
IMAGE_ERRORS = (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError)


@contextmanager
def _tolerate_truncation():
    previous = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = previous


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to 3-channel RGB.

    Palette images go through RGBA first (PIL warns on transparency otherwise); alpha is dropped;
    16/32-bit grayscale is scaled to 8 bit instead of saturating.
    """
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        img = img.point(lambda v: v * (1 / 256)).convert("L")
    return img.convert("RGB")


def load_rgb(path: str | os.PathLike, exif_transpose: bool = True, allow_truncated: bool = True,
             labelled_size: tuple[int, int] | None = None) -> tuple[Image.Image, bool]:
    """Open an image file as an RGB PIL image, decoded in full, turned as its labels see it.

    Args:
        path: the file.
        exif_transpose: turn the image as PIL's `ImageOps.exif_transpose` shows it, by the one EXIF rule
            (`detlib.datacheck.orientation.labels_on_shown_image`): every orientation 2..8, square or not, unless
            `labelled_size` is the stored size and not the shown one. False: the stored pixels (predict's
            `--no_exif_transpose`).
        allow_truncated: decode a truncated file (the missing part is grey) instead of failing.
        labelled_size: (width, height) px an annotation file gives the image (a COCO json's, a VOC xml's); None: no
            size is stated (YOLO, predict on files), the image is turned.
    Returns:
        (image in mode RGB, truncated) where `truncated` says the file was cut short.
    Raises:
        OSError: the file is missing, empty or not an image, with the path in the message.
    """
    path = os.fspath(path)
    truncated = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # palette-transparency and EXIF chatter from PIL
            try:
                with Image.open(path) as im:
                    im.load()
                    img = im
            except OSError as e:
                if not allow_truncated or "truncated" not in str(e).lower():
                    raise
                truncated = True
                with _tolerate_truncation(), Image.open(path) as im:
                    im.load()
                    img = im
            if exif_transpose and labels_on_shown_image(exif_orientation(img), img.size, labelled_size):
                img = ImageOps.exif_transpose(img)
            return to_rgb(img), truncated
    except IMAGE_ERRORS as e:
        raise OSError(f"cannot read image {path}: {e}") from e


def check_image_file(path: str | os.PathLike, full_decode: bool = True) -> str | None:
    """Why a file cannot be used as an image, or None if it can.

    `full_decode=True` decodes every pixel, which finds truncated files (PIL's `verify()` does not);
    `False` only checks that the file exists, is not empty and has a readable header.
    Returns a short reason ("missing", "empty file", "truncated", "not an image: ...").
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError:
        return "missing"
    if size == 0:
        return "empty file"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(path) as im:
                if full_decode:
                    im.load()
    except OSError as e:
        if "truncated" in str(e).lower():
            return "truncated"
        return f"not an image: {e}"
    except IMAGE_ERRORS as e:
        return f"not an image: {e}"
    return None


def load_skipping_unreadable(load: Callable[[int], T], index: int, size: int, train: bool,
                             placeholder: Callable[[int, Exception], T]) -> T:
    """`load(index)` of a data set of `size` items, surviving files that cannot be read (`IMAGE_ERRORS`).

    Training: the next index is tried, with a warning, up to `MAX_UNREADABLE_IN_A_ROW` in a row. Evaluation
    (`train=False`), where every image must count exactly once: `placeholder(index, error)` is returned.
    Raises:
        RuntimeError: that many images in a row could not be read (the folder is wrong, not one file).
    """
    tries = min(MAX_UNREADABLE_IN_A_ROW, size)
    for attempt in range(tries):
        i = (index + attempt) % size
        try:
            return load(i)
        except IMAGE_ERRORS as e:
            if not train:
                return placeholder(i, e)
            logger.warning("skipping unreadable image: %s", e)
    raise RuntimeError(f"{tries} images in a row starting at index {index} could not be read; see the warnings above")


# ---- image files as the samples of a prediction (scripts/predict_*.py)


class DetectionImageFiles(torch.utils.data.Dataset):
    """Image files as detection samples, in the item layout of `CocoDetection` (so `collate_detection` and the
    evaluation's decoding apply unchanged).

    Args:
        paths: the files; item i has `image_id` = i.
        transform: the evaluation transform (`build_transform(size, "none", max_size)`).
        exif_transpose: turn images upright by their EXIF orientation before anything else.
    Item: {"image": [3, h, w] uint8 resized, "boxes" / "crowd_boxes": [0, 4], "labels": [0], "image_id": int,
           "scale": (sy, sx), "valid": bool}; an unreadable file gives
           an 8x8 placeholder with valid=False (and a logged warning), never an exception.
    """

    def __init__(self, paths: list[str], transform=None, exif_transpose: bool = True):
        self.paths = list(paths)
        self.transform = transform
        self.exif_transpose = exif_transpose

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict:
        try:
            pil, truncated = load_rgb(self.paths[index], exif_transpose=self.exif_transpose)
        except IMAGE_ERRORS as e:
            logger.warning("skipping unreadable image: %s", e)
            return {**detection_item(np.zeros((8, 8, 3), np.uint8), None, index), "valid": False}
        if truncated:
            logger.warning("image %s is truncated; its missing part is decoded as grey", self.paths[index])
        rgb = rgb_array(pil)
        del pil  # PIL's 4 bytes a pixel freed before the item is made: a large image is held once, as `rgb`
        return detection_item(rgb, self.transform, index)


def rgb_array(pil: Image.Image) -> np.ndarray:
    """[H, W, 3] uint8, writable, of an RGB PIL image, copied in strips of rows: `np.asarray` goes through
    `tobytes`, which holds the pixels twice more while it joins them (measured: 1.04 GB more than the 543 MB of a
    13,500 x 13,400 px image)."""
    width, height = pil.size
    out = np.empty((height, width, 3), np.uint8)
    rows = max(1, 2**24 // (3 * width))  # 16 MB strips
    for y in range(0, height, rows):
        out[y:y + rows] = np.asarray(pil.crop((0, y, width, min(y + rows, height))))
    return out


def detection_item(rgb: np.ndarray, transform, image_id: int) -> dict:
    """The item of `DetectionImageFiles` for an [H, W, 3] uint8 RGB array (an image file's pixels, a video frame).
    A writable contiguous array is not copied (without `transform`, the item's image is a view of it: a 13,500 x
    13,400 px image predicted by tiles is 543 MB)."""
    empty = torch.zeros((0, 4))
    rgb = np.ascontiguousarray(rgb)
    image = torch.from_numpy(rgb if rgb.flags.writeable else rgb.copy()).permute(2, 0, 1)
    sample = make_sample(image, empty, torch.zeros((0,), dtype=torch.int64), torch.zeros((0,), dtype=torch.bool))
    if transform is not None:
        sample = transform(sample)
    return {"image": sample["image"].as_subclass(torch.Tensor), "boxes": empty,
            "labels": torch.zeros((0,), dtype=torch.int64), "crowd_boxes": empty, "image_id": image_id,
            "scale": sample.get("scale", (1.0, 1.0)), "valid": True}


class ClassificationImageFiles(DetectionImageFiles):
    """Image files for a classifier.

    Args:
        paths: the files; transform: PIL RGB -> tensor (`classification_transform(size, train=False)`).
        exif_transpose: turn images upright by their EXIF orientation first.
    Item: {"image": float32 [3, S, S] (a black image's transform when unreadable), "index": int, "valid": bool};
    an unreadable file is logged and flagged, never raised. (The file list and EXIF handling are the detection
    set's; only the item differs.)
    """

    def __getitem__(self, index: int) -> dict:
        try:
            img, _ = load_rgb(self.paths[index], exif_transpose=self.exif_transpose)
            valid = True
        except IMAGE_ERRORS as e:
            logger.warning("skipping unreadable image: %s", e)
            img, valid = Image.new("RGB", (64, 64)), False
        return {"image": self.transform(img), "index": index, "valid": valid}
