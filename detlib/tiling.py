"""Tiled inference for small objects in large images: the tile grid, the scale a window goes to the model at, the
detections mapped back to image pixels, and the class-wise merge across windows (issues 40, 52; docs/predict_export.md,
"Tiled prediction"; docs/small_objects.md).

A model trained at N px sees a whole image shrunk to N px: a 20 px car in a 4000 x 3000 photo predicted at 600 px is
3 px, too small for any level of the FPN. Tiled, the image is cut at its native resolution into overlapping
`tile` x `tile` windows (`tile_grid`; a grid of absurdly many windows is refused, `grid_error`); each window is
detected and its boxes are shifted by the window's corner back into image pixels; the merge (`merge_detections`)
keeps each object once.

The scale rule (`window_transform`, the one place it is written): a window goes to the model at the scale the model
was trained at. A model trained on tiles (`--train_tile`, recorded as `train_tile` in its model_config.json) learnt
from tiles cut at native resolution: its windows are not resized, whatever --image_size says for whole images. A
model trained on whole images resized to its --image_size gets each window resized to that size, as its training
images were.

Memory: an image's windows are cut, resized and run `batch_size` at a time (`detect_tiled`), so what tiling adds to
the decoded image (3 bytes a pixel, held once) is one batch of windows, whatever the image's size.

Determinism: the windows come in row-major order and are batched in that order; a batch of one is filled up as the
evaluation's batches are (`EvaluationCollate`); so an image's detections are a function of the image alone, on any
number of processes (each image is tiled whole by one process).
"""

from __future__ import annotations

from typing import Callable

# torch and detlib.data are imported inside the functions: the scripts' --help reads `add_tile_flags` alone

TILE_OVERLAP = 0.2  # --tile_overlap's default, sahi's
# A grid may hold at most this many times the windows per image area of the same tile at overlap 0.5 (each point seen
# by 4 windows there): 16x is overlap 0.875, each point in 64 windows; past it a step of a few px (0.99 on 128 px
# tiles: 2 px, 66,049 windows on a 640 px image) runs for hours and adds nothing a 0.5 overlap does not see.
MAX_WINDOW_FACTOR = 16
# A window this many times larger or smaller than what the model was trained on is said (`window_transform`).
SCALE_MISMATCH = 1.5


def add_tile_flags(group) -> None:
    """--tile, --tile_overlap, --tile_full on an argparse group (the predict and training scripts')."""
    from .argtypes import float_range, int_at_least

    group.add_argument("--tile", type=int_at_least(16), help="detect on overlapping TILE x TILE px windows cut from "
                       "each image at its native resolution, each at the scale the model was trained at (a model "
                       "trained with --train_tile: not resized; else resized to the model's size), boxes merged "
                       "across windows: for objects that the whole image resized would shrink below what the model "
                       "sees (docs/predict_export.md; default: none, the whole image resized)")
    group.add_argument("--tile_overlap", type=float_range(0, 1, hi_open=True), default=TILE_OVERLAP,
                       help="share of a tile that neighbouring tiles overlap (with --tile); make it cover the largest "
                       f"object's size so each object is seen whole in some tile (a grid of more than "
                       f"{MAX_WINDOW_FACTOR}x the windows of overlap 0.5 is refused)")
    group.add_argument("--tile_full", action="store_true", help="with --tile, also detect on the whole image "
                       "resized and merge its boxes in: large objects that no tile holds whole")


def tile_grid(width: int, height: int, tile: int, overlap: float) -> list[tuple[int, int, int, int]]:
    """The windows of a `width` x `height` px image: `tile` x `tile` px, neighbours overlapping by
    int(`tile` * `overlap`) px, the last row and column moved back to end at the image's edge (so no window is
    smaller than a tile and none reaches outside; sahi's `get_slice_bboxes` cuts the same grid). An image smaller
    than a tile in a direction is one window across in it, as large as the image.

    Returns:
        [(x0, y0, x1, y1)] int xyxy pixels of the image, row by row (y, then x), top left first.
    Raises:
        ValueError: `tile` < 1, `overlap` outside [0, 1), or an empty image.
    """
    from .data.train_tiles import training_tile_grid  # the one grid rule, training's and prediction's

    return [tuple(int(v) for v in window) for window in training_tile_grid(width, height, tile, overlap)]


