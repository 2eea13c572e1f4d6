"""COCO box evaluation that runs on every process and counts every image exactly once.

Each process decodes its shard of the validation set; `detlib.evaluation.detect.detect_images` gathers the
per-image results of all processes as Python objects by image id (an image repeated to fill a batch counts once).
The main process then runs COCOeval (`CocoEvaluator.evaluate`) and returns the 12 standard stats by name.

The ground truth is the checked, normalised json of `detlib.datacheck.coco` (a raw dict is checked here): numbers
parsed, boxes derived, ids made integers. Annotation ids are always renumbered 1..N for COCOeval, because
pycocotools stores matches by annotation id and takes 0 for "no match": a ground-truth box with id 0 (or a
negative, repeated or non-integer id) could never count as found. Image ids that the check had to
renumber are mapped back to the json's own (`original_id`) in `CocoEvaluator.results`.

COCOeval backends: pycocotools (the reference), hotcoco (the same algorithm in Rust: the 12 stats and the
precision / recall arrays equal pycocotools' bit for bit on every case of `benchmarks/coco_eval_cases.py`, about
0.03 of its time on 5,000 images: `benchmarks/coco_evaluators.py`, docs/benchmarks.md) and faster-coco-eval (C++;
the same stats to 1e-16, not bit for bit). "auto" takes hotcoco when it is installed, then faster-coco-eval, then
pycocotools.

Area ranges: the size stats (APs, APm, APl, ARs, ARm, ARl) take COCO's ranges (`COCO_AREA_RANGES`: small below
32^2 px^2, medium below 96^2, large up to 1e5^2) unless `area_ranges` gives others (`area_ranges_from_edges`);
every backend gets them as `params.areaRng`, so the stats equal pycocotools' with the same `params.areaRng`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import numbers
import warnings
from typing import Iterable

import numpy as np
import torch

from ..boxes import box_xyxy_to_xywh

logger = logging.getLogger(__name__)

# The order of COCOeval.stats (pycocotools cocoeval.py, COCOeval.summarize / _summarizeDets).
STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
BACKENDS = ("auto", "pycocotools", "faster", "hotcoco")
# COCOeval.params.areaRng of pycocotools (Params.setDetParams): all, small, medium, large, in px^2 of the box area
# (the `area` field of the ground truth, the box's w * h for detections).
COCO_AREA_RANGES = ((0.0, 1e5 ** 2), (0.0, 32.0 ** 2), (32.0 ** 2, 96.0 ** 2), (96.0 ** 2, 1e5 ** 2))
# The same ranges as `--area_ranges` edges (px, the square root of the area): small [0, 32), medium [32, 96), large
# [96, 1e5].
COCO_AREA_EDGES = (0.0, 32.0, 96.0, 1e5)
_STAT_TITLES = (
    ("Average Precision", "0.50:0.95", "all", 100), ("Average Precision", "0.50", "all", 100),
    ("Average Precision", "0.75", "all", 100), ("Average Precision", "0.50:0.95", "small", 100),
    ("Average Precision", "0.50:0.95", "medium", 100), ("Average Precision", "0.50:0.95", "large", 100),
    ("Average Recall", "0.50:0.95", "all", 1), ("Average Recall", "0.50:0.95", "all", 10),
    ("Average Recall", "0.50:0.95", "all", 100), ("Average Recall", "0.50:0.95", "small", 100),
    ("Average Recall", "0.50:0.95", "medium", 100), ("Average Recall", "0.50:0.95", "large", 100),
)


def format_stats(stats: dict[str, float]) -> str:
    """The 12 stats in the layout of pycocotools' summarize(), whatever backend computed them."""
    lines = []
    for name, (title, iou, area, dets) in zip(STAT_NAMES, _STAT_TITLES):
        kind = "(AP)" if title.startswith("Average Precision") else "(AR)"
        lines.append(f" {title:<18} {kind} @[ IoU={iou:<9} | area={area:>6s} | maxDets={dets:>3d} ] = {stats[name]:0.3f}  {name}")
    return "\n".join(lines)


