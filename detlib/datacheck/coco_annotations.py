"""The labels of a COCO json, checked for `detlib.datacheck.coco`: the `categories` list and the `annotations`
(image and category ids, ids pycocotools mishandles, bbox, area, iscrowd).
"""

from __future__ import annotations

from collections import Counter

from .coco_fields import coco_area, fallback_box, ids_after, int_id, number
from .report import DataReport, Findings

CATEGORY_FINDINGS = {
    "bad": ("error", "categories", "categories without an integer id"),
    "conflict": ("error", "categories", "category id listed twice with different names"),
    "twice": ("repair", "categories", "category listed twice with the same name: kept once"),
    "parsed": ("repair", "categories", "category ids given as strings or floats: parsed"),
    "unnamed": ("repair", "categories", "categories without a name: named by their id"),
}

ANNOTATION_FINDINGS = {
    "bad_entry": ("error", "structure", "annotations that are not objects"),
    "no_image": ("repair", "ids", "annotations whose image_id is not in images: dropped"),
    "no_cat": ("repair", "ids", "annotations whose category_id is not in categories: dropped"),
    "parsed": ("repair", "ids", "annotation image_id / category_id given as strings or floats: parsed"),
    "renumbered": ("repair", "ids", "annotation ids pycocotools mishandles ({why}; it takes id 0 for 'no match'): "
                   "renumbered after the largest id"),
    "strings": ("repair", "boxes", "bbox / area / iscrowd given as numeric strings: parsed"),
    "box_from_seg": ("repair", "boxes", "bbox missing or not 4 finite numbers: derived from the segmentation"),
    "no_box": ("repair", "boxes", "annotations without a usable bbox or segmentation: dropped"),
    "degenerate": ("repair", "boxes", "degenerate boxes (width or height <= 0 after clipping to the image, or "
                   "entirely outside it): dropped"),
    "clipped": ("repair", "boxes", "boxes crossing the image border: clipped to the image"),
    "area_set": ("repair", "boxes", "area missing or not a positive number: computed from the segmentation (or "
                 "the box)"),
    "crowd_set": ("repair", "boxes", "iscrowd not 0 / 1: taken as 0 unless it is a true value"),
    "mask_crowd": ("repair", "boxes", "iscrowd 1 on most annotations, each an RLE mask with its box: a tool's export "
                   "of masks (CVAT's COCO export, through datumaro, writes every mask as RLE with iscrowd 1), not crowd "
                   "regions: read as objects, iscrowd 0"),
    "ignore": ("repair", "boxes", "annotations with a true `ignore` field (CityPersons / CrowdHuman style): read as "
               "ignore regions, iscrowd 1 (never trained on as objects nor counted as misses in evaluation)"),
}
# The findings whose annotations are not in the normalised json.
DROPPING_FINDINGS = ("bad_entry", "no_image", "no_cat", "no_box", "degenerate")


def check_categories(cats: list, report: DataReport, split: str) -> list[dict]:
    """The json's `categories` normalised (int `id`, unique; a `name`), its findings added to `report`."""
    found = Findings(CATEGORY_FINDINGS)
    out: list[dict] = []
    by_id: dict[int, dict] = {}
    for cat in cats:
        cid = int_id(cat.get("id")) if isinstance(cat, dict) else None
        if cid is None:
            found["bad"].append(cat.get("id") if isinstance(cat, dict) else repr(cat)[:40])
            continue
        if type(cat["id"]) is not int:
            found["parsed"].append(cat["id"])
        name = cat.get("name")
        if not isinstance(name, str) or not name.strip():
            found["unnamed"].append(cid)
            name = str(cid)
        if cid in by_id:
            same = by_id[cid]["name"] == name
            found["twice" if same else "conflict"].append(f"{cid} {by_id[cid]['name']!r} / {name!r}")
            continue
        by_id[cid] = {**cat, "id": cid, "name": name}
        out.append(by_id[cid])
    found.add_to(report, split)
    if not out:
        report.add("error", "categories", split, "no category is listed", count=1)
    names = Counter(cat["name"] for cat in out)
    report.add("warning", "categories", split, "category ids that share a name", [n for n, k in names.items() if k > 1])
    alike: dict[str, list[dict]] = {}
    for cat in out:
        alike.setdefault(folded_name(cat["name"]), []).append(cat)
    report.add("warning", "categories", split, "category names equal but for case or spaces: separate classes, "
               "probably one (merge them in the json if so)",
               [", ".join(f"{c['id']} {c['name']!r}" for c in cs) for cs in alike.values()
                if len({c["name"] for c in cs}) > 1])
    return out