def grid_error(tile: int, overlap: float) -> str | None:
    """The one line that refuses a grid of absurdly many windows, or None: more than `MAX_WINDOW_FACTOR` times the
    windows per image area that the same `tile` gives at overlap 0.5 (the windows per area go as 1 / step^2, step =
    `tile` - int(`tile` * `overlap`) px). Known from the flags alone, before any image is read; the line names the
    count on an image of 5 tiles a side."""
    import math

    step, half = tile - int(tile * overlap), tile - int(tile * 0.5)
    if (half / step) ** 2 <= MAX_WINDOW_FACTOR:
        return None
    side = 5 * tile
    highest = 1 - math.ceil(half / MAX_WINDOW_FACTOR ** 0.5) / tile  # the smallest step allowed
    many, usual = len(tile_grid(side, side, tile, overlap)), len(tile_grid(side, side, tile, 0.5))
    return (f"--tile {tile} --tile_overlap {overlap:g} steps {step} px: {(half / step) ** 2:,.0f}x the windows of "
            f"--tile_overlap 0.5 ({many:,} windows on an image of {side} x {side} px instead of {usual:,}); give an "
            f"overlap of at most {math.floor(highest * 1000) / 1000:g} with this tile (at most {MAX_WINDOW_FACTOR}x)")


def count_windows(sizes, tile: int, overlap: float) -> int:
    """The windows of images of `sizes` [(height, width) px], known before the first one runs."""
    return sum(len(tile_grid(int(w), int(h), tile, overlap)) for h, w in sizes)


def window_transform(model_config: dict, tile: int, image_size: int, max_size: int | None = None
                     ) -> tuple[Callable | None, str, str | None]:
    """The scale rule of tiled evaluation and prediction, written once: a window goes to the model at the scale the
    model was trained at.

    * `model_config["train_tile"]` set (trained with --train_tile: tiles cut at native resolution, `TrainingTiles`,
      whose resize is the identity): windows are not resized (scale 1), whatever `image_size` says (it sizes whole
      images: untiled runs and --tile_full's pass).
    * Otherwise (trained on whole images resized to `image_size` / `max_size`): each window is resized to that size
      with the model's `resize_mode`, as its training images were (scale image_size / `tile` for a full window).

    Args:
        model_config: the model's model_config.json (`train_tile`, `resize_mode`; absent keys: a whole-image model
            resized with antialiasing).
        tile: the window's side in px (--tile); image_size, max_size: the whole images' resize (--image_size /
            --max_size, or the model's own).
    Returns:
        (the windows' transform, None for none; the rule and its scale factor as a phrase for the start line; a
        line when the windows differ from what the model was trained on by more than `SCALE_MISMATCH` x (window
        side against training tile side, or the resize factor of a window), else None).
    """
    from .data.transforms import build_transform, resized_size

    trained = model_config.get("train_tile")
    if trained:
        ratio = tile / trained
        rule = (f"each window at native scale (x1), as the model's {trained} px training tiles were "
                f"(model_config.json train_tile {trained}; --image_size {image_size} sizes whole images only)")
        mismatch = (f"--tile {tile} is {ratio:.3g}x the {trained} px tiles the model was trained on: each window, at "
                    f"native scale as they were, holds {ratio * ratio:.3g}x the area of a training tile (--tile "
                    f"{trained} gives windows as it learnt them)")
        return None, rule, (mismatch if max(ratio, 1 / ratio) > SCALE_MISMATCH else None)
    resize_mode = model_config.get("resize_mode") or "antialias"
    factor = resized_size(tile, tile, image_size, max_size, resize_mode)[0] / tile
    rule = (f"each window resized x{factor:.3g} to the model's {image_size} px, as its training images were (trained "
            "on whole images: no train_tile in model_config.json)")
    mismatch = (f"--tile {tile}: each window is {'enlarged' if factor > 1 else 'shrunk'} x{factor:.3g} to the model's "
                f"{image_size} px input ({factor * factor:.3g}x the pixels of the window; objects x{factor:.3g} their "
                f"size in the file); --tile {image_size} keeps them at their size")
    return (build_transform(image_size, "none", max_size, resize_mode), rule,
            mismatch if max(factor, 1 / factor) > SCALE_MISMATCH else None)


