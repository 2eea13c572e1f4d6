"""Detection data sets in the Pascal VOC and YOLO (ultralytics) layouts, read as COCO-format dicts in memory, so
the one data check (`detlib.datacheck.coco`: errors, repairs, warnings, data_report.json), the data set and the COCO
evaluation apply to them unchanged.

Layouts (`data_dir_paths` finds which one a folder holds; `detect_format`):

  coco  ROOT/annotations/instances_{set}.json, images in ROOT/{set} or ROOT/images/{set}
  voc   ROOT/Annotations/<id>.xml, ROOT/JPEGImages/<id>.jpg, ROOT/ImageSets/Main/{set}.txt (one id a line): the
        devkit's VOC2007 / VOC2012 folder, or any set in that layout (LabelImg, CVAT's "Pascal VOC" export)
  yolo  ROOT/data.yaml with `names` (a list, or {index: name}) and `train:` / `val:` (an image folder, searched
        recursively, a .txt list of image paths, or a list of them; relative to the yaml's `path:`, else to the
        yaml's folder); one `class cx cy w h` row per box, normalised to 0..1 (a polygon row `class x1 y1 x2 y2
        ...` gives its extent), in each image's label file (`yolo_label_files`, the rule below)

What the conversion decides (boxes inside detlib are xyxy pixels; the COCO dicts carry COCO's xywh pixels):

* VOC boxes are 1-based pixel indices, inclusive: `xmin=1, xmax=W` covers the whole image. As detectron2's
  `load_voc_instances`, xmin and ymin lose 1: the box is [xmin - 1, ymin - 1, xmax, ymax] in pixel coordinates.
* VOC `difficult` objects become `iscrowd: 1`: ignore regions, neither positives nor negatives in training and
  left out of the evaluation's matching (as mmdetection's `ignore_flag` and the VOC evaluation treat them;
  detectron2 trains on them: `--include_crowd` does that). `truncated` is kept on the annotation and counted;
  a truncated object is a whole box of the visible part, nothing to repair.
* VOC classes are the sorted names found in every xml of Annotations/ (all splits), numbered 1..K, so train,
  val and an `--evaluate_only` run on val alone number them alike (the VOC 20 are alphabetical anyway). Two
  spellings are one class when they differ only in case, spaces, `_` or `-` (`chair`, `Chair `, `CHAIR`;
  `pottedplant`, `potted_plant`): the class takes its most frequent spelling (ties: the first in sorted order),
  a repair names the merged ones (`class_key`). Names that stay apart but are close (`person`, `persons`) are a
  warning. A class list (`class_names`, `read_class_names`) fixes the classes and their order instead; objects
  of another name are dropped (a repair naming them).
* VOC boxes with xmin > xmax or ymin > ymax are dropped, not swapped back (which corner is wrong cannot be known).
  Every object a VOC finding names is `<id>.xml object <k> (<name>)`, k counting the xml's objects from 1.
* YOLO classes keep their index as the category id (0..K-1), named by `names`. A row whose class id is not one
  of them stops the run (an error naming `label file:line`, as ultralytics refuses the label). A set whose rows
  use class 1 but never class 0 looks written from 1: when a row also has class K (one past `names`) that is
  an error saying so; when every id is inside `names`, a warning (class 0 may simply be unused). A LabelImg
  `classes.txt` beside the label files that orders the classes otherwise than `names` is an error too.
* YOLO label files (`yolo_label_files`): the image's path with its last `/images/` made `/labels/` and the
  extension `.txt` (ultralytics' `img2label_paths`), else the `.txt` beside the image (darknet's, CVAT's YOLO 1.1
  and LabelImg's layout). labels/ wins where both exist. A label file read beside its image and one that a
  labels/ file replaces are warnings, and a split where no image has either says where it looked: an image
  never becomes background without a word.
* YOLO image lists (`train: train.txt`, ultralytics' coco.yaml form): one image path a line, absolute or relative to
  the list's folder (ultralytics replaces a leading `./` by it), else to the set's root (`path:`); the split's
  `file_name`s are relative to the list's folder (`_yolo_folder`). A path found in neither is a repair naming the
  list, the line and the folders looked in.
* Text files (data.yaml, label files, classes.txt, image lists, split and class lists) are read by one rule,
  `read_text`: UTF-8 with or without a BOM, UTF-16 with a BOM; any line end; spaces or tabs between fields.
* Sizes: a YOLO image's is its file's as shown (EXIF orientation applied: its rows are normalised to that, as
  ultralytics' `exif_size`); a VOC xml without <size> takes the same; a VOC <size> is stated and decides with the
  EXIF rule of `detlib.datacheck.orientation`, as a COCO json's does.
* Every converted annotation carries `_source`, its xml and object or its label file and line, by which the data
  check names it (a box clipped or dropped there is named by its file, not by the annotation id given here).
* Image ids: the file stems when all are distinct integers (COCO-style names), else 1..N in sorted order
  (VOC's own id then kept as `original_id`, which predictions carry).

Faults of each layout are findings in the same report (`detlib.datacheck.report`), listed in VOC_FINDINGS and
YOLO_FINDINGS; a missing xml leaves its image out, an image without a label file has no boxes (a background
image, counted), a label file without an image is warned about.
"""

