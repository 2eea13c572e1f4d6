"""Tiled inference for small objects in large images: the tile grid, detections mapped back to image pixels, and
the class-wise merge across tiles (issue 40; docs/predict_export.md, "Tiled prediction").

A model trained at N px sees a whole image shrunk to N px: a 20 px car in a 4000 x 3000 photo predicted at 600 px is
3 px, too small for any level of the FPN. Tiled, the image is cut at its native resolution into overlapping
`tile` x `tile` windows (`tile_grid`); each window goes through the model's own evaluation transform (resized to the
model's size, as a training image was), is detected, and its boxes are shifted by the window's corner back into
image pixels. An object cut by a window's edge is seen in part (a fragment) in that window and whole in a neighbour
when the overlap is at least its size: the merge (`merge_detections`) keeps it once.

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


def add_tile_flags(group) -> None:
    """--tile, --tile_overlap, --tile_full on an argparse group (the predict and training scripts')."""
    from .argtypes import float_range, int_at_least

    group.add_argument("--tile", type=int_at_least(16), help="detect on overlapping TILE x TILE px windows cut from "
                       "each image at its native resolution, each resized to the model's size, boxes merged across "
                       "windows: for objects that the whole image resized would shrink below what the model sees "
                       "(docs/predict_export.md; default: none, the whole image resized)")
    group.add_argument("--tile_overlap", type=float_range(0, 1, hi_open=True), default=TILE_OVERLAP,
                       help="share of a tile that neighbouring tiles overlap (with --tile); make it cover the largest "
                       "object's size so each object is seen whole in some tile")
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


def merge_detections(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor,
                     match_thresh: float = 0.5) -> dict[str, torch.Tensor]:
    """Merge the detections of overlapping windows: greedy, class by class, on intersection over the smaller box
    (IoS), the matching of sahi's GREEDYNMM. The highest-scored box is kept and every box of its class whose IoS with
    it exceeds `match_thresh` is dropped (a fragment cut by a window's edge lies inside the whole object's box: its IoS
    is near 1 where its IoU is only its share of the object); then the next box left, and so on. Measured on the
    issue's mosaic (docs/predict_export.md): plain NMS on IoU keeps the fragments (AP50 0.906, 6.8 % of the detections
    above 0.3 fragments); this gives AP50 0.934 and none; sahi's merge of the matched boxes into their union instead
    makes a kept box as large as a low-scored box around it (AP50 0.03 with the decoding's 0.05 score threshold).

    Args:
        boxes: [N, 4] float xyxy pixels of the image; scores: [N] float; labels: [N] int64.
        match_thresh: the IoS above which a lower-scored box of the same class is merged into a higher one.
    Returns:
        {"boxes" [M, 4], "scores" [M], "labels" [M]}, M <= N, by decreasing score (equal scores: input order).
    """
    import torch

    from .boxes import box_area

    order = torch.sort(scores, descending=True, stable=True).indices
    boxes, scores, labels = boxes[order], scores[order], labels[order]
    area = box_area(boxes)
    left = torch.ones(len(boxes), dtype=torch.bool, device=boxes.device)
    keep = []
    for i in range(len(boxes)):  # one row at a time: memory O(N), not the N x N of a matrix
        if not left[i]:
            continue
        lt = torch.maximum(boxes[i, :2], boxes[:, :2])
        rb = torch.minimum(boxes[i, 2:], boxes[:, 2:])
        ios = (rb - lt).clamp(min=0).prod(dim=1) / torch.minimum(area[i], area).clamp(min=1e-12)
        left &= ~((labels == labels[i]) & (ios > match_thresh))
        keep.append(i)
    keep = torch.tensor(keep, dtype=torch.int64, device=boxes.device)
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]}


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
                 merge=merge_detections) -> dict[str, torch.Tensor]:
    """One image's detections by tiles, merged: the one call a script makes per image.

    Args:
        detect: the model and its decoding on a collated batch (`EvaluationCollate`): one dict per batch item,
            {"boxes" [n, 4] float32 xyxy pixels of the item as it was before the transform, "scores" [n],
            "labels" [n] int64} (`decode_detections(...).per_image(B)`).
        image: [3, H, W] uint8, the image at its native resolution (on the CPU: windows are cut from it).
        transform: the model's evaluation transform (`build_transform(image_size, "none", max_size, ...)`), applied
            to each window.
        tile, overlap: the grid (`tile_grid`).
        batch_size: windows per forward pass (the memory tiling adds is one batch of them).
        full: also detect the whole image (resized by `transform`, as without tiles) and merge its boxes in: large
            objects that no window holds whole.
        max_detections: the highest-scored detections kept after the merge (None: all).
        match_thresh, merge: the merge across windows (`merge_detections`).
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
    found = []
    for start in range(0, len(windows), batch_size):
        part = windows[start:start + batch_size]
        items = [_window_item(image[:, y0:y1, x0:x1], transform, k) for k, (x0, y0, x1, y1) in enumerate(part)]
        for (x0, y0, _, _), d in zip(part, detect(collate(items))):  # zip drops a filled batch's copy
            shift = torch.tensor([x0, y0, x0, y0], dtype=d["boxes"].dtype, device=d["boxes"].device)
            found.append({**d, "boxes": d["boxes"] + shift})
    if full:
        found.append(detect(collate([_window_item(image, transform, 0)]))[0])
    merged = merge(torch.cat([d["boxes"] for d in found]), torch.cat([d["scores"] for d in found]),
                   torch.cat([d["labels"] for d in found]), match_thresh)
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


def tile_flag_notes(args) -> list[str]:
    """One line per tiling flag given without --tile (not used)."""
    if args.tile:
        return []
    return [f"--{k} is not used: it sets the tiles of --tile, which is not given"
            for k, default in (("tile_overlap", TILE_OVERLAP), ("tile_full", False)) if getattr(args, k) != default]