def folded_name(name: str) -> str:
    """A class name compared without case and surrounding or repeated spaces ("Cat ", "cat" -> "cat")."""
    return " ".join(name.split()).casefold()


def _true(value) -> bool:
    """A json flag's truth: a true bool, a non-zero number or numeric string, a word such as "true" / "yes"."""
    if isinstance(value, str):
        n = number(value)
        return n != 0 if n is not None else value.strip().lower() in ("true", "yes", "y")
    return bool(value)


def check_annotations(raw: list, images: dict[int, dict], by_int: dict[int, int], by_str: dict[str, int],
                      left_out: set[int], category_ids: set[int], report: DataReport, split: str
                      ) -> tuple[list[dict], int]:
    """The json's `annotations` normalised, its findings added to `report`.

    Args:
        raw: the json's `annotations` list, as loaded (not modified).
        images: normalised id -> normalised image, for the images with a size.
        by_int, by_str: the json's int / string image ids -> normalised id (see `check_image_list`).
        left_out: ids of images left out for their file: their annotations go without a finding.
        category_ids: the normalised category ids.
    Returns:
        (annotations, dropped): the normalised annotations (the entries of `raw` where nothing changed, new
        dicts otherwise; ids renumbered after the largest where pycocotools would mishandle them), and how
        many annotations were left out.
    """
    check = _AnnotationCheck(images, by_int, by_str, left_out, category_ids)
    out: list[dict] = []
    seen_ids: set[int] = set()
    renumber: list[int] = []  # positions in `out` whose id pycocotools would mishandle
    id_faults: Counter = Counter()
    for a in raw:
        if type(a) is not dict:
            check.found["bad_entry"].append(repr(a)[:40])
            continue
        a = check.normalised(a)
        if a is None:
            continue
        aid = a.get("id")
        if type(aid) is int and aid > 0 and aid not in seen_ids:
            seen_ids.add(aid)
        else:
            id_faults["missing" if aid is None else "not a positive integer" if type(aid) is not int or aid <= 0
                      else "duplicate"] += 1
            renumber.append(len(out))
        out.append(a)
    new_ids = ids_after(seen_ids)
    for pos in renumber:
        check.found["renumbered"].append(out[pos].get("id"))
        out[pos] = {**out[pos], "id": next(new_ids)}
    masks = [k for k, a in enumerate(out) if a["iscrowd"] == 1 and isinstance(a.get("segmentation"), dict)
             and not _true(a.get("ignore") or 0)]
    if len(masks) * 2 > len(out):  # crowd regions are a few (COCO: 1 %); a mask tool's export marks every mask so
        for k in masks:
            check.found["mask_crowd"].append(out[k]["id"])
            out[k] = {**out[k], "iscrowd": 0}
    dropped = sum(len(check.found[key]) for key in DROPPING_FINDINGS) + check.with_image_left_out
    check.found.add_to(report, split, why=", ".join(f"{n} {k}" for k, n in id_faults.items()))
    return out, dropped