from __future__ import annotations

import codecs
import difflib
import glob
import math
import os
import re
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass

from ..datacheck.coco import check_coco_data
from ..datacheck.orientation import shown_size
from ..datacheck.report import DEFAULT_MAX_IMAGE_PIXELS, DataReport, Findings, publish_report, read_image_headers

FORMATS = ("coco", "voc", "yolo")
# File name extensions read as images in a YOLO image folder (ultralytics' IMG_FORMATS, lower case).
YOLO_IMAGE_EXTENSIONS = (".bmp", ".dng", ".jpeg", ".jpg", ".mpo", ".png", ".tif", ".tiff", ".webp", ".pfm", ".heic")
# Image files looked for under JPEGImages/ for a VOC id, in this order, when the xml's <filename> is not there.
VOC_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG", ".bmp")
YOLO_YAML_NAMES = ("data.yaml", "dataset.yaml", "data.yml")
# A YOLO box whose corners lie further outside 0..1 than this is not normalised (pixels?) and is dropped; a
# little outside is rounding, clipped by the data check.
YOLO_OUTSIDE_TOLERANCE = 0.01
# Corners outside 0..1 by no more than this are the rounding of a label file's decimals: clamped without a finding.
YOLO_ROUNDING = 1e-4
# The split names when --train_set / --val_set are not given.
DEFAULT_SPLITS = {"coco": ("train2017", "val2017"), "voc": ("train", "val"), "yolo": ("train", "val")}

VOC_FINDINGS = {
    "no_xml": ("repair", "images", "ids in the split list without Annotations/<id>.xml: left out (their boxes are "
               "unknown)"),
    "bad_xml": ("repair", "structure", "xml files that do not parse: left out with their image"),
    "twice": ("repair", "ids", "ids listed twice in the split list: kept once"),
    "no_name": ("repair", "boxes", "objects without a <name>: dropped"),
    "no_bndbox": ("repair", "boxes", "objects without 4 numbers in <bndbox> (xmin, ymin, xmax, ymax): dropped"),
    "corners": ("repair", "boxes", "boxes with xmin > xmax or ymin > ymax (corners swapped?): dropped"),
    "not_listed": ("repair", "categories", "objects whose name is not in the class list: dropped"),
    "size_from_file": ("repair", "images", "xml without a usable <size>: width and height taken from the image file"),
    "zero_based": ("warning", "boxes", "boxes with xmin or ymin 0: VOC coordinates are 1-based, so they were "
                   "probably written 0-based (the data check clips them to the image)"),
}
VOC_UNLISTED = ("warning", "ids", "Annotations/*.xml in no ImageSets/Main list: not used")
# Of the whole set (every xml), reported once.
VOC_CLASS_FINDINGS = {
    "merged": ("repair", "categories", "object names that differ only in case, spaces, _ or -: one class each, "
               "named by its most frequent spelling"),
    "close": ("warning", "categories", "class names close to another (a typo or a plural?), kept apart"),
}
# Two class names whose difflib ratio reaches this are named as close (`person` / `persons` 0.92, `cat` / `car` 0.67).
CLOSE_NAME_RATIO = 0.85
YOLO_FINDINGS = {
    "no_image": ("repair", "images", "images listed that do not exist: left out"),
    "twice": ("repair", "ids", "images listed twice: kept once"),
    "bad_row": ("repair", "boxes", "label rows that are not `class cx cy w h` numbers (or a polygon): dropped"),
    "bad_class": ("error", "categories", "label rows whose class id is not one of names (0..{last}): no class of "
                  "the model is theirs (fix the id, or the names)"),
    "not_normalised": ("repair", "boxes", "label rows with coordinates outside 0..1 (pixels instead of normalised?): "
                       "dropped"),
    "duplicate_row": ("repair", "boxes", "duplicate label rows: kept once"),
    "unreadable_label": ("repair", "images", "label files that cannot be read as text: the image left out"),
    "orphan_label": ("warning", "images", "label files without an image: not used"),
    "beside": ("warning", "images", "label files beside their images, not under labels/: read (ultralytics reads only "
               "labels/)"),
    "shadowed": ("warning", "images", "label files beside their images that the image's labels/ file replaces: not used"),
    "classes_txt": ("error", "categories", "classes.txt files (LabelImg's class list, whose order the label rows' ids "
                    "follow) that name the classes in another order than `names`: make `names` that list"),
}


