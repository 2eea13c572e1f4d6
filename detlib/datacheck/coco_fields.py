"""The values of a COCO json's fields as the data check reads them (see `detlib.datacheck.coco`).

Converters write ids, sizes and boxes as strings or floats, a bbox as a json string, or no bbox at all next
to a polygon or an RLE mask. These functions read what can be read and say None where nothing usable is
there; the check counts and reports each repair.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Iterable, Iterator


def int_id(v) -> int | None:
    """An id as int: ints, integral floats and numeric strings; None for anything else (bools included)."""
    if type(v) is int:
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            try:
                f = float(v)
            except ValueError:
                return None
            return int(f) if f.is_integer() else None
    return None


def ids_after(used: Iterable[int]) -> Iterator[int]:
    """New ids for entries whose own id cannot be used: the integers after the largest id in use, so every
    usable id of the json stays what it was (1 when none is in use)."""
    return itertools.count(max(used, default=0) + 1)


def number(v) -> float | None:
    """A finite float from a number or a numeric string; None otherwise (bools included)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        f = float(v)
    elif isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            return None
    else:
        return None
    return f if math.isfinite(f) else None


def positive_size(v) -> int | None:
    """An image width or height in pixels: `number(v)` rounded to int when > 0; None otherwise."""
    f = number(v)
    return int(round(f)) if f is not None and f > 0 else None


def fallback_box(a: dict) -> tuple[list[float] | None, str | None]:
    """The bbox of an annotation whose `bbox` is not 4 finite numbers.

    Args:
        a: the annotation dict (its `bbox` and `segmentation` are read).
    Returns:
        ([x, y, w, h] floats in pixels, how): how is "strings" for a bbox of numeric strings (or a json string
        of the list), "segmentation" for the extent of its polygons or RLE mask; (None, None) when neither
        gives a finite box.
    """
    bbox = a.get("bbox")
    if isinstance(bbox, str):  # some converters write the list as a string
        try:
            bbox = json.loads(bbox)
        except ValueError:
            bbox = None
    if isinstance(bbox, (list, tuple)) and len(bbox) == 4:
        values = [number(v) for v in bbox]
        if None not in values:
            return values, "strings"
    seg = a.get("segmentation")
    try:
        if isinstance(seg, list) and seg:
            # The polygon's own extent, as COCO's bboxes are (floats); pycocotools' toBbox would round to pixels.
            polys = seg if isinstance(seg[0], (list, tuple)) else [seg]
            xs = [float(v) for p in polys for v in p[0::2]]
            ys = [float(v) for p in polys for v in p[1::2]]
            if xs and ys and all(map(math.isfinite, xs + ys)):
                return [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)], "segmentation"
        elif isinstance(seg, dict) and "counts" in seg and "size" in seg:
            from pycocotools import mask as mask_utils

            rle = mask_utils.frPyObjects(seg, *seg["size"]) if isinstance(seg["counts"], list) else seg
            box = [float(v) for v in mask_utils.toBbox(rle)]
            if box[2] > 0 and box[3] > 0:
                return box, "segmentation"
    except (TypeError, ValueError, KeyError):
        pass
    return None, None


def coco_area(a: dict, w: float, h: float, height: int, width: int) -> float:
    """COCO's area of an annotation: its segmentation's (pycocotools `mask.area`), else the box's.

    Args:
        a: the annotation dict (its `segmentation` is read: polygons or RLE).
        w, h: the (clipped) box's width and height in pixels, for the fallback w * h.
        height, width: the image's size in pixels (polygons are rasterised on it).
    Returns:
        the area in square pixels, > 0 when w and h are.
    """
    seg = a.get("segmentation")
    try:
        if seg:
            from pycocotools import mask as mask_utils

            if isinstance(seg, list):
                polys = seg if isinstance(seg[0], (list, tuple)) else [seg]
                rle = mask_utils.merge(mask_utils.frPyObjects([[float(v) for v in p] for p in polys], height, width))
            else:
                rle = mask_utils.frPyObjects(seg, *seg["size"]) if isinstance(seg["counts"], list) else seg
            area = float(mask_utils.area(rle))
            if area > 0:
                return area
    except (TypeError, ValueError, KeyError, IndexError):
        pass
    return float(w * h)