def tile_settings(model_config: dict, tile: int, overlap: float, full: bool, batch_size: int, sizes=None,
                  poll=None) -> tuple[dict, str, str | None]:
    """What a script's --tile makes of a model: `detect_tiled`'s keyword arguments and the lines to log at start.

    Args:
        model_config: the model's model_config.json with the `image_size` / `max_size` this run resizes whole
            images to (the flags' when given); tile, overlap, full: --tile, --tile_overlap, --tile_full;
            batch_size: windows per forward pass.
        sizes: [(height, width) px] of the images when known before reading them (a json's): the start line then
            counts their windows.
        poll: `detect_tiled`'s, between batches of windows (a stop signal).
    Returns:
        (the keyword arguments, the start line: grid, window count, scale rule and factor; the mismatch line or None
        (`window_transform`)).
    """
    from .data.transforms import build_transform

    image_size, max_size = model_config["image_size"], model_config.get("max_size")
    transform, rule, mismatch = window_transform(model_config, tile, image_size, max_size)
    whole = build_transform(image_size, "none", max_size, model_config.get("resize_mode") or "antialias")
    count = f"{count_windows(sizes, tile, overlap):,} windows on {len(sizes)} images, " if sizes is not None else ""
    line = f"--tile {tile} --tile_overlap {overlap:g}{' --tile_full' * full}: {count}{rule}"
    return (dict(transform=transform, whole_transform=whole, tile=tile, overlap=overlap, batch_size=batch_size,
                 full=full, poll=poll), line, mismatch)


def merge_detections(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor,
                     windows: torch.Tensor, match_thresh: float = 0.5) -> dict[str, torch.Tensor]:
    """Merge the detections of overlapping windows: one box per object, which covers it. The rule, written once:

    * Only boxes of different windows are merged: what the decoder's NMS kept inside one window (two overlapping
      objects of one class) stays, so an image that is a single window gives its untiled detections.
    * Two boxes of different windows are one object when they agree where both windows saw: clipped to the
      intersection of their windows, their IoU is above `match_thresh`. A fragment cut by a window's edge and the
      whole box from the neighbour are the same there (IoU ~1); a large low-scored box around a small one is not
      (which is why sahi's union of boxes matched on intersection-over-smaller lost AP: docs/predict_export.md).
    * Greedy, by decreasing score: the highest-scored box left takes from each other window its best match (highest
      clipped IoU) of its class; those are dropped, and the kept box is extended past its own window's edges to
      where they reach (beyond its window the others saw and it did not): a fragment cut by its window's edge
      becomes the whole object whichever of the two scores higher, and keeps the higher score.

    Args:
        boxes: [N, 4] float xyxy pixels of the image; scores: [N] float; labels: [N] int64.
        sources: [N] int64, the window each box was detected in (a row of `windows`).
        windows: [S, 4] float xyxy pixels of the image, the windows (the whole image for --tile_full's pass).
        match_thresh: the clipped IoU above which boxes of two windows are one object.
    Returns:
        {"boxes" [M, 4], "scores" [M], "labels" [M]}, M <= N, by decreasing score (equal scores: input order).
    """
    import torch

    order = torch.sort(scores, descending=True, stable=True).indices
    boxes, scores, labels, sources = boxes[order], scores[order], labels[order], sources[order]
    seen = windows.to(boxes)[sources]  # [N, 4] the window of each box
    matches = _window_matches(boxes, labels, sources, seen, match_thresh)
    left, keep, extended, window_of = [True] * len(boxes), [], [], sources.tolist()
    for i in range(len(boxes)):
        if not left[i]:
            continue
        best: dict[int, int] = {}  # at most one box of each other window: its own NMS kept the others apart
        for _, j in matches.get(i, ()):
            if left[j]:
                best.setdefault(window_of[j], j)
        for j in best.values():
            left[j] = False
        keep.append(i)
        extended.append((i, sorted(best.values())))
    box_out = boxes[keep].clone()
    for k, (i, matched) in enumerate(extended):  # past its window's edges, to where its matches reach
        if matched:
            m = boxes[matched]
            inf = torch.full((2,), float("inf"), dtype=boxes.dtype, device=boxes.device)
            box_out[k, :2] = torch.minimum(box_out[k, :2], torch.where(m[:, :2] < seen[i, :2], m[:, :2], inf).amin(0))
            box_out[k, 2:] = torch.maximum(box_out[k, 2:], torch.where(m[:, 2:] > seen[i, 2:], m[:, 2:], -inf).amax(0))
    keep = torch.tensor(keep, dtype=torch.int64, device=boxes.device)
    return {"boxes": box_out, "scores": scores[keep], "labels": labels[keep]}


