"""Detections drawn on images: a fixed sample of validation images, boxes in the original image's pixels.

The sample is chosen once from the sorted image ids with a seeded `random.Random`, so it is the same at
every evaluation (a user scrubs through epochs on the same images) and on every process count (it depends on
the ground-truth json alone, never on the sharding).

Orientation: boxes refer to the image as the data set reads it, turned by its EXIF orientation as
`detlib.datacheck.orientation` rules (`detlib.data.images.load_rgb`). Where that rule reads an image as stored (a
json that gives the stored size) or predict ran with `--no_exif_transpose`, the image is still shown upright the way
viewers do (`PIL.ImageOps.exif_transpose`) and the boxes are mapped with it (`exif_transpose_boxes`): what a user
sees is the image as a viewer shows it, boxes on the right objects.

Drawing: PIL's ImageDraw, labels in matplotlib's DejaVu Sans (installed with matplotlib). A drawn sample
(`draw_sample`) is resized up to SAMPLE_DISPLAY_SIZE px, so labels are legible on the built-in 128 px images,
and each label sits on a tag outside its box where there is room, never under another's; ground truth is dashed,
detections solid, each line over a dark outline (visible on any colour). Samples are written as PNG: JPEG blurs thin lines and text.
"""

from __future__ import annotations

import colorsys
import functools
import io
import math
import os
import random
from typing import Iterable, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from ..boxes import box_xywh_to_xyxy
from ..data.images import load_rgb
from ..datacheck.orientation import labels_on_shown_image

EXIF_ORIENTATION_TAG = 0x0112
# PIL transpose method of each EXIF orientation, as in PIL.ImageOps.exif_transpose.
_EXIF_METHODS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
                 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
                 8: Image.Transpose.ROTATE_90}
# Drawing: a ground-truth box is dashed white over a solid black line, a detection a solid line of its class
# colour over a black one, so both show on any image (a white or green line alone vanishes on a white or green
# object); a label is black or white (whichever reads) on a tag of the class colour.
GT_COLOR = (255, 255, 255)
OUTLINE_COLOR = (0, 0, 0)
LEGEND_DETECTION_COLOR = (255, 200, 0)
BAND_COLOR = (40, 40, 40)
# Drawn samples are resized (never shrunk) so their longer side is at least this many pixels: the built-in
# 128 px images would show 13 px labels over their shapes.
SAMPLE_DISPLAY_SIZE = 640
# predict's drawn images: one whose longer side is at most this many px is drawn enlarged (`drawing_scale`)
SMALL_IMAGE_SIDE = 256


def select_sample_ids(image_ids: Iterable[int], num: int, seed: int = 0) -> list[int]:
    """A fixed sample of `num` image ids (all of them when there are fewer), sorted.

    Depends only on the set of ids and the seed (not on their order, the process or the epoch).
    """
    ids = sorted({int(i) for i in image_ids})
    if num >= len(ids):
        return ids
    return sorted(random.Random(seed).sample(ids, max(0, int(num))))


def exif_orientation(path: str | os.PathLike) -> int:
    """The EXIF orientation (1..8) of an image file; 1 (as stored) when absent, unknown or unreadable."""
    try:
        with Image.open(path) as im:
            o = int(im.getexif().get(EXIF_ORIENTATION_TAG, 1))
    except Exception:  # a damaged EXIF block must not stop the drawing
        return 1
    return o if o in _EXIF_METHODS else 1


def exif_transpose_boxes(boxes: torch.Tensor, orientation: int, width: int, height: int) -> torch.Tensor:
    """Map boxes of the stored image onto the image turned upright by `PIL.ImageOps.exif_transpose`.

    Args:
        boxes: [N, 4] float, xyxy pixels of the stored image (pixel edges: 0..width, 0..height).
        orientation: EXIF orientation 1..8.
        width, height: size of the stored image.
    Returns:
        [N, 4] xyxy pixels of the upright image (width and height swapped for orientations 5-8).
    """
    x1, y1, x2, y2 = boxes.unbind(-1)
    W, H = float(width), float(height)
    # each corner (x, y) of the stored image -> its position after the transpose
    xs, ys = {
        1: ((x1, x2), (y1, y2)),
        2: ((W - x2, W - x1), (y1, y2)),                   # FLIP_LEFT_RIGHT
        3: ((W - x2, W - x1), (H - y2, H - y1)),           # ROTATE_180
        4: ((x1, x2), (H - y2, H - y1)),                   # FLIP_TOP_BOTTOM
        5: ((y1, y2), (x1, x2)),                           # TRANSPOSE
        6: ((H - y2, H - y1), (x1, x2)),                   # ROTATE_270 (clockwise)
        7: ((H - y2, H - y1), (W - x2, W - x1)),           # TRANSVERSE
        8: ((y1, y2), (W - x2, W - x1)),                   # ROTATE_90 (counter-clockwise)
    }[int(orientation) if orientation in _EXIF_METHODS else 1]
    return torch.stack((xs[0], ys[0], xs[1], ys[1]), dim=-1)


