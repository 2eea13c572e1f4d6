"""The images of a COCO json, checked for `detlib.datacheck.coco`: the `images` list (ids, file names, sizes, one
file under two ids) and, with the image folder, the files themselves (present, readable, within the pixel
limit, of the json's size up to a resize once turned by the EXIF rule of `detlib.datacheck.orientation`).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections import defaultdict

from .coco_fields import ids_after, int_id, positive_size
from .orientation import labels_on_shown_image, same_aspect, shown_size
from .report import DataReport, Findings, read_image_headers

# Image ids travel through a batch as torch.int64; an id outside its range is renumbered like a string id.
INT64_RANGE = range(-2**63, 2**63)

IMAGE_LIST_FINDINGS = {
    "bad": ("error", "structure", "images that are not objects"),
    "no_file": ("error", "structure", "images without a file_name (ids shown)"),
    "conflict": ("error", "ids", "image id used by two different files (whose boxes are whose cannot be known)"),
    "same_file_twice": ("repair", "ids", "image listed twice with the same id and file: kept once"),
    "parsed": ("repair", "ids", "image ids given as strings or floats: parsed"),
    "renumbered": ("repair", "ids", "image ids that are not integers (or missing): numbered after the largest id, "
                   "the json's id kept as original_id and used in predictions"),
    "sizes": ("repair", "structure", "image width / height given as strings or floats: parsed"),
    "size_conflict": ("error", "ids", "file listed under two image ids with different sizes"),
    "merged": ("repair", "ids", "file listed under two image ids: merged into the first id (the annotations of "
               "both kept)"),
}

IMAGE_FILE_FINDINGS = {
    "tool_name": ("repair", "images", "file names as a labelling tool writes them (Label Studio's "
                  "/data/upload/<project>/<hash>-<name>, /data/local-files/?d=<path>, a URL): matched to the file of "
                  "that name in the image folder"),
    "missing": ("repair", "images", "image files missing or empty: left out with their annotations"),
    "unreadable": ("repair", "images", "image files that cannot be read as images: left out with their annotations"),
    "too_big": ("error", "images", "images larger than the pixel limit {limit} (PIL's decompression-bomb guard); "
                "if they are genuine, pass --max_image_pixels {needed} or more"),
    "filled": ("repair", "images", "width / height missing in the json: taken from the file (as shown, by its EXIF "
               "orientation)"),
    "stored": ("warning", "images", "images whose EXIF orientation turns them by 90 degrees but whose json width / "
               "height is their stored size, not their shown one: read as stored, unturned (their boxes taken to "
               "refer to the stored pixels)"),
    "resized": ("repair", "images", "json size differs from the file's by a resize (same aspect ratio): the image is "
                "resized to the json's size when loaded, so the boxes stay in place"),
    "mismatch": ("error", "images", "json size differs from the file's with another aspect ratio: the boxes cannot "
                 "be placed on the file"),
}
# The summary that names every image the loader turns by its EXIF orientation (console and data_report.json).
TURNED_SUMMARY = "{split} (turned upright by their EXIF orientation)"


def check_image_list(raw: list, need_files: bool, report: DataReport, split: str
                     ) -> tuple[list[dict], dict[int, int], dict[str, int]]:
    """The json's `images` normalised, its findings added to `report`.

    Args:
        raw: the json's `images` list, as loaded (not modified).
        need_files: an image without a `file_name` is an error.
    Returns:
        (images, by_int, by_str): the normalised images (copies; int `id`, `width` / `height` int or None
        when not readable); the json's int ids and its non-numeric string ids -> the normalised id.
    """
    found = Findings(IMAGE_LIST_FINDINGS)
    first: dict = {}  # the json's id (int, or non-numeric str) -> its first record
    out, pending = _read_image_records(raw, need_files, first, found)
    by_int = {k: k for k in first}
    by_str = _number_non_integer_ids(pending, first, out, found)
    out = _merge_files_under_two_ids(out, by_int, by_str, found)
    found.add_to(report, split)
    return out, by_int, by_str


def _keep_first(first: dict, key, rec: dict, found: Findings) -> bool:
    """True for the first record of an id; a later one is dropped, a repair when it names the same file."""
    if key in first:
        prev = first[key]
        if prev.get("file_name") == rec.get("file_name"):
            found["same_file_twice"].append(key)
        else:
            found["conflict"].append(f"{key}: {prev.get('file_name')}, {rec.get('file_name')}")
        return False
    first[key] = rec
    return True


def _read_image_records(raw: list, need_files: bool, first: dict, found: Findings) -> tuple[list[dict], list[dict]]:
    """(records with an int id, first of each id; records whose id is not an integer, numbered later)."""
    out: list[dict] = []
    pending: list[dict] = []
    for im in raw:
        if not isinstance(im, dict):
            found["bad"].append(repr(im)[:40])
            continue
        fn = im.get("file_name")
        if need_files and (not isinstance(fn, str) or not fn.strip()):
            found["no_file"].append(im.get("id"))
            continue
        rec = dict(im)
        w, h = im.get("width"), im.get("height")
        if type(w) is not int or type(h) is not int or w <= 0 or h <= 0:
            rec["width"], rec["height"] = positive_size(w), positive_size(h)
            if rec["width"] is not None and rec["height"] is not None:
                found["sizes"].append(im.get("id"))
        raw_id = im.get("id")
        iid = int_id(raw_id)
        if iid is None or iid not in INT64_RANGE:
            pending.append(rec)
            continue
        if type(raw_id) is not int:
            found["parsed"].append(raw_id)
        rec["id"] = iid
        if _keep_first(first, iid, rec, found):
            out.append(rec)
    return out, pending


def _number_non_integer_ids(pending: list[dict], first: dict, out: list[dict], found: Findings) -> dict[str, int]:
    """Give the pending records ids after the largest int id (appended to `out`); returns string id -> new id."""
    by_str: dict[str, int] = {}
    new_ids = ids_after(first)
    for rec in pending:
        raw_id = rec.get("id")
        key = raw_id if isinstance(raw_id, str) else None
        if key is not None and not _keep_first(first, key, rec, found):
            continue
        rec["original_id"], rec["id"] = raw_id, next(new_ids)
        if key is not None:
            by_str[key] = rec["id"]
        found["renumbered"].append(raw_id)
        out.append(rec)
    return by_str


def _merge_files_under_two_ids(out: list[dict], by_int: dict, by_str: dict, found: Findings) -> list[dict]:
    """One file under two ids: its boxes would be split between two samples of the same pixels, so the later
    ids point at the first (in `by_int` / `by_str`, updated in place) and their records go."""
    by_file: dict[str, list[dict]] = defaultdict(list)
    for rec in out:
        if isinstance(rec.get("file_name"), str):
            by_file[rec["file_name"]].append(rec)
    into = {}
    for fn, recs in by_file.items():
        if len(recs) < 2:
            continue
        head = recs[0]
        if any((r["width"], r["height"]) != (head["width"], head["height"]) for r in recs[1:]):
            found["size_conflict"].append(f"{fn} (ids {[r['id'] for r in recs]})")
            continue
        for r in recs[1:]:
            found["merged"].append(f"{fn}: {r.get('original_id', r['id'])} -> {head['id']}")
            into[r["id"]] = head["id"]
    if into:
        out = [r for r in out if r["id"] not in into]
        for table in (by_int, by_str):
            for k, v in table.items():
                table[k] = into.get(v, v)
    return out


# Label Studio stores an uploaded file as /data/upload/<project>/<8 hex digits>-<its name> (and its COCO export as
# images/<8 hex digits>-<its name>).
LABELSTUDIO_UPLOAD = re.compile(r"^[0-9a-f]{8}-(.+)$")


def tool_file_name(image_dir: str, file_name: str) -> str | None:
    """The file in `image_dir` that a labelling tool's image reference names, when `file_name` itself is not there:
    the path of Label Studio's `/data/local-files/?d=<path>` or of a URL, relative to `image_dir`; else its last
    part; else that part without Label Studio's upload prefix (`5d8e1c2a-photo.jpg` -> `photo.jpg`). Returns the
    first of these that is a file (relative to `image_dir`), None when none is."""
    ref = file_name.replace("\\", "/")
    if "?d=" in ref:
        ref = urllib.parse.unquote(ref.split("?d=", 1)[1])
    elif "://" in ref:
        ref = urllib.parse.unquote(urllib.parse.urlparse(ref).path)
    base = ref.rsplit("/", 1)[-1]
    upload = LABELSTUDIO_UPLOAD.match(base)
    for name in [ref.lstrip("/"), base] + ([upload.group(1)] if upload else []):
        if name and os.path.isfile(os.path.join(image_dir, name)):
            return name
    return None


def check_image_files(images: list[dict], image_dir: str, max_image_pixels: int | None, num_workers: int | None,
                      progress: bool, cache_file: str | None, report: DataReport, split: str
                      ) -> tuple[list[dict], set[int]]:
    """The image files of normalised images, by their headers; findings added to `report`.

    A missing width / height is taken from the file as shown. Every image the loader turns by its EXIF orientation
    (`labels_on_shown_image`) is named in `report.summaries[TURNED_SUMMARY]` (file name: orientation). Other
    arguments: see `check_coco`.
    Returns:
        (the images whose file can be read, modified in place; the ids of those left out).
    """
    heads = read_image_headers([os.path.join(image_dir, im["file_name"]) for im in images], num_workers,
                               progress, cache_file)
    found = Findings(IMAGE_FILE_FINDINGS)
    for k, im in enumerate(images):  # a labelling tool's reference to a file that is here under its own name
        if heads[k][0] == "missing" and (name := tool_file_name(image_dir, im["file_name"])) is not None:
            found["tool_name"].append(f"{im['file_name']} -> {name}")
            im["file_name"] = name
            heads[k] = read_image_headers([os.path.join(image_dir, name)], 0, False, cache_file)[0]
    out, left_out, turned = [], set(), {}
    for im, (status, fw, fh, orientation) in zip(images, heads):
        fn = im["file_name"]
        if status != "ok":
            found["missing" if status in ("missing", "empty file") else "unreadable"].append(f"{fn} ({status})")
            left_out.add(im["id"])
            continue
        out.append(im)
        if max_image_pixels and fw * fh > max_image_pixels:
            found["too_big"].append((fw * fh, f"{fn} ({fw}x{fh})"))
        if _match_json_size(im, fw, fh, orientation, found):
            turned[fn] = f"orientation {orientation}"
    too_big = found["too_big"]
    too_big.sort(reverse=True)  # the largest first: the message names the limit that lets all of them in
    needed = too_big[0][0] if too_big else None
    too_big[:] = [text for _, text in too_big]
    found.add_to(report, split, limit=max_image_pixels, needed=needed)
    if turned:
        report.summaries[TURNED_SUMMARY.format(split=split)] = turned
    return out, left_out


def _match_json_size(im: dict, fw: int, fh: int, orientation: int, found: Findings) -> bool:
    """Compare the json's size of an image with its file's stored size (fw, fh) and EXIF orientation; True when the
    loader turns the image (`labels_on_shown_image`: the json's size, not its pixels, decides the exception)."""
    fn = im["file_name"]
    stated = None if im["width"] is None or im["height"] is None else (im["width"], im["height"])
    turn = labels_on_shown_image(orientation, (fw, fh), stated)
    w, h = shown_size((fw, fh), orientation) if turn else (fw, fh)
    if stated is None:
        im["width"], im["height"] = w, h
        found["filled"].append(fn)
        return turn
    if not turn and shown_size((fw, fh), orientation) != (fw, fh):
        found["stored"].append(f"{fn} (orientation {orientation}, json {stated[0]}x{stated[1]})")
    if stated == (w, h):
        return turn
    if same_aspect(stated, (w, h)):
        how = f" turned by EXIF orientation {orientation}" if turn and (w, h) != (fw, fh) else ""
        found["resized"].append(f"{fn} (json {stated[0]}x{stated[1]}, file {w}x{h}{how})")
    else:
        found["mismatch"].append(f"{fn} (json {stated[0]}x{stated[1]}, file {w}x{h})")
    return turn
