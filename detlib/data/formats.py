"""The data set root of `--data_dir` in any of three layouts, COCO, Pascal VOC and YOLO (ultralytics): which layout
a folder holds, its splits' files, the flags that name them, and the training script's data check of it in one call.
VOC and YOLO splits are read as COCO-format dicts in memory (`detlib.data.voc`, `detlib.data.yolo`), so the one data
check (`detlib.datacheck.coco`: errors, repairs, warnings, data_report.json), the data set and the COCO evaluation
apply to them unchanged.

Layouts (`data_dir_paths` finds which one a folder holds; `detect_format`):

  coco  ROOT/annotations/instances_{set}.json, images in ROOT/{set} or ROOT/images/{set}
  voc   ROOT/Annotations/<id>.xml, ROOT/JPEGImages/<id>.jpg, ROOT/ImageSets/Main/{set}.txt (one id a line): the
        devkit's VOC2007 / VOC2012 folder, or any set in that layout (LabelImg, CVAT's "Pascal VOC" export)
  yolo  ROOT/data.yaml with `names` (a list, or {index: name}) and `train:` / `val:` (an image folder, searched
        recursively, a .txt list of image paths, or a list of them; relative to the yaml's `path:`, else to the
        yaml's folder); one `class cx cy w h` row per box, normalised to 0..1 (a polygon row `class x1 y1 x2 y2
        ...` gives its extent), in each image's label file (`detlib.data.yolo.yolo_label_files`)

What the conversion decides (boxes inside detlib are xyxy pixels; the COCO dicts carry COCO's xywh pixels): VOC's
own rules are in `detlib.data.voc` (1-based boxes, `difficult`, class names), YOLO's in `detlib.data.yolo` (class
ids, label files, image lists); both follow these:

* Text files (data.yaml, label files, classes.txt, image lists, split and class lists) are read by one rule,
  `detlib.data.converted.read_text`: UTF-8 with or without a BOM, UTF-16 with a BOM; any line end; spaces or tabs
  between fields.
* Sizes: a YOLO image's is its file's as shown (EXIF orientation applied: its rows are normalised to that, as
  ultralytics' `exif_size`); a VOC xml without <size> takes the same; a VOC <size> is stated and decides with the
  EXIF rule of `detlib.datacheck.orientation`, as a COCO json's does.
* Every converted annotation carries `_source`, its xml and object or its label file and line, by which the data
  check names it (a box clipped or dropped there is named by its file, not by the annotation id given here).
* Image ids: the file stems when all are distinct integers (COCO-style names), else 1..N in sorted order
  (VOC's own id then kept as `original_id`, which predictions carry).

Faults of each layout are findings in the same report (`detlib.datacheck.report`), listed in VOC_FINDINGS and
YOLO_FINDINGS.
"""

from __future__ import annotations

import os
from collections import Counter

from ..datacheck.coco import check_coco_data
from ..datacheck.report import DEFAULT_MAX_IMAGE_PIXELS, DataReport, publish_report
from .voc import VOC_UNLISTED, VocClasses, read_voc_split, voc_classes, voc_root, voc_split_paths, voc_unlisted
from .yolo import read_yolo_split, read_yolo_yaml, yolo_shifted_ids, yolo_split_paths, yolo_yaml_in

FORMATS = ("coco", "voc", "yolo")
# The split names when --train_set / --val_set are not given.
DEFAULT_SPLITS = {"coco": ("train2017", "val2017"), "voc": ("train", "val"), "yolo": ("train", "val")}


def detect_format(root: str) -> str:
    """The layout of a data set root: "voc" (Annotations/ and JPEGImages/), "yolo" (data.yaml, or the yaml
    itself), "coco" (annotations/, or COCO's image folders train2017/, val2017/, images/).

    Raises:
        FileNotFoundError: `root` does not exist or holds none of the three (names what was looked for).
    """
    if not os.path.exists(root):
        raise FileNotFoundError(f"data folder not found: {root}")
    if os.path.isdir(os.path.join(root, "Annotations")) and os.path.isdir(os.path.join(root, "JPEGImages")):
        return "voc"
    if yolo_yaml_in(root):
        return "yolo"
    if any(os.path.isdir(os.path.join(root, d)) for d in ("annotations", "train2017", "val2017", "images")):
        return "coco"  # COCO's image folders without annotations/: the missing json is named next
    hint = ""
    if os.path.isdir(root):
        inner = sorted(d for d in os.listdir(root) if d.upper().startswith("VOC") and os.path.isdir(os.path.join(root, d)))
        if inner:
            hint = f" (a VOCdevkit folder? give one of its sets: {', '.join(os.path.join(root, d) for d in inner)})"
    raise FileNotFoundError(f"{root} is not a data set root of a known layout: COCO (annotations/instances_*.json), "
                            f"VOC (Annotations/, JPEGImages/, ImageSets/Main/) or YOLO (data.yaml){hint}")