class _AnnotationCheck:
    """One annotation at a time against the normalised images and categories (see `check_annotations`)."""

    def __init__(self, images: dict, by_int: dict, by_str: dict, left_out: set[int], category_ids: set[int]):
        self.images, self.by_int, self.by_str = images, by_int, by_str
        self.left_out, self.category_ids = left_out, category_ids
        self.found = Findings(ANNOTATION_FINDINGS)
        self.strings = self.found["strings"]  # read for every annotation: bound once
        self.with_image_left_out = 0

    def normalised(self, a: dict) -> dict | None:
        """`a` with its image / category id, bbox, area and iscrowd repaired (a new dict when anything
        changed, else `a` itself); None when it is dropped."""
        n_strings = len(self.strings)
        # the examples name an annotation by its id, or by where a converted one came from (a VOC xml and object, a
        # YOLO label file and line: `detlib.data.formats`), which its given id means nothing to
        aid = a.get("_source", a.get("id"))
        iid = a.get("image_id")
        nid = self.by_int.get(iid) if type(iid) is int else self._image_of(iid)
        im = self.images.get(nid)
        if im is None:
            if nid in self.left_out:
                self.with_image_left_out += 1
            else:
                self.found["no_image"].append(aid if aid is not None else f"image_id {iid!r}")
            return None
        cid = cid0 = a.get("category_id")
        if type(cid) is not int:
            cid = int_id(cid)
        if cid not in self.category_ids:
            self.found["no_cat"].append(aid if aid is not None else f"category_id {cid0!r}")
            return None
        changed = nid != iid or cid is not cid0
        if changed and ((type(iid) is not int and not (isinstance(iid, str) and iid in self.by_str))
                        or type(cid0) is not int):
            self.found["parsed"].append(aid)
        W, H = im["width"], im["height"]
        box = self._box(a, aid, W, H)
        if box is None:
            return None
        x, y, w, h, box_changed = box
        area = a.get("area")
        if type(area) is not float and type(area) is not int or not area > 0 or area - area != 0:
            area = self._area(a, area, aid, w, h, H, W)
            changed = True
        crowd = a.get("iscrowd", 0)
        if type(crowd) is not int or (crowd != 0 and crowd != 1):
            crowd = self._crowd(crowd, aid)
            changed = True
        ignore = a.get("ignore")
        if ignore is not None and ignore != 0 and crowd != 1 and _true(ignore):
            # pycocotools' evaluate overwrites `ignore` with iscrowd and the loader reads iscrowd only: as written
            # the box would be an ordinary one; an ignore region is what the exporter meant
            self.found["ignore"].append(aid)
            crowd, changed = 1, True
        if changed or box_changed:
            del self.strings[n_strings + 1:]  # an annotation counts once, however many of its fields were strings
            a = {**a, "image_id": nid, "category_id": cid, "bbox": [float(x), float(y), float(w), float(h)],
                 "area": float(area), "iscrowd": crowd}
        return a

    def _image_of(self, iid) -> int | None:
        """The normalised image id of an `image_id` that is not an int (a string id or a parsed number)."""
        if isinstance(iid, str) and iid in self.by_str:
            return self.by_str[iid]
        n = int_id(iid)
        return self.by_int.get(n) if n is not None else None

    def _box(self, a: dict, aid, W: int, H: int) -> tuple[float, float, float, float, bool] | None:
        """(x, y, w, h in pixels clipped to the W x H image, whether it was repaired); None when dropped."""
        # Fast path: a list of 4 numbers. Anything else (strings, None, a polygon only) takes fallback_box.
        bbox = a.get("bbox")
        try:
            x, y, w, h = bbox
            x2, y2 = x + w, y + h
            s = x2 + y2
            ok = s - s == 0.0  # false for inf / nan
        except (TypeError, ValueError):
            ok = False
        repaired = not ok
        if not ok:
            box, how = fallback_box(a)
            if box is None:
                self.found["no_box"].append(aid)
                return None
            self.found["strings" if how == "strings" else "box_from_seg"].append(aid)
            x, y, w, h = box
            x2, y2 = x + w, y + h
        if not (0 <= x < x2 <= W and 0 <= y < y2 <= H):  # the common case needs no clipping
            x1c, y1c = min(max(x, 0.0), W), min(max(y, 0.0), H)
            x2c, y2c = min(max(x2, 0.0), W), min(max(y2, 0.0), H)
            if x2c - x1c <= 0 or y2c - y1c <= 0:
                self.found["degenerate"].append(aid)
                return None
            self.found["clipped"].append(aid)
            x, y, w, h = x1c, y1c, x2c - x1c, y2c - y1c
            repaired = True
        return x, y, w, h, repaired

    def _area(self, a: dict, area, aid, w: float, h: float, H: int, W: int) -> float:
        """A usable area for an `area` that is not a positive number: parsed from a string, else COCO's."""
        value = number(area)
        if value is not None and value > 0:
            self.strings.append(aid)
            return value
        self.found["area_set"].append(aid)
        return coco_area(a, w, h, H, W)

    def _crowd(self, crowd, aid) -> int:
        """0 or 1 for an `iscrowd` that is neither: parsed from a string, else 1 for any true value."""
        value = int_id(crowd) if not isinstance(crowd, bool) else int(crowd)
        self.found["strings" if isinstance(crowd, str) and value in (0, 1) else "crowd_set"].append(aid)
        return 1 if value else 0
