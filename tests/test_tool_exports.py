"""The exports of the labelling tools read back with the right classes and boxes (issue 51), one fixture per quirk,
each written from the tool's documented format: Label Studio's COCO export (category and image ids from 0, its
stored upload names), its JSON and JSON-min exports (percent coordinates, `rotation`), CVAT's COCO export of masks
(RLE with iscrowd 1, and a box), segmentation-only annotations with an empty bbox, Roboflow's COCO (non-contiguous
ids) and YOLO (`../train/images` in data.yaml) exports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import write_image

from detlib.data.formats import data_dir_paths, read_data_dir_splits
from detlib.datacheck import DataReport, check_coco
from detlib.datacheck.labelstudio import rotated_hull
from detlib.labels import CategoryMap


def checked(annotations, image_dir: Path | None, strict: bool = False):
    check = check_coco(annotations, None if image_dir is None else str(image_dir), split="train",
                       report=DataReport(strict), progress=False)
    return check.dataset, check.report


def boxes_by_file(d: dict) -> dict[str, list[tuple]]:
    names = {c["id"]: c["name"] for c in d["categories"]}
    files = {im["id"]: im["file_name"] for im in d["images"]}
    out = {f: [] for f in files.values()}
    for a in d["annotations"]:
        out[files[a["image_id"]]].append((names[a["category_id"]], *[round(v, 6) for v in a["bbox"]], a["iscrowd"]))
    return {k: sorted(v) for k, v in out.items()}


def messages(report: DataReport) -> list[str]:
    return [f"{f.level}: {f.message} {f.examples}" for f in report.findings]


@pytest.fixture
def photos(tmp_path) -> Path:
    write_image(tmp_path / "img" / "street.jpg", 200, 100, seed=1)
    write_image(tmp_path / "img" / "park.jpg", 80, 60, seed=2)
    return tmp_path / "img"


def test_labelstudio_coco_export_ids_from_0_and_upload_names_matched_to_the_files(photos):
    """Label Studio's COCO export (label-studio-converter's convert_to_coco): categories 0..K-1 by sorted name, image
    and annotation ids from 0, file names as Label Studio stored the uploads (`<8 hex>-<name>`, under images/ or
    /data/upload/<project>/)."""
    export = {"images": [{"width": 200, "height": 100, "id": 0, "file_name": "images/5d8e1c2a-street.jpg"},
                         {"width": 80, "height": 60, "id": 1, "file_name": "/data/upload/3/0ab3c2d1-park.jpg"}],
              "categories": [{"id": 0, "name": "car"}, {"id": 1, "name": "person"}],
              "annotations": [{"id": 0, "image_id": 0, "category_id": 0, "segmentation": [], "bbox": [10, 20, 30, 40],
                               "ignore": 0, "iscrowd": 0, "area": 1200},
                              {"id": 1, "image_id": 1, "category_id": 1, "segmentation": [], "bbox": [5, 6, 7, 8],
                               "ignore": 0, "iscrowd": 0, "area": 56}],
              "info": {"year": 2024, "version": "1.0", "contributor": "Label Studio"}}
    d, report = checked(export, photos)
    assert report.ok
    assert boxes_by_file(d) == {"street.jpg": [("car", 10, 20, 30, 40, 0)], "park.jpg": [("person", 5, 6, 7, 8, 0)]}
    assert any("matched to the file of that name" in m and "/data/upload/3/0ab3c2d1-park.jpg -> park.jpg" in m
               for m in messages(report))
    labels = CategoryMap([c["id"] for c in d["categories"]], [c["name"] for c in d["categories"]])
    assert labels.category_ids == [0, 1] and labels.names == ["car", "person"]  # id 0 is a class like any other


def test_roboflow_coco_export_non_contiguous_ids_keep_their_classes(photos):
    d, report = checked({"images": [{"id": 0, "file_name": "street.jpg", "width": 200, "height": 100}],
                         "categories": [{"id": 0, "name": "vehicles", "supercategory": "none"},
                                        {"id": 4, "name": "bus", "supercategory": "vehicles"},
                                        {"id": 9, "name": "car", "supercategory": "vehicles"}],
                         "annotations": [{"id": 0, "image_id": 0, "category_id": 9, "bbox": [1, 2, 3, 4], "area": 12,
                                          "iscrowd": 0, "segmentation": []},
                                         {"id": 1, "image_id": 0, "category_id": 4, "bbox": [50, 20, 30, 10],
                                          "area": 300, "iscrowd": 0, "segmentation": []}]}, photos)
    assert report.ok and boxes_by_file(d) == {"street.jpg": [("bus", 50, 20, 30, 10, 0), ("car", 1, 2, 3, 4, 0)]}
    labels = CategoryMap([c["id"] for c in d["categories"]], [c["name"] for c in d["categories"]])
    assert [labels.names[labels.to_label(c)] for c in (9, 4, 0)] == ["car", "bus", "vehicles"]


def rle(counts: list[int], h: int, w: int) -> dict:
    return {"size": [h, w], "counts": counts}


def test_cvat_coco_export_of_masks_iscrowd_1_with_boxes_are_read_as_objects(photos):
    """CVAT's COCO 1.0 export (datumaro's coco exporter: `is_crowd = mask is not None`) writes every mask, those of
    its SAM tool too, as an uncompressed RLE with iscrowd 1, beside its bbox."""
    anns = [{"id": 1, "image_id": 1, "category_id": 1, "segmentation": rle([410, 20, 80, 20, 19470], 100, 200),
             "area": 40.0, "bbox": [4.0, 10.0, 2.0, 20.0], "iscrowd": 1, "attributes": {"occluded": False}},
            {"id": 2, "image_id": 1, "category_id": 2, "segmentation": rle([1000, 50, 18950], 100, 200),
             "area": 50.0, "bbox": [10.0, 0.0, 1.0, 50.0], "iscrowd": 1, "attributes": {"occluded": False}},
            {"id": 3, "image_id": 1, "category_id": 2, "segmentation": [[100, 10, 150, 10, 150, 40, 100, 40]],
             "area": 1500.0, "bbox": [100.0, 10.0, 50.0, 30.0], "iscrowd": 0, "attributes": {"occluded": False}}]
    export = {"licenses": [{"name": "", "id": 0, "url": ""}], "info": {"contributor": "", "version": ""},
              "categories": [{"id": 1, "name": "dog", "supercategory": ""}, {"id": 2, "name": "tree", "supercategory": ""}],
              "images": [{"id": 1, "width": 200, "height": 100, "file_name": "street.jpg", "license": 0}],
              "annotations": anns}
    d, report = checked(export, photos)
    assert report.ok
    assert boxes_by_file(d) == {"street.jpg": [("dog", 4, 10, 2, 20, 0), ("tree", 10, 0, 1, 50, 0),
                                               ("tree", 100, 10, 50, 30, 0)]}
    assert any(m.startswith("repair: iscrowd 1 on most annotations") and "[1, 2]" in m for m in messages(report))
    # COCO's own crowd regions (a few among objects) stay ignore regions
    crowd = {**export, "annotations": anns[1:] + [dict(anns[2], id=4), dict(anns[2], id=5)]}
    d, report = checked(crowd, photos)
    assert [a["iscrowd"] for a in d["annotations"]] == [1, 0, 0, 0]


def test_segmentation_only_annotations_with_an_empty_bbox_get_the_mask_s_box(photos):
    d, report = checked({"images": [{"id": 1, "file_name": "street.jpg", "width": 200, "height": 100}],
                         "categories": [{"id": 1, "name": "dog"}],
                         "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [], "iscrowd": 0, "area": 0,
                                          "segmentation": [[30, 30, 60, 30, 60, 50, 30, 50]]},
                                         {"id": 2, "image_id": 1, "category_id": 1, "bbox": [], "iscrowd": 0,
                                          "segmentation": rle([410, 20, 80, 20, 19470], 100, 200)}]}, photos)
    assert report.ok and boxes_by_file(d) == {"street.jpg": [("dog", 4, 10, 2, 20, 0), ("dog", 30, 30, 30, 20, 0)]}


def labelstudio_result(x, y, w, h, label, rotation=0, W=200, H=100) -> dict:
    return {"original_width": W, "original_height": H, "image_rotation": 0, "id": "r" + label, "from_name": "label",
            "to_name": "image", "type": "rectanglelabels",
            "value": {"x": x, "y": y, "width": w, "height": h, "rotation": rotation, "rectanglelabels": [label]}}


def test_labelstudio_json_export_percent_boxes_latest_annotation_and_upload_names(photos):
    tasks = [{"id": 7, "data": {"image": "/data/upload/2/5d8e1c2a-street.jpg"},
              "annotations": [{"id": 1, "created_at": "2024-05-01T10:00:00Z", "was_cancelled": False,
                               "result": [labelstudio_result(50, 50, 10, 10, "car")]},
                              {"id": 2, "created_at": "2024-05-02T10:00:00Z", "was_cancelled": False,
                               "result": [labelstudio_result(5, 20, 15, 40, "car"),
                                          labelstudio_result(60, 10, 20, 30, "person")]},
                              {"id": 3, "created_at": "2024-05-03T10:00:00Z", "was_cancelled": True, "result": []}],
              "predictions": [{"result": [labelstudio_result(0, 0, 50, 50, "person")]}]},
             {"id": 8, "data": {"image": "/data/local-files/?d=img/park.jpg"}, "annotations": [
                 {"id": 4, "result": [{"type": "choices", "value": {"choices": ["night"]}, "from_name": "c",
                                       "to_name": "image"}]}]}]
    d, report = checked(tasks, photos)
    assert report.ok, report.format()
    # percent of 200 x 100: x 5 % -> 10 px, y 20 % -> 20 px, width 15 % -> 30 px, height 40 % -> 40 px
    assert boxes_by_file(d) == {"street.jpg": [("car", 10, 20, 30, 40, 0), ("person", 120, 10, 40, 30, 0)],
                                "park.jpg": []}
    assert [im["id"] for im in d["images"]] == [7, 8]
    text = "\n".join(messages(report))
    assert "task 7 (2 annotations)" in text and "not rectangles" in text and "park.jpg" in text


def test_labelstudio_json_min_and_a_rotated_box_read_as_its_hull_or_refused_with_strict_data(photos):
    tasks = [{"image": "/data/upload/2/5d8e1c2a-street.jpg", "id": 3, "annotator": 1, "annotation_id": 9,
              "created_at": "2024-05-02T10:00:00Z", "updated_at": "2024-05-02T10:00:00Z", "lead_time": 3.2,
              "label": [{"x": 25, "y": 20, "width": 10, "height": 40, "rotation": 90, "rectanglelabels": ["car"],
                         "original_width": 200, "original_height": 100},
                        {"x": 50, "y": 50, "width": 5, "height": 10, "rotation": 0, "rectanglelabels": ["person"],
                         "original_width": 200, "original_height": 100}]}]
    d, report = checked(tasks, photos)
    assert report.ok
    # 20 x 40 px at (50, 20) turned 90 degrees clockwise about its top-left corner: x 10..50, y 20..40
    assert boxes_by_file(d) == {"street.jpg": [("car", 10, 20, 40, 20, 0), ("person", 100, 50, 10, 10, 0)]}
    assert any("read as their axis-aligned hull" in m and "task 3 (car, 90 degrees)" in m for m in messages(report))
    _, strict = checked(tasks, photos, strict=True)
    assert not strict.ok and "read as their axis-aligned hull" in strict.format()
    x1, y1, x2, y2 = rotated_hull(0, 0, 10, 0, 30)  # a segment of 10 px turned 30 degrees clockwise (y down)
    assert (x1, y1) == (0, 0) and x2 == pytest.approx(10 * math.cos(math.pi / 6)) and y2 == pytest.approx(5)


def test_roboflow_yolo_export_with_dotdot_split_paths(tmp_path):
    """Roboflow's YOLO export: data.yaml beside train/ and valid/, naming them `../train/images`."""
    root = tmp_path / "roboflow"
    for split in ("train", "valid"):
        write_image(root / split / "images" / "x_jpg.rf.0a1b.jpg", 100, 50)
        (root / split / "labels").mkdir(parents=True)
        (root / split / "labels" / "x_jpg.rf.0a1b.txt").write_text("1 0.5 0.5 0.2 0.4\n")
    (root / "data.yaml").write_text("train: ../train/images\nval: ../valid/images\ntest: ../test/images\n\nnc: 2\n"
                                    "names: ['bus', 'car']\n\nroboflow:\n  workspace: me\n  project: cars\n  version: 1\n")
    paths = data_dir_paths(str(root), None, None, None)
    assert paths["format"] == "yolo" and paths["val_images"] == str(root / "valid" / "images")
    d = read_data_dir_splits(paths, {"train": None, "val": None}, report=DataReport(), progress=False)
    assert boxes_by_file(d["val"]) == {"x_jpg.rf.0a1b.jpg": [("car", 40, 15, 20, 20, 0)]}


def test_a_labelstudio_export_that_is_not_tasks_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "export.json"
    path.write_text(json.dumps([1, 2]))
    check = check_coco(str(path), None, check_images=False)
    assert not check.report.ok and check.report.format().count("error") >= 1
    assert "holds a list, not an object with images, annotations and categories" in check.report.format()