def load_display_image(path: str, size: tuple[int, int] | None = None,
                       exif_transpose: bool = True) -> tuple[Image.Image, int]:
    """An image file as RGB as the data set reads it (`load_rgb(path, exif_transpose, labelled_size)` with the json's
    `size` = (height, width)), resized to `size` when the file differs (as `CocoDetection` does), and the EXIF
    orientation still to apply to show it upright: 1 when it was read turned. Raises OSError naming the path."""
    labelled = None if size is None else (int(size[1]), int(size[0]))
    img, _ = load_rgb(path, exif_transpose, labelled_size=labelled)
    orientation = exif_orientation(path)
    if exif_transpose and labels_on_shown_image(orientation, image_size(path)[::-1], labelled):
        orientation = 1
    if size is not None and (img.height, img.width) != tuple(size):
        img = img.resize((int(size[1]), int(size[0])), Image.Resampling.BILINEAR)
    return img, orientation


def image_size(path: str) -> tuple[int, int]:
    """(height, width) of an image file, from its header."""
    with Image.open(path) as im:
        return im.height, im.width


def upright_image_and_boxes(path: str, boxes: torch.Tensor, exif_transpose: bool = True,
                            size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An image file as a viewer shows it (EXIF orientation applied), and boxes in its pixels.

    Args:
        path: the image file.
        boxes: [N, 4] float xyxy pixels of the image as the model saw it: `load_display_image(path, size,
            exif_transpose)`; where that is not upright they are mapped with the image.
        exif_transpose: False: the model saw the stored pixels (predict's `--no_exif_transpose`).
        size: (height, width) a json gives the image (the EXIF rule's stated size; the pixels are resized to it).
    Returns:
        (image [3, H, W] uint8 RGB upright, boxes [N, 4] float32 xyxy pixels of it).
    Raises:
        OSError: the file cannot be read (names it).
    """
    pil, orientation = load_display_image(path, size, exif_transpose)
    if orientation != 1:
        boxes = exif_transpose_boxes(boxes, orientation, pil.width, pil.height)
        pil = pil.transpose(_EXIF_METHODS[orientation])
    return torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1), boxes.float()


def boxes_from_coco(xywh: Sequence[Sequence[float]]) -> torch.Tensor:
    """COCO result / annotation boxes [[x, y, w, h], ...] -> [N, 4] float32 xyxy pixels (N may be 0)."""
    return box_xywh_to_xyxy(torch.tensor(xywh, dtype=torch.float32).reshape(-1, 4))


def class_color(category_id: int) -> tuple[int, int, int]:
    """A fixed, saturated colour per category id (golden-ratio hues)."""
    h = (int(category_id) * 0.618033988749895) % 1.0
    r, g, b = colorsys.hsv_to_rgb(h, 0.85, 1.0)
    return int(r * 255), int(g * 255), int(b * 255)


@functools.lru_cache(maxsize=1)
def _font_path() -> str | None:
    try:
        from matplotlib import font_manager

        return font_manager.findfont("DejaVu Sans", fallback_to_default=True)
    except Exception:  # no matplotlib: PIL's built-in font
        return None


@functools.lru_cache(maxsize=8)
def _font(size: int):
    path = _font_path()
    try:
        return ImageFont.truetype(path, size) if path else ImageFont.load_default(size)
    except OSError:
        return ImageFont.load_default(size)


def _style(side: int) -> tuple[int, int]:
    """(line width, font size) in pixels for an image whose longer side is `side` pixels."""
    return max(2, round(side / 320)), max(13, round(side / 40))


def _dashes(p: tuple[float, float], q: tuple[float, float], dash: float, gap: float):
    """The dashes of the segment p -> q, as (start, end) point pairs."""
    length = math.hypot(q[0] - p[0], q[1] - p[1])
    if length == 0:
        return
    ux, uy = (q[0] - p[0]) / length, (q[1] - p[1]) / length
    t = 0.0
    while t < length:
        e = min(t + dash, length)
        yield (p[0] + ux * t, p[1] + uy * t), (p[0] + ux * e, p[1] + uy * e)
        t = e + gap


def _draw_box(draw, box, color, width: int, dashed: bool) -> None:
    """A box as a bright line over a dark outline 1 px wider on each side, so it shows on any image: solid in
    `color` (a detection) or dashed white (ground truth, its outline solid black)."""
    x1, y1, x2, y2 = (round(float(v)) for v in box)  # whole pixels: the line starts at round(x1)
    draw.rectangle((x1 - 1, y1 - 1, x2 + 1, y2 + 1), outline=OUTLINE_COLOR, width=width + 2)
    if not dashed:
        draw.rectangle((x1, y1, x2, y2), outline=color, width=width)
        return
    inset = width / 2  # PIL draws a rectangle's outline inside it; the dashes follow the same line
    corners = [(x1 + inset, y1 + inset), (x2 - inset, y1 + inset), (x2 - inset, y2 - inset), (x1 + inset, y2 - inset)]
    for p, q in zip(corners, corners[1:] + corners[:1]):
        for a, b in _dashes(p, q, dash=4 * width, gap=3 * width):
            draw.line((a, b), fill=color, width=width)


def _text_size(draw, text: str, font) -> tuple[int, int]:
    x1, y1, x2, y2 = draw.textbbox((0, 0), text, font=font)
    return int(math.ceil(x2)), int(math.ceil(y2))


def _place_label(box, w: int, h: int, image_w: int, image_h: int, top: int, taken: list) -> tuple[float, float]:
    """Where a w x h label tag goes: just above the box, outside it, or else just below it, the first of those
    within the image that overlaps no tag placed before (`taken`, higher scores first); else the free row nearest
    the box's top edge (so a tag never hides under another's while the image has room); else above the box.
    Kept within the image (x from the box's left edge, y within `top` .. `image_h`)."""
    x1, y1, x2, y2 = (float(v) for v in box)
    tx = min(max(0.0, x1 - 1), max(0.0, image_w - w))
    lo, hi = float(top), max(float(top), image_h - h)

    def free(ty):
        return not any(tx < a2 and a1 < tx + w and ty < b2 and b1 < ty + h for a1, b1, a2, b2 in taken)

    outside = [ty for ty in (y1 - 1 - h, y2 + 1) if lo <= ty <= hi]
    near = min(max(y1 - 1 - h, lo), hi)
    rows = sorted((lo + k for k in range(int(hi - lo) + 1)), key=lambda ty: abs(ty - near))
    ty = next((ty for ty in outside + rows if free(ty)), near)
    taken.append((tx, ty, tx + w, ty + h))
    return tx, ty


def _draw_label(draw, xy: tuple[float, float], text: str, color, font, pad: int) -> None:
    """The label on a tag of the box's colour at `xy`, its text black or white, whichever reads on the colour."""
    tw, th = _text_size(draw, text, font)
    tx, ty = xy
    draw.rectangle((tx, ty, tx + tw + 2 * pad, ty + th + 2 * pad), fill=color, outline=OUTLINE_COLOR, width=1)
    luminance = 0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2]  # ITU-R BT.601
    draw.text((tx + pad, ty + pad), text, fill=(0, 0, 0) if luminance > 140 else (255, 255, 255), font=font)


def _draw_all(pil: Image.Image, boxes: torch.Tensor, labels: Sequence[str], colors: Sequence[tuple[int, int, int]],
              gt_boxes: torch.Tensor | None, width: int, font, top: int = 0, image_h: int | None = None) -> None:
    draw = ImageDraw.Draw(pil)
    for b in (gt_boxes.tolist() if gt_boxes is not None else []):
        _draw_box(draw, b, GT_COLOR, width, dashed=True)
    order = list(range(len(boxes)))[::-1]  # the highest score (first) drawn last, on top
    for i in order:
        _draw_box(draw, boxes[i].tolist(), colors[i], width, dashed=False)
    pad = max(1, font.size // 6) if hasattr(font, "size") else 2
    taken: list = []
    spots = []
    for i in range(len(boxes)):  # the highest scores choose their place first
        tw, th = _text_size(draw, labels[i], font)
        spots.append(_place_label(boxes[i].tolist(), tw + 2 * pad, th + 2 * pad, pil.width,
                                  image_h if image_h is not None else pil.height, top, taken))
    for i in order:  # tags after every box: no line crosses a label
        _draw_label(draw, spots[i], labels[i], colors[i], font, pad)


def drawing_scale(height: int, width: int) -> int:
    """The integer factor predict draws an image of height x width pixels at: 1 for a photo; for a thumbnail whose
    longer side is at most SMALL_IMAGE_SIDE px (the built-in set's 128 px), the smallest one that brings that side
    to 2 * SMALL_IMAGE_SIDE or more, so that its labels (at least 13 px high) do not cover the objects."""
    side = max(height, width)
    return 1 if side > SMALL_IMAGE_SIDE or side <= 0 else math.ceil(2 * SMALL_IMAGE_SIDE / side)


def draw_detections(image: torch.Tensor, boxes: torch.Tensor, labels: Sequence[str], colors: Sequence[tuple[int, int, int]],
                    gt_boxes: torch.Tensor | None = None, scale: int = 1) -> torch.Tensor:
    """Draw ground-truth boxes (dashed white on black, unlabelled) and detections (solid, class colour on black,
    each with its label on a tag outside the box) on the image, at its own size times `scale` (predict's output).

    Args:
        image: [3, H, W] uint8 RGB.
        boxes: [N, 4] float xyxy pixels of `image`, highest score first; labels: N strings ("person 0.87");
            colors: N RGB tuples.
        gt_boxes: [G, 4] float xyxy pixels, or None.
        scale: an integer >= 1: the image is enlarged by it (pixels repeated, not smoothed) before the boxes, scaled
            with it, are drawn; `drawing_scale` gives predict's.
    Returns:
        [3, H * scale, W * scale] uint8, a new tensor.
    """
    pil = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
    if scale > 1:
        pil = pil.resize((pil.width * scale, pil.height * scale), Image.Resampling.NEAREST)
        boxes = boxes.float() * scale
        gt_boxes = None if gt_boxes is None else gt_boxes.float() * scale
    width, font_size = _style(max(pil.size))
    _draw_all(pil, boxes.float(), labels, colors, gt_boxes, width, _font(font_size))
    return torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)


def draw_batch(images: torch.Tensor, boxes: Sequence[torch.Tensor] | None, labels: Sequence[Sequence[str]],
               colors: Sequence[Sequence[tuple[int, int, int]]]) -> torch.Tensor:
    """A batch as one grid image, ceil(sqrt(B)) columns, 2 px of black between tiles: each image enlarged as predict
    draws it (`drawing_scale`), with its boxes and their labels drawn as detections (`draw_detections`), or, with
    `boxes` None, its one label (a classifier's) on a tag at its top left.

    Args:
        images: [B, 3, H, W] uint8 RGB, one size (a padded batch).
        boxes: B tensors [N_i, 4] float xyxy pixels of the images, or None.
        labels, colors: per image, a string and an RGB tuple per box (with `boxes` None: one each).
    Returns:
        [3, rows * (H * s + 2) - 2, columns * (W * s + 2) - 2] uint8, s = `drawing_scale(H, W)`.
    """
    B, _, H, W = images.shape
    s, columns = drawing_scale(H, W), math.ceil(math.sqrt(B))
    rows = math.ceil(B / columns)
    grid = torch.zeros(3, rows * (H * s + 2) - 2, columns * (W * s + 2) - 2, dtype=torch.uint8)
    for i in range(B):
        if boxes is not None:
            tile = draw_detections(images[i], boxes[i], labels[i], colors[i], scale=s)
        else:
            pil = Image.fromarray(images[i].permute(1, 2, 0).contiguous().numpy())
            pil = pil.resize((W * s, H * s), Image.Resampling.NEAREST)
            font = _font(_style(max(pil.size))[1])
            _draw_label(ImageDraw.Draw(pil), (0, 0), labels[i][0], colors[i][0], font, max(1, font.size // 6))
            tile = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
        y, x = (i // columns) * (H * s + 2), (i % columns) * (W * s + 2)
        grid[:, y:y + H * s, x:x + W * s] = tile
    return grid


def sample_layout(height: int, width: int) -> dict:
    """Where an image of height x width pixels lands in its drawn sample (`draw_sample`).

    Returns:
        {"scale": float >= 1, the image is resized by it (its longer side to at least SAMPLE_DISPLAY_SIZE px);
         "top": px above the image (0: the labels of boxes at its top edge go below their edge);
         "bottom": px of the legend band below it; "font_size", "line_width": px;
         "size": (height, width) of the drawn sample}.
    A box (x1, y1, x2, y2) of the image is drawn at (x1 * scale, y1 * scale + top, ...).
    """
    scale = max(1.0, SAMPLE_DISPLAY_SIZE / max(height, width))
    h, w = round(height * scale), round(width * scale)
    line, font = _style(max(h, w))
    band = font + 2 * max(1, font // 6) + 4
    # no band above: it stayed empty on most images; a box at the top edge has its label below it or inside
    return {"scale": scale, "top": 0, "bottom": band, "font_size": font, "line_width": line,
            "size": (h + band, w)}


def draw_sample(image: torch.Tensor, boxes: torch.Tensor, labels: Sequence[str], colors: Sequence[tuple[int, int, int]],
                gt_boxes: torch.Tensor | None = None, legend: str | None = None) -> torch.Tensor:
    """A sample image for a person to look at: resized so its longer side is at least SAMPLE_DISPLAY_SIZE
    pixels (128 px shapes become legible), with a legend band below (dashed: ground truth, solid: detections).
    Boxes and labels are drawn as `draw_detections` draws them; `sample_layout` says where the image lands.

    Args:
        image: [3, H, W] uint8 RGB; boxes, labels, colors, gt_boxes: as `draw_detections`, in pixels of `image`.
        legend: the text after the two line samples in the legend band (e.g. "detections with score >= 0.30").
    Returns:
        [3, H', W'] uint8 with (H', W') = sample_layout(H, W)["size"].
    """
    lay = sample_layout(*image.shape[-2:])
    h, w = lay["size"][0] - lay["top"] - lay["bottom"], lay["size"][1]
    pil = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
    if lay["scale"] > 1:
        pil = pil.resize((w, h), Image.Resampling.LANCZOS)
    canvas = Image.new("RGB", (w, lay["size"][0]), BAND_COLOR)
    canvas.paste(pil, (0, lay["top"]))
    s, top = lay["scale"], lay["top"]

    def place(b: torch.Tensor | None) -> torch.Tensor | None:
        if b is None:
            return None
        return b.float().reshape(-1, 4) * s + torch.tensor([0.0, top, 0.0, top])

    font = _font(lay["font_size"])
    _draw_all(canvas, place(boxes), labels, colors, place(gt_boxes), lay["line_width"], font, top=0,
              image_h=top + h)
    _draw_legend(canvas, top + h, lay["bottom"], lay["line_width"], font, legend)
    return torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1)


def _draw_legend(canvas: Image.Image, y0: int, band: int, width: int, font, legend: str | None) -> None:
    draw = ImageDraw.Draw(canvas)
    x, cy = 6, y0 + band / 2
    seg = 5 * width + 20
    for text, dashed, color in (("ground truth", True, GT_COLOR), (legend or "detections", False, LEGEND_DETECTION_COLOR)):
        _draw_box(draw, (x, cy - band / 4, x + seg, cy + band / 4), color, width, dashed)
        x += seg + 6
        draw.text((x, cy), text, fill=(255, 255, 255), font=font, anchor="lm")
        x += _text_size(draw, text, font)[0] + 18


def sample_detections(coco_gt: dict, results: list[dict], image_dir: str, image_ids: Sequence[int],
                      category_names: dict[int, str] | None = None, display_thresh: float = 0.3) -> list[dict]:
    """Load, orient and draw the sample images.

    Args:
        coco_gt: ground-truth COCO dict (`images` with `file_name`, `height`, `width`; `annotations`; `categories`).
        results: COCO results (xywh pixels of the stored image, category ids, scores).
        image_dir: the folder of the images' `file_name`s.
        image_ids: the images to draw (`select_sample_ids`).
        category_names: {category id: name}; default: the json's category names.
        display_thresh: detections with a lower score are not drawn.
    Returns:
        one dict per readable image, in `image_ids` order: {"image_id", "file_name", "image": [3, H, W] uint8
        upright undrawn, "drawn": [3, H', W'] uint8 (`draw_sample`: resized up, with label and legend bands),
        "boxes": [N, 4] float32 xyxy upright pixels of "image", "scores": [N], "category_ids": [N] int64,
        "gt_boxes": [G, 4], "gt_category_ids": [G] int64, "gt_crowd": [G] bool}.
        Unreadable images are left out.
    """
    names = category_names or {c["id"]: str(c.get("name", c["id"])) for c in coco_gt["categories"]}
    wanted = {int(i) for i in image_ids}
    images = {im["id"]: im for im in coco_gt["images"] if im["id"] in wanted}
    dets: dict[int, list[dict]] = {i: [] for i in wanted}
    for r in results:
        if r["image_id"] in dets and r["score"] >= display_thresh:
            dets[r["image_id"]].append(r)
    gts: dict[int, list[dict]] = {i: [] for i in wanted}
    for a in coco_gt["annotations"]:
        if a["image_id"] in gts:
            gts[a["image_id"]].append(a)
    out = []
    for iid in image_ids:
        info = images.get(int(iid))
        if info is None:
            continue
        try:
            pil, orientation = load_display_image(os.path.join(image_dir, info["file_name"]), (info["height"], info["width"]))
        except OSError:
            continue
        W, H = pil.size
        if orientation != 1:
            pil = pil.transpose(_EXIF_METHODS[orientation])
        image = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
        d = sorted(dets[int(iid)], key=lambda r: -r["score"])
        boxes = exif_transpose_boxes(boxes_from_coco([r["bbox"] for r in d]), orientation, W, H)
        scores = torch.tensor([float(r["score"]) for r in d], dtype=torch.float32)
        cats = torch.tensor([int(r["category_id"]) for r in d], dtype=torch.int64)
        g = gts[int(iid)]
        gt_boxes = exif_transpose_boxes(boxes_from_coco([a["bbox"] for a in g]), orientation, W, H)
        labels = [f"{names.get(int(c), c)} {s:.2f}" for c, s in zip(cats.tolist(), scores.tolist())]
        drawn = draw_sample(image, boxes, labels, [class_color(c) for c in cats.tolist()], gt_boxes,
                            legend=f"detections, score >= {display_thresh:.2f}")
        out.append({"image_id": int(iid), "file_name": info["file_name"], "image": image, "drawn": drawn,
                    "boxes": boxes, "scores": scores, "category_ids": cats, "gt_boxes": gt_boxes,
                    "gt_category_ids": torch.tensor([int(a["category_id"]) for a in g], dtype=torch.int64),
                    "gt_crowd": torch.tensor([bool(a.get("iscrowd", 0)) for a in g], dtype=torch.bool)})
    return out


def save_image(image: torch.Tensor, path: str, quality: int = 90) -> bytes:
    """Write a [3, H, W] uint8 RGB tensor as JPEG (.jpg / .jpeg) or PNG (any other suffix).

    PNG (zlib level 1) for drawn samples: JPEG blurs 2 px lines and small text; PNG costs ~10-40 ms more per
    640 px image (16 samples: under a second per evaluation). Returns the encoded bytes (TensorBoard takes
    them as they are, see `detlib.evaluation.report`).
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    buf = io.BytesIO()
    pil = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
    if path.lower().endswith((".jpg", ".jpeg")):
        pil.save(buf, format="JPEG", quality=quality)
    else:
        pil.save(buf, format="PNG", compress_level=1)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    return data


def save_samples(samples: list[dict], folder: str, ext: str = "png") -> list[bytes]:
    """Save each sample's drawn image as `folder/<image id, 12 digits>.<ext>`. Returns the encoded files."""
    return [save_image(s["drawn"], os.path.join(folder, f"{s['image_id']:012d}.{ext}")) for s in samples]


def wandb_boxes(sample: dict, category_names: dict[int, str]) -> dict:
    """The `boxes=` argument of `wandb.Image` for one sample: "predictions" (with a "score" per box, so the
    UI can filter by score) and "ground_truth" (crowd boxes captioned as such), class ids = category ids,
    positions in pixels of the upright image."""
    class_labels = {int(k): str(v) for k, v in category_names.items()}

    def box(b, cid, caption, scores=None):
        x1, y1, x2, y2 = (float(v) for v in b)
        d = {"position": {"minX": x1, "minY": y1, "maxX": x2, "maxY": y2}, "domain": "pixel", "class_id": int(cid),
             "box_caption": caption}
        if scores is not None:
            d["scores"] = scores
        return d

    preds = [box(b, c, f"{class_labels.get(int(c), c)} {s:.2f}", {"score": float(s)})
             for b, c, s in zip(sample["boxes"].tolist(), sample["category_ids"].tolist(), sample["scores"].tolist())]
    gt = [box(b, c, class_labels.get(int(c), str(c)) + (" (crowd)" if crowd else ""))
          for b, c, crowd in zip(sample["gt_boxes"].tolist(), sample["gt_category_ids"].tolist(), sample["gt_crowd"].tolist())]
    return {"predictions": {"box_data": preds, "class_labels": class_labels},
            "ground_truth": {"box_data": gt, "class_labels": class_labels}}
