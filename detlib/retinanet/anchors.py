"""RetinaNet anchors on the FPN levels P3-P7.

Conventions (the model's head outputs are flattened in exactly this order):
  * Levels P3..P7 have strides 8, 16, 32, 64, 128 and base sizes 32, 64, 128, 256, 512 px
    (RetinaNet paper, section 4: "areas of 32^2 to 512^2 on pyramid levels P3 to P7").
  * At every location: 3 octave scales 2^0, 2^(1/3), 2^(2/3) times 3 aspect ratios 0.5, 1, 2, so A = 9.
  * Aspect ratio = h / w, at constant area: w = size / sqrt(ratio), h = size * sqrt(ratio).
  * The anchor index within a location is `ratio_index * num_scales + scale_index` (ratio-major, the
    order torchvision's AnchorGenerator uses).
  * Centre of the anchor at grid cell (y, x) of a level with stride s: ((x + 0.5) * s, (y + 0.5) * s),
    the pixel centre of the cell's receptive field (`offset=0.5`).
  * Order of the flattened [A_total, 4] tensor: level -> y -> x -> anchor.
  * Anchors are xyxy in pixels of the padded input image. They are not clipped to the image.

torchvision's convention (`torchvision_anchor_settings()`, for weights converted from its RetinaNet;
torchvision/models/detection/anchor_utils.py and retinanet.py), which this generator reproduces exactly
when given those settings:
  * explicit per-level sizes `int(x * 2 ** (k / 3))` (truncated: 32, 40, 50 on P3), the same ratio-major
    order, cell anchors computed in float32 and rounded to whole pixels (`round_cell=True`);
  * grid offset 0 (`offset=0.0`): the anchor of cell (y, x) is centred on its top-left pixel (x * s, y * s);
  * the stride of a level is the padded input size divided (floored) by the level's grid size, per axis
    (`stride_from_grid=True`): 64 and 128 on P6 and P7 only when the input is a multiple of 128 (an 800-row
    input has 13 P6 rows of stride 61 and 7 P7 rows of stride 114).

Inputs are padded to a multiple of 32 (the backbone's output stride) by the collate function. Levels up
to P5 then have exactly H / s rows; P6 and P7 come from stride-2 3x3 convs (padding 1), which round up,
so every level has ceil(H / s) x ceil(W / s) cells and anchors depend only on the padded input size.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..data.transforms import INPUT_DIVISIBILITY

DEFAULT_STRIDES = (8, 16, 32, 64, 128)
DEFAULT_SIZES = (32, 64, 128, 256, 512)
DEFAULT_SCALES = (1.0, 2 ** (1 / 3), 2 ** (2 / 3))
DEFAULT_RATIOS = (0.5, 1.0, 2.0)
DEFAULT_NUM_ANCHORS = len(DEFAULT_SCALES) * len(DEFAULT_RATIOS)  # A = 9 per location


def torchvision_anchor_settings() -> dict:
    """The keyword arguments of `AnchorGenerator` that reproduce torchvision's RetinaNet anchors (v1 and v2):
    its sizes `(x, int(x * 2 ** (1 / 3)), int(x * 2 ** (2 / 3)))` for x = 32..512, rounded cell anchors,
    offset 0, strides from the grid. Plain values, stored as they are in model_config.json."""
    sizes = [[x, int(x * 2 ** (1.0 / 3)), int(x * 2 ** (2.0 / 3))] for x in DEFAULT_SIZES]
    return {"sizes": sizes, "offset": 0.0, "round_cell": True, "stride_from_grid": True}


# model_config.json key -> AnchorGenerator keyword (absent keys: the detlib defaults).
ANCHOR_CONFIG_KEYS = {"anchor_sizes": "sizes", "anchor_offset": "offset", "anchor_round_cell": "round_cell",
                      "anchor_stride_from_grid": "stride_from_grid"}


def anchor_generator_from_config(config: dict | None) -> "AnchorGenerator":
    """The AnchorGenerator a model_config.json describes: its `anchor_*` keys (see `ANCHOR_CONFIG_KEYS`), the
    detlib defaults for those it lacks (every config written before these keys existed)."""
    kwargs = {arg: config[key] for key, arg in ANCHOR_CONFIG_KEYS.items() if config and config.get(key) is not None}
    return AnchorGenerator(**kwargs)


def anchor_config(generator_kwargs: dict) -> dict:
    """The model_config.json keys of AnchorGenerator keyword arguments (inverse of `anchor_generator_from_config`)."""
    return {key: generator_kwargs[arg] for key, arg in ANCHOR_CONFIG_KEYS.items() if arg in generator_kwargs}


def cell_anchors(size: float | Sequence[float], scales: Sequence[float], ratios: Sequence[float],
                 round_cell: bool = False) -> torch.Tensor:
    """The anchors of one location centred at (0, 0).

    Args:
        size: the level's base size in pixels (times each of `scales`), or a sequence of explicit sizes
            (one per scale; `scales` is then ignored).
        round_cell: compute as torchvision's `AnchorGenerator.generate_anchors` does (float32, half sides
            rounded to whole pixels, ties to even) instead of exactly in float64.
    Returns:
        [len(ratios) * len(sizes), 4] float32 xyxy, ordered ratio-major (index = r * len(sizes) + s).
    """
    if isinstance(size, (list, tuple)):
        sizes = [float(x) for x in size]
    else:
        sizes = [size * scale for scale in scales]
    if round_cell:
        # torchvision's own arithmetic, so a tie rounds the same way
        sz = torch.as_tensor(sizes, dtype=torch.float32)
        h_ratios = torch.sqrt(torch.as_tensor(ratios, dtype=torch.float32))
        ws = ((1 / h_ratios)[:, None] * sz[None, :]).view(-1)
        hs = (h_ratios[:, None] * sz[None, :]).view(-1)
        return (torch.stack([-ws, -hs, ws, hs], dim=1) / 2).round()
    scales = [1.0] * len(sizes)
    out = []
    for ratio in ratios:
        for size_s, scale in zip(sizes, scales):
            w = size_s * scale / math.sqrt(ratio)
            h = size_s * scale * math.sqrt(ratio)
            out.append([-w / 2, -h / 2, w / 2, h / 2])
    return torch.tensor(out, dtype=torch.float32)


class AnchorGenerator:
    """Makes the anchors for a padded input size, cached per (height, width, device).

    Args:
        strides: stride of each level in pixels (P3..P7).
        sizes: base anchor size of each level in pixels, or per level a sequence of explicit sizes (one per
            scale; `scales` is then ignored).
        scales: octave scales applied to every base size.
        ratios: aspect ratios h / w.
        offset: centre offset within a cell, in cells (0.5 = cell centre; 0 = torchvision's top-left pixel).
        round_cell: round the cell anchors to whole pixels as torchvision does (see `cell_anchors`).
        stride_from_grid: a level's stride is (padded H // H_l, padded W // W_l), torchvision's rule, instead of
            `strides` (the two agree on P3-P5 and differ on P6 / P7 unless the input is a multiple of 128).
    Raises:
        ValueError: when the levels' sizes and strides differ in number, or the levels' anchor counts differ.
    """

    def __init__(
        self,
        strides: Sequence[int] = DEFAULT_STRIDES,
        sizes: Sequence[float] = DEFAULT_SIZES,
        scales: Sequence[float] = DEFAULT_SCALES,
        ratios: Sequence[float] = DEFAULT_RATIOS,
        offset: float = 0.5,
        round_cell: bool = False,
        stride_from_grid: bool = False,
    ):
        if len(strides) != len(sizes):
            raise ValueError(f"one size per stride expected, got strides={strides} sizes={sizes}")
        self.strides = tuple(int(s) for s in strides)
        self.offset = float(offset)
        self.stride_from_grid = bool(stride_from_grid)
        self.cell = [cell_anchors(s, scales, ratios, round_cell) for s in sizes]
        counts = {c.shape[0] for c in self.cell}
        if len(counts) != 1:
            raise ValueError(f"every level needs the same number of anchors per location, got sizes={sizes}")
        self.num_anchors_per_location = counts.pop()
        self._cache: dict[tuple, tuple[torch.Tensor, list[int]]] = {}

    def grid_sizes(self, height: int, width: int) -> list[tuple[int, int]]:
        """Feature-map size (H_l, W_l) = (ceil(H / s), ceil(W / s)) of every level.

        Raises:
            ValueError: if height or width is not a multiple of 32 (the backbone's output stride).
        """
        if height % INPUT_DIVISIBILITY or width % INPUT_DIVISIBILITY:
            raise ValueError(f"input {height}x{width} must be padded to a multiple of {INPUT_DIVISIBILITY}")
        return [(-(-height // s), -(-width // s)) for s in self.strides]

    def __call__(self, height: int, width: int, device=None) -> tuple[torch.Tensor, list[int]]:
        """Anchors for a padded input of height x width pixels, made on `device` (default: the CPU).

        Returns:
            anchors: [A_total, 4] float32 xyxy pixels on `device`, ordered level -> y -> x -> anchor.
            num_per_level: A_l = H_l * W_l * anchors_per_location for each level (sums to A_total).
        """
        device = torch.device("cpu" if device is None else device)
        key = (int(height), int(width), str(device))
        if key not in self._cache:
            # made on `device` itself (only the 9 cell anchors per level are copied there): the grid is never
            # built on the host and copied over, and the arithmetic is the same elementwise float32 on any device
            all_anchors, counts = [], []
            for (h, w), stride, cell in zip(self.grid_sizes(height, width), self.strides, self.cell):
                sy, sx = (height // h, width // w) if self.stride_from_grid else (stride, stride)
                ys = (torch.arange(h, dtype=torch.float32, device=device) + self.offset) * sy
                xs = (torch.arange(w, dtype=torch.float32, device=device) + self.offset) * sx
                cy, cx = torch.meshgrid(ys, xs, indexing="ij")
                centres = torch.stack((cx, cy, cx, cy), dim=-1).reshape(-1, 1, 4)  # [h*w, 1, 4]
                level = (centres + cell.to(device)[None]).reshape(-1, 4)
                all_anchors.append(level)
                counts.append(level.shape[0])
            self._cache[key] = (torch.cat(all_anchors), counts)
        return self._cache[key]
