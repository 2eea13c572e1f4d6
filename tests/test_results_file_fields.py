"""Issue 50, G22, G23, G24, G28: a COCO results file from another tool is read once, field by field, by one rule for
every consumer (the 12 stats, best-F1, label errors, the comparison): numbers written as strings, values that are no
numbers, boxes of no area, classes the ground truth lacks, and tied scores whose order in the file must not decide."""

from __future__ import annotations

import json
import sys

import pytest

from detlib.evaluation.coco import CocoEvaluator, checked_ground_truth, evaluate_coco
from detlib.evaluation.metrics import best_f1_thresholds

from conftest import REPO, traceback_through_our_code

sys.path.insert(0, str(REPO / "scripts"))
import compare_predictions  # noqa: E402
import evaluate_predictions  # noqa: E402


def two_image_gt(boxes_per_image: int = 5) -> dict:
    """2 images of 200 x 200 px, `boxes_per_image` boxes each, classes 1 and 2 alternating; ids 7 and 8."""
    anns = [{"id": 10 * i + j + 1, "image_id": i, "category_id": 1 + j % 2, "bbox": [5.0 + 35 * j, 20.0, 25.0, 30.0],
             "area": 750.0, "iscrowd": 0} for i in (7, 8) for j in range(boxes_per_image)]
    return {"images": [{"id": i, "width": 200, "height": 200, "file_name": f"{i}.jpg"} for i in (7, 8)],
            "annotations": anns, "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]}


def perfect(gt: dict) -> list[dict]:
    """The ground truth as detections, scores 0.9 down to 0.5 (no two alike)."""
    n = len(gt["annotations"])
    return [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": list(a["bbox"]),
             "score": 0.9 - 0.4 * k / n} for k, a in enumerate(gt["annotations"])]


def write(tmp_path, name, obj) -> str:
    (tmp_path / name).write_text(json.dumps(obj))
    return str(tmp_path / name)


def evaluate(tmp_path, gt, results, name="r.json") -> dict:
    return evaluate_predictions.main(["--annotations", write(tmp_path, "gt.json", gt), "--predictions",
                                      write(tmp_path, name, results), "--n_bootstrap", "5"])


AS_STRINGS = {  # G22, G23 and the other fields of the kind
    "score": lambda r: dict(r, score=str(r["score"])),
    "category_id": lambda r: dict(r, category_id=str(r["category_id"])),
    "bbox": lambda r: dict(r, bbox=[str(v) for v in r["bbox"]]),
    "image_id": lambda r: dict(r, image_id=str(r["image_id"])),
    "all four": lambda r: {k: (str(v) if k != "bbox" else [str(x) for x in v]) for k, v in r.items()},
}


@pytest.mark.parametrize("field", AS_STRINGS)
def test_numbers_written_as_strings_are_read_as_numbers_by_every_consumer(field, tmp_path, capsys):
    """G22 (`"score": "0.95"`: a traceback in best-F1 after the stats) and G23 (`"category_id": "1"`: AP 1.0 but F1 0
    and 10 "wrong class" label errors): perfect detections are perfect for the stats, best-F1 and label errors alike,
    and one line names the field and its first result; the comparison with the plain file finds no difference."""
    gt = two_image_gt()
    plain = perfect(gt)
    stringly = [AS_STRINGS[field](r) for r in plain]
    got = evaluate(tmp_path, gt, stringly)
    out = capsys.readouterr().out
    assert got["AP"] == 1.0 and got["best_f1"]["all"]["F1"] == 1.0
    assert all(c["F1"] == 1.0 for c in got["best_f1"]["per_class"].values())
    assert got["label_errors"] == {"wrong_class": 0, "badly_placed": 0, "missing_box": 0}
    line = [x for x in out.splitlines() if "given as strings" in x]
    named = ["image_id", "category_id", "bbox", "score"] if field == "all four" else [field]
    assert len(line) == 1 and all(f"{f} in 10 results (first: result 0, " in line[0] for f in named), line
    c = compare_predictions.main(["--annotations", str(tmp_path / "gt.json"), "--a", write(tmp_path, "a.json", plain),
                                  "--b", str(tmp_path / "r.json"), "--n_bootstrap", "5"])
    assert c["AP"]["A"] == c["AP"]["B"] == 1.0 and c["AP"]["delta"] == 0


