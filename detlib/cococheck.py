"""The COCO part of the data check (see `detlib.datacheck` for the levels and the report): a COCO-format
detection json read once, checked with its image files, and normalised for training and evaluation.

The normalised json (`CocoCheck.dataset`) is a COCO dict where every image has an int `id` (unique), an int
`width` / `height` and a `file_name`; every annotation an int `id` > 0 (unique), an int `image_id` and
`category_id` that exist, a finite `bbox` [x, y, w, h] (pixels, clipped to the image, w and h > 0), a finite
`area` and an int `iscrowd`; every category an int `id` (unique) and a `name`. Images whose id had to be
renumbered (non-numeric) keep the json's own id as `original_id`; `_exif_transpose: True` tells the loader
that the json's size is the file's EXIF-rotated one. `CocoDetection` trains and `CocoEvaluator` evaluates on
it, so both see the same repaired values.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass

from .datacheck import DEFAULT_MAX_IMAGE_PIXELS, DataReport, publish_report, read_image_headers

# A json size that differs from the file's only by a resize (same aspect ratio within this) is repaired.
ASPECT_TOLERANCE = 0.01


def _int_id(v) -> int | None:
    """An id as int: ints, integral floats and numeric strings; None for anything else (bools included)."""
    if type(v) is int:
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            try:
                f = float(v)
            except ValueError:
                return None
            return int(f) if f.is_integer() else None
    return None


def _number(v) -> float | None:
    """A finite float from a number or a numeric string; None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        f = float(v)
    elif isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            return None
    else:
        return None
    return f if math.isfinite(f) else None


def _size(v) -> int | None:
    f = _number(v)
    return int(round(f)) if f is not None and f > 0 else None


def load_json(path: str) -> dict:
    """Read a json file. Raises FileNotFoundError naming the path, ValueError for a file that is not json."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"annotation file not found: {path}")
    try:
        with open(path, "rb") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read COCO annotations from {path}: not json ({e})") from e


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
               need_files: bool = True) -> CocoCheck:
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
    Returns:
        CocoCheck: `.dataset` is the normalised json (see the module docstring; valid as such only when
        `report.ok`), None when the file has no usable COCO structure.
    Raises:
        FileNotFoundError: `annotations` is a path that does not exist (names it).
    """
    report = report if report is not None else DataReport(strict)
    source = annotations if isinstance(annotations, str) else "<dict>"
    c = _CocoChecker(report, split)
    if isinstance(annotations, str):
        try:
            data = load_json(annotations)
        except ValueError as e:
            c.add("error", "structure", str(e), count=1)
            return CocoCheck(None, report, split, source)
    else:
        data = annotations
    if not isinstance(data, dict):
        c.add("error", "structure", f"the json holds a {type(data).__name__}, not an object with images, "
              "annotations and categories", count=1)
        return CocoCheck(None, report, split, source)
    missing = [k for k in ("images", "annotations", "categories") if not isinstance(data.get(k), list)]
    if missing:
        c.add("error", "structure", "required lists missing or not lists", missing)
        return CocoCheck(None, report, split, source)

    categories = c.categories(data["categories"])
    images, by_int, by_str = c.images(data["images"], need_files)
    left_out: set[int] = set()
    if image_dir is not None and check_images:
        images, left_out = c.image_files(images, image_dir, max_image_pixels, num_workers, progress, cache_file)
    unsized = [im.get("file_name", im["id"]) for im in images if im["width"] is None or im["height"] is None]
    c.add("error", "structure", "images without a valid width / height (the image file check fills them in: "
          "do not skip it)", unsized)
    annotations_out = c.annotations(data["annotations"], {im["id"]: im for im in images if im["width"]}, by_int,
                                    by_str, left_out, {cat["id"] for cat in categories})
    if split != "val":
        used = set(a["category_id"] for a in annotations_out)
        c.add("warning", "categories", "categories without any annotation (the model still has an output for each)",
              [f"{cat['id']} {cat['name']!r}" for cat in categories if cat["id"] not in used])
    if not images:
        c.add("error", "images", "no usable image is left", count=1)

    out = {k: v for k, v in data.items() if k not in ("images", "annotations", "categories")}
    out.setdefault("info", {})  # pycocotools >= 2.0.9 copies these in loadRes() (case B11)
    out.setdefault("licenses", [])
    out.update(images=images, annotations=annotations_out, categories=categories)
    with_boxes = len({a["image_id"] for a in annotations_out})
    report.summaries[split] = {"file": source, "images": len(images), "annotations": len(annotations_out),
                               "categories": len(categories), "images without annotations": len(images) - with_boxes}
    return CocoCheck(out, report, split, source, c.dropped)