def add_format_flags(group) -> None:
    """--data_dir, --data_format, --train_set, --val_set and --class_names on an argparse group."""
    from ..argtypes import path

    group.add_argument("--data_dir", type=path, help="data set root: COCO (DIR/annotations/instances_{set}.json, images "
                       "in DIR/{set} or DIR/images/{set}), Pascal VOC (DIR/Annotations/, DIR/JPEGImages/, "
                       "DIR/ImageSets/Main/{set}.txt) or YOLO (DIR/data.yaml) (default: none; without data flags, the "
                       "built-in synthetic set)")
    group.add_argument("--data_format", choices=FORMATS, help="the layout of --data_dir (default: detected from its "
                       "folders)")
    group.add_argument("--train_set", help="training split: COCO's {set}, VOC's list name, YOLO's yaml key (default: "
                       "train2017 for COCO, train for VOC and YOLO)")
    group.add_argument("--val_set", help="validation split (default: val2017 for COCO, val for VOC and YOLO)")
    group.add_argument("--class_names", type=path, help="Pascal VOC: the classes, in label order: a file of one name a "
                       "line, or names separated by commas; objects of other names are dropped and named (default: "
                       "every name the xml files use, spellings that differ only in case, spaces, _ or - merged)")


def data_dir_paths(root: str, fmt: str | None, train_set: str | None, val_set: str | None,
                   need_train: bool = True) -> dict[str, str | None]:
    """The data of a `--data_dir ROOT`: its format and, per split, the image folder and the annotation source.

    Args:
        fmt: "coco", "voc", "yolo", or None to detect it (`detect_format`).
        train_set, val_set: split names (default DEFAULT_SPLITS of the format: COCO's train2017 / val2017, VOC's
            ImageSets/Main/{train,val}.txt, YOLO's `train:` / `val:` keys).
        need_train: False: the training split is neither looked for nor returned (evaluation only).
    Returns:
        {"format", "train_images", "train_annotations", "val_images", "val_annotations"}: for COCO the json
        files, for VOC the split lists, for YOLO the yaml (converted by `read_split`); train ones None unless
        `need_train`.
    Raises:
        FileNotFoundError: a folder or file of the layout is missing (names it, and the splits there are).
        ValueError: a YOLO yaml without the split's key or `names`.
    """
    fmt = fmt or detect_format(root)
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r} (one of {', '.join(FORMATS)})")
    default_train, default_val = DEFAULT_SPLITS[fmt]
    splits = {"val": val_set or default_val}
    if need_train:
        splits["train"] = train_set or default_train
    out: dict[str, str | None] = {"format": fmt, "train_images": None, "train_annotations": None}
    for key, name in splits.items():
        if fmt == "coco":
            images, annotations = _coco_split(root, name)
        elif fmt == "voc":
            images, annotations = voc_split_paths(root, name)
        else:
            images, annotations = yolo_split_paths(root, name)
        out[f"{key}_images"], out[f"{key}_annotations"] = images, annotations
    return out


def _coco_split(root: str, name: str) -> tuple[str, str]:
    cands = (os.path.join(root, name), os.path.join(root, "images", name))
    images = next((c for c in cands if os.path.isdir(c)), None)
    if images is None:
        raise FileNotFoundError(f"image folder not found: {cands[0]} (nor {cands[1]})")
    return images, os.path.join(root, "annotations", f"instances_{name}.json")


def read_split(fmt: str, annotations: str, split_name: str, *, report: DataReport, split: str,
               cache_file: str | None = None, progress: bool = True, classes: VocClasses | None = None,
               class_rows: Counter | None = None) -> dict:
    """One split of a VOC or YOLO set as a COCO-format dict (checked afterwards by `detlib.datacheck.coco.check_coco`).

    Args:
        fmt: "voc" or "yolo".
        annotations: the split's annotation source from `data_dir_paths` (VOC: ImageSets/Main/<split>.txt, YOLO:
            the yaml).
        split_name: the split's own name (VOC: the list's, YOLO: the yaml key).
        report, split: the report and the split name ("train", "val") its findings are added under.
        cache_file, progress: of the image header pass (`read_image_headers`; YOLO needs every image's size).
        classes: VOC: the set's classes (`voc_classes`; default: found in the xml files, their findings added
            under `split`).
        class_rows: YOLO: counts the label rows of each class id (out-of-range ones too) into it, for the
            set-level check of ids written from 1 (`read_data_dir_splits`).
    Returns:
        {"info", "licenses", "images", "annotations", "categories"}: images {"id", "file_name" (relative to the
        split's image folder of `data_dir_paths`), "width", "height"}; annotations {"id", "image_id",
        "category_id", "bbox" [x, y, w, h] pixels, "area", "iscrowd", "_source"} (+ VOC's "difficult",
        "truncated").
    Raises:
        FileNotFoundError: the split list, yaml or a folder it names is missing.
        ValueError: a yaml that does not say what the layout needs (names, the split).
    """
    if fmt == "voc":
        return read_voc_split(annotations, report=report, split=split, cache_file=cache_file, classes=classes)
    if fmt == "yolo":
        return read_yolo_split(annotations, split_name, report=report, split=split, cache_file=cache_file,
                               progress=progress, class_rows=class_rows)
    raise ValueError(f"read_split reads voc and yolo sets, not {fmt!r}")