def area_ranges_from_edges(edges) -> tuple[tuple[float, float], ...]:
    """COCOeval's four area ranges (all, small, medium, large) from the size edges of `--area_ranges`.

    Args:
        edges: 3 or 4 increasing numbers >= 0, in px (the square root of the box area): small is [e0, e1),
            medium [e1, e2), large [e2, e3) with e3 = 1e5 (COCO's upper bound) when only 3 are given. COCO's
            defaults are `0 32 96` (= `COCO_AREA_EDGES`); `0 16 32 96` makes large [32, 96) px.
    Returns:
        ((lo, hi) px^2 x 4): "all" stays COCO's [0, 1e5^2] (so AP, AP50, AP75 and AR1-100 never change with the
        ranges), then small, medium, large, each [e_i^2, e_{i+1}^2]. pycocotools counts a box of area a in a range
        when lo <= a <= hi (cocoeval.py, evaluateImg), so a box exactly on an edge is in both neighbours, as in COCO.
    Raises:
        ValueError: for another count, a negative or non-finite value, or edges that do not increase.
    """
    values = [float(e) for e in edges]
    if len(values) not in (3, 4):
        raise ValueError(f"area ranges need 3 or 4 edges in px (small, medium, large), got {len(values)}: {values}")
    if len(values) == 3:
        values.append(COCO_AREA_EDGES[-1])
    if not all(np.isfinite(values)) or values[0] < 0 or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"area range edges must be finite, >= 0 and increasing, got {values}")
    sq = [v * v for v in values]
    return (COCO_AREA_RANGES[0], (sq[0], sq[1]), (sq[1], sq[2]), (sq[2], sq[3]))


def area_ranges_mixup(area_ranges, gt_dataset: dict) -> str | None:
    """A warning when `area_ranges` look like edges given in px^2 (areas, as pycocotools writes `areaRng`) where px
    (sides) were meant, else None: when they put every ground-truth box of the set in one size range, or an edge
    lies past the largest image side (no box can be that many px across).

    Args:
        area_ranges: 4 (lo, hi) pairs in px^2 (`area_ranges_from_edges`); gt_dataset: the checked json (`area`,
            image `width` / `height`), its non-crowd boxes counted.
    """
    sides = [float(np.sqrt(hi)) for _, hi in area_ranges[1:3]]  # the edges between small, medium and large, px
    largest = max((max(im.get("width", 0), im.get("height", 0)) for im in gt_dataset.get("images", [])), default=0)
    areas = np.array([a["area"] for a in gt_dataset.get("annotations", []) if not a.get("iscrowd", 0)], np.float64)
    hint = ("--area_ranges takes the edges in px of the box side, sqrt(area) (COCO's: 0 32 96), not in px^2 of the "
            "area (pycocotools' areaRng: 0 1024 9216)")
    if largest and max(sides) > largest:
        return f"area range edges {[round(x, 1) for x in sides]} px lie past the largest image side ({largest} px): {hint}"
    if len(areas) > 1:
        bins = [int(((areas >= lo) & (areas < hi)).sum()) for lo, hi in area_ranges[1:]]
        for name, count in zip(("small", "medium", "large"), bins):
            if count == len(areas):
                return f"the area ranges put all {count} ground-truth boxes in '{name}' (AP of the others is -1): {hint}"
    return None


def _checked_area_ranges(area_ranges) -> list[list[float]] | None:
    """`area_ranges` as COCOeval's `params.areaRng` (4 [lo, hi] lists), None for COCO's own."""
    if area_ranges is None:
        return None
    rng = [[float(lo), float(hi)] for lo, hi in area_ranges]
    if len(rng) != 4 or any(not (0 <= lo < hi) for lo, hi in rng):
        raise ValueError(f"area_ranges must be 4 (lo, hi) pairs in px^2 with 0 <= lo < hi (all, small, medium, large), "
                         f"got {area_ranges}")
    return rng