class _CocoChecker:
    """The checks of one json, adding to one report (see `check_coco`)."""

    def __init__(self, report: DataReport, split: str):
        self.report, self.split = report, split
        self.dropped = 0

    def add(self, level: str, kind: str, message: str, examples=(), count: int | None = None) -> None:
        self.report.add(level, kind, self.split, message, examples, count)

    def categories(self, cats: list) -> list[dict]:
        out: list[dict] = []
        by_id: dict[int, dict] = {}
        parsed, unnamed, bad, twice, conflict = [], [], [], [], []
        for cat in cats:
            cid = _int_id(cat.get("id")) if isinstance(cat, dict) else None
            if cid is None:
                bad.append(cat.get("id") if isinstance(cat, dict) else repr(cat)[:40])
                continue
            if type(cat["id"]) is not int:
                parsed.append(cat["id"])
            name = cat.get("name")
            if not isinstance(name, str) or not name.strip():
                unnamed.append(cid)
                name = str(cid)
            if cid in by_id:
                (twice if by_id[cid]["name"] == name else conflict).append(f"{cid} {by_id[cid]['name']!r} / {name!r}")
                continue
            by_id[cid] = {**cat, "id": cid, "name": name}
            out.append(by_id[cid])
        self.add("error", "categories", "categories without an integer id", bad)
        self.add("error", "categories", "category id listed twice with different names", conflict)
        self.add("repair", "categories", "category listed twice with the same name: kept once", twice)
        self.add("repair", "categories", "category ids given as strings or floats: parsed", parsed)
        self.add("repair", "categories", "categories without a name: named by their id", unnamed)
        if not out:
            self.add("error", "categories", "no category is listed", count=1)
        names = Counter(cat["name"] for cat in out)
        self.add("warning", "categories", "category ids that share a name", [n for n, k in names.items() if k > 1])
        return out

    def images(self, raw: list, need_files: bool = True) -> tuple[list[dict], dict[int, int], dict[str, int]]:
        """Normalised images; the json's int ids and non-numeric ids -> the normalised id."""
        out: list[dict] = []
        first: dict = {}  # the json's id (int, or non-numeric str) -> its first record
        pending: list[dict] = []  # images whose id is not numeric: numbered after all int ids are known
        bad, no_file, parsed, sizes, same_file_twice, conflict = [], [], [], [], [], []

        def keep(key, rec):
            if key in first:
                prev = first[key]
                if prev.get("file_name") == rec.get("file_name"):
                    same_file_twice.append(key)
                else:
                    conflict.append(f"{key}: {prev.get('file_name')}, {rec.get('file_name')}")
                return False
            first[key] = rec
            return True

        for im in raw:
            if not isinstance(im, dict):
                bad.append(repr(im)[:40])
                continue
            fn = im.get("file_name")
            if need_files and (not isinstance(fn, str) or not fn.strip()):
                no_file.append(im.get("id"))
                continue
            rec = dict(im)
            w, h = im.get("width"), im.get("height")
            if type(w) is not int or type(h) is not int or w <= 0 or h <= 0:
                rec["width"], rec["height"] = _size(w), _size(h)
                if rec["width"] is not None and rec["height"] is not None:
                    sizes.append(im.get("id"))
            raw_id = im.get("id")
            iid = _int_id(raw_id)
            if iid is None or not -2**63 <= iid < 2**63:  # torch.int64 carries the id through the batch
                pending.append(rec)
                continue
            if type(raw_id) is not int:
                parsed.append(raw_id)
            rec["id"] = iid
            if keep(iid, rec):
                out.append(rec)
        by_int = {k: k for k in first}
        by_str: dict[str, int] = {}
        renumbered = []
        next_id = max((k for k in first), default=0) + 1
        for rec in pending:
            raw_id = rec.get("id")
            key = raw_id if isinstance(raw_id, str) else None
            if key is not None and not keep(key, rec):
                continue
            rec["original_id"], rec["id"] = raw_id, next_id
            if key is not None:
                by_str[key] = next_id
            next_id += 1
            renumbered.append(raw_id)
            out.append(rec)
        self.add("error", "structure", "images that are not objects", bad)
        self.add("error", "structure", "images without a file_name (ids shown)", no_file)
        self.add("error", "ids", "image id used by two different files (whose boxes are whose cannot be known)", conflict)
        self.add("repair", "ids", "image listed twice with the same id and file: kept once", same_file_twice)
        self.add("repair", "ids", "image ids given as strings or floats: parsed", parsed)
        self.add("repair", "ids", "image ids that are not integers (or missing): numbered after the largest id, "
                 "the json's id kept as original_id and used in predictions", renumbered)
        self.add("repair", "structure", "image width / height given as strings or floats: parsed", sizes)

        # One file under two ids: its boxes would be split between two samples of the same pixels.
        by_file: dict[str, list[dict]] = defaultdict(list)
        for rec in out:
            if isinstance(rec.get("file_name"), str):
                by_file[rec["file_name"]].append(rec)
        merged, size_conflict, into = [], [], {}
        for fn, recs in by_file.items():
            if len(recs) < 2:
                continue
            head = recs[0]
            if any((r["width"], r["height"]) != (head["width"], head["height"]) for r in recs[1:]):
                size_conflict.append(f"{fn} (ids {[r['id'] for r in recs]})")
                continue
            for r in recs[1:]:
                merged.append(f"{fn}: {r.get('original_id', r['id'])} -> {head['id']}")
                into[r["id"]] = head["id"]
        if into:
            out = [r for r in out if r["id"] not in into]
            for table in (by_int, by_str):
                for k, v in table.items():
                    table[k] = into.get(v, v)
        self.add("error", "ids", "file listed under two image ids with different sizes", size_conflict)
        self.add("repair", "ids", "file listed under two image ids: merged into the first id (the annotations of both "
                 "kept)", merged)
        return out, by_int, by_str

    def image_files(self, images: list[dict], image_dir: str, max_image_pixels, num_workers, progress,
                    cache_file) -> tuple[list[dict], set[int]]:
        heads = read_image_headers([os.path.join(image_dir, im["file_name"]) for im in images], num_workers,
                                   progress, cache_file)
        out, left_out = [], set()
        missing, unreadable, too_big, filled, rotated, resized, mismatch = [], [], [], [], [], [], []
        for im, (status, fw, fh, orientation) in zip(images, heads):
            fn = im["file_name"]
            if status != "ok":
                (missing if status in ("missing", "empty file") else unreadable).append(f"{fn} ({status})")
                left_out.add(im["id"])
                continue
            out.append(im)
            if max_image_pixels and fw * fh > max_image_pixels:
                too_big.append((fw * fh, f"{fn} ({fw}x{fh})"))
            # EXIF orientations 5-8 turn the image by 90 degrees: its shown size is the stored one transposed.
            sw, sh = (fh, fw) if orientation in (5, 6, 7, 8) else (fw, fh)
            w, h = im["width"], im["height"]
            if w is None or h is None:
                im["width"], im["height"] = fw, fh
                filled.append(fn)
            elif (w, h) == (fw, fh):
                continue
            elif (w, h) == (sw, sh):
                im["_exif_transpose"] = True
                rotated.append(f"{fn} (orientation {orientation})")
            elif abs(w / h - fw / fh) <= ASPECT_TOLERANCE * fw / fh:
                resized.append(f"{fn} (json {w}x{h}, file {fw}x{fh})")
            elif (sw, sh) != (fw, fh) and abs(w / h - sw / sh) <= ASPECT_TOLERANCE * sw / sh:
                im["_exif_transpose"] = True
                resized.append(f"{fn} (json {w}x{h}, file {fw}x{fh} turned by EXIF orientation {orientation})")
            else:
                mismatch.append(f"{fn} (json {w}x{h}, file {fw}x{fh})")
        self.add("repair", "images", "image files missing or empty: left out with their annotations", missing)
        self.add("repair", "images", "image files that cannot be read as images: left out with their annotations",
                 unreadable)
        if too_big:
            too_big.sort(reverse=True)
            self.add("error", "images", f"images larger than the pixel limit {max_image_pixels} (PIL's decompression-bomb "
                     f"guard); if they are genuine, pass --max_image_pixels {too_big[0][0]} or more",
                     [t for _, t in too_big])
        self.add("repair", "images", "width / height missing in the json: taken from the file", filled)
        self.add("repair", "images", "json size is the file's size turned by its EXIF orientation: the image is "
                 "turned the same way when loaded", rotated)
        self.add("repair", "images", "json size differs from the file's by a resize (same aspect ratio): the image is "
                 "resized to the json's size when loaded, so the boxes stay in place", resized)
        self.add("error", "images", "json size differs from the file's with another aspect ratio: the boxes cannot be "
                 "placed on the file", mismatch)
        return out, left_out

    def annotations(self, raw: list, images: dict[int, dict], by_int: dict, by_str: dict, left_out: set[int],
                    category_ids: set[int]) -> list[dict]:
        out: list[dict] = []
        seen_ids: set[int] = set()
        renumber: list[int] = []  # positions in `out` whose id pycocotools would mishandle
        bad_entry, no_image, no_cat, parsed, strings, box_from_seg, no_box = [], [], [], [], [], [], []
        degenerate, clipped, area_set, crowd_set, id_faults = [], [], [], [], Counter()
        with_image_left_out = 0
        for a in raw:
            if type(a) is not dict:
                bad_entry.append(repr(a)[:40])
                continue
            n_strings = len(strings)
            aid = a.get("id")
            iid = a.get("image_id")
            if type(iid) is int:
                nid = by_int.get(iid)
            else:
                nid = self._image_of(iid, by_int, by_str)
            im = images.get(nid)
            if im is None:
                if nid in left_out:
                    with_image_left_out += 1
                else:
                    no_image.append(aid if aid is not None else f"image_id {iid!r}")
                continue
            cid = cid0 = a.get("category_id")
            if type(cid) is not int:
                cid = _int_id(cid)
            if cid not in category_ids:
                no_cat.append(aid if aid is not None else f"category_id {cid0!r}")
                continue
            changed = nid != iid or cid is not cid0
            if changed and ((type(iid) is not int and not (isinstance(iid, str) and iid in by_str)) or type(cid0) is not int):
                parsed.append(aid)
            # Fast path: a list of 4 numbers. Anything else (strings, None, a polygon only) takes _box_of.
            bbox = a.get("bbox")
            try:
                x, y, w, h = bbox
                x2, y2 = x + w, y + h
                s = x2 + y2
                ok = s - s == 0.0  # false for inf / nan
            except (TypeError, ValueError):
                ok = False
            if not ok:
                box, how = _box_of(a)
                if box is None:
                    no_box.append(aid)
                    continue
                (strings if how == "strings" else box_from_seg).append(aid)
                x, y, w, h = box
                x2, y2 = x + w, y + h
                changed = True
            W, H = im["width"], im["height"]
            if not (0 <= x < x2 <= W and 0 <= y < y2 <= H):  # the common case needs no clipping
                x1c, y1c = min(max(x, 0.0), W), min(max(y, 0.0), H)
                x2c, y2c = min(max(x2, 0.0), W), min(max(y2, 0.0), H)
                if x2c - x1c <= 0 or y2c - y1c <= 0:
                    degenerate.append(aid)
                    continue
                clipped.append(aid)
                x, y, w, h = x1c, y1c, x2c - x1c, y2c - y1c
                changed = True
            area = a.get("area")
            if type(area) is not float and type(area) is not int or not area > 0 or area - area != 0:
                number = _number(area)
                if number is not None and number > 0:
                    strings.append(aid)
                    area = number
                else:
                    area = _area_of(a, w, h, H, W)
                    area_set.append(aid)
                changed = True
            crowd = a.get("iscrowd", 0)
            if type(crowd) is not int or (crowd != 0 and crowd != 1):
                value = _int_id(crowd) if not isinstance(crowd, bool) else int(crowd)
                (strings if isinstance(crowd, str) and value in (0, 1) else crowd_set).append(aid)
                crowd = 1 if value else 0
                changed = True
            if changed:
                del strings[n_strings + 1:]  # an annotation counts once, however many of its fields were strings
                a = {**a, "image_id": nid, "category_id": cid, "bbox": [float(x), float(y), float(w), float(h)],
                     "area": float(area), "iscrowd": crowd}
            if type(aid) is int and aid > 0 and aid not in seen_ids:
                seen_ids.add(aid)
            else:
                id_faults["missing" if aid is None else "not a positive integer" if type(aid) is not int or aid <= 0
                          else "duplicate"] += 1
                renumber.append(len(out))
            out.append(a)
        next_id = max(seen_ids, default=0) + 1
        renumbered = []
        for pos in renumber:
            renumbered.append(out[pos].get("id"))
            out[pos] = {**out[pos], "id": next_id}
            next_id += 1
        self.dropped = len(bad_entry) + len(no_image) + len(no_cat) + len(no_box) + len(degenerate) + with_image_left_out
        self.add("error", "structure", "annotations that are not objects", bad_entry)
        self.add("repair", "ids", "annotations whose image_id is not in images: dropped", no_image)
        self.add("repair", "ids", "annotations whose category_id is not in categories: dropped", no_cat)
        self.add("repair", "ids", "annotation image_id / category_id given as strings or floats: parsed", parsed)
        if renumbered:
            why = ", ".join(f"{n} {k}" for k, n in id_faults.items())
            self.add("repair", "ids", f"annotation ids pycocotools mishandles ({why}; it takes id 0 for 'no match'): "
                     f"renumbered after the largest id", renumbered)
        self.add("repair", "boxes", "bbox / area / iscrowd given as numeric strings: parsed", strings)
        self.add("repair", "boxes", "bbox missing or not 4 finite numbers: derived from the segmentation", box_from_seg)
        self.add("repair", "boxes", "annotations without a usable bbox or segmentation: dropped", no_box)
        self.add("repair", "boxes", "degenerate boxes (width or height <= 0 after clipping to the image, or entirely "
                 "outside it): dropped", degenerate)
        self.add("repair", "boxes", "boxes crossing the image border: clipped to the image", clipped)
        self.add("repair", "boxes", "area missing or not a positive number: computed from the segmentation (or the box)",
                 area_set)
        self.add("repair", "boxes", "iscrowd not 0 / 1: taken as 0 unless it is a true value", crowd_set)
        return out

    @staticmethod
    def _image_of(iid, by_int: dict, by_str: dict):
        if isinstance(iid, str) and iid in by_str:
            return by_str[iid]
        n = _int_id(iid)
        return by_int.get(n) if n is not None else None


