"""The COCO part of the data check (see `detlib.datacheck.report` for the levels and the report): a COCO-format
detection json read once, checked with its image files, and normalised for training and evaluation.

The normalised json (`CocoCheck.dataset`) is a COCO dict where every image has an int `id` (unique), an int
`width` / `height` and a `file_name`; every annotation an int `id` > 0 (unique), an int `image_id` and
`category_id` that exist, a finite `bbox` [x, y, w, h] (pixels, clipped to the image, w and h > 0), a finite
`area` and an int `iscrowd`; every category an int `id` (unique) and a `name`. Images whose id had to be
renumbered (non-numeric) keep the json's own id as `original_id`. An image is turned by its EXIF orientation as
`detlib.datacheck.orientation` rules, its width / height then the size as loaded. `CocoDetection` trains and
`CocoEvaluator` evaluates on it, so both see the same repaired values.

Here: the entry points (`check_coco`, val against train, the scripts' one call). The checks of the json's
parts: `detlib.datacheck.coco_images` (images and their files), `detlib.datacheck.coco_annotations` (categories and annotations),
on the field readers of `detlib.datacheck.coco_fields`.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from ..files import JsonFileError, read_json
from .coco_annotations import check_annotations, check_categories
from .coco_images import check_image_files, check_image_list
from .labelstudio import is_labelstudio_export, labelstudio_to_coco
from .report import DEFAULT_MAX_IMAGE_PIXELS, DataReport, check_balance

# COCOeval's largest maxDets (pycocotools Params.setDetParams: 1, 10, 100): the detections it ranks per image and class.
COCO_MAX_DETS = 100


def load_json(path: str) -> dict:
    """Read a json file. Raises FileNotFoundError naming the path, ValueError for a file that is not json."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"annotation file not found: {path}")
    try:
        return read_json(path)
    except JsonFileError as e:
        raise ValueError(f"cannot read COCO annotations from {path}: not json ({e.reason})") from e


@dataclass
class CocoCheck:
    """What `check_coco` returns: the normalised json (None when the file could not be read as COCO) and
    the report it added to."""

    dataset: dict | None
    report: DataReport
    split: str
    source: str
    dropped_annotations: int = 0


