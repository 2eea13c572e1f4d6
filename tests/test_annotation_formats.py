"""The detections and the label-error review tasks written for labelling tools (detlib/evaluation/annotation_formats.py,
predict_retinanet.py --format, review_label_errors.py), each read back by the tool's own reader: Label Studio's
tasks by label-studio-converter (its COCO conversion), YOLO and Pascal VOC by Roboflow's supervision
(`DetectionDataset.from_yolo` / `from_pascal_voc`), Pascal VOC by torchvision's VOCDetection parser too, CVAT for
images 1.1, YOLO and VOC by datumaro where it is installed, YOLO and VOC by detlib's own readers. Hand-made
detections (no model): boxes with fractions, non-contiguous category ids, images of two sizes, one image without
detections.

label-studio-converter (about 110 MB with pandas and nltk) and supervision (about 3 MB with pyDeprecate) are in
requirements-dev.txt. datumaro (about 420 MB: pyarrow, opencv, pandas; it pins pillow < 13) is not: its tests skip
without it. Install it in a separate venv (`python -m venv --system-site-packages v && v/bin/pip install datumaro`)
and run this file with v/bin/python. The fiftyone test skips without fiftyone.
"""

from __future__ import annotations

import argparse
import json
import logging
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from conftest import write_image
from helpers import load_script, run_main

from detlib.data.formats import read_split
from detlib.datacheck import DataReport, check_coco
from detlib.evaluation.annotation_formats import (PREDICTION_FORMATS, REVIEW_FORMATS, percent_box,
                                                   write_prediction_files, write_review_files)

NAMES = {3: "cat", 7: "dog", 10: "traffic light"}  # COCO ids, not contiguous; a name with a space
SIZES = {"a.jpg": (200, 100), "b.jpg": (64, 96), "empty.jpg": (50, 40)}  # (width, height)
DETECTIONS = [  # COCO results: xywh pixels
    {"image_id": 0, "category_id": 3, "bbox": [10.25, 5.5, 40.125, 30.75], "score": 0.91},
    {"image_id": 0, "category_id": 10, "bbox": [150.0, 60.0, 49.5, 39.25], "score": 0.42},
    {"image_id": 0, "category_id": 7, "bbox": [0.0, 0.0, 200.0, 100.0], "score": 0.07},
    {"image_id": 1, "category_id": 7, "bbox": [3.3, 7.7, 20.2, 60.6], "score": 0.66},
]


@pytest.fixture
def images(tmp_path) -> list[dict]:
    folder = tmp_path / "photos"
    out = []
    for k, (name, (w, h)) in enumerate(SIZES.items()):
        write_image(folder / name, w, h, seed=k)
        out.append({"image_id": k, "file_name": name, "out_name": name[:-4], "width": w, "height": h,
                    "path": str(folder / name)})
    return out


def write(fmt: str, tmp_path: Path, images: list[dict], **kw) -> Path:
    write_prediction_files(fmt, str(tmp_path / "out"), images, DETECTIONS, list(NAMES), NAMES, **kw)
    return tmp_path / "out" / fmt


def ours(images: list[dict]) -> dict[str, list[tuple]]:
    """{file name: sorted [(class name, x1, y1, x2, y2)]} of DETECTIONS."""
    out = {im["file_name"]: [] for im in images}
    for r in DETECTIONS:
        x, y, w, h = r["bbox"]
        out[images[r["image_id"]]["file_name"]].append((NAMES[r["category_id"]], x, y, x + w, y + h))
    return {k: sorted(v) for k, v in out.items()}


def assert_same(read: dict[str, list[tuple]], expected: dict[str, list[tuple]], tol: float = 0.5) -> None:
    """The same images, the same count and classes per image, boxes within `tol` px."""
    assert sorted(read) == sorted(expected)
    for name, boxes in expected.items():
        got = sorted(read[name])
        assert [b[0] for b in got] == [b[0] for b in boxes], name
        for g, e in zip(got, boxes):
            assert max(abs(a - b) for a, b in zip(g[1:], e[1:])) <= tol, (name, g, e)


def test_predict_script_formats_are_the_module_s():
    assert load_script("predict_retinanet").PREDICTION_FORMATS == PREDICTION_FORMATS
    assert load_script("review_label_errors").REVIEW_FORMATS == REVIEW_FORMATS


