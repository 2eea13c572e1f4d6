"""A COCO results file read against its ground truth, for the commands that evaluate files (evaluate_predictions.py,
compare_predictions.py): which image each result is of, and which images a file covers. The rules (docs/evaluation.md,
"Predictions files"), applied once here, so the stats, best-F1, label errors and the comparison read one file alike:

* Fields. Every result is an object with `image_id`, `category_id`, `bbox` [x, y, w, h] px and `score`. Numbers
  written as strings (`"0.95"`, `"1"`) are read as numbers, as the data check reads the ground truth's, and said in
  one line per file naming the fields and their first such result. A value that is not a number (a word, NaN, a
  bool, a bbox that is not 4 numbers) stops the command with one line naming the field and the first bad result.
* Boxes of no area. A width or height <= 0 (a box written [x2, y, -w, h], or clipped to nothing) is read as 0: a
  detection that covers nothing, a false positive wherever it ranks, for every consumer (COCOeval counts a zero-size
  box so but leaves a negative one out of every area range, i.e. uncounted). Counted and named in one line.
* Categories. Results of a category id the ground truth does not list are left out, as COCOeval leaves them out,
  and counted in one line.
* Image ids. Results name images by the json's ids, read as the data check reads the json's (numeric strings as
  numbers). A file whose every result carries a `file_name` (what `predict_retinanet.py` writes for a folder of
  images, numbered by its place in the sorted list) is matched to the ground truth by file name instead: the path
  as written, else its last part when that names one image only. Any result left unmatched stops the command with
  one line naming the unknown ids and how to get the json's.
* Ties. Results of equal score are ranked by `coco.ranked` (image id, then class and box), not by their place in the
  file (pycocotools' stable sort keeps the file's order, so a file's order could move its AP); when results of one
  class share a score, one line says how many.
* Coverage: the images of the ground truth with at least one result. A model run on every image has results on
  nearly all of them (100 per image at score 0.05); a file that covers fewer was most likely run on part of the set.
"""

from __future__ import annotations

import json
import os
from collections import Counter

from ..datacheck.coco_fields import int_id, number
from ..files import JsonFileError, read_json
from ..logtext import short_middle

RESULT_FIELDS = ("image_id", "category_id", "bbox", "score")
_NUMBER = (int, float)  # the json types of a number (not bool)


class ResultsFileError(ValueError):
    """A results file that cannot be evaluated against the ground truth; the message is one line for the user."""


def read_results(path: str) -> tuple[list[dict], list[str]]:
    """The results of a COCO results json, every field read by the module's rules (`checked_results`).

    Returns:
        (the results and notes of `checked_results`).
    Raises:
        ResultsFileError: unreadable, not a list of results, or a field that is not a number (one line).
    """
    try:
        results = read_json(path)
    except JsonFileError as e:
        raise ResultsFileError(str(e)) from None  # names the file already
    except OSError as e:
        raise ResultsFileError(f"cannot read {path}: {e}") from None
    if not isinstance(results, list):
        raise ResultsFileError(f"{path} is not a COCO results file (a list of {{image_id, category_id, bbox, score}})")
    return checked_results(results, path)


def _result_fields(r, k: int, name: str) -> tuple:
    """(image_id, category_id, [x, y, w, h], score) of result `k`, numbers parsed; raises ResultsFileError."""
    if not isinstance(r, dict) or not set(RESULT_FIELDS) <= r.keys():
        have = sorted(r) if isinstance(r, dict) else type(r).__name__
        raise ResultsFileError(f"{name}: result {k} is not a COCO result ({{image_id, category_id, bbox, score}}; "
                               f"it has {have})")
    iid, cid, bbox, score = (r[f] for f in RESULT_FIELDS)
    parsed_iid = int_id(iid)
    iid = parsed_iid if parsed_iid is not None else iid if isinstance(iid, str) else None
    cid = int_id(cid)
    box = [number(v) for v in bbox] if isinstance(bbox, (list, tuple)) and len(bbox) == 4 else [None]
    score = number(score)
    for field, value in zip(RESULT_FIELDS, (iid, cid, None if None in box else box, score)):
        if value is None:
            what = {"image_id": "an image id of the json", "category_id": "an integer category id",
                    "bbox": "4 finite numbers [x, y, w, h]", "score": "a finite number"}[field]
            raise ResultsFileError(f"{name}: result {k}: {field} {short_middle(repr(r[field]))} is not {what} "
                                   f"(the first bad result: {short_middle(json.dumps(r, default=repr))})")
    return iid, cid, box, score


