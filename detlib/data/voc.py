"""Pascal VOC sets read as COCO-format dicts (`read_voc_split`), and their classes: the names the xml files use, one
class per name whatever its spelling (`voc_classes`), or a class list (`read_class_names`).

Layout: ROOT/Annotations/<id>.xml, ROOT/JPEGImages/<id>.jpg, ROOT/ImageSets/Main/{set}.txt (one id a line): the
devkit's VOC2007 / VOC2012 folder, or any set in that layout (LabelImg, CVAT's "Pascal VOC" export). The rules VOC
shares with YOLO (text files, sizes, `_source`, image ids) are in `detlib.data.formats`; VOC's own:

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

Faults are findings in the data check's report (`detlib.datacheck.report`), listed in VOC_FINDINGS and
VOC_CLASS_FINDINGS; a missing xml leaves its image out.
"""

from __future__ import annotations

import difflib
import glob
import math
import os
import re
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass

from ..datacheck.orientation import shown_size
from ..datacheck.report import DataReport, Findings, read_image_headers
from .converted import coco_dict, read_lines, stem_ids

# Image files looked for under JPEGImages/ for a VOC id, in this order, when the xml's <filename> is not there.
VOC_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG", ".bmp")
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


def voc_split_paths(root: str, name: str) -> tuple[str, str]:
    """(the image folder, the split list) of the split `name` of a VOC root. Raises FileNotFoundError: no list
    ImageSets/Main/<name>.txt (names the splits there are)."""
    listing = os.path.join(root, "ImageSets", "Main", f"{name}.txt")
    if not os.path.isfile(listing):
        there = sorted(os.path.splitext(f)[0] for f in os.listdir(os.path.dirname(listing))
                       if f.endswith(".txt") and "_" not in f) if os.path.isdir(os.path.dirname(listing)) else []
        raise FileNotFoundError(f"VOC split list not found: {listing}" + (f" (splits there: {', '.join(there)})" if there
                                                                          else " (ImageSets/Main/ holds none)"))
    return os.path.join(root, "JPEGImages"), listing


def voc_root(listing: str) -> str:
    """The VOC root of a split list (ROOT/ImageSets/Main/<split>.txt)."""
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
    root = voc_root(listing)
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
    image_ids, numeric = stem_ids([vid for vid, _ in parsed])
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
    return coco_dict(images, annotations, categories, f"converted from Pascal VOC {listing}")


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


def voc_unlisted(root: str) -> list[str]:
    """The Annotations/*.xml of a VOC root that no ImageSets/Main list names (sorted file names)."""
    listed = set()
    for f in glob.glob(os.path.join(root, "ImageSets", "Main", "*.txt")):
        listed.update(line.split()[0] for line in read_lines(f))
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(root, "Annotations", "*.xml"))
                  if os.path.splitext(os.path.basename(f))[0] not in listed)

