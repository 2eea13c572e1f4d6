"""EXIF orientation: the one rule by which an image's labels meet its pixels (docs/data_check.md, "EXIF orientation").

A phone stores its pixels as the sensor read them and writes how to show them in the EXIF orientation tag (1..8:
mirrored, upside down, turned by 90 degrees). Viewers, labelling tools and ultralytics show the image turned, so its
labels refer to the image as shown: PIL's `ImageOps.exif_transpose` is the turn, for every orientation 2..8, square
or not. The one exception is an annotation file that states the image's size (COCO's width / height, VOC's <size>)
as the stored size and not the shown one, which only a 90-degree orientation (5..8) of a non-square image can tell
apart: those labels were drawn on the stored pixels, so the image is read as stored. YOLO states no size: always
turned. The loader (`detlib.data.images.load_rgb`) and the data check (`detlib.datacheck.coco_images`) both ask
`labels_on_shown_image`, so what the check reports is what training reads.
"""

from __future__ import annotations

import functools

from PIL import Image, ImageOps

EXIF_ORIENTATION_TAG = 0x0112
# A stated size that differs from the image's by a resize (same aspect ratio within this) still fits it.
ASPECT_TOLERANCE = 0.01


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation 1..8 of an open image; 1 (as stored) when absent, out of range or unreadable."""
    try:
        o = int(img.getexif().get(EXIF_ORIENTATION_TAG, 1) or 1)
    except Exception:  # a damaged EXIF block does not make the pixels unusable
        return 1
    return o if 1 <= o <= 8 else 1


@functools.cache
def _turns_sideways(orientation: int) -> bool:
    # asked of PIL itself on a 2x1 probe, so the sizes follow exif_transpose and no table of ours
    probe = Image.new("L", (2, 1))
    probe.getexif()[EXIF_ORIENTATION_TAG] = orientation
    return ImageOps.exif_transpose(probe).size == (1, 2)


def shown_size(size: tuple[int, int], orientation: int) -> tuple[int, int]:
    """(width, height) px of an image of stored `size` (width, height) as `ImageOps.exif_transpose` shows it."""
    return (size[1], size[0]) if _turns_sideways(int(orientation)) else (size[0], size[1])


def same_aspect(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Two (width, height) sizes equal up to a resize: aspect ratios within `ASPECT_TOLERANCE` (relative)."""
    return abs(a[0] / a[1] - b[0] / b[1]) <= ASPECT_TOLERANCE * b[0] / b[1]


def labels_on_shown_image(orientation: int, stored: tuple[int, int], stated: tuple[int, int] | None = None) -> bool:
    """Whether an image is turned as `ImageOps.exif_transpose` shows it before its labels are used: the rule above.

    Args:
        orientation: the file's EXIF orientation (`exif_orientation`).
        stored: (width, height) px of the stored pixels.
        stated: (width, height) the annotation file gives the image (COCO json, VOC xml), or None (YOLO, predict).
    Returns:
        True for orientations 2..8 unless `stated` is the stored size (or a resize of it) and not the shown one;
        False for orientation 1 (nothing to turn).
    """
    if orientation == 1 or not 1 <= orientation <= 8:
        return False
    shown = shown_size(stored, orientation)
    if stated is None or tuple(stated) == shown:
        return True
    if tuple(stated) == tuple(stored):
        return False
    return not (same_aspect(stated, stored) and not same_aspect(stated, shown))