def test_labelstudio_tasks_hold_percent_boxes_sizes_scores_and_the_image_url(tmp_path, images):
    folder = write("labelstudio", tmp_path, images, image_root_url="https://host/bucket/", model_version="run/best")
    tasks = json.loads((folder / "tasks.json").read_text())
    assert [t["data"]["image"] for t in tasks] == ["https://host/bucket/a.jpg", "https://host/bucket/b.jpg",
                                                  "https://host/bucket/empty.jpg"]
    first = tasks[0]["predictions"][0]
    assert first["model_version"] == "run/best" and first["score"] == pytest.approx((0.91 + 0.42 + 0.07) / 3)
    r = first["result"][0]
    assert (r["original_width"], r["original_height"], r["score"]) == (200, 100, 0.91)
    assert r["value"] == {"x": 5.125, "y": 5.5, "width": 20.0625, "height": 30.75, "rotation": 0,
                          "rectanglelabels": ["cat"]}
    assert tasks[2]["predictions"][0]["result"] == []
    config = ET.fromstring((folder / "label_config.xml").read_text())
    assert [(x.get("value"), x.get("category")) for x in config.iter("Label")] == [("cat", "3"), ("dog", "7"),
                                                                                     ("traffic light", "10")]
    assert percent_box([50, 25, 100, 50], 200, 100) == {"x": 25.0, "y": 25.0, "width": 50.0, "height": 50.0,
                                                        "rotation": 0}


def test_labelstudio_tasks_read_by_label_studio_converter_equal_our_detections(tmp_path, images):
    """Label Studio's converter (label-studio-converter's Converter.convert_to_coco, what its COCO export runs) on
    our tasks, their predictions accepted as annotations (what Label Studio makes of an accepted prediction)."""
    import label_studio_converter as converter  # requirements-dev.txt: a failed install fails here, never skips
    folder = write("labelstudio", tmp_path, images, image_root_url=str(tmp_path / "photos"))
    tasks = json.loads((folder / "tasks.json").read_text())
    accepted = [{"id": k + 1, "data": t["data"], "annotations": [{"id": k + 1, "result": t["predictions"][0]["result"]}]}
                for k, t in enumerate(tasks)]
    (tmp_path / "accepted.json").write_text(json.dumps(accepted))
    c = converter.Converter(config=str(folder / "label_config.xml"), project_dir=str(tmp_path))
    c.convert_to_coco(str(tmp_path / "accepted.json"), str(tmp_path / "coco"), is_dir=False)
    coco = json.loads((tmp_path / "coco" / "result.json").read_text())
    # the <Label category=...> ids kept (as the strings the xml holds: our COCO reader parses them, a repair)
    assert {int(c["id"]): c["name"] for c in coco["categories"]} == NAMES
    coco["annotations"] = [dict(a, category_id=int(a["category_id"])) for a in coco["annotations"]]
    names = {im["id"]: Path(im["file_name"]).name for im in coco["images"]}
    read = {n: [] for n in names.values()}
    for a in coco["annotations"]:
        x, y, w, h = a["bbox"]
        read[names[a["image_id"]]].append((NAMES[a["category_id"]], x, y, x + w, y + h))
    assert_same(read, ours(images), tol=1e-6)


def cvat_boxes(path: Path) -> tuple[dict[str, list[tuple]], list[float]]:
    root = ET.parse(path).getroot()
    assert root.find("version").text == "1.1"
    out, scores = {}, []
    for im in root.iter("image"):
        out[im.get("name")] = [(b.get("label"), *(float(b.get(k)) for k in ("xtl", "ytl", "xbr", "ybr")))
                               for b in im.iter("box")]
        scores += [float(a.text) for b in im.iter("box") for a in b.iter("attribute") if a.get("name") == "score"]
    return out, scores


def test_cvat_xml_has_the_documented_structure_and_our_boxes(tmp_path, images):
    folder = write("cvat", tmp_path, images)
    root = ET.parse(folder / "annotations.xml").getroot()
    assert [x.text for x in root.iter("name") if x.text in NAMES.values()] == list(NAMES.values())
    assert [(im.get("id"), im.get("width"), im.get("height")) for im in root.iter("image")] == [
        ("0", "200", "100"), ("1", "64", "96"), ("2", "50", "40")]
    boxes, scores = cvat_boxes(folder / "annotations.xml")
    assert_same(boxes, ours(images), tol=0.01)  # written to 2 decimals
    assert scores == [0.91, 0.42, 0.07, 0.66]


