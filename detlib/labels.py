"""Label conventions, stated once.

Class labels
  Training labels are contiguous integers 0..K-1. A data set's own category ids (COCO: 1..90 with
  gaps) are mapped to them in sorted order by `CategoryMap`, and mapped back only when results are
  exported for evaluation. Nothing else in detlib sees a data set's category ids.

Padded ground truth
  A batch pads each image's boxes to the batch's largest count M. Padded slots carry label
  `PAD_LABEL` (-1) and box [0, 0, 0, 0]; a slot is real when `labels >= 0`.

Anchor assignment (the output of `detlib.matching.match_anchors`, one value per anchor)
  >= 0         index of the matched ground-truth box (a positive / foreground anchor)
  BACKGROUND   -1: a negative anchor, trained towards "no object" in every class
  IGNORE       -2: takes no part in the loss (IoU between the two thresholds, or inside a crowd region)
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

PAD_LABEL = -1
BACKGROUND = -1
IGNORE = -2


class CategoryMap:
    """Maps a data set's category ids to contiguous labels 0..K-1 and back.

    Args:
        category_ids: the data set's category ids in any order (COCO: `[c["id"] for c in categories]`).
        names: optional names in the same order as `category_ids`.
    Raises:
        ValueError: if `category_ids` is empty or has duplicates.
    """

    def __init__(self, category_ids: Iterable[int], names: Sequence[str] | None = None):
        ids = [int(c) for c in category_ids]
        if not ids:
            raise ValueError("CategoryMap needs at least one category id")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate category ids: {sorted(ids)}")
        by_id = dict(zip(ids, names)) if names is not None else {}
        self.category_ids: list[int] = sorted(ids)
        self.names: list[str] = [str(by_id.get(c, c)) for c in self.category_ids]
        self._to_label = {c: i for i, c in enumerate(self.category_ids)}
        self._to_id = torch.tensor(self.category_ids, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.category_ids)

    def to_label(self, category_id: int) -> int:
        """Data-set category id -> contiguous label. Raises KeyError naming the unknown id."""
        try:
            return self._to_label[int(category_id)]
        except KeyError:
            raise KeyError(f"category id {category_id} is not in the data set's categories") from None

    def to_category_ids(self, labels: torch.Tensor) -> torch.Tensor:
        """[N] int64 contiguous labels -> [N] int64 data-set category ids (on labels' device)."""
        return self._to_id.to(labels.device)[labels.long()]