def to_builtin(obj):
    """Recursively turn tensors and numpy scalars / arrays into Python ints, floats and lists.

    `json.dump` and pycocotools' `loadRes` accept the result. Floats are converted without rounding.
    """
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, dict):
        return {str(k): to_builtin(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_builtin(v) for v in obj]
    return obj


# Values `to_builtin` returns unchanged: a result holding only these (and flat lists of them) is already plain.
_PLAIN_SCALARS = frozenset((int, float, bool, str, type(None)))


def _plain_results(results: Iterable) -> list[dict]:
    """`to_builtin` of every result, as new dicts (pycocotools' loadRes writes `area`, `id`, ... into them).

    A result made by `detections_to_coco` (str keys; Python numbers and a flat list of them) only needs a shallow
    copy: walking it through `to_builtin` gives the same values and took 4.7 s of a 13 s evaluation of
    500,000 detections. Anything else (numpy, tensors, nested lists, tuples) goes through `to_builtin`.
    """
    out = []
    for r in results:
        if type(r) is dict and all(type(k) is str and (type(v) in _PLAIN_SCALARS or (type(v) is list and all(
                type(x) in _PLAIN_SCALARS for x in v))) for k, v in r.items()):
            out.append(dict(r))
        else:
            out.append(to_builtin(r))
    return out


def _results_table(results) -> np.ndarray | None:
    """The results as hotcoco's `load_res` array: [N, 7] float64 (image_id, x, y, w, h, score, category_id), in
    results order (detection ids 1..N follow it, as with the dicts); None when a result is not a flat dict of
    numbers (non-integer image ids, a tensor box, a missing key): those go through `_plain_results` instead.
    Float64 holds every Python float and every id below 2^53 exactly, so the stats equal the dicts' (tested)."""
    try:
        table = np.array([(r["image_id"], *r["bbox"], r["score"], r["category_id"]) for r in results], dtype=np.float64)
    except (TypeError, ValueError, KeyError):
        return None
    if table.size == 0:
        return np.zeros((0, 7))
    if table.ndim != 2 or table.shape[1] != 7 or not np.array_equal(table[:, 0], np.round(table[:, 0])):
        return None
    return table


def rank_key(result: dict) -> tuple:
    """The ranking of one image's results: decreasing score (COCOeval's), ties by class, then box (x, y, w, h).

    pycocotools ranks an image's detections with a stable sort by score (cocoeval.py, evaluateImg), so results of
    equal score keep the order they were loaded in: the AP of a file could change with its order. Across images its
    accumulation ranks equal scores by image id. With every image's results in this order first (`ranked`), the
    ranking depends on the results only, never on the order they came in (docs/evaluation.md, "Predictions files")."""
    return (-result["score"], result["category_id"], *result["bbox"])


def ranked(results: list[dict]) -> list[dict]:
    """One image's results in `rank_key` order (the same list when no two share a score: nothing to decide)."""
    if len({r["score"] for r in results}) == len(results):
        return results
    return sorted(results, key=rank_key)


def detections_to_coco(boxes: torch.Tensor, scores: torch.Tensor, category_ids: torch.Tensor, image_id: int) -> list[dict]:
    """One image's detections as COCO result dicts.

    Args:
        boxes: [N, 4] xyxy pixels of the original image.
        scores: [N] float.
        category_ids: [N] int64 data-set category ids (already mapped back from contiguous labels).
        image_id: the json's image id.
    Returns:
        list of {"image_id": int, "category_id": int, "bbox": [x, y, w, h] floats, "score": float}, in `rank_key`
        order, the order the evaluation ranks them in: so every file of results we write (evaluation, predict, tiled
        or not) lists equal scores the same way, whatever order the decoder or the tile merge gave them in.
    """
    xywh = box_xyxy_to_xywh(boxes.detach().float().cpu()).tolist()
    s = scores.detach().float().cpu().tolist()
    c = category_ids.detach().cpu().tolist()
    iid = int(image_id)
    return ranked([{"image_id": iid, "category_id": int(ci), "bbox": b, "score": si} for b, si, ci in zip(xywh, s, c)])


def _coco_classes(backend: str):
    if backend in ("auto", "hotcoco"):
        try:
            import hotcoco

            return hotcoco.COCO, hotcoco.COCOeval, "hotcoco"
        except ImportError:
            if backend == "hotcoco":
                raise ImportError("backend 'hotcoco' needs `pip install hotcoco`") from None
    if backend in ("auto", "faster"):
        try:
            from faster_coco_eval import COCO, COCOeval_faster

            return COCO, COCOeval_faster, "faster"
        except ImportError:
            if backend == "faster":
                raise ImportError("backend 'faster' needs `pip install faster-coco-eval`") from None
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    return COCO, COCOeval, "pycocotools"


def checked_ground_truth(gt_dataset: dict) -> dict:
    """The normalised json of `detlib.datacheck.coco.check_coco` (json part) for a ground-truth dict.

    Raises:
        ValueError: the check finds errors (the message holds the report).
    """
    from ..datacheck.coco import check_coco

    check = check_coco(gt_dataset, split="val", check_images=False, need_files=False)
    if not check.report.ok:
        raise ValueError(f"the evaluation ground truth has errors:\n{check.report.format()}")
    return check.dataset


def evaluate_coco(gt_dataset: dict, results: list[dict], image_ids: Iterable[int] | None = None,
                  backend: str = "pycocotools", checked: bool = False, return_cocoeval: bool = False,
                  area_ranges=None):
    """Run COCO box evaluation.

    Args:
        gt_dataset: the ground truth as a COCO-format dict (`coco.dataset`); it is not modified.
        checked: `gt_dataset` is already normalised by `detlib.datacheck.coco` (else `checked_ground_truth` runs;
            results may then name the json's own non-integer image ids).
        results: COCO result dicts (`detections_to_coco`), Python or numpy/tensor values (converted here).
        image_ids: the images to evaluate (default: all of the ground truth). Images in this list with no
            result count as images where nothing was detected.
        backend: "pycocotools", "hotcoco", "faster" or "auto" (see the module docstring).
        area_ranges: COCOeval's `params.areaRng`, 4 (lo, hi) pairs in px^2 (all, small, medium, large;
            `area_ranges_from_edges` makes them from `--area_ranges`); None: COCO's (`COCO_AREA_RANGES`).
    Returns:
        (stats, summary): the 12 stats by `STAT_NAMES` (-1 where COCO has nothing to measure, e.g. no
        small objects), and their printout (`format_stats`). With no result at all the stats are all 0.0 and a
        warning is logged (pycocotools' loadRes cannot take an empty list).
        With `return_cocoeval=True` a third element follows: the evaluated and accumulated COCOeval object
        (its `eval["precision"]` feeds `detlib.evaluation.metrics`), None when there was no result at all.
    Raises:
        ValueError: if a result names an image id that is not in the ground truth (the message lists them),
            an unknown backend or malformed `area_ranges`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    area_rng = _checked_area_ranges(area_ranges)
    COCO, COCOeval, name = _coco_classes(backend)
    if not checked:
        gt_dataset = checked_ground_truth(gt_dataset)
        internal = {im["original_id"]: im["id"] for im in gt_dataset["images"] if "original_id" in im}
        if internal:
            results = [dict(r, image_id=internal.get(r["image_id"], r["image_id"])) for r in results]
    # hotcoco reads the results as one float64 array and writes into nothing: no per-result copy (at 500,000
    # results the copies and checks of `_plain_results` took 5 of the 6 s of an evaluation)
    table = _results_table(results) if name == "hotcoco" else None
    if table is None:
        results = _plain_results(results)
        result_ids = {r["image_id"] for r in results}
    else:
        result_ids = set(np.unique(table[:, 0]).astype(np.int64).tolist())
    known = {int(im["id"]) for im in gt_dataset.get("images", [])}
    unknown = sorted(result_ids - known)
    if unknown:
        raise ValueError(f"{len(unknown)} result image ids are not in the ground truth: {unknown[:20]}"
                         f"{' ...' if len(unknown) > 20 else ''} (results must carry the json's image ids)")
    if not len(results):
        logger.warning("COCO evaluation: no detections at all; reporting every stat as 0.0")
        stats = {k: 0.0 for k in STAT_NAMES}
        return (stats, "no detections", None) if return_cocoeval else (stats, "no detections")
    COCO, COCOeval, name = _coco_classes(backend)
    # The backends write into the ground truth's dicts (COCOeval's `ignore` into annotations, faster-coco-eval
    # int ids into images), never into nested values: copying the dicts keeps `gt_dataset` as it was.
    # pycocotools >= 2.0.9 copies info and licenses in loadRes(); hand-made json often lacks them.
    gt = dict(gt_dataset)
    gt.setdefault("info", {})
    gt.setdefault("licenses", [])
    for key in ("images", "categories"):
        if key in gt:
            gt[key] = [dict(d) for d in gt[key]]
    # renumbered 1..N: see the module docstring, pycocotools takes id 0 for "no match"
    gt["annotations"] = [dict(ann, id=k) for k, ann in enumerate(gt["annotations"], 1)]
    # Backend output is for debugging: pycocotools prints (captured here), faster-coco-eval's COCOeval logs
    # progress and its own copy of the summary at INFO (sent to DEBUG here). The caller logs `format_stats` once.
    backend_kwargs = {"print_function": logger.debug} if name == "faster" else {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        if name == "hotcoco":  # builds its index from the dict, which it does not modify
            coco_gt = COCO(gt)
            coco_dt = coco_gt.load_res(table if table is not None else results)
        else:
            coco_gt = COCO()
            coco_gt.dataset = gt
            coco_gt.createIndex()
            coco_dt = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, coco_dt, "bbox", **backend_kwargs)
        if image_ids is not None:
            ev.params.imgIds = sorted(int(i) for i in image_ids)
        if area_rng is not None:  # hotcoco's params: whole values are assigned, never mutated in place
            ev.params.areaRng = area_rng
        with warnings.catch_warnings():  # hotcoco warns that other area ranges are not COCO's: the caller chose them
            warnings.filterwarnings("ignore", message=".*area range", category=UserWarning)
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
    if printed.getvalue():
        logger.debug("%s output:\n%s", name, printed.getvalue().rstrip())
    stats = {k: float(v) for k, v in zip(STAT_NAMES, ev.stats)}
    return (stats, format_stats(stats), ev) if return_cocoeval else (stats, format_stats(stats))


class CocoEvaluator:
    """Holds per-image detections (`per_image`, `failed`: `detect_images`' gathered results, or `add`) and gives their
    COCO stats (`evaluate`).

    Args:
        gt_dataset: the validation ground truth as a COCO-format dict, normalised here by the data check (the
            training script passes the normalised dict of its val set; checking it again changes nothing).
        backend: COCOeval implementation ("auto", "pycocotools", "hotcoco", "faster").
        area_ranges: the size stats' area ranges (`evaluate_coco`); None: COCO's. Ranges that look like a px / px^2
            mix-up for this ground truth are warned of (`area_ranges_mixup`).
    Raises:
        ValueError: the ground truth has errors (see `checked_ground_truth`), or malformed `area_ranges`.

    Use: `add(image_id, results)` for every image (also for images with no detection: the image is then counted
    with zero detections) and `add_failed(image_id)` for images that could not be read, or set `per_image` and
    `failed` to `detect_images`' results; then `evaluate()` on the main process.
    """

    def __init__(self, gt_dataset: dict, backend: str = "auto", area_ranges=None):
        _checked_area_ranges(area_ranges)
        self.gt_dataset = checked_ground_truth(gt_dataset)
        if area_ranges is not None and (mixup := area_ranges_mixup(area_ranges, self.gt_dataset)):
            logger.warning("%s", mixup)
        self.backend = backend
        self.area_ranges = area_ranges
        # ids the check renumbered (non-integer in the json) -> the json's own, for exported results
        self.original_ids = {im["id"]: im["original_id"] for im in self.gt_dataset["images"] if "original_id" in im}
        self.per_image: dict[int, list[dict]] = {}
        self.failed: set[int] = set()
        self.coco_eval = None  # the COCOeval object of the last `evaluate` (main process), for detlib.evaluation.metrics

    def reset(self) -> None:
        """Forget everything recorded (call before each evaluation pass)."""
        self.per_image.clear()
        self.failed.clear()

    def add(self, image_id: int, results: list[dict]) -> None:
        """Record one image's COCO result dicts. A repeated image id keeps its first results."""
        self.per_image.setdefault(int(image_id), results)

    def add_failed(self, image_id: int) -> None:
        """Record an image that could not be decoded: it is left out of the evaluation, with a warning."""
        self.failed.add(int(image_id))

    @property
    def results(self) -> list[dict]:
        """All recorded detections, by image id, carrying the json's own image ids (for predictions files)."""
        if not self.original_ids:
            return self._internal_results()
        return [dict(r, image_id=self.original_ids.get(r["image_id"], r["image_id"])) for r in self._internal_results()]

    def _internal_results(self) -> list[dict]:
        return [r for iid in sorted(self.per_image) for r in self.per_image[iid]]

    def evaluated(self) -> tuple[list[dict], list[int]]:
        """What `evaluate` scores: (the recorded detections, with the normalised ground truth's image ids, by image
        id; the ids of the images evaluated: recorded and readable, sorted)."""
        return self._internal_results(), sorted(set(self.per_image) - self.failed)

    @property
    def num_images(self) -> int:
        return len(self.per_image)

    @property
    def num_images_evaluated(self) -> int:
        """Distinct images the last `evaluate` scored (recorded and readable): `num_images_evaluated` in
        metrics.jsonl, which equals the val set's size when every image was decoded, on any process count."""
        return len(set(self.per_image) - self.failed)

    def evaluate(self) -> tuple[dict[str, float], str]:
        """COCO stats over the recorded images (see `evaluate_coco`); warns when images are missing. Each image's
        results are put in `rank_key` order first (`results` and `evaluated` give them so from then on).

        Keeps the COCOeval object in `self.coco_eval` (None when nothing was detected).
        """
        all_ids = {int(im["id"]) for im in self.gt_dataset["images"]}
        ids = set(self.per_image) - self.failed
        for iid, results in self.per_image.items():  # ties ranked by the results, not by their order (`rank_key`)
            self.per_image[iid] = ranked(results)
        if self.failed:
            logger.warning("COCO evaluation leaves out %d unreadable images: %s", len(self.failed), sorted(self.failed)[:10])
        if ids != all_ids - self.failed:
            logger.warning("COCO evaluation covers %d of the %d ground-truth images", len(ids), len(all_ids))
        stats, summary, self.coco_eval = evaluate_coco(self.gt_dataset, self._internal_results(), image_ids=sorted(ids),
                                                       backend=self.backend, checked=True, return_cocoeval=True,
                                                       area_ranges=self.area_ranges)
        return stats, summary