def test_cvat_xml_read_by_datumaro_equals_our_detections(tmp_path, images):
    dm = pytest.importorskip("datumaro")
    folder = write("cvat", tmp_path, images)
    (folder / "images").mkdir()  # CVAT's export with its images: images/ beside annotations.xml
    for im in images:
        (folder / "images" / im["file_name"]).symlink_to(im["path"])
    dataset = dm.Dataset.import_from(str(folder / "annotations.xml"), "cvat")
    labels = dataset.categories()[dm.AnnotationType.label]
    read, scores = {}, []
    for item in dataset:
        read[item.id + ".jpg"] = []
        for a in item.annotations:
            x, y, w, h = a.get_bbox()
            read[item.id + ".jpg"].append((labels[a.label].name, x, y, x + w, y + h))
            scores.append(a.attributes["score"])
    assert_same(read, ours(images), tol=0.01)  # written to 2 decimals
    assert sorted(scores) == sorted(r["score"] for r in DETECTIONS)


def test_yolo_rows_classes_file_data_yaml_and_save_conf(tmp_path, images):
    folder = write("yolo", tmp_path, images, save_conf=True)
    assert (folder / "classes.txt").read_text() == "cat\ndog\ntraffic light\n"
    assert yaml.safe_load((folder / "data.yaml").read_text()) == {"nc": 3, "names": {0: "cat", 1: "dog",
                                                                                      2: "traffic light"}}
    rows = (folder / "labels" / "a.txt").read_text().splitlines()
    # cat at x 10.25..50.375, y 5.5..36.25 of 200 x 100: centre (30.3125, 20.875), size (40.125, 30.75)
    assert rows[0] == "0 0.151562 0.208750 0.200625 0.307500 0.910000"
    assert [r.split()[0] for r in rows] == ["0", "2", "1"] and (folder / "labels" / "empty.txt").read_text() == ""


def yolo_set(tmp_path: Path, folder: Path, images: list[dict]) -> Path:
    """Our labels/, classes.txt and data.yaml with the images in ultralytics' layout (images/val/, labels/val/, our
    data.yaml with `val: images/val` added)."""
    root = tmp_path / "yolo_set"
    for im in images:
        (root / "images" / "val").mkdir(parents=True, exist_ok=True)
        (root / "images" / "val" / im["file_name"]).symlink_to(im["path"])
        (root / "labels" / "val").mkdir(parents=True, exist_ok=True)
        (root / "labels" / "val" / (im["out_name"] + ".txt")).write_text((folder / "labels" / (im["out_name"] + ".txt")).read_text())
    names = (folder / "classes.txt").read_text().splitlines()
    (root / "obj.names").write_text("\n".join(names) + "\n")
    (root / "data.yaml").write_text((folder / "data.yaml").read_text() + "val: images/val\n")
    return root


def test_yolo_files_read_back_by_our_reader_equal_our_detections(tmp_path, images):
    root = yolo_set(tmp_path, write("yolo", tmp_path, images), images)
    d = read_split("yolo", str(root / "data.yaml"), "val", report=DataReport(), split="val", progress=False)
    names = {c["id"]: c["name"] for c in d["categories"]}
    files = {im["id"]: im["file_name"] for im in d["images"]}
    read = {f: [] for f in files.values()}
    for a in d["annotations"]:
        x, y, w, h = a["bbox"]
        read[files[a["image_id"]]].append((names[a["category_id"]], x, y, x + w, y + h))
    assert_same(read, ours(images), tol=0.5 * 1e-6 * 200 + 1e-3)  # 6 decimals of the normalised values


def test_yolo_files_read_by_datumaro_equal_our_detections(tmp_path, images):
    dm = pytest.importorskip("datumaro")
    root = yolo_set(tmp_path, write("yolo", tmp_path, images), images)
    (root / "data.yaml").unlink()  # datumaro's loose YOLO: obj.names, images/<subset>/, labels/<subset>/
    dataset = dm.Dataset.import_from(str(root), "yolo")
    labels = dataset.categories()[dm.AnnotationType.label]
    read = {}
    for item in dataset:
        read[item.id + ".jpg"] = [(labels[a.label].name, a.x, a.y, a.x + a.w, a.y + a.h) for a in item.annotations]
    assert_same(read, ours(images), tol=0.01)  # 6 decimals of the normalised values, read in float32