def checked_results(results: list, name: str) -> tuple[list[dict], list[str]]:
    """Every result read by the module's rules (fields, boxes of no area; see its docstring), once, for every consumer.

    Args:
        results: the json's list, as loaded (not modified); name: the file, for the messages.
    Returns:
        (the results in the file's order, new dicts where a value was read otherwise: `category_id` int, `bbox`
        [x, y, w, h] numbers px with w, h >= 0, `score` a number, `image_id` int or the json's own string id, other
        keys kept; one-line notes: numbers given as strings, boxes of no area).
    Raises:
        ResultsFileError: a result that is not an object with the four fields, or a field that is not a number.
    """
    out, as_strings, no_area = [], {}, []
    for k, r in enumerate(results):
        try:  # fast path, what a file of ours holds: ints, floats, 4 finite numbers of some area (kept as they are)
            iid, cid, bbox, score = r["image_id"], r["category_id"], r["bbox"], r["score"]
            x, y, w, h = bbox
            total = x + y + w + h + score
            if (type(iid) is int and type(cid) is int and type(score) in _NUMBER and type(bbox) is list
                    and type(x) in _NUMBER and type(y) in _NUMBER and type(w) in _NUMBER and type(h) in _NUMBER
                    and total - total == 0 and w > 0 and h > 0):
                out.append(r)
                continue
        except (TypeError, ValueError, KeyError):
            pass
        iid, cid, box, score = _result_fields(r, k, name)
        for field, as_string in (("image_id", isinstance(r["image_id"], str) and iid != r["image_id"]),
                                 ("category_id", isinstance(r["category_id"], str)),
                                 ("bbox", any(isinstance(v, str) for v in r["bbox"])),
                                 ("score", isinstance(r["score"], str))):
            if as_string:
                as_strings.setdefault(field, []).append(k)
        if box[2] <= 0 or box[3] <= 0:
            no_area.append(k)
            box = [box[0], box[1], max(box[2], 0.0), max(box[3], 0.0)]
        out.append({**r, "image_id": iid, "category_id": cid, "bbox": box, "score": score})
    notes = []
    if as_strings:
        notes.append(f"{name}: numbers given as strings, read as numbers: " + "; ".join(
            f"{field} in {len(ks)} results (first: result {ks[0]}, {short_middle(repr(results[ks[0]][field]))})"
            for field, ks in as_strings.items()))
    if no_area:
        k = no_area[0]
        notes.append(f"{name}: {len(no_area)} of {len(results)} results have a box of width or height <= 0 (first: "
                     f"result {k}, bbox {results[k]['bbox']}): read as boxes of no area, false positives wherever they "
                     "rank (COCO boxes are [x, y, w, h], w, h > 0)")
    return out, notes


