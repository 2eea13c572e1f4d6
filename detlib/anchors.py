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

Inputs are padded to a multiple of 32 (the backbone's output stride) by the collate function. Levels up
to P5 then have exactly H / s rows; P6 and P7 come from stride-2 3x3 convs (padding 1), which round up,
so every level has ceil(H / s) x ceil(W / s) cells and anchors depend only on the padded input size.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

DEFAULT_STRIDES = (8, 16, 32, 64, 128)
DEFAULT_SIZES = (32, 64, 128, 256, 512)
DEFAULT_SCALES = (1.0, 2 ** (1 / 3), 2 ** (2 / 3))
DEFAULT_RATIOS = (0.5, 1.0, 2.0)
# Inputs must be a multiple of the backbone's output stride so C3-C5 have exactly H / s rows.
INPUT_DIVISIBILITY = 32


def cell_anchors(size: float, scales: Sequence[float], ratios: Sequence[float]) -> torch.Tensor:
    """The anchors of one location centred at (0, 0).

    Returns:
        [len(ratios) * len(scales), 4] float32 xyxy, ordered ratio-major (index = r * len(scales) + s).
    """
    out = []
    for ratio in ratios:
        for scale in scales:
            w = size * scale / math.sqrt(ratio)
            h = size * scale * math.sqrt(ratio)
            out.append([-w / 2, -h / 2, w / 2, h / 2])
    return torch.tensor(out, dtype=torch.float32)


class AnchorGenerator:
    """Makes the anchors for a padded input size, cached per (height, width, device).

    Args:
        strides: stride of each level in pixels (P3..P7).
        sizes: base anchor size of each level in pixels.
        scales: octave scales applied to every base size.
        ratios: aspect ratios h / w.
        offset: centre offset within a cell, in cells (0.5 = cell centre).
    """

    def __init__(
        self,
        strides: Sequence[int] = DEFAULT_STRIDES,
        sizes: Sequence[float] = DEFAULT_SIZES,
        scales: Sequence[float] = DEFAULT_SCALES,
        ratios: Sequence[float] = DEFAULT_RATIOS,
        offset: float = 0.5,
    ):
        if len(strides) != len(sizes):
            raise ValueError(f"one size per stride expected, got strides={strides} sizes={sizes}")
        self.strides = tuple(int(s) for s in strides)
        self.offset = float(offset)
        self.cell = [cell_anchors(s, scales, ratios) for s in sizes]
        self.num_anchors_per_location = len(scales) * len(ratios)
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
        """Anchors for a padded input of height x width pixels.

        Returns:
            anchors: [A_total, 4] float32 xyxy pixels, ordered level -> y -> x -> anchor.
            num_per_level: A_l = H_l * W_l * anchors_per_location for each level (sums to A_total).
        """
        key = (int(height), int(width), str(device))
        if key not in self._cache:
            all_anchors, counts = [], []
            for (h, w), stride, cell in zip(self.grid_sizes(height, width), self.strides, self.cell):
                ys = (torch.arange(h, dtype=torch.float32) + self.offset) * stride
                xs = (torch.arange(w, dtype=torch.float32) + self.offset) * stride
                cy, cx = torch.meshgrid(ys, xs, indexing="ij")
                centres = torch.stack((cx, cy, cx, cy), dim=-1).reshape(-1, 1, 4)  # [h*w, 1, 4]
                level = (centres + cell[None]).reshape(-1, 4)
                all_anchors.append(level)
                counts.append(level.shape[0])
            self._cache[key] = (torch.cat(all_anchors).to(device), counts)
        return self._cache[key]