@pytest.mark.parametrize("save_conf", [False, True])
def test_yolo_files_read_by_supervision_equal_our_detections(tmp_path, images, save_conf):
    """Roboflow's supervision (`DetectionDataset.from_yolo`: an image folder, the label folder, data.yaml's `names`)
    on our folder as written, the images where they are; the score column of `save_conf` it leaves out."""
    import supervision as sv  # requirements-dev.txt: a failed install fails here, never skips
    folder = write("yolo", tmp_path, images, save_conf=save_conf)
    dataset = sv.DetectionDataset.from_yolo(images_directory_path=str(tmp_path / "photos"),
                                            annotations_directory_path=str(folder / "labels"),
                                            data_yaml_path=str(folder / "data.yaml"))
    assert dataset.classes == list(NAMES.values())
    read = {Path(p).name: [(dataset.classes[c], *map(float, xyxy)) for xyxy, c in zip(d.xyxy, d.class_id)]
            for p, d in dataset.annotations.items()}
    assert_same(read, ours(images), tol=0.01)  # 6 decimals of the normalised values, read in float32


def test_voc_xml_read_by_supervision_equals_our_detections(tmp_path, images):
    """Roboflow's supervision (`DetectionDataset.from_pascal_voc`: an image folder, the Annotations folder; the
    classes as the xml names them) on our folder as written, the images where they are. It reads xmin / ymin as
    VOC's 1-based pixel indices, as we write them: our boxes back."""
    import supervision as sv  # requirements-dev.txt: a failed install fails here, never skips
    folder = write("voc", tmp_path, images)
    dataset = sv.DetectionDataset.from_pascal_voc(images_directory_path=str(tmp_path / "photos"),
                                                  annotations_directory_path=str(folder / "Annotations"))
    assert sorted(dataset.classes) == sorted(NAMES.values())
    read = {Path(p).name: [(dataset.classes[c], *map(float, xyxy)) for xyxy, c in zip(d.xyxy, d.class_id)]
            for p, d in dataset.annotations.items()}
    assert_same(read, ours(images), tol=0.01)  # written to 2 decimals


def test_voc_xml_read_by_torchvision_and_by_our_reader_equal_our_detections(tmp_path, images):
    from torchvision.datasets import VOCDetection

    folder = write("voc", tmp_path, images)
    assert (folder / "ImageSets" / "Main" / "predicted.txt").read_text() == "a\nb\nempty\n"
    read = {}
    for im in images:
        parsed = VOCDetection.parse_voc_xml(ET.parse(folder / "Annotations" / f"{im['out_name']}.xml").getroot())
        a = parsed["annotation"]
        assert (int(a["size"]["width"]), int(a["size"]["height"])) == (im["width"], im["height"])
        # VOC's 1-based xmin / ymin (torchvision's reference subtracts 1 as detectron2 does)
        read[im["file_name"]] = [(o["name"], float(o["bndbox"]["xmin"]) - 1, float(o["bndbox"]["ymin"]) - 1,
                                  float(o["bndbox"]["xmax"]), float(o["bndbox"]["ymax"])) for o in a.get("object", [])]
    assert_same(read, ours(images), tol=0.01)  # written to 2 decimals
    d = read_split("voc", str(folder / "ImageSets" / "Main" / "predicted.txt"), "predicted", report=DataReport(),
                   split="val")
    names = {c["id"]: c["name"] for c in d["categories"]}
    files = {im["id"]: im["file_name"] for im in d["images"]}
    ours_read = {f: [] for f in files.values()}
    for a in d["annotations"]:
        x, y, w, h = a["bbox"]
        ours_read[files[a["image_id"]]].append((names[a["category_id"]], x, y, x + w, y + h))
    assert_same(ours_read, ours(images), tol=0.01)  # written to 2 decimals


def test_voc_xml_read_by_datumaro_equals_our_detections(tmp_path, images):
    dm = pytest.importorskip("datumaro")
    folder = write("voc", tmp_path, images)
    dataset = dm.Dataset.import_from(str(folder), "voc_detection")
    labels = dataset.categories()[dm.AnnotationType.label]
    read = {}
    for item in dataset:
        read[item.id + ".jpg"] = [(labels[a.label].name, a.x, a.y, a.x + a.w, a.y + a.h) for a in item.annotations
                                  if a.type == dm.AnnotationType.bbox]
    # datumaro keeps VOC's numbers as written (1-based xmin / ymin): one pixel from ours on those two sides
    shifted = {k: [(c, x1 + 1, y1 + 1, x2, y2) for c, x1, y1, x2, y2 in v] for k, v in ours(images).items()}
    assert_same(read, shifted, tol=0.01)  # written to 2 decimals