def _box_of(a: dict) -> tuple[list[float] | None, str | None]:
    """A bbox that the fast path could not read: numeric strings ("strings"), or derived from the segmentation
    ("segmentation"); (None, None) when neither gives a finite box."""
    bbox = a.get("bbox")
    if isinstance(bbox, str):  # some converters write the list as a string
        try:
            bbox = json.loads(bbox)
        except ValueError:
            bbox = None
    if isinstance(bbox, (list, tuple)) and len(bbox) == 4:
        values = [_number(v) for v in bbox]
        if None not in values:
            return values, "strings"
    seg = a.get("segmentation")
    try:
        if isinstance(seg, list) and seg:
            # The polygon's own extent, as COCO's bboxes are (floats); pycocotools' toBbox would round to pixels.
            polys = seg if isinstance(seg[0], (list, tuple)) else [seg]
            xs = [float(v) for p in polys for v in p[0::2]]
            ys = [float(v) for p in polys for v in p[1::2]]
            if xs and ys and all(map(math.isfinite, xs + ys)):
                return [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)], "segmentation"
        elif isinstance(seg, dict) and "counts" in seg and "size" in seg:
            from pycocotools import mask as mask_utils

            rle = mask_utils.frPyObjects(seg, *seg["size"]) if isinstance(seg["counts"], list) else seg
            box = [float(v) for v in mask_utils.toBbox(rle)]
            if box[2] > 0 and box[3] > 0:
                return box, "segmentation"
    except (TypeError, ValueError, KeyError):
        pass
    return None, None