def read_data_dir_splits(paths: dict, splits: dict[str, str], *, report: DataReport, cache_file: str | None = None,
                         progress: bool = True, class_names: list[str] | None = None) -> dict[str, dict]:
    """The COCO dicts of a VOC or YOLO `data_dir_paths` result, by report split: {"train": ..., "val": ...} for
    the splits whose annotations `paths` holds; {} for a COCO set (its json files are read by the check).

    The faults of the whole set are reported once, under the first split read: VOC's unlisted xml files and
    merged or close class names, YOLO's class ids written from 1 (`yolo_shifted_ids`).
    Args:
        splits: {"train": train split name, "val": val split name} (VOC list names, YOLO yaml keys).
        class_names: a VOC set's classes in id order (the scripts' `--class_names`, `read_class_names`); None:
            the names its xml files use.
    Raises:
        ValueError: `class_names` for a set that is not VOC (a YOLO set's classes are its yaml's `names`), or a
            class list naming one class twice.
    """
    fmt = paths["format"]
    if class_names is not None and fmt != "voc":
        raise ValueError(f"a class list is read for a VOC set only: a {fmt.upper()} set names its classes itself"
                         + (" (data.yaml's names)" if fmt == "yolo" else " (its json's categories)"))
    if fmt == "coco":
        return {}
    read = [s for s in ("train", "val") if paths.get(f"{s}_annotations")]
    if not read:
        return {}
    first = read[0]
    classes = voc_classes(voc_root(paths[f"{first}_annotations"]), class_names) if fmt == "voc" else None
    class_rows: Counter = Counter()
    out = {}
    for split in read:
        out[split] = read_split(fmt, paths[f"{split}_annotations"], splits[split] or DEFAULT_SPLITS[fmt][split == "val"],
                                report=report, split=split, cache_file=cache_file, progress=progress, classes=classes,
                                class_rows=class_rows)
    if fmt == "voc":  # faults of the data set, not of a split: reported once
        report.add(VOC_UNLISTED[0], VOC_UNLISTED[1], first, VOC_UNLISTED[2],
                   voc_unlisted(voc_root(paths[f"{first}_annotations"])))
        classes.add_to(report, first)
    else:
        names = read_yolo_yaml(paths[f"{first}_annotations"])["names"]
        shifted = yolo_shifted_ids(class_rows, names)
        if shifted:
            level, message, rows = shifted
            report.add(level, "categories", first, message, count=rows)
    return out


def check_coco_for_training(paths: dict, output_dir: str | None, *, check_images: bool = True,
                            max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS, strict: bool = False,
                            is_main: bool = True, data_format: str = "coco",
                            splits: dict[str, str | None] | None = None,
                            include_crowd: bool = False, class_names: list[str] | None = None,
                            max_detections: int = 100) -> tuple[dict | None, dict]:
    """The training script's data check in one call: `check_coco_data` + `publish_report`.

    Every process runs it, so every process holds the same repaired data without sending it around (the json
    part is fast: see benchmarks/datacheck_118k.py). The image headers are read by the main process (the
    script calls this under `main_process_first`) and cached in `output_dir/image_header_cache.json`, where the
    other processes find them: read once per run when `output_dir` is on a disk all machines share (otherwise the
    processes of the other machines read them again).
    A VOC or YOLO set (`data_format`; `paths` from `detlib.data.formats.data_dir_paths`, `splits` its split names) is
    converted first (`detlib.data.formats.read_data_dir_splits`, with `class_names` for a VOC set), its own faults
    in the same report. `max_detections`: the model's `--detections_per_image` (val images with more boxes are named).
    Returns:
        (train normalised json or None, val normalised json).
    Raises:
        DataCheckError (a ValueError) on errors, after logging the report; FileNotFoundError for a missing json.
    """
    cache = os.path.join(output_dir, "image_header_cache.json") if output_dir and check_images else None
    report = DataReport(strict)
    converted = {}
    if data_format != "coco" or class_names is not None:  # a class list for a COCO json: refused there
        converted = read_data_dir_splits({**paths, "format": data_format}, splits or {"train": None, "val": None},
                                         report=report, cache_file=cache, progress=is_main, class_names=class_names)
    train, val, report = check_coco_data(paths, check_images=check_images, max_image_pixels=max_image_pixels,
                                         strict=strict, progress=is_main, cache_file=cache, converted=converted,
                                         report=report, include_crowd=include_crowd, max_detections=max_detections)
    publish_report(report, output_dir, is_main)
    return train, val