def test_predict_script_writes_the_format_beside_an_unchanged_predictions_json(tmp_path, images, caplog):
    predict = load_script("predict_retinanet")
    ds = argparse.Namespace(paths=[im["path"] for im in images],
                            inputs=([im["file_name"] for im in images], [im["out_name"] for im in images], None, True))
    shards = [({im["image_id"]: [dict(r) for r in DETECTIONS if r["image_id"] == im["image_id"]] for im in images},
               [], {}, {})]
    base = dict(score_thresh=0.05, no_images=True, draw_thresh=0.3, image_root_url=None, weights="w", save_conf=False)
    coco = predict.write_outputs(argparse.Namespace(output_dir=str(tmp_path / "coco"), format="coco", **base), ds,
                                 shards, [], NAMES)
    assert sorted(p.name for p in (tmp_path / "coco").iterdir()) == ["predictions.json"]
    with caplog.at_level(logging.INFO):
        cvat = predict.write_outputs(argparse.Namespace(output_dir=str(tmp_path / "cvat"), format="cvat", **base), ds,
                                     shards, [], NAMES)
    assert cvat == coco and (tmp_path / "cvat" / "predictions.json").read_text() == (
        tmp_path / "coco" / "predictions.json").read_text()
    boxes, _ = cvat_boxes(tmp_path / "cvat" / "cvat" / "annotations.xml")
    assert_same(boxes, ours(images), tol=0.01)  # written to 2 decimals
    assert caplog.records[-1].getMessage().startswith(f"wrote {tmp_path / 'cvat' / 'predictions.json'}")


# ---- review tasks of label_errors.json (review_label_errors.py)

def review_run(tmp_path: Path, images: list[dict]) -> Path:
    """A run folder: config.yaml naming a COCO val json of the images, and a label_errors.json of 3 entries on
    image a.jpg (wrong_class, badly_placed) and b.jpg (missing_box)."""
    run = tmp_path / "run"
    run.mkdir()
    coco = {"images": [{"id": 100 + im["image_id"], "file_name": im["file_name"], "width": im["width"],
                        "height": im["height"]} for im in images],
            "annotations": [{"id": 1, "image_id": 100, "category_id": 3, "bbox": [10, 5, 40, 30], "area": 1200, "iscrowd": 0},
                            {"id": 2, "image_id": 100, "category_id": 7, "bbox": [120, 50, 60, 40], "area": 2400, "iscrowd": 0},
                            {"id": 3, "image_id": 101, "category_id": 7, "bbox": [30, 60, 20, 20], "area": 400, "iscrowd": 0}],
            "categories": [{"id": c, "name": n} for c, n in NAMES.items()]}
    (tmp_path / "val.json").write_text(json.dumps(coco))
    (run / "config.yaml").write_text(f"data_format: coco\ndata_val_annotations: {tmp_path / 'val.json'}\n"
                                     f"data_val_images: {tmp_path / 'photos'}\n")
    entry = {"score": 0.9, "label_score": 0.1, "covered": 0.0, "iou": 0.8}
    errors = [{**entry, "rank": 1, "type": "wrong_class", "confidence": 0.81, "image_id": 100, "annotation_id": 1,
               "category": "cat", "suggested_category": "dog", "annotated_bbox": [10, 5, 40, 30],
               "suggested_bbox": [11, 6, 40, 30]},
              {**entry, "rank": 2, "type": "missing_box", "confidence": 0.7, "image_id": 101, "annotation_id": None,
               "category": None, "suggested_category": "traffic light", "annotated_bbox": None,
               "suggested_bbox": [3.3, 7.7, 20.2, 10.0], "label_score": None, "iou": 0.0},
              {**entry, "rank": 3, "type": "badly_placed", "confidence": 0.55, "image_id": 100, "annotation_id": 2,
               "category": "dog", "suggested_category": "dog", "annotated_bbox": [120, 50, 60, 40],
               "suggested_bbox": [140, 55, 50, 40], "iou": 0.3}]
    (run / "label_errors.json").write_text(json.dumps({"counts": {}, "errors": errors}))
    return run