def check_coco(annotations: str | dict, image_dir: str | None = None, *, split: str = "train",
               report: DataReport | None = None, check_images: bool = True,
               max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS, strict: bool = False,
               num_workers: int | None = None, progress: bool = True, cache_file: str | None = None,
               need_files: bool = True, source: str | None = None) -> CocoCheck:
    """Check a COCO-format detection json (and, with `image_dir`, its image files) and normalise it.

    Everything that can be checked is checked, so one report lists all faults of the file.

    Args:
        annotations: path of the json, or the loaded dict (not modified; the result may share entries with it).
        image_dir: folder of the images' `file_name`s; None (or `check_images=False`) checks the json alone.
        split: name used in the report ("train", "val"). Categories without annotations are warned about
            except in "val" (a val set need not cover every class).
        report: add to this report (default: a new one, with `strict`).
        max_image_pixels: width * height above which an image file is an error (None: no limit).
        num_workers, progress, cache_file: of the image header pass (see `read_image_headers`).
        need_files: images must have a `file_name` (False for a ground truth used in evaluation only).
        source: what the report names as the file (default: the path, or "<dict>"), e.g. the VOC / YOLO set
            a dict was converted from (`detlib.data.formats`).
    Returns:
        CocoCheck: `.dataset` is the normalised json (see the module docstring; valid as such only when
        `report.ok`), None when the file has no usable COCO structure.
    Raises:
        FileNotFoundError: `annotations` is a path that does not exist (names it).
    """
    report = report if report is not None else DataReport(strict)
    source = source or (annotations if isinstance(annotations, str) else "<dict>")
    data = _coco_dict(annotations, report, split)
    if data is None:
        return CocoCheck(None, report, split, source)
    categories = check_categories(data["categories"], report, split)
    images, by_int, by_str = check_image_list(data["images"], need_files, report, split)
    left_out: set[int] = set()
    if image_dir is not None and check_images:
        images, left_out = check_image_files(images, image_dir, max_image_pixels, num_workers, progress, cache_file,
                                             report, split)
    unsized = [im.get("file_name", im["id"]) for im in images if im["width"] is None or im["height"] is None]
    report.add("error", "structure", split, "images without a valid width / height (the image file check fills them "
               "in: do not skip it)", unsized)
    sized = {im["id"]: im for im in images if im["width"] and im["height"]}
    annotations_out, dropped = check_annotations(data["annotations"], sized,
                                                 by_int, by_str, left_out, {cat["id"] for cat in categories}, report,
                                                 split)
    if split != "val":
        used = set(a["category_id"] for a in annotations_out)
        report.add("warning", "categories", split, "categories without any annotation (the model still has an output "
                   "for each)", [f"{cat['id']} {cat['name']!r}" for cat in categories if cat["id"] not in used])
        boxed = {(a["category_id"], a["image_id"]) for a in annotations_out if not a["iscrowd"]}
        holding = Counter(c for c, _ in boxed)  # images holding each category
        f_max = max(holding.values(), default=0) / max(len(images), 1)
        check_balance(report, split, {f"{cat['id']} {cat['name']!r}": holding[cat["id"]] for cat in categories},
                      f"train_retinanet.py --sampler repeat_factor --repeat_threshold T (classes in fewer than a "
                      f"fraction T of the images are repeated; the most frequent is in {f_max:.2g}; docs/flags.md)")
    if not images:
        report.add("error", "images", split, "no usable image is left", count=1)

    out = {k: v for k, v in data.items() if k not in ("images", "annotations", "categories")}
    out.setdefault("info", {})  # pycocotools >= 2.0.9 copies these in loadRes()
    out.setdefault("licenses", [])
    out.update(images=images, annotations=annotations_out, categories=categories)
    with_boxes = len({a["image_id"] for a in annotations_out})
    report.summaries[split] = {"file": source, "images": len(images), "annotations": len(annotations_out),
                               "categories": len(categories), "images without annotations": len(images) - with_boxes}
    return CocoCheck(out, report, split, source, dropped)


def _coco_dict(annotations: str | dict, report: DataReport, split: str) -> dict | None:
    """The json as a dict with the three lists; None (with an error in `report`) when it is not one.

    Raises:
        FileNotFoundError: `annotations` is a path that does not exist.
    """
    if isinstance(annotations, str):
        try:
            data = load_json(annotations)
        except ValueError as e:
            report.add("error", "structure", split, str(e), count=1)
            return None
    else:
        data = annotations
    if is_labelstudio_export(data):  # Label Studio's JSON / JSON-min export: its tasks as a COCO dict
        data = labelstudio_to_coco(data, report, split, annotations if isinstance(annotations, str) else "<list>")
    if not isinstance(data, dict):
        report.add("error", "structure", split, f"the json holds a {type(data).__name__}, not an object with images, "
                   "annotations and categories", count=1)
        return None
    missing = [k for k in ("images", "annotations", "categories") if not isinstance(data.get(k), list)]
    if missing:
        report.add("error", "structure", split, "required lists missing or not lists", missing)
        return None
    return data


# ---- train against val, and what the scripts call