def _window_matches(boxes: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor, seen: torch.Tensor,
                    match_thresh: float) -> dict[int, list[tuple[float, int]]]:
    """{i: [(-IoU, j), ...] ascending}: the boxes j > i (lower-scored) of i's class from another window whose IoU
    with box i, both clipped to the region both windows saw (`seen` [N, 4]: each box's window), is above
    `match_thresh`. Only boxes that intersect can match (clipping only shrinks them), so the pairs are found by rows
    of a few million entries at a time, not the whole N x N."""
    import torch

    n, found = len(boxes), {}
    rows = max(1, 2 ** 22 // max(n, 1))
    x0, y0, x1, y1 = boxes.unbind(1)
    for start in range(0, n, rows):
        r, c = slice(start, start + rows), slice(start, n)  # rows i, columns j >= i
        candidate = ((x0[r, None] < x1[None, c]) & (x1[r, None] > x0[None, c]) & (y0[r, None] < y1[None, c])
                     & (y1[r, None] > y0[None, c]) & (labels[r, None] == labels[None, c])
                     & (sources[r, None] != sources[None, c]))
        i, j = torch.nonzero(candidate, as_tuple=True)
        i, j = i + start, j + start
        i, j = i[i < j], j[i < j]
        lo, hi = torch.maximum(seen[i, :2], seen[j, :2]), torch.minimum(seen[i, 2:], seen[j, 2:])
        a, b = _clip(boxes[i], lo, hi), _clip(boxes[j], lo, hi)
        inter = (torch.minimum(a[:, 2:], b[:, 2:]) - torch.maximum(a[:, :2], b[:, :2])).clamp(min=0).prod(1)
        union = (a[:, 2:] - a[:, :2]).clamp(min=0).prod(1) + (b[:, 2:] - b[:, :2]).clamp(min=0).prod(1) - inter
        iou = torch.where(union > 0, inter / union.clamp(min=1e-12), torch.zeros_like(inter))
        hit = iou > match_thresh
        for ii, jj, v in zip(i[hit].tolist(), j[hit].tolist(), iou[hit].tolist()):
            found.setdefault(ii, []).append((-v, jj))
    for pairs in found.values():
        pairs.sort()  # the highest IoU first; equal IoU: the higher-scored box
    return found


def _clip(boxes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """[R, 4] xyxy `boxes` clipped to the regions [R, 2] `lo` (x0, y0) .. `hi` (x1, y1); an empty region (lo > hi)
    gives an empty box."""
    import torch

    return torch.cat([torch.minimum(torch.maximum(corner, lo), hi) for corner in (boxes[:, :2], boxes[:, 2:])], 1)


def _window_item(crop: torch.Tensor, transform, index: int) -> dict:
    """A window [3, h, w] uint8 as an evaluation item (`DetectionImageFiles`' layout), resized by `transform`."""
    import torch

    from .data.transforms import make_sample

    empty = torch.zeros((0, 4))
    sample = make_sample(crop, empty, torch.zeros((0,), dtype=torch.int64), torch.zeros((0,), dtype=torch.bool))
    if transform is not None:
        sample = transform(sample)
    return {"image": sample["image"].as_subclass(torch.Tensor), "boxes": empty, "labels": torch.zeros((0,), dtype=torch.int64),
            "crowd_boxes": empty, "image_id": index, "scale": sample.get("scale", (1.0, 1.0)), "valid": True}


Detect = Callable[[dict], list[dict]]


def detect_tiled(detect: Detect, image: torch.Tensor, transform, tile: int, overlap: float, batch_size: int = 8,
                 full: bool = False, max_detections: int | None = None, match_thresh: float = 0.5,
                 merge=merge_detections, whole_transform=None, poll=None) -> dict[str, torch.Tensor]:
    """One image's detections by tiles, merged: the one call a script makes per image.

    Args:
        detect: the model and its decoding on a collated batch (`EvaluationCollate`): one dict per batch item,
            {"boxes" [n, 4] float32 xyxy pixels of the item as it was before the transform, "scores" [n],
            "labels" [n] int64} (`decode_detections(...).per_image(B)`).
        image: [3, H, W] uint8, the image at its native resolution (on the CPU: windows are cut from it).
        transform: the windows' transform (`window_transform`: None for a model trained on tiles, else the model's
            evaluation transform, `build_transform(image_size, "none", max_size, ...)`).
        tile, overlap: the grid (`tile_grid`), computed before the first window.
        batch_size: windows per forward pass (the memory tiling adds is one batch of them).
        full: also detect the whole image (resized by `whole_transform`, as without tiles) and merge its boxes in:
            large objects that no window holds whole.
        max_detections: the highest-scored detections kept after the merge (None: all).
        match_thresh, merge: the merge across windows (`merge_detections`).
        whole_transform: the whole image's transform with `full` (default: `transform`).
        poll: called before each batch of windows; it may raise (a stop signal), and a true result stops the image
            there, its remaining windows not run (the caller's own poll then stops the run).
    Returns:
        {"boxes" [M, 4] float32 xyxy pixels of `image`, "scores" [M], "labels" [M] int64}, by decreasing score.
    Raises:
        ValueError: `image` is not [3, H, W] uint8, or a bad grid (`tile_grid`).
    """
    import torch

    from .data.coco import EvaluationCollate

    if image.dim() != 3 or image.shape[0] != 3 or image.dtype != torch.uint8:
        raise ValueError(f"detect_tiled needs a [3, H, W] uint8 image, got {tuple(image.shape)} {image.dtype}")
    height, width = image.shape[-2:]
    windows = tile_grid(width, height, tile, overlap)
    collate = EvaluationCollate()
    found, sources = [], []
    for start in range(0, len(windows), batch_size):
        if poll is not None and poll():
            break
        part = windows[start:start + batch_size]
        items = [_window_item(image[:, y0:y1, x0:x1], transform, k) for k, (x0, y0, x1, y1) in enumerate(part)]
        for k, ((x0, y0, _, _), d) in enumerate(zip(part, detect(collate(items)))):  # zip drops a filled batch's copy
            shift = torch.tensor([x0, y0, x0, y0], dtype=d["boxes"].dtype, device=d["boxes"].device)
            found.append({**d, "boxes": d["boxes"] + shift})
            sources.append(torch.full((len(d["boxes"]),), start + k, dtype=torch.int64, device=d["boxes"].device))
    if full:
        found.append(detect(collate([_window_item(image, whole_transform or transform, 0)]))[0])
        sources.append(torch.full((len(found[-1]["boxes"]),), len(windows), dtype=torch.int64,
                                  device=found[-1]["boxes"].device))
        windows = windows + [(0, 0, width, height)]
    if not found:  # stopped before the first window
        return {"boxes": torch.zeros((0, 4)), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)}
    merged = merge(torch.cat([d["boxes"] for d in found]), torch.cat([d["scores"] for d in found]),
                   torch.cat([d["labels"] for d in found]), torch.cat(sources),
                   torch.tensor(windows, dtype=torch.float32), match_thresh)
    return {k: v[:max_detections] for k, v in merged.items()}


def collate_images(samples: list[dict]) -> dict:
    """The batch of a tiled loader: {"images": the [3, H, W] uint8 images at their native sizes (a list: no padding,
    no stacking), "image_ids": [B] int64, "valid": [B] bool}; {} for no sample (a process's filler batch)."""
    import torch

    if not samples:
        return {}
    return {"images": [s["image"] for s in samples], "image_ids": torch.tensor([s["image_id"] for s in samples]),
            "valid": torch.tensor([bool(s["valid"]) for s in samples])}


def tiled_loader(dataset, num_processes: int = 1, process_index: int = 0, **loader_kwargs):
    """A DataLoader of this process's share of `dataset`'s images at their native resolution, one image a batch
    (`collate_images`), for `detect_tiled`.

    Args:
        dataset: an evaluation data set (`CocoDetection` with `train=False`, `DetectionImageFiles`); a shallow copy
            without its transform is read, so the images are decoded as the data set decodes them (EXIF turn, a
            json's size) but not resized.
        num_processes, process_index: image i goes to process i % num_processes (`EvaluationBatchSampler`, every
            process as many batches, the short ones ending with empty ones); so no image is seen twice.
        loader_kwargs: the DataLoader's other arguments (workers).
    """
    import copy

    import torch

    from .data.sampler import EvaluationBatchSampler

    native = copy.copy(dataset)
    native.transform = None
    batches = EvaluationBatchSampler(range(len(native)), 1, num_processes, process_index)
    return torch.utils.data.DataLoader(native, batch_sampler=batches, collate_fn=collate_images, **loader_kwargs)


def tile_flag_error(args) -> str | None:
    """The error line of the tiling flags of a parsed command (`grid_error`), or None: both scripts' parse step."""
    return grid_error(args.tile, args.tile_overlap) if args.tile else None


def tile_flag_notes(args) -> list[str]:
    """One line per tiling flag given without --tile (not used)."""
    if args.tile:
        return []
    return [f"--{k} is not used: it sets the tiles of --tile, which is not given"
            for k, default in (("tile_overlap", TILE_OVERLAP), ("tile_full", False)) if getattr(args, k) != default]