NOT_NUMBERS = {  # field, what the result holds
    "score": "high", "category_id": "cat", "bbox": [1, 2, 3], "image_id": None,
}


@pytest.mark.parametrize("script", [evaluate_predictions, compare_predictions])
@pytest.mark.parametrize("field", list(NOT_NUMBERS) + ["score NaN", "score bool", "bbox word", "no score"])
def test_a_field_that_is_no_number_stops_the_command_in_one_line_naming_it(field, script, tmp_path, capsys):
    """The same kind, refused: a value no reader can take as a number is one line naming the field and the first bad
    result (its index and the result), exit 1, no traceback through scripts/ or detlib/."""
    gt = two_image_gt()
    results = perfect(gt)
    bad = dict(results[3])
    name = field.split()[0]
    if field == "score NaN":
        bad["score"] = float("nan")
    elif field == "score bool":
        bad["score"] = True
    elif field == "bbox word":
        bad["bbox"] = ["1", "two", 3, 4]
    elif field == "no score":
        del bad["score"]
    else:
        bad[field] = NOT_NUMBERS[field]
    results[3] = bad
    gt_path, path = write(tmp_path, "gt.json", gt), write(tmp_path, "bad.json", results)
    argv = (["--predictions", path] if script is evaluate_predictions
            else ["--a", write(tmp_path, "a.json", perfect(gt)), "--b", path])
    with pytest.raises(SystemExit) as e:
        script.main(["--annotations", gt_path, *argv, "--n_bootstrap", "5"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1 and not traceback_through_our_code(err), err
    if field == "no score":
        assert "result 3 is not a COCO result" in err and "'bbox', 'category_id', 'image_id'" in err
    else:
        assert f"bad.json: result 3: {name} " in err and "the first bad result" in err


def test_boxes_of_no_area_are_named_and_count_as_false_positives_for_every_consumer(tmp_path, capsys):
    """G24: 6 of 11 perfect boxes written [x + w, y, -w, h] gave AP 0.52 with nothing said (pycocotools leaves a box
    of negative area out of every area range: neither matched nor counted). Now one line counts and names them, and
    every consumer counts each as a false positive, as COCOeval counts a box of width 0: the stats equal those of the
    same file with the widths written 0, best-F1 finds 5 of the 11 boxes, and no label error is made of them."""
    gt = two_image_gt()
    gt["annotations"] = gt["annotations"][:9] + [dict(gt["annotations"][9], id=99, bbox=[150.0, 100.0, 20.0, 20.0])]
    gt["annotations"].append(dict(gt["annotations"][0], id=100, bbox=[100.0, 150.0, 30.0, 30.0]))
    plain = perfect(gt)
    assert len(plain) == 11
    flipped = [dict(r, bbox=[r["bbox"][0] + r["bbox"][2], r["bbox"][1], -r["bbox"][2], r["bbox"][3]]) if k % 2 == 0
               else r for k, r in enumerate(plain)]
    zero_width = [dict(r, bbox=[r["bbox"][0] + r["bbox"][2], r["bbox"][1], 0.0, r["bbox"][3]]) if k % 2 == 0
                  else r for k, r in enumerate(plain)]
    got = evaluate(tmp_path, gt, flipped)
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if "width or height <= 0" in x]
    assert len(line) == 1 and "6 of 11 results" in line[0]
    assert "first: result 0, bbox [30.0, 20.0, -25.0, 30.0]" in line[0]
    reference = evaluate_coco(gt, zero_width, backend="pycocotools")[0]
    assert {k: got[k] for k in reference} == pytest.approx(reference, abs=1e-12)
    assert got["AP"] < 0.5
    f1 = best_f1_thresholds(checked_ground_truth(gt), zero_width)["all"]
    assert got["best_f1"]["all"] == f1 and f1["recall"] == pytest.approx(5 / 11)  # read before: F1 1.0, all matched
    assert got["label_errors"]["missing_box"] == 0
    # the other inputs of the kind: zero width, negative height, both negative: named alike, the same stats
    for name, bbox in (("zero", lambda b: [b[0], b[1], 0.0, b[3]]),
                       ("neg_h", lambda b: [b[0], b[1] + b[3], b[2], -b[3]]),
                       ("both", lambda b: [b[0] + b[2], b[1] + b[3], -b[2], -b[3]])):
        other = [dict(r, bbox=bbox(r["bbox"])) if k % 2 == 0 else r for k, r in enumerate(plain)]
        again = evaluate(tmp_path, gt, other, f"{name}.json")
        assert "6 of 11 results have a box of width or height <= 0" in capsys.readouterr().out, name
        assert again["AP50"] == pytest.approx(reference["AP50"], abs=1e-12), name


def test_results_of_classes_the_ground_truth_lacks_are_left_out_alike(tmp_path, capsys):
    """Every field, the category id too: a result of a class the ground truth does not list is left out by every
    consumer, as COCOeval ignores it, and said in one line."""
    gt = two_image_gt()
    results = perfect(gt) + [dict(r, category_id=5, score=0.99) for r in perfect(gt)[:4]]
    got = evaluate(tmp_path, gt, results)
    out = capsys.readouterr().out
    assert "4 results of category ids the ground truth does not list ([5]): left out" in out
    assert got["AP"] == 1.0 and got["best_f1"]["all"]["precision"] == 1.0 and sum(got["label_errors"].values()) == 0


def tied_case() -> tuple[dict, list[dict], list[dict]]:
    """G28: 10 boxes on one image, 15 results all of score 1.0 (a detector without scores): the 10 boxes and 5 false
    positives. Returns (gt, false positives first, false positives last)."""
    gt = two_image_gt(10)
    gt["images"], gt["annotations"] = gt["images"][:1], [a for a in gt["annotations"] if a["image_id"] == 7]
    hits = [dict(r, score=1.0) for r in perfect(gt)]
    misses = [{"image_id": 7, "category_id": 1 + k % 2, "bbox": [10.0 + 30 * k, 120.0, 20.0, 20.0], "score": 1.0}
              for k in range(5)]
    return gt, misses + hits, hits + misses


def test_tied_scores_rank_the_same_whatever_the_files_order(tmp_path, capsys):
    """G28: AP 0.855 with the false positives first in the file, 0.930 with them last, nothing said. Now one line says
    that ties decide the ranking (how many results share a score), and the ranking is the results' own (image id,
    then box), so both orders give one AP, best-F1 and label-error list; a run's evaluator ranks its ties alike."""
    gt, first, last = tied_case()
    as_written = [evaluate_coco(gt, r, backend="pycocotools")[0]["AP"] for r in (first, last)]
    assert as_written == [pytest.approx(0.5098, abs=1e-4), pytest.approx(0.9495, abs=1e-4)]  # pycocotools: file order
    a = evaluate(tmp_path, gt, first, "first.json")
    out = capsys.readouterr().out
    assert "first.json: ties decide the ranking: 15 of 15 results share their score with another of their class" in out
    b = evaluate(tmp_path, gt, last, "last.json")
    assert {k: v for k, v in a.items() if k != "predictions"} == {k: v for k, v in b.items() if k != "predictions"}
    c = compare_predictions.main(["--annotations", str(tmp_path / "gt.json"), "--a", str(tmp_path / "first.json"),
                                  "--b", str(tmp_path / "last.json"), "--n_bootstrap", "5"])
    assert c["AP"]["A"] == c["AP"]["B"] == a["AP"]
    for backend in ("pycocotools", "hotcoco"):
        aps = []
        for results in (first, last):
            ev = CocoEvaluator(gt, backend)
            ev.add(7, results)
            aps.append(ev.evaluate()[0]["AP"])
        assert aps[0] == aps[1] == a["AP"], backend