def check_train_val(train: CocoCheck, val: CocoCheck, train_images: str | None = None,
                    val_images: str | None = None) -> None:
    """Categories and files of val against train, added to `val.report`.

    The model's classes are train's categories. Val may list a subset of them (only those it uses)
    or all; a val id with another name than in train, or a val id unknown to train that val boxes use, is an
    error that lists only the differing pairs. When consistent, val's category list becomes train's, so the
    label map and COCOeval see the same categories in both.
    """
    if train.dataset is None or val.dataset is None:
        return
    report, split = val.report, val.split
    tc = {c["id"]: c["name"] for c in train.dataset["categories"]}
    vc = {c["id"]: c["name"] for c in val.dataset["categories"]}
    conflicts = [f"{i}: train {tc[i]!r}, val {vc[i]!r}" for i in sorted(tc.keys() & vc.keys()) if tc[i] != vc[i]]
    report.add("error", "categories", split, "category ids with another name in val than in train", conflicts)
    used = Counter(a["category_id"] for a in val.dataset["annotations"])
    unknown = sorted(vc.keys() - tc.keys())
    report.add("error", "categories", split, "val categories unknown to train that val boxes use (the model cannot "
               "predict them)", [f"{i} {vc[i]!r} ({used[i]} boxes)" for i in unknown if used[i]])
    report.add("warning", "categories", split, "val lists categories unknown to train that no val box uses: ignored",
               [f"{i} {vc[i]!r}" for i in unknown if not used[i]])
    if not conflicts and not any(used[i] for i in unknown):
        val.dataset["categories"] = [dict(c) for c in train.dataset["categories"]]
        if vc.keys() != tc.keys():
            report.summaries.setdefault(split, {})["categories"] = (
                f"{len(vc.keys() & tc.keys())} listed, consistent with train's {len(tc)}: evaluated with train's list")
    if train_images and val_images:
        root_t, root_v = os.path.realpath(train_images), os.path.realpath(val_images)
        files_t = {os.path.join(root_t, im["file_name"]) for im in train.dataset["images"]}
        both = [im["file_name"] for im in val.dataset["images"] if os.path.join(root_v, im["file_name"]) in files_t]
        report.add("warning", "images", split, "images that are also in the training set (val AP will be optimistic)",
                   both)


def check_learnable(train: CocoCheck | None, val: CocoCheck | None, include_crowd: bool = False,
                    max_detections: int = COCO_MAX_DETS) -> None:
    """What a training run and its evaluation need beyond valid jsons, added to their reports: a box to train on
    (with `include_crowd`, crowd boxes count), a val box to evaluate against (else every AP is -1, undefined),
    val categories that have training boxes (AP 0 whatever is learnt otherwise: an error when no val box
    has one, a warning listing them when some do not), and val images with more boxes than the detections an image
    can have (`check_detection_cap`). `train` None: evaluation only (its model's classes are not known here).
    `max_detections`: the model's detections per image (`--detections_per_image`)."""
    if train is not None and train.dataset is not None and not any(
            include_crowd or not a["iscrowd"] for a in train.dataset["annotations"]):
        train.report.add("error", "boxes", train.split, "no usable (non-crowd, non-degenerate) box in the whole "
                         "training set: nothing to learn from"
                         + ("" if include_crowd else " (--include_crowd trains on crowd boxes)"), count=1)
    if val is None or val.dataset is None or not val.dataset["images"]:
        return
    check_detection_cap(val, max_detections)
    evaluated = Counter(a["category_id"] for a in val.dataset["annotations"] if not a["iscrowd"])
    if not evaluated:  # COCOeval scores a category only where it has ground truth: with none, every stat is -1
        val.report.add("error", "boxes", val.split, "no (non-crowd) box to evaluate against: AP is undefined (COCO "
                       "reports -1) and best/ could never be chosen; annotate val images "
                       "(scripts/predict_retinanet.py runs on unlabelled ones)", count=1)
        return
    if train is None or train.dataset is None:
        return
    names = {c["id"]: c["name"] for c in train.dataset["categories"]}
    trained = {a["category_id"] for a in train.dataset["annotations"]}  # crowd ones too (--include_crowd)
    untrained = [f"{i} {names[i]!r} ({n} boxes)" for i, n in sorted(evaluated.items()) if i in names and i not in trained]
    if untrained and len(untrained) == len([i for i in evaluated if i in names]):
        val.report.add("error", "categories", val.split, "no val box is of a category that has training boxes: AP is "
                       "0 whatever the model learns", untrained)
    else:
        val.report.add("warning", "categories", val.split, "val boxes of categories without any training box (their "
                       "AP will be 0)", untrained)


