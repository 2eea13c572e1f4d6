"""Training on tiles (`--train_tile SIZE`): the training images cut at their native resolution into SIZE x SIZE tiles.

For objects a few pixels wide in large images, which a whole image resized to the model's input would shrink to
nothing. Each training image is cut into tiles on a fixed grid (`training_tile_grid`: `TRAIN_TILE_OVERLAP` of a tile
shared by neighbours, the last row and column aligned to the image edge; an image smaller than a tile is one tile,
padded at the bottom and right with `PAD_VALUE` to SIZE x SIZE like the batch padding). The tiles are the items of an
epoch, not the images:

* Boxes are clipped to the tile (`tile_boxes`). A box with at least `min_visible` of its area inside is a target
  (clipped); one with less inside is an ignore region: it joins the crowd boxes, whose anchors the loss ignores
  instead of teaching them as background (`detlib.retinanet.matching`, crowd_ioa), so half an object cut by the tile
  border is neither an object nor "no object". Crowd boxes stay crowd boxes, clipped.
* A tile with a target is a positive tile: every one is in every epoch. A tile without one (background only, or only
  ignore regions) is an empty tile: each epoch holds round(`empty_rate` x their count) of them, a choice that is a
  function of (seed, epoch) alone. The epoch's length is the same in every epoch, so the schedule's steps are.
* Item i of an epoch is a function of (seed, epoch, i) alone: its tile (above) and its augmentation (the sample's
  seeded stream, `CocoDetection`'s rule). The samplers deal indices to processes and replay them on a resume as
  they do for images, so N processes see different tiles and a run resumed mid-epoch sees the same tiles.

The tiles then take the training transform at SIZE (`build_transform(SIZE, augmentation)`): the resize is the
identity, so the pixels are the image's own; flips and crops apply as on whole images.

Cost: a tile reads and decodes its whole image (JPEG has no random access), so a 4000 x 3000 image cut into 256 px
tiles is decoded once per tile. The grid and the box assignment need no pixels: they come from the json's sizes.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .coco import CocoDetection, sample_item
from .images import load_skipping_unreadable
from .records import CompactRecords
from .seeds import sample_rng
from .transforms import PAD_VALUE, build_transform, make_sample

logger = logging.getLogger(__name__)

# The share of a tile that neighbouring training tiles overlap: an object cut by one tile's border lies whole in the
# next one unless it is larger than this share of a tile (a quarter, as sahi's and YOLO tiling's usual 0.2-0.25).
TRAIN_TILE_OVERLAP = 0.25


def training_tile_grid(width: int, height: int, tile: int, overlap: float = TRAIN_TILE_OVERLAP) -> np.ndarray:
    """The tile windows of a `width` x `height` px image: [T, 4] int64 xyxy px, row-major (y, then x).

    Tiles are `tile` px squares starting every tile - int(tile * overlap) px; the last row and column end at the
    image edge (so they may overlap their neighbour more); an image side shorter than `tile` is covered by one window
    of that side's length. The one grid rule: tiled prediction's `detlib.tiling.tile_grid` is this grid, and sahi's
    slicing cuts the same windows.
    Raises:
        ValueError: a tile below 1 px, an overlap outside [0, 1), or an empty image.
    """
    if tile < 1 or not 0 <= overlap < 1 or width < 1 or height < 1:
        raise ValueError(f"need tile >= 1, 0 <= overlap < 1 and a non-empty image, got tile {tile}, overlap "
                         f"{overlap}, image {width}x{height}")
    step = tile - int(tile * overlap)

    def starts(side: int) -> list[int]:
        return list(range(0, side - tile, step)) + [max(0, side - tile)]

    return np.asarray([(x, y, min(x + tile, width), min(y + tile, height))
                       for y in starts(height) for x in starts(width)], dtype=np.int64).reshape(-1, 4)


def tile_boxes(boxes: np.ndarray, iscrowd: np.ndarray, window, min_visible: float):
    """The boxes of one tile, in the tile's pixels.

    Args:
        boxes: [N, 4] xyxy px of the image;  iscrowd: [N] bool.
        window: (x0, y0, x1, y1) px of the tile in the image.
        min_visible: the least share of a box's area inside the tile for it to be a target.
    Returns:
        (index [M] int64 into `boxes` of the boxes inside the tile, their boxes [M, 4] float32 clipped to the tile
        and shifted to its origin, ignored [M] bool: crowd boxes and boxes with less than `min_visible` inside).
        A box touching the tile only along an edge (no area inside) is not in it.
    """
    x0, y0, x1, y1 = (float(v) for v in window)
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    clipped = np.stack([np.clip(boxes[:, 0], x0, x1), np.clip(boxes[:, 1], y0, y1),
                        np.clip(boxes[:, 2], x0, x1), np.clip(boxes[:, 3], y0, y1)], axis=1)
    inside = (clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1])
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    index = np.flatnonzero(inside > 0)
    visible = inside[index] / area[index]
    ignored = np.asarray(iscrowd, dtype=bool)[index] | (visible < min_visible)
    shifted = clipped[index] - np.asarray([x0, y0, x0, y0], dtype=np.float32)
    return index, shifted.astype(np.float32), ignored


class TrainingTiles(torch.utils.data.Dataset):
    """The tiles of a training set as its items (see the module docstring).

    Args:
        images: the training set (its records give the sizes and boxes; its `read` the pixels; its seed and epoch).
        tile: the tile's side in px.
        min_visible: the least share of a box's area inside a tile for it to be a target there (else ignored).
        empty_rate: the share of the tiles without a target that each epoch holds, in [0, 1].
        augmentation, resize_mode: the training transform's (`build_transform`).
        overlap: the grid's overlap (`training_tile_grid`).
    Item: `CocoDetection`'s, of a tile: image [3, tile, tile] uint8, boxes and crowd_boxes in the tile's pixels, the
        image's id; scale (1, 1).
    `records`: one per item, `CompactRecords` fields (size (tile, tile); a positive tile's targets; an empty slot's
        none), for the samplers.
    Raises:
        ValueError: `empty_rate` outside [0, 1], `min_visible` outside (0, 1], or no tile with a target.
    """

    def __init__(self, images: CocoDetection, tile: int, min_visible: float = 0.5, empty_rate: float = 0.1,
                 augmentation: str = "none", resize_mode: str = "antialias", overlap: float = TRAIN_TILE_OVERLAP):
        if not 0 <= empty_rate <= 1 or not 0 < min_visible <= 1:
            raise ValueError(f"need an empty tile rate in [0, 1] and a visible share in (0, 1], got {empty_rate} "
                             f"and {min_visible}")
        self.images, self.tile, self.min_visible = images, int(tile), float(min_visible)
        self.category_map, self.train, self.seed = images.category_map, True, images.seed
        self.transform = build_transform(self.tile, augmentation, None, resize_mode)
        positive, empty, records = [], [], []
        for i, rec in enumerate(images.records):
            for window in training_tile_grid(rec["size"][1], rec["size"][0], self.tile, overlap):
                index, boxes, ignored = tile_boxes(rec["boxes"], rec["iscrowd"], window, self.min_visible)
                if ignored.all():
                    empty.append((i, *window))
                    continue
                positive.append((i, *window))
                records.append({"id": rec["id"], "path": rec["path"], "size": (self.tile, self.tile),
                                "boxes": boxes[~ignored], "labels": rec["labels"][index[~ignored]],
                                "iscrowd": np.zeros(int((~ignored).sum()), dtype=bool)})
        if not positive:
            raise ValueError(f"no {self.tile} px tile holds {min_visible:.0%} of a box: nothing to learn from (a "
                             "larger --train_tile, or a lower --tile_min_visible)")
        self.positive = np.asarray(positive, dtype=np.int64).reshape(-1, 5)
        self.empty = np.asarray(empty, dtype=np.int64).reshape(-1, 5)
        self.num_empty = round(empty_rate * len(self.empty))
        empty_record = {"id": -1, "path": "", "size": (self.tile, self.tile), "boxes": np.zeros((0, 4), np.float32),
                        "labels": np.zeros(0, np.int64), "iscrowd": np.zeros(0, bool)}
        self.records = CompactRecords(records + [empty_record] * self.num_empty)
        self._chosen: tuple[int, np.ndarray] | None = None
        logger.info("--train_tile %d: %d training images give %d tiles with a target and %d without, %d of them "
                    "each epoch (--empty_tile_rate %g): %d tiles an epoch", self.tile, len(images.records),
                    len(self.positive), len(self.empty), self.num_empty, empty_rate, len(self))

    def __len__(self) -> int:
        return len(self.positive) + self.num_empty

    @property
    def epoch(self) -> int:
        return self.images.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's empty tiles and augmentation stream (with the seed); see `CocoDetection.set_epoch`."""
        self.images.set_epoch(epoch)

    def empty_tiles(self, epoch: int) -> np.ndarray:
        """[num_empty] int64: the rows of `self.empty` in `epoch`, a function of (seed, epoch) alone, sorted."""
        if self._chosen is None or self._chosen[0] != epoch:
            g = torch.Generator().manual_seed(((self.seed or 0) * 1_000_003 + epoch) * 2 + 1)  # not the shuffle's stream
            self._chosen = (epoch, np.sort(torch.randperm(len(self.empty), generator=g)[:self.num_empty].numpy()))
        return self._chosen[1]

    def tile_of(self, index: int) -> np.ndarray:
        """[5] int64 (image index, x0, y0, x1, y1 px) of item `index` in the current epoch."""
        if index < len(self.positive):
            return self.positive[index]
        return self.empty[self.empty_tiles(self.epoch)[index - len(self.positive)]]

    def _load(self, index: int) -> dict:
        image_index, x0, y0, x1, y1 = (int(v) for v in self.tile_of(index))
        whole = self.images.read(image_index)
        rec = self.images.records[image_index]
        kept, boxes, ignored = tile_boxes(rec["boxes"], rec["iscrowd"], (x0, y0, x1, y1), self.min_visible)
        image = torch.tensor(PAD_VALUE, dtype=torch.uint8).view(3, 1, 1).repeat(1, self.tile, self.tile)
        image[:, : y1 - y0, : x1 - x0] = whole["image"][:, y0:y1, x0:x1]
        sample = make_sample(image, torch.from_numpy(boxes), whole["labels"][torch.from_numpy(kept)],
                             torch.from_numpy(ignored))
        with sample_rng(self.seed, self.epoch, index):
            sample = self.transform(sample)
        return sample_item(sample, rec["id"])

    def __getitem__(self, index: int) -> dict:
        return load_skipping_unreadable(self._load, index, len(self), True, None)