def _area_of(a: dict, w: float, h: float, height: int, width: int) -> float:
    """COCO's area is the segmentation's (pycocotools mask.area); the box's when there is no usable one."""
    seg = a.get("segmentation")
    try:
        if seg:
            from pycocotools import mask as mask_utils

            if isinstance(seg, list):
                polys = seg if isinstance(seg[0], (list, tuple)) else [seg]
                rle = mask_utils.merge(mask_utils.frPyObjects([[float(v) for v in p] for p in polys], height, width))
            else:
                rle = mask_utils.frPyObjects(seg, *seg["size"]) if isinstance(seg["counts"], list) else seg
            area = float(mask_utils.area(rle))
            if area > 0:
                return area
    except (TypeError, ValueError, KeyError, IndexError):
        pass
    return float(w * h)


# ---- train against val, and what the scripts call


def check_train_val(train: CocoCheck, val: CocoCheck, train_images: str | None = None,
                    val_images: str | None = None) -> None:
    """Categories and files of val against train, added to `val.report`.

    The model's classes are train's categories. Val may list a subset of them (only those it uses, case C19)
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


def check_coco_data(paths: dict, *, check_images: bool = True, max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
                    strict: bool = False, progress: bool = True, cache_file: str | None = None,
                    num_workers: int | None = None) -> tuple[dict | None, dict | None, DataReport]:
    """Check a training script's COCO data: train (when `paths["train_annotations"]`), val, and val against train.

    Args:
        paths: {"train_annotations", "train_images", "val_annotations", "val_images"}; train ones may be None.
        the others: see `check_coco`.
    Returns:
        (train normalised json or None, val normalised json, report).
    Raises:
        FileNotFoundError: an annotation file does not exist.
    """
    for key in ("val_annotations", "train_annotations"):  # a missing file is named before any check runs
        if paths.get(key) and not os.path.isfile(paths[key]):
            raise FileNotFoundError(f"annotation file not found: {paths[key]}")
    report = DataReport(strict)
    kw = dict(report=report, check_images=check_images, max_image_pixels=max_image_pixels, progress=progress,
              cache_file=cache_file, num_workers=num_workers)
    train = None
    if paths.get("train_annotations"):
        train = check_coco(paths["train_annotations"], paths.get("train_images"), split="train", **kw)
    val = check_coco(paths["val_annotations"], paths.get("val_images"), split="val", **kw)
    if train is not None:
        check_train_val(train, val, paths.get("train_images"), paths.get("val_images"))
    return (train.dataset if train else None), val.dataset, report



def check_coco_for_training(paths: dict, output_dir: str | None, *, check_images: bool = True,
                            max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS, strict: bool = False,
                            is_main: bool = True) -> tuple[dict | None, dict]:
    """The training script's data check in one call: `check_coco_data` + `publish_report`.

    Every process runs it, so every process holds the same repaired data without sending it around (the json
    part is fast: see benchmarks/datacheck_118k.py). The image headers are read by the main process (the
    script calls this under `main_process_first`) and cached in `output_dir/image_header_cache.json`, where the
    other processes find them: read once per run when `output_dir` is on a disk all machines share (otherwise the
    processes of the other machines read them again).
    Returns:
        (train normalised json or None, val normalised json).
    Raises:
        DataCheckError (a ValueError) on errors, after logging the report; FileNotFoundError for a missing json.
    """
    cache = os.path.join(output_dir, "image_header_cache.json") if output_dir and check_images else None
    train, val, report = check_coco_data(paths, check_images=check_images, max_image_pixels=max_image_pixels,
                                         strict=strict, progress=is_main, cache_file=cache)
    publish_report(report, output_dir, is_main)
    return train, val