def check_detection_cap(val: CocoCheck, max_detections: int = COCO_MAX_DETS) -> None:
    """A warning, added to `val.report`, naming the val images whose (non-crowd) boxes outnumber the detections an
    image can have: `max_detections` per image (the model's cap, `--detections_per_image`), or COCO's maxDets
    (`COCO_MAX_DETS`, per image and class, whatever the model keeps). On them recall, and so AP, cannot reach 1,
    however good the model."""
    names = {im["id"]: im.get("file_name", im["id"]) for im in val.dataset["images"]}
    per_image = Counter(a["image_id"] for a in val.dataset["annotations"] if not a["iscrowd"])
    per_class = Counter((a["image_id"], a["category_id"]) for a in val.dataset["annotations"] if not a["iscrowd"])
    over = sorted(i for i, n in per_image.items() if n > max_detections)
    val.report.add("warning", "boxes", val.split, f"images with more ground-truth boxes than the {max_detections} "
                   f"detections per image the model keeps (--detections_per_image {max_detections}): recall and AP "
                   "cannot reach 1 on them; raise --detections_per_image (COCO's AP counts at most "
                   f"{COCO_MAX_DETS} per image and class)", [f"{names[i]} ({per_image[i]} boxes)" for i in over])
    most = Counter()  # image -> its largest count of one class
    for (i, _), n in per_class.items():
        most[i] = max(most[i], n)
    crowded = sorted(i for i, n in most.items() if n > COCO_MAX_DETS and i not in set(over))
    val.report.add("warning", "boxes", val.split, f"images with more than {COCO_MAX_DETS} ground-truth boxes of one "
                   f"class: COCO's AP counts at most {COCO_MAX_DETS} detections per image and class (maxDets), "
                   "whatever --detections_per_image: recall and AP cannot reach 1 on them",
                   [f"{names[i]} ({most[i]} of one class)" for i in crowded])


def check_coco_data(paths: dict, *, check_images: bool = True, max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
                    strict: bool = False, progress: bool = True, cache_file: str | None = None,
                    num_workers: int | None = None, converted: dict[str, dict] | None = None,
                    report: DataReport | None = None, include_crowd: bool = False,
                    max_detections: int = COCO_MAX_DETS) -> tuple[dict | None, dict | None, DataReport]:
    """Check a training script's COCO data: train (when `paths["train_annotations"]`), val, and val against train.

    Args:
        paths: {"train_annotations", "train_images", "val_annotations", "val_images"}; train ones may be None.
        converted: {"train" / "val": COCO dict} read in place of that split's json: a VOC or YOLO split
            (`detlib.data.formats.read_data_dir_splits`); its `paths` annotations then only name the source.
        report: add to this report (the conversion's findings); default a new one with `strict`.
        include_crowd: crowd boxes are trained on (`check_learnable`).
        max_detections: the model's detections per image, `--detections_per_image` (`check_detection_cap`).
        the others: see `check_coco`.
    Returns:
        (train normalised json or None, val normalised json, report).
    Raises:
        FileNotFoundError: an annotation file does not exist.
    """
    converted = converted or {}
    for key in ("val_annotations", "train_annotations"):  # a missing file is named before any check runs
        if paths.get(key) and key.split("_")[0] not in converted and not os.path.isfile(paths[key]):
            raise FileNotFoundError(f"annotation file not found: {paths[key]}")
    report = report if report is not None else DataReport(strict)
    kw = dict(report=report, check_images=check_images, max_image_pixels=max_image_pixels, progress=progress,
              cache_file=cache_file, num_workers=num_workers)
    train = None
    if paths.get("train_annotations"):
        train = check_coco(converted.get("train", paths["train_annotations"]), paths.get("train_images"), split="train",
                           source=paths["train_annotations"], **kw)
    val = check_coco(converted.get("val", paths["val_annotations"]), paths.get("val_images"), split="val",
                     source=paths["val_annotations"], **kw)
    if train is not None:
        check_train_val(train, val, paths.get("train_images"), paths.get("val_images"))
    check_learnable(train, val, include_crowd, max_detections)
    return (train.dataset if train else None), val.dataset, report