def match_to_ground_truth(results: list[dict], gt: dict, name: str) -> tuple[list[dict], str | None]:
    """`results` with the image ids of `gt` (the checked json of `checked_ground_truth`: its internal ids).

    Args:
        results: COCO results (json image ids, or any ids with a `file_name` on every result); gt: the checked json;
            name: the file, for the messages.
    Returns:
        (new result dicts with `gt`'s ids, in the file's order; a note when they were matched by file name, else None).
    Raises:
        ResultsFileError: results whose images are not in the ground truth (one line: which ids, how to fix).
    """
    internal = {im.get("original_id", im["id"]): im["id"] for im in gt["images"]}
    if results and all(isinstance(r.get("file_name"), str) for r in results):
        by_path = {os.path.normpath(im["file_name"]): im["id"] for im in gt["images"] if "file_name" in im}
        by_base: dict[str, list[int]] = {}
        for p, i in by_path.items():
            by_base.setdefault(os.path.basename(p), []).append(i)
        ids = {}
        for f in {r["file_name"] for r in results}:
            p = os.path.normpath(f)
            one = by_base.get(os.path.basename(p), [])
            ids[f] = by_path.get(p, one[0] if len(one) == 1 else None)
        if all(i is not None for i in ids.values()):
            moved = sum(internal.get(r["image_id"]) != ids[r["file_name"]] for r in results)
            note = (f"{name}: matched to the ground truth by file_name ({len(ids)} images"
                    + (f"; {moved} results had other image ids)" if moved else ")"))
            return [dict(r, image_id=ids[r["file_name"]]) for r in results], note
    unknown = sorted({r["image_id"] for r in results if r["image_id"] not in internal}, key=str)
    if unknown:
        raise ResultsFileError(
            f"{name}: {len(unknown)} result image ids are not in the ground truth ({unknown[:10]}"
            f"{' ...' if len(unknown) > 10 else ''}): predict on the json (predict_retinanet.py --source GT.json "
            "--images DIR) to get its ids, or keep each result's file_name to be matched by it")
    return [dict(r, image_id=internal[r["image_id"]]) for r in results], None


def covered_images(results: list[dict]) -> set[int]:
    """The image ids with at least one result."""
    return {r["image_id"] for r in results}


def read_files(annotations: str, predictions: list[str]) -> tuple[dict, list[list[dict]], list[str]]:
    """The ground truth (`checked_ground_truth`) and each predictions file read (`read_results`), matched to it
    (`match_to_ground_truth`), its unknown classes left out and its results ranked (`known_classes_ranked`): what
    every command that evaluates predictions files reads first. Returns (gt, results per file, notes).
    Raises ResultsFileError: one line naming the file that cannot be used."""
    from .coco import checked_ground_truth

    try:
        gt = checked_ground_truth(read_json(annotations))
    except JsonFileError as e:
        raise ResultsFileError(str(e)) from None  # names the file already
    except (OSError, ValueError) as e:
        raise ResultsFileError(f"{annotations}: {e}") from None
    runs, notes = [], []
    for path in predictions:
        results, read_notes = read_results(path)
        results, note = match_to_ground_truth(results, gt, path)
        results, known_notes = known_classes_ranked(results, gt, path)
        runs.append(results)
        notes += read_notes + ([note] if note else []) + known_notes
    return gt, runs, notes


def known_classes_ranked(results: list[dict], gt: dict, name: str) -> tuple[list[dict], list[str]]:
    """`results` (with `gt`'s image ids) without those of categories `gt` does not list, by image id and then
    `coco.rank_key`; notes: how many were left out, and how many share their score with another of their class."""
    from .coco import rank_key

    cats = {c["id"] for c in gt["categories"]}
    other = Counter(r["category_id"] for r in results if r["category_id"] not in cats)
    notes = []
    if other:
        listed = f"{sorted(other)[:10]}{' ...' if len(other) > 10 else ''}"
        notes.append(f"{name}: {sum(other.values())} results of category ids the ground truth does not list "
                     f"({listed}): left out, as COCOeval leaves them out")
        results = [r for r in results if r["category_id"] in cats]
    shared = Counter((r["category_id"], r["score"]) for r in results)
    tied = sum(n for n in shared.values() if n > 1)
    if tied:
        (cid, score), most = shared.most_common(1)[0]
        notes.append(f"{name}: ties decide the ranking: {tied} of {len(results)} results share their score with "
                     f"another of their class (most: {most} at {score:g}, category {cid}); tied results are ranked by "
                     "image id, then box (x, y, w, h), not by their order in the file")
    return sorted(results, key=lambda r: (r["image_id"], *rank_key(r))), notes
