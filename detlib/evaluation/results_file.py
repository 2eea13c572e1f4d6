"""A COCO results file read against its ground truth, for the commands that evaluate files (evaluate_predictions.py,
compare_predictions.py): which image each result is of, and which images a file covers. The rules (docs/evaluation.md):

* Image ids. Results name images by the json's ids. A file whose every result carries a `file_name` (what
  `predict_retinanet.py` writes for a folder of images, numbered by its place in the sorted list) is matched to the
  ground truth by file name instead: the path as written, else its last part when that names one image only. Any
  result left unmatched stops the command with one line naming the unknown ids and how to get the json's.
* Coverage: the images of the ground truth with at least one result. A model run on every image has results on
  nearly all of them (100 per image at score 0.05); a file that covers fewer was most likely run on part of the set.
"""

from __future__ import annotations

import os

from ..files import JsonFileError, read_json


class ResultsFileError(ValueError):
    """A results file that cannot be evaluated against the ground truth; the message is one line for the user."""


def read_results(path: str) -> list[dict]:
    """The results list of a COCO results json. Raises ResultsFileError (unreadable, not a list of results)."""
    try:
        results = read_json(path)
    except JsonFileError as e:
        raise ResultsFileError(str(e)) from None  # names the file already
    except OSError as e:
        raise ResultsFileError(f"cannot read {path}: {e}") from None
    if not isinstance(results, list) or not all(isinstance(r, dict) and {"image_id", "category_id", "bbox", "score"}
                                                <= r.keys() for r in results):
        raise ResultsFileError(f"{path} is not a COCO results file (a list of {{image_id, category_id, bbox, score}})")
    return results


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
    """The ground truth (`checked_ground_truth`) and each predictions file matched to it (`match_to_ground_truth`):
    what every command that evaluates predictions files reads first. Returns (gt, results per file, notes).
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
        results, note = match_to_ground_truth(read_results(path), gt, path)
        runs.append(results)
        notes += [note] if note else []
    return gt, runs, notes