def read_text(path: str) -> str:
    """A text file as every reader here takes it (data.yaml, label files, classes.txt, image lists, split lists,
    class lists), whatever wrote it: UTF-8 with or without a BOM (Windows Notepad writes one), UTF-16 with its BOM
    (Notepad's "Unicode"). Lines are then split by `str.splitlines` (LF, CRLF or CR) and rows by `str.split` (spaces
    or tabs). VOC xml goes to its parser as bytes, which honours a BOM itself.

    Raises:
        OSError: the file cannot be read; UnicodeDecodeError: it is neither.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return data.decode("utf-16")
    return data.decode("utf-8-sig")


def read_lines(path: str) -> list[str]:
    """The non-blank lines of a text file (`read_text`), stripped."""
    return [line.strip() for line in read_text(path).splitlines() if line.strip()]


def _yaml_in(root: str) -> str | None:
    if os.path.isfile(root) and root.lower().endswith((".yaml", ".yml")):
        return root
    for name in YOLO_YAML_NAMES:
        if os.path.isfile(os.path.join(root, name)):
            return os.path.join(root, name)
    return None


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
    if _yaml_in(root):
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
            images, annotations = _voc_split(root, name)
        else:
            images, annotations = _yolo_split(root, name)
        out[f"{key}_images"], out[f"{key}_annotations"] = images, annotations
    return out


def _coco_split(root: str, name: str) -> tuple[str, str]:
    cands = (os.path.join(root, name), os.path.join(root, "images", name))
    images = next((c for c in cands if os.path.isdir(c)), None)
    if images is None:
        raise FileNotFoundError(f"image folder not found: {cands[0]} (nor {cands[1]})")
    return images, os.path.join(root, "annotations", f"instances_{name}.json")


def _voc_split(root: str, name: str) -> tuple[str, str]:
    listing = os.path.join(root, "ImageSets", "Main", f"{name}.txt")
    if not os.path.isfile(listing):
        there = sorted(os.path.splitext(f)[0] for f in os.listdir(os.path.dirname(listing))
                       if f.endswith(".txt") and "_" not in f) if os.path.isdir(os.path.dirname(listing)) else []
        raise FileNotFoundError(f"VOC split list not found: {listing}" + (f" (splits there: {', '.join(there)})" if there
                                                                          else " (ImageSets/Main/ holds none)"))
    return os.path.join(root, "JPEGImages"), listing


def _yolo_split(root: str, name: str) -> tuple[str, str]:
    yaml_path = _yaml_in(root)
    if yaml_path is None:
        raise FileNotFoundError(f"no {' / '.join(YOLO_YAML_NAMES)} in {root}")
    cfg = read_yolo_yaml(yaml_path)
    return _yolo_folder(_yolo_image_entries(cfg, yaml_path, name)), yaml_path


# ---------------------------------------------------------------------------------------------------- reading


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


def _image_ids(stems: list[str]) -> tuple[list[int], bool]:
    """Integer ids for the images of a split: their stems when all are distinct integers, else 1..N."""
    if stems and all(s.isdigit() for s in stems) and len({int(s) for s in stems}) == len(stems):
        return [int(s) for s in stems], True
    return list(range(1, len(stems) + 1)), False


def _dataset(images: list[dict], annotations: list[dict], categories: list[dict], description: str) -> dict:
    for i, a in enumerate(annotations, 1):
        a["id"] = i
    return {"info": {"description": description}, "licenses": [], "images": images, "annotations": annotations,
            "categories": categories}


# ---- VOC


def _voc_root(listing: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(listing))))


def _text(node, tag: str) -> str | None:
    child = node.find(tag) if node is not None else None
    return child.text.strip() if child is not None and child.text and child.text.strip() else None


def _number(node, tag: str) -> float | None:
    t = _text(node, tag)
    try:
        v = float(t) if t is not None else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None


def _parse_voc_xml(path: str):
    try:
        return ET.parse(path).getroot()
    except (ET.ParseError, OSError, UnicodeDecodeError):
        return None


def class_key(name: str) -> str:
    """What the spellings of one class name share: the name without case, spaces, `_` and `-` (`Chair ` ->
    `chair`, `Potted_Plant` -> `pottedplant`). The rule by which VOC names (and a class list) are one class."""
    return re.sub(r"[\s_-]+", "", name).casefold() or name.casefold()


def read_class_names(text: str) -> list[str]:
    """A class list (the scripts' `--class_names`): a file with one name a line (blank lines and `#` comments
    skipped), or the names separated by commas.

    Raises:
        ValueError: no name, or two names that are one class by `class_key` (both named).
    """
    if os.path.isfile(text):
        names = [line for line in read_lines(text) if not line.startswith("#")]
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
    return _checked_class_list(names, text)


def _checked_class_list(names: list[str], what: str) -> list[str]:
    if not names:
        raise ValueError(f"class list {what!r} names no class")
    seen: dict[str, str] = {}
    for n in names:
        if class_key(n) in seen:
            raise ValueError(f"class list {what!r}: {seen[class_key(n)]!r} and {n!r} are one class (names are compared "
                             "without case, spaces, _ and -)")
        seen[class_key(n)] = n
    return names


@dataclass
class VocClasses:
    """The classes of a VOC set (`voc_classes`): `names` in id order (ids 1..K), `ids` {class_key: id}, and the set's
    findings by VOC_CLASS_FINDINGS key ({"merged": [...], "close": [...]})."""

    names: list[str]
    ids: dict[str, int]
    findings: dict[str, list[str]]

    def add_to(self, report: DataReport, split: str) -> None:
        found = Findings(VOC_CLASS_FINDINGS)
        for key, examples in self.findings.items():
            found[key].extend(examples)
        found.add_to(report, split)


def voc_classes(root: str, class_names: list[str] | None = None) -> VocClasses:
    """The classes of a VOC root: by default the names of every Annotations/*.xml (unparsable files skipped), the
    spellings of one class (`class_key`) merged under the most frequent one, sorted; or `class_names` in its order.

    Raises:
        ValueError: `class_names` holds two names of one class (`read_class_names`).
    """
    spellings: dict[str, Counter] = {}
    for f in glob.glob(os.path.join(root, "Annotations", "*.xml")):
        r = _parse_voc_xml(f)
        if r is not None:
            for n in (_text(o, "name") for o in r.iter("object")):
                if n:
                    spellings.setdefault(class_key(n), Counter())[n] += 1
    if class_names is None:
        chosen = {k: min(c, key=lambda n: (-c[n], n)) for k, c in spellings.items()}
        names = sorted(chosen.values())
    else:
        names = _checked_class_list([str(n).strip() for n in class_names], ", ".join(map(str, class_names)))
        chosen = {class_key(n): n for n in names}
    merged = [f"{' / '.join(repr(s) for s in sorted(c) if s != chosen[k])} -> {chosen[k]!r} "
              f"({sum(v for s, v in c.items() if s != chosen[k])} objects)"
              for k, c in sorted(spellings.items()) if k in chosen and set(c) != {chosen[k]}]
    close = []
    if len(names) <= 500:  # pairwise: a second at 500 classes
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if difflib.SequenceMatcher(None, a.casefold(), b.casefold()).ratio() >= CLOSE_NAME_RATIO:
                    close.append(f"{a!r} ~ {b!r}")
    return VocClasses(names, {class_key(n): k for k, n in enumerate(names, 1)}, {"merged": merged, "close": close})


def voc_class_names(root: str) -> list[str]:
    """The classes of every Annotations/*.xml of a VOC root, in id order (`voc_classes`)."""
    return voc_classes(root).names


def read_voc_split(listing: str, *, report: DataReport, split: str, cache_file: str | None = None,
                   classes: VocClasses | None = None) -> dict:
    """A VOC split list (ImageSets/Main/<split>.txt) and its xml files as a COCO dict (see `read_split`)."""
    root = _voc_root(listing)
    ids_listed = [line.split()[0] for line in read_lines(listing)]
    found = Findings(VOC_FINDINGS)
    seen, ids = set(), []
    for i in ids_listed:
        if i in seen:
            found["twice"].append(i)
        else:
            seen.add(i)
            ids.append(i)
    if classes is None:
        classes = voc_classes(root)
        classes.add_to(report, split)
    parsed = []
    for vid in ids:
        xml = os.path.join(root, "Annotations", f"{vid}.xml")
        if not os.path.isfile(xml):
            found["no_xml"].append(vid)
            continue
        r = _parse_voc_xml(xml)
        if r is None:
            found["bad_xml"].append(f"{vid}.xml")
            continue
        parsed.append((vid, r))
    image_ids, numeric = _image_ids([vid for vid, _ in parsed])
    images, annotations = [], []
    difficult = truncated = 0
    need_size = []
    for (vid, r), iid in zip(parsed, image_ids):
        size = r.find("size")
        w, h = _number(size, "width"), _number(size, "height")
        im = {"id": iid, "file_name": _voc_image_file(root, vid, _text(r, "filename")),
              "width": int(w) if w and w > 0 else None, "height": int(h) if h and h > 0 else None}
        if not numeric:
            im["original_id"] = vid
        if im["width"] is None or im["height"] is None:
            need_size.append(im)
        images.append(im)
        for k, obj in enumerate(r.iter("object"), 1):
            name = _text(obj, "name")
            where = f"{vid}.xml object {k}" + (f" ({name})" if name else "")
            if name is None:
                found["no_name"].append(where)
                continue
            box = obj.find("bndbox")
            xyxy = [_number(box, c) for c in ("xmin", "ymin", "xmax", "ymax")]
            if None in xyxy:
                found["no_bndbox"].append(where)
                continue
            if xyxy[2] < xyxy[0] or xyxy[3] < xyxy[1]:
                found["corners"].append(where)
                continue
            cid = classes.ids.get(class_key(name))
            if cid is None:
                found["not_listed"].append(where)
                continue
            if xyxy[0] == 0 or xyxy[1] == 0:
                found["zero_based"].append(where)
            # 1-based inclusive pixel indices -> pixel coordinates (detectron2's load_voc_instances)
            x1, y1, x2, y2 = xyxy[0] - 1.0, xyxy[1] - 1.0, xyxy[2], xyxy[3]
            is_difficult = int(_number(obj, "difficult") or 0) == 1
            is_truncated = int(_number(obj, "truncated") or 0) == 1
            difficult += is_difficult
            truncated += is_truncated
            annotations.append({"image_id": iid, "category_id": cid, "bbox": [x1, y1, x2 - x1, y2 - y1],
                                "area": max(x2 - x1, 0.0) * max(y2 - y1, 0.0), "iscrowd": int(is_difficult),
                                "difficult": int(is_difficult), "truncated": int(is_truncated), "_source": where})
    if need_size:
        image_dir = os.path.join(root, "JPEGImages")
        for im, (status, fw, fh, orientation) in zip(need_size, read_image_headers(
                [os.path.join(image_dir, im["file_name"]) for im in need_size], progress=False, cache_file=cache_file)):
            if status == "ok":  # as shown: a size taken from the file states nothing against the EXIF rule
                im["width"], im["height"] = shown_size((fw, fh), orientation)
                found["size_from_file"].append(im["file_name"])
    found.add_to(report, split)
    report.summaries[f"{split} (voc)"] = {"list": listing, "difficult (ignored, as crowd)": difficult,
                                          "truncated": truncated}
    categories = [{"id": k, "name": n} for k, n in enumerate(classes.names, 1)]
    return _dataset(images, annotations, categories, f"converted from Pascal VOC {listing}")


def _voc_image_file(root: str, vid: str, filename: str | None) -> str:
    """JPEGImages/<id>.<ext> as the devkit names it (detectron2 and mmdetection use the id, not <filename>);
    the xml's <filename> when no such file is there; <id>.jpg (reported missing by the image check) else."""
    folder = os.path.join(root, "JPEGImages")
    for ext in VOC_IMAGE_EXTENSIONS:
        if os.path.isfile(os.path.join(folder, vid + ext)):
            return vid + ext
    if filename and os.path.isfile(os.path.join(folder, filename)):
        return filename
    return vid + ".jpg"


def _voc_unlisted(root: str) -> list[str]:
    listed = set()
    for f in glob.glob(os.path.join(root, "ImageSets", "Main", "*.txt")):
        listed.update(line.split()[0] for line in read_lines(f))
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(root, "Annotations", "*.xml"))
                  if os.path.splitext(os.path.basename(f))[0] not in listed)


# ---- YOLO


def read_yolo_yaml(path: str) -> dict:
    """A YOLO data.yaml with `names` as {index: name} (a list becomes 0..K-1).

    Raises:
        ValueError: not yaml, no `names`, indices that are not 0..K-1, or an `nc` that disagrees with `names`.
    """
    import yaml

    try:
        cfg = yaml.safe_load(read_text(path))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not yaml ({type(e).__name__})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("names"), (list, dict)) or not cfg["names"]:
        raise ValueError(f"{path} has no `names` (the class names, a list or {{index: name}})")
    names = cfg["names"]
    names = dict(enumerate(names)) if isinstance(names, list) else names
    try:
        names = {int(k): str(v) for k, v in names.items()}
    except (TypeError, ValueError):
        raise ValueError(f"{path}: `names` keys must be class indices 0..K-1") from None
    if sorted(names) != list(range(len(names))):
        raise ValueError(f"{path}: `names` indices must be 0..{len(names) - 1}, got {sorted(names)[:10]}")
    if "nc" in cfg and cfg["nc"] != len(names):
        raise ValueError(f"{path}: nc: {cfg['nc']} but `names` lists {len(names)} classes")
    return {**cfg, "names": names}


def _yolo_base(cfg: dict, yaml_path: str) -> str:
    base = os.path.dirname(os.path.abspath(yaml_path))
    if cfg.get("path"):
        p = str(cfg["path"])
        cand = p if os.path.isabs(p) else os.path.join(base, p)
        if os.path.isdir(cand):
            return os.path.abspath(cand)
    return base


def _yolo_image_entries(cfg: dict, yaml_path: str, key: str) -> list[str]:
    if not cfg.get(key):
        raise ValueError(f"{yaml_path} has no `{key}:` (the {key} images: a folder, a .txt list, or a list of them)")
    base = _yolo_base(cfg, yaml_path)
    entries = cfg[key] if isinstance(cfg[key], list) else [cfg[key]]
    out = []
    for e in entries:
        p = str(e) if os.path.isabs(str(e)) else os.path.join(base, str(e))
        if not os.path.exists(p):
            raise FileNotFoundError(f"{yaml_path}: `{key}: {e}` not found ({p})")
        out.append(os.path.abspath(p))
    return out


def yolo_label_path(image_path: str) -> str:
    """The label file of an image under labels/: the last `/images/` of its path becomes `/labels/`, the extension
    `.txt` (ultralytics' `img2label_paths`)."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return os.path.splitext(sb.join(image_path.rsplit(sa, 1)))[0] + ".txt"


def yolo_label_files(image_path: str) -> tuple[str | None, str | None]:
    """(the label file read for an image, a label file beside it that is not read, or None): the labels/ file
    (`yolo_label_path`) when it exists, else the `.txt` beside the image (same folder and stem: darknet's, CVAT's
    YOLO 1.1 and LabelImg's layout). The one rule for where YOLO labels are (see the module docstring)."""
    under, beside = yolo_label_path(image_path), os.path.splitext(image_path)[0] + ".txt"
    if os.path.isfile(under):
        return under, beside if beside != under and os.path.isfile(beside) else None
    return (beside, None) if os.path.isfile(beside) else (None, None)


def _yolo_folder(entries: list[str]) -> str:
    """The image folder of a split's entries, which its images' `file_name`s are relative to: the folder of one
    entry (a list's own folder), or the folder that holds them all."""
    return os.path.commonpath([e if os.path.isdir(e) else os.path.dirname(e) for e in entries])


def _yolo_listed(line: str, listing: str, base: str) -> tuple[str | None, list[str]]:
    """(the image file a line of an image list names, or None; the folders it was looked for in). A relative line
    is relative to the list's folder (ultralytics replaces a leading `./` by it), else to the set's root `base`."""
    if os.path.isabs(line):
        return (line if os.path.isfile(line) else None), [os.path.dirname(line)]
    folders = list(dict.fromkeys([os.path.dirname(listing), base]))
    found = next((os.path.join(d, line) for d in folders if os.path.isfile(os.path.join(d, line))), None)
    return (os.path.abspath(found) if found else None), folders


def _yolo_images(entries: list[str], found: Findings, base: str) -> list[str]:
    """The image files of a split's entries (folders searched recursively, .txt lists read: `_yolo_listed`), sorted,
    unique; `base` the set's root."""
    files = []
    for e in entries:
        if os.path.isdir(e):
            for dirpath, dirnames, filenames in os.walk(e, followlinks=True):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                files += [os.path.join(dirpath, f) for f in filenames
                          if not f.startswith(".") and f.lower().endswith(YOLO_IMAGE_EXTENSIONS)]
        else:
            for line in read_lines(e):
                p, looked = _yolo_listed(line, e, base)
                if p is not None:
                    files.append(p)
                else:
                    found["no_image"].append(f"{os.path.basename(e)}: {line} (looked for in {' and '.join(looked)})")
    out, seen = [], set()
    for p in sorted(files):
        if p in seen:
            found["twice"].append(p)
        else:
            seen.add(p)
            out.append(p)
    return out


def read_yolo_split(yaml_path: str, key: str, *, report: DataReport, split: str, cache_file: str | None = None,
                    progress: bool = True, class_rows: Counter | None = None) -> dict:
    """The `key` split of a YOLO data set (its yaml) as a COCO dict (see `read_split`).

    Every image's size comes from its header (YOLO labels are normalised), read once and cached in `cache_file`,
    where the data check's image pass then finds it. Label files are named relative to the set's root (the
    yaml's `path:`), rows as `file:line` from 1.
    """
    cfg = read_yolo_yaml(yaml_path)
    names = cfg["names"]
    base = _yolo_base(cfg, yaml_path)
    entries = _yolo_image_entries(cfg, yaml_path, key)
    found = Findings(YOLO_FINDINGS)
    files = _yolo_images(entries, found, base)
    folder = _yolo_folder(entries)
    heads = read_image_headers(files, progress=progress, cache_file=cache_file)
    image_ids, _ = _image_ids([os.path.splitext(os.path.basename(p))[0] for p in files])
    class_rows = Counter() if class_rows is None else class_rows
    images, annotations = [], []
    background = labelled = 0
    label_dirs: set[str] = set()
    for path, iid, (status, fw, fh, orientation) in zip(files, image_ids, heads):
        # the boxes are normalised to the image as shown (ultralytics applies the EXIF turn, exif_size)
        sw, sh = shown_size((fw, fh), orientation)
        im = {"id": iid, "file_name": os.path.relpath(path, folder), "width": sw if status == "ok" else None,
              "height": sh if status == "ok" else None}
        label, unused = yolo_label_files(path)
        if label is not None:
            label_dirs.add(os.path.dirname(label))
        if unused:
            found["shadowed"].append(os.path.relpath(unused, base))
        rows = None
        if label is not None:
            labelled += 1
            if label != yolo_label_path(path):
                found["beside"].append(os.path.relpath(label, base))
            try:
                rows = [(n, line.split()) for n, line in enumerate(read_text(label).splitlines(), 1) if line.strip()]
            except (OSError, UnicodeDecodeError):
                found["unreadable_label"].append(os.path.relpath(label, base))
                continue
        images.append(im)
        if not rows:
            background += 1
            continue
        if status != "ok":
            continue  # the image check reports the file; its boxes go with it
        seen_rows = set()
        for n, row in rows:
            where = f"{os.path.relpath(label, base)}:{n}"
            box = _yolo_row(row, len(names), found, where, class_rows)
            if box is None:
                continue
            if tuple(row) in seen_rows:
                found["duplicate_row"].append(where)
                continue
            seen_rows.add(tuple(row))
            cls, cx, cy, w, h = box
            x1, y1, bw, bh = (cx - w / 2) * sw, (cy - h / 2) * sh, w * sw, h * sh
            # a box that ends at the border must not pass it by a float rounding (a "clipped" repair otherwise)
            bw = min(bw, sw - x1) if x1 + bw > sw and x1 + bw - sw < 1e-6 * sw else bw
            bh = min(bh, sh - y1) if y1 + bh > sh and y1 + bh - sh < 1e-6 * sh else bh
            annotations.append({"image_id": iid, "category_id": cls, "bbox": [x1, y1, bw, bh], "area": bw * bh,
                                "iscrowd": 0, "_source": where})
    found["orphan_label"].extend(_yolo_orphan_labels(entries, files))
    found["classes_txt"].extend(_yolo_classes_txt_conflicts(label_dirs, names, base))
    found.add_to(report, split, last=len(names) - 1)
    if files and not labelled:  # every image background: say where the labels were looked for
        report.add("warning", "images", split, "no image has a label file, so every image is background: looked for "
                   f"{os.path.relpath(yolo_label_path(files[0]), base)} and {os.path.relpath(os.path.splitext(files[0])[0], base)}"
                   ".txt (and the same for each image)", count=len(files))
    report.summaries[f"{split} (yolo)"] = {"yaml": yaml_path, "split": key, "images without a label file or rows "
                                           "(background)": background}
    categories = [{"id": k, "name": names[k]} for k in sorted(names)]
    return _dataset(images, annotations, categories, f"converted from YOLO {yaml_path} ({key})")


def _yolo_row(row: list[str], num_classes: int, found: Findings, where: str, class_rows: Counter):
    """(class, cx, cy, w, h) normalised of a label row; None (with its finding) when it is dropped. Counts the row's
    class id into `class_rows` (out-of-range ones too)."""
    try:
        values = [float(v) for v in row]
    except ValueError:
        values = None
    if (values is None or len(values) < 5 or (len(values) > 5 and len(values) % 2 == 0)
            or not all(map(math.isfinite, values)) or not values[0].is_integer()):
        found["bad_row"].append(where)
        return None
    cls = int(values[0])
    class_rows[cls] += 1
    if not 0 <= cls < num_classes:
        found["bad_class"].append(f"{where} (class {cls})")
        return None
    if len(values) == 5:
        cx, cy, w, h = values[1:]
        x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
    else:  # a segment: its polygon's extent, as ultralytics' segments2boxes
        xs, ys = values[1::2], values[2::2]
        x1, y1, x2, y2 = min(xs), min(ys), max(xs), max(ys)
        cx, cy, w, h = (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1
    t = YOLO_OUTSIDE_TOLERANCE
    if min(x1, y1) < -t or max(x2, y2) > 1 + t:
        found["not_normalised"].append(where)
        return None
    if min(x1, y1) < 0 <= min(x1, y1) + YOLO_ROUNDING or 1 < max(x2, y2) <= 1 + YOLO_ROUNDING:
        # written with a few decimals, a box at the border overshoots it by the rounding: not a fault to report
        x1, y1, x2, y2 = max(x1, 0.0), max(y1, 0.0), min(x2, 1.0), min(y2, 1.0)
        cx, cy, w, h = (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1
    return cls, cx, cy, w, h


def _yolo_classes_txt_conflicts(label_dirs: set[str], names: dict[int, str], base: str) -> list[str]:
    """The classes.txt files in the folders labels were read from whose i-th name is not `names[i]` (for every i
    both have; LabelImg appends new classes at the end), each with its first difference."""
    out = []
    for folder in sorted(label_dirs):
        f = os.path.join(folder, "classes.txt")
        try:
            listed = read_lines(f)
        except (OSError, UnicodeDecodeError):
            continue
        diff = next((i for i, n in enumerate(listed[:len(names)]) if n != names[i]), None)
        if diff is not None:
            out.append(f"{os.path.relpath(f, base)}: class {diff} is {listed[diff]!r} there, {names[diff]!r} in names")
    return out


def _yolo_orphan_labels(entries: list[str], files: list[str]) -> list[str]:
    """Label files under the labels/ folder of a split's image folder that no image of the split has."""
    wanted = {yolo_label_path(p) for p in files}
    out = []
    for e in entries:
        if not os.path.isdir(e):
            continue
        labels = os.path.dirname(yolo_label_path(os.path.join(e, "x.jpg")))
        if os.path.abspath(labels) == os.path.abspath(e):
            continue  # labels beside the images: any other .txt there is no label of ours to judge
        for dirpath, _, filenames in os.walk(labels):
            out += [os.path.join(dirpath, f) for f in filenames
                    if f.endswith(".txt") and f != "classes.txt" and os.path.join(dirpath, f) not in wanted]
    return sorted(out)


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
    classes = voc_classes(_voc_root(paths[f"{first}_annotations"]), class_names) if fmt == "voc" else None
    class_rows: Counter = Counter()
    out = {}
    for split in read:
        out[split] = read_split(fmt, paths[f"{split}_annotations"], splits[split] or DEFAULT_SPLITS[fmt][split == "val"],
                                report=report, split=split, cache_file=cache_file, progress=progress, classes=classes,
                                class_rows=class_rows)
    if fmt == "voc":  # faults of the data set, not of a split: reported once
        report.add(VOC_UNLISTED[0], VOC_UNLISTED[1], first, VOC_UNLISTED[2],
                   _voc_unlisted(_voc_root(paths[f"{first}_annotations"])))
        classes.add_to(report, first)
    else:
        names = read_yolo_yaml(paths[f"{first}_annotations"])["names"]
        shifted = yolo_shifted_ids(class_rows, names)
        if shifted:
            level, message, rows = shifted
            report.add(level, "categories", first, message, count=rows)
    return out


def yolo_shifted_ids(class_rows: Counter, names: dict[int, str]) -> tuple[str, str, int] | None:
    """(level, message, rows) when the label rows' class ids look written from 1 instead of 0, else None.

    The rule: the rows use class 1 and never class 0. Then when a row has class K = len(names), one past the
    last name, the set is refused (an error: every box would train under the name of the class before its own,
    and the rows of class K have none); when every id is inside `names` it is said (a warning: class 0 may
    simply have no box).
    """
    if not class_rows or 0 in class_rows or min(class_rows) != 1:
        return None
    k, top = len(names), max(class_rows)
    if top == k:
        return ("error", f"class ids look written from 1, not 0: no label row has class 0 and {class_rows[k]} rows "
                f"have class {k}, one past names (0..{k - 1}); subtract 1 from every class id (ultralytics counts "
                "from 0)", class_rows[k])
    return ("warning", f"no label row has class 0 ({names[0]!r}) while rows of classes 1..{top} do: if the labels "
            "count from 1, every box trains under the name of the class before its own (then subtract 1 from every "
            "class id)", 1)


def check_coco_for_training(paths: dict, output_dir: str | None, *, check_images: bool = True,
                            max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS, strict: bool = False,
                            is_main: bool = True, data_format: str = "coco",
                            splits: dict[str, str | None] | None = None,
                            include_crowd: bool = False, class_names: list[str] | None = None) -> tuple[dict | None, dict]:
    """The training script's data check in one call: `check_coco_data` + `publish_report`.

    Every process runs it, so every process holds the same repaired data without sending it around (the json
    part is fast: see benchmarks/datacheck_118k.py). The image headers are read by the main process (the
    script calls this under `main_process_first`) and cached in `output_dir/image_header_cache.json`, where the
    other processes find them: read once per run when `output_dir` is on a disk all machines share (otherwise the
    processes of the other machines read them again).
    A VOC or YOLO set (`data_format`; `paths` from `detlib.data.formats.data_dir_paths`, `splits` its split names) is
    converted first (`detlib.data.formats.read_data_dir_splits`, with `class_names` for a VOC set), its own faults
    in the same report.
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
                                         report=report, include_crowd=include_crowd)
    publish_report(report, output_dir, is_main)
    return train, val