def test_review_labelstudio_tasks_show_current_boxes_and_suggestions_and_read_back(tmp_path, images, capsys):
    run = review_run(tmp_path, images)
    code, out, err = run_main("review_label_errors", [run, "--format", "labelstudio", "--top", "3",
                                                      "--image_root_url", "/data/local-files/?d=photos"], capsys)
    assert code == 0, out + err
    assert "2 tasks (images) for the top 3 of the 3 entries" in out
    tasks = json.loads((run / "review" / "labelstudio" / "tasks.json").read_text())
    assert [t["data"]["image"] for t in tasks] == ["/data/local-files/?d=photos/a.jpg", "/data/local-files/?d=photos/b.jpg"]
    assert tasks[0]["data"]["label_errors"] == ("#1 wrong_class: box 1 'cat' looks like 'dog' (confidence 0.81); "
                                                "#3 badly_placed: box 2 'dog' misplaced (IoU 0.30) (confidence 0.55)")
    result = tasks[0]["annotations"][0]["result"]
    assert [(r["id"], r["value"]["rectanglelabels"][0], r.get("score")) for r in result] == [
        ("ann1", "cat", None), ("ann2", "dog", None), ("err1", "dog", 0.81), ("err3", "dog", 0.55)]
    assert result[2]["meta"]["text"] == ["#1 wrong_class: box 1 'cat' looks like 'dog' (confidence 0.81)"]
    # the tasks as Label Studio exports them once reviewed: read back by the data check (Label Studio JSON)
    check = check_coco(tasks, None, split="val", check_images=False)
    assert check.report.ok
    names = {c["id"]: c["name"] for c in check.dataset["categories"]}
    got = sorted((names[a["category_id"]], *[round(v, 6) for v in a["bbox"]]) for a in check.dataset["annotations"])
    assert got == sorted([("cat", 10, 5, 40, 30), ("dog", 120, 50, 60, 40), ("dog", 11, 6, 40, 30),
                          ("dog", 140, 55, 50, 40), ("dog", 30, 60, 20, 20), ("traffic light", 3.3, 7.7, 20.2, 10.0)])


def test_review_cvat_xml_and_a_top_that_keeps_one_entry(tmp_path, images, capsys):
    run = review_run(tmp_path, images)
    code, out, err = run_main("review_label_errors", [run, "--format", "cvat", "--top", "1"], capsys)
    assert code == 0, out + err
    root = ET.parse(run / "review" / "cvat" / "annotations.xml").getroot()
    assert [im.get("name") for im in root.iter("image")] == ["a.jpg"]
    boxes = [(b.get("label"), b.get("source"), {a.get("name"): a.text for a in b.iter("attribute")})
             for b in root.iter("box")]
    assert boxes == [("cat", "manual", {"review": "current", "annotation_id": "1"}),
                     ("dog", "manual", {"review": "current", "annotation_id": "2"}),
                     ("dog", "auto", {"review": "#1 wrong_class: box 1 'cat' looks like 'dog' (confidence 0.81)",
                                      "annotation_id": None})]


def test_review_of_a_folder_without_label_errors_is_one_line(tmp_path, capsys):
    code, out, err = run_main("review_label_errors", [tmp_path, "--format", "cvat"], capsys)
    assert code == 1 and err.strip().splitlines() == [
        f"error: {tmp_path / 'label_errors.json'} not found: a run writes it at its final evaluation "
        "(scripts/evaluate_predictions.py --plots DIR writes one for a predictions file)"]


def test_review_fiftyone_dataset(tmp_path, images):
    fo = pytest.importorskip("fiftyone")
    try:
        fo.Dataset().delete()
    except Exception as e:  # FiftyOneConfigError: its MongoDB cannot start on this machine
        pytest.skip(f"fiftyone is installed but cannot make a dataset here: {str(e)[:120]}")
    run = review_run(tmp_path, images)
    d = json.loads((tmp_path / "val.json").read_text())
    ims = [{**im, "path": str(tmp_path / "photos" / im["file_name"])} for im in d["images"]]
    errors = json.loads((run / "label_errors.json").read_text())["errors"]
    folder = write_review_files("fiftyone", str(tmp_path / "review"), ims, d["annotations"], errors, list(NAMES),
                                NAMES, top=3)[0]
    dataset = fo.Dataset.from_dir(folder, dataset_type=fo.types.FiftyOneDataset)
    first = dataset.first()
    assert Path(first.filepath).name == "a.jpg" and first.top_rank == 1
    assert [d.label for d in first.ground_truth.detections] == ["cat", "dog"]
    assert [(d.label, d.confidence) for d in first.label_errors.detections] == [("dog", 0.81), ("dog", 0.55)]
    assert first.label_errors.detections[0].bounding_box == pytest.approx([11 / 200, 6 / 100, 40 / 200, 30 / 100])
