"""Issue 50, F03, F07, F17: what in a data set would silently change training or evaluation, said by the data check:
images with more boxes than the detection cap, `ignore` flags, and class names that differ only in case or spaces."""

from __future__ import annotations

import sys

import pytest

from detlib.datacheck.coco import check_coco, check_coco_data
from detlib.evaluation.coco import CocoEvaluator

from conftest import REPO, write_coco

sys.path.insert(0, str(REPO / "scripts"))
import check_dataset  # noqa: E402


def crowded_json(path, counts: dict[int, tuple[int, ...]]):
    """{image id: boxes per class} on 400 x 400 images of 10 x 10 px boxes in rows (classes 1, 2)."""
    anns = []
    for iid, per_class in counts.items():
        k = 0
        for cls, n in enumerate(per_class, 1):
            for _ in range(n):
                box = [(k % 30) * 13.0, (k // 30) * 13.0, 10.0, 10.0]
                anns.append({"image_id": iid, "category_id": cls, "bbox": box})
                k += 1
    images = [{"id": i, "width": 400, "height": 400, "file_name": f"{i}.jpg"} for i in counts]
    return write_coco(path, images, anns, [{"id": 1, "name": "person"}, {"id": 2, "name": "bag"}])


def cap_findings(report) -> dict[str, list]:
    return {("model" if "--detections_per_image " in f.message and "raise" in f.message else "coco"): f.examples
            for f in report.findings if "cannot reach 1" in f.message}


def test_images_with_more_boxes_than_the_detection_cap_are_counted_with_the_cap_and_its_flag(tmp_path, capsys):
    """F03: a crowd of 120 boxes (60 + 60), one of 150 of one class and one of 30; the best model cannot recall them
    all when the cap (--detections_per_image, and COCO's maxDets 100 per image and class) is below their count."""
    val = crowded_json(tmp_path / "val.json", {1: (60, 60), 2: (150, 0), 3: (20, 10)})
    paths = {"train_annotations": str(val), "val_annotations": str(val), "train_images": None, "val_images": None}
    report = check_coco_data(paths, check_images=False)[2]
    found = [f for f in report.findings if "cannot reach 1" in f.message]
    assert len(found) == 1 and found[0].level == "warning" and found[0].split == "val" and found[0].count == 2
    assert found[0].examples == ["1.jpg (120 boxes)", "2.jpg (150 boxes)"]
    assert "than the 100 detections per image" in found[0].message
    assert "raise --detections_per_image" in found[0].message
    assert cap_findings(check_coco_data(paths, check_images=False, max_detections=25)[2]) == {
        "model": ["1.jpg (120 boxes)", "2.jpg (150 boxes)", "3.jpg (30 boxes)"]}
    # a cap above every image: only COCO's 100 per image and class is left, which no flag raises
    assert cap_findings(check_coco_data(paths, check_images=False, max_detections=300)[2]) == {
        "coco": ["2.jpg (150 of one class)"]}
    # why it matters: perfect detections of the 150 boxes recall 100 of them
    ev = CocoEvaluator(check_coco(str(val), split="val", check_images=False, need_files=False).dataset, "pycocotools")
    for im in ev.gt_dataset["images"]:
        ev.add(im["id"], [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
                          for a in ev.gt_dataset["annotations"] if a["image_id"] == im["id"]][:100])
    assert ev.evaluate()[0]["AR100"] < 1.0
    # check_dataset.py says it with the flag's value
    code = check_dataset.main(["--annotations", str(val), "--val_annotations", str(val), "--skip_image_check",
                               "--detections_per_image", "25"])
    out = capsys.readouterr().out
    assert code == 0 and "than the 25 detections per image the model keeps (--detections_per_image 25)" in out


@pytest.mark.parametrize("flag", [1, True, "1", "true", 1.0])
def test_ignore_flag_is_read_as_an_ignore_region_and_said(flag, tmp_path):
    """F07: CityPersons / CrowdHuman exports mark ignore regions `"ignore": 1`; read as written they were ordinary
    boxes (trained on, and a miss for every model that rightly finds nothing there). Now they are crowd regions
    (iscrowd 1), one repair line naming the field and the count; `"ignore": 0` changes nothing."""
    anns = [{"image_id": 1, "category_id": 1, "bbox": [10, 10, 30, 30]},
            {"image_id": 1, "category_id": 1, "bbox": [50, 50, 40, 40], "ignore": flag},
            {"image_id": 1, "category_id": 1, "bbox": [5, 60, 20, 20], "ignore": 0}]
    path = write_coco(tmp_path / "d.json", [{"id": 1, "width": 100, "height": 100, "file_name": "a.jpg"}], anns)
    check = check_coco(str(path), split="val", check_images=False, need_files=False)
    assert [a["iscrowd"] for a in check.dataset["annotations"]] == [0, 1, 0]
    found = [f for f in check.report.findings if "ignore" in f.message]
    assert len(found) == 1 and found[0].level == "repair" and found[0].count == 1 and found[0].examples == [2]
    assert "`ignore` field" in found[0].message and "iscrowd 1" in found[0].message
    ev = CocoEvaluator(check.dataset, "pycocotools")
    ev.add(1, [{"image_id": 1, "category_id": 1, "bbox": b, "score": 0.9} for b in ([10, 10, 30, 30], [5, 60, 20, 20])]
           + [{"image_id": 1, "category_id": 1, "bbox": [52, 52, 36, 36], "score": 0.8}])  # inside the ignore region
    assert ev.evaluate()[0]["AP"] == pytest.approx(1.0, abs=1e-9)


def test_category_names_equal_but_for_case_or_spaces_are_warned_naming_both_ids(tmp_path):
    """F17: `cat` and `Cat`, `dog ` and `dog` from two exporters were three (here five) classes, nothing said. One
    warning lists each group with its ids; names equal as written keep their own warning."""
    cats = [{"id": 1, "name": "cat"}, {"id": 2, "name": "Cat"}, {"id": 3, "name": "dog "}, {"id": 4, "name": "dog"},
            {"id": 5, "name": "hot  dog"}, {"id": 6, "name": "Hot Dog"}, {"id": 7, "name": "bird"},
            {"id": 8, "name": "bird"}, {"id": 9, "name": "fish"}]
    anns = [{"image_id": 1, "category_id": c["id"], "bbox": [10 * c["id"], 5, 8, 8]} for c in cats]
    path = write_coco(tmp_path / "d.json", [{"id": 1, "width": 100, "height": 100, "file_name": "a.jpg"}], anns, cats)
    report = check_coco(str(path), check_images=False).report
    found = [f for f in report.findings if "case or spaces" in f.message]
    assert len(found) == 1 and found[0].level == "warning" and found[0].count == 3
    assert found[0].examples == ["1 'cat', 2 'Cat'", "3 'dog ', 4 'dog'", "5 'hot  dog', 6 'Hot Dog'"]
    assert [f.examples for f in report.findings if f.message == "category ids that share a name"] == [["bird"]]
