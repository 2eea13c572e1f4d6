"""Label conventions, stated once.

Class labels
  Training labels are contiguous integers 0..K-1. A data set's own category ids (COCO: 1..90 with
  gaps) are mapped to them in sorted order by `CategoryMap`, and mapped back only when results are
  exported for evaluation. Nothing else in detlib sees a data set's category ids.

Padded ground truth
  A batch pads each image's boxes to the batch's largest count M. Padded slots carry label
  `PAD_LABEL` (-1) and box [0, 0, 0, 0]; a slot is real when `labels >= 0`.

Anchor assignment (the output of `detlib.retinanet.matching.match_anchors`, one value per anchor)
  >= 0         index of the matched ground-truth box (a positive / foreground anchor)
  BACKGROUND   -1: a negative anchor, trained towards "no object" in every class
  IGNORE       -2: takes no part in the loss (IoU between the two thresholds, or inside a crowd region)
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

PAD_LABEL = -1
BACKGROUND = -1
IGNORE = -2


class CategoryMap:
    """Maps a data set's category ids to contiguous labels 0..K-1 and back.

    Args:
        category_ids: the data set's category ids in any order (COCO: `[c["id"] for c in categories]`).
        names: optional names in the same order as `category_ids`.
        sort: labels follow the sorted ids (the convention); False keeps the given order (a model's classes
            matched by name to another data set's ids, `match_categories`).
    Raises:
        ValueError: if `category_ids` is empty or has duplicates.
    """

    def __init__(self, category_ids: Iterable[int], names: Sequence[str] | None = None, sort: bool = True):
        ids = [int(c) for c in category_ids]
        if not ids:
            raise ValueError("CategoryMap needs at least one category id")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate category ids: {sorted(ids)}")
        by_id = dict(zip(ids, names)) if names is not None else {}
        self.category_ids: list[int] = sorted(ids) if sort else ids
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


def _same_name(a: str, b: str) -> bool:
    return str(a).strip().casefold() == str(b).strip().casefold()


def match_categories(model: CategoryMap, data: CategoryMap, by_name: bool = False, model_source: str = "the model",
                     data_source: str = "the data", flag: str = "--categories_by_name",
                     unit: str = "id") -> dict[int, int | None]:
    """Where a trained model meets a data set's categories: which data-set category each model class means.

    Without `by_name` the classes are matched by category id, and an id that both sides have must carry the same
    name on both (compared without case and outer spaces), or the labels would silently change meaning (a
    model's "triangle" scored as the json's "car"). Ids only one side has are fine (a val json may list only the
    categories it uses). With `by_name` each model class is matched to the data set's category of the same name,
    whatever its id; a model class whose name the data set lacks maps to None (its detections mean nothing there).

    Args:
        model: the model's classes (from its model_config.json). data: the data set's (its json's categories).
        flag, unit: the flag that matches by name and what an id is (a classifier's "output"), for the message.
    Returns:
        {model category id: data category id, or None (by_name, no category of that name)}, in the model's order.
    Raises:
        ValueError: ids whose names differ (without `by_name`); one line naming both sides of each pair (the
            first five) and the flag that maps by name. With `by_name`: two data categories of one name.
    """
    data_names = dict(zip(data.category_ids, data.names))
    if not by_name:
        clash = [(c, n, data_names[c]) for c, n in zip(model.category_ids, model.names)
                 if c in data_names and not _same_name(n, data_names[c])]
        if clash:
            pairs = ", ".join(f"{unit} {c} is {m!r} in {model_source} but {d!r} in {data_source}" for c, m, d in clash[:5])
            more = f" (and {len(clash) - 5} more)" if len(clash) > 5 else ""
            raise ValueError(f"the model's classes are not this data set's: {pairs}{more}; pass {flag} to match the "
                             "classes by name")
        return {c: c for c in model.category_ids}
    by_folded: dict[str, int] = {}
    for c, n in data_names.items():
        key = str(n).strip().casefold()
        if key in by_folded:
            raise ValueError(f"{data_source}: categories {by_folded[key]} and {c} are both named {n!r}; classes cannot "
                             "be matched by name")
        by_folded[key] = c
    return {c: by_folded.get(str(n).strip().casefold()) for c, n in zip(model.category_ids, model.names)}


def describe_mapping(mapping: dict[int, int | None], model: CategoryMap) -> str | None:
    """One line for the log when `match_categories(..., by_name=True)` moved or dropped classes, else None."""
    names = dict(zip(model.category_ids, model.names))
    moved = [f"{names[m]} {m}->{d}" for m, d in mapping.items() if d is not None and d != m]
    dropped = [names[m] for m, d in mapping.items() if d is None]
    if not moved and not dropped:
        return None
    parts = [f"ids mapped by name: {', '.join(moved)}"] if moved else []
    if dropped:
        parts.append(f"not in the data set (their detections are left out): {', '.join(dropped)}")
    return "; ".join(parts)


def model_classes_in_data(model: CategoryMap, data: CategoryMap, by_name: bool = False, model_source: str = "the model",
                          data_source: str = "the data", flag: str = "--categories_by_name",
                          unit: str = "id") -> tuple[list[int | None], list[int | None]]:
    """Where a trained model meets a data set (evaluation, predict, `--init_from`, a classifier's `--weights`):
    `match_categories` (its ValueError), the line of classes moved or dropped logged. Returns (for each model label,
    the data category id of its class or None; for each data label, the model label of its class or None)."""
    mapping = match_categories(model, data, by_name, model_source, data_source, flag, unit)
    if line := describe_mapping(mapping, model):
        logger.info("%s: %s", flag, line)
    ids = [mapping[c] for c in model.category_ids]
    return ids, [ids.index(c) if c in ids else None for c in data.category_ids]


def evaluated_classes(saved: dict, coco: dict, by_name: bool, model_source: str, data_source: str) -> CategoryMap:
    """The classes of a model evaluated on a COCO json: those of its model_config.json (`saved`: "category_ids" and
    optional "category_names"), under the ids the json (`coco`) gives them (`model_classes_in_data`: by id, or by name
    with `by_name`); a class the json lacks is evaluated under an id the json does not use. Raises ValueError (one line)
    on classes that do not match and on val boxes of a category that is no class of the model."""
    classes = CategoryMap(saved["category_ids"], saved.get("category_names"))
    if saved.get("category_names"):
        data = CategoryMap(*zip(*[(c["id"], c.get("name", c["id"])) for c in coco["categories"]]))
        ids, _ = model_classes_in_data(classes, data, by_name, model_source, data_source)
        spare = iter(range(max(data.category_ids) + 1, max(data.category_ids) + 1 + len(ids)))
        classes = CategoryMap([next(spare) if i is None else i for i in ids], classes.names, sort=False)
    unknown = sorted({a["category_id"] for a in coco["annotations"]} - set(classes.category_ids))
    if unknown:
        raise ValueError(f"{data_source}: category ids {unknown} have val boxes but are not classes of the model in "
                         f"{model_source}")
    return classes
