"""Pascal VOC and YOLO data sets (detlib.data.formats): read into the same data as the COCO json they were written from,
trained and evaluated like it, and their own faults reported by the data check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import needs_coco_subset, write_image
from detlib.data.formats import check_coco_for_training, data_dir_paths, detect_format, read_data_dir_splits
from detlib.datacheck.coco import check_coco
from detlib.datacheck.report import DataReport
from formats_fixtures import reference_coco, voc_xml, write_voc, write_yolo


def converted(root: Path, fmt: str | None = None, **kw) -> tuple[dict, dict, DataReport, dict]:
    """(train, val) normalised by the data check, its report, and the paths, of a VOC / YOLO root."""
    paths = data_dir_paths(str(root), fmt, None, None)
    fmt = paths.pop("format")
    train, val = check_coco_for_training(paths, None, data_format=fmt, **kw)
    return train, val, paths


def report_of(root: Path, **kw) -> DataReport:
    paths = data_dir_paths(str(root), None, None, None)
    report = DataReport()
    dicts = read_data_dir_splits(paths, {"train": None, "val": None}, report=report)
    from detlib.datacheck.coco import check_coco_data

    check_coco_data(paths, converted=dicts, report=report, **kw)
    return report


def boxes_of(d: dict) -> list[tuple]:
    """(image id, category id, iscrowd, x1, y1, x2, y2) of every annotation, sorted."""
    return sorted((a["image_id"], a["category_id"], a["iscrowd"], a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2],
                   a["bbox"][1] + a["bbox"][3]) for a in d["annotations"])


def assert_same_data(a: dict, b: dict, tol: float) -> None:
    assert [(im["id"], im["file_name"], im["width"], im["height"]) for im in sorted(a["images"], key=lambda i: i["id"])] \
        == [(im["id"], im["file_name"], im["width"], im["height"]) for im in sorted(b["images"], key=lambda i: i["id"])]
    assert [(c["id"], c["name"]) for c in a["categories"]] == [(c["id"], c["name"]) for c in b["categories"]]
    ba, bb = boxes_of(a), boxes_of(b)
    assert len(ba) == len(bb) > 0
    for x, y in zip(ba, bb):
        assert x[:3] == y[:3]
        assert max(abs(u - v) for u, v in zip(x[3:], y[3:])) <= tol, (x, y)


def normalised(d: dict, split: str) -> dict:
    check = check_coco(d, None, split=split, check_images=False)
    assert check.report.ok
    return check.dataset


# ---- the layouts read back into the COCO json they were written from


@needs_coco_subset
@pytest.mark.parametrize("fmt, tol", [("{:.17g}", 1e-9), ("{:.0f}", 0.5)])
def test_voc_boxes_there_and_back_equal_the_coco_json(tmp_path, fmt, tol):
    train, val = reference_coco(crowd=True)
    root = write_voc(tmp_path / "VOC", {"train": train, "val": val}, fmt=fmt)
    assert detect_format(str(root)) == "voc"
    t, v, paths = converted(root)
    assert paths["train_images"] == str(root / "JPEGImages") and paths["val_annotations"].endswith("ImageSets/Main/val.txt")
    assert_same_data(t, normalised(train, "train"), tol)
    assert_same_data(v, normalised(val, "val"), tol)
    # COCO crowd boxes were written as difficult and read back as crowd (ignore regions)
    assert sum(a["iscrowd"] for a in t["annotations"]) == sum(a["iscrowd"] for a in train["annotations"]) > 0


@needs_coco_subset
@pytest.mark.parametrize("fmt, tol", [("{:.17g}", 1e-9), ("{:.6f}", 1e-3)])
def test_yolo_boxes_there_and_back_equal_the_coco_json(tmp_path, fmt, tol):
    train, val = reference_coco()
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val}, fmt=fmt)
    assert detect_format(str(root)) == "yolo"
    t, v, paths = converted(root)
    assert paths["train_images"] == str(root / "images" / "train")
    # YOLO's class index is the category id: the reference's ids 1..K are 0..K-1 here
    for d in (train, val):
        d = normalised(d, "val")
        shifted = {**d, "categories": [{**c, "id": c["id"] - 1} for c in d["categories"]],
                   "annotations": [{**a, "category_id": a["category_id"] - 1} for a in d["annotations"]]}
        assert_same_data(t if d["images"][0]["id"] == train["images"][0]["id"] else v, shifted, tol)


# ---- trained and evaluated like the COCO json

TINY = ["--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "16", "--per_device_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--num_workers", "2", "--epochs", "1", "--lr", "1e-3", "--report_to", "none",
        "--score_thresh", "0.0", "--num_log_images", "1", "--seed", "3"]


def load_script(name: str):
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_coco_subset
@pytest.mark.slow
def test_voc_and_yolo_sets_train_and_evaluate_exactly_like_the_coco_json(tmp_path):
    train, val = reference_coco()
    coco = tmp_path / "coco"
    for split, d in (("train", train), ("val", val)):
        (coco / f"{split}.json").parent.mkdir(parents=True, exist_ok=True)
        (coco / f"{split}.json").write_text(json.dumps(d))
    from conftest import COCO_SUBSET

    runs = {"coco": ["--train_images", str(COCO_SUBSET / "images"), "--train_annotations", str(coco / "train.json"),
                     "--val_images", str(COCO_SUBSET / "images"), "--val_annotations", str(coco / "val.json")],
            "voc": ["--data_dir", str(write_voc(tmp_path / "VOC", {"train": train, "val": val}))],
            "yolo": ["--data_dir", str(write_yolo(tmp_path / "yolo", {"train": train, "val": val})), "--data_format", "yolo"]}
    stats, preds = {}, {}
    for fmt, data in runs.items():
        out = tmp_path / f"run_{fmt}"
        stats[fmt] = load_script("train_retinanet").main([*data, *TINY, "--output_dir", str(out)])
        shift = 1 if fmt == "yolo" else 0  # YOLO's class index is the category id: 0..K-1 for the json's 1..K
        preds[fmt] = [(p["image_id"], p["category_id"] + shift, p["score"], *p["bbox"])
                      for p in json.loads((out / "predictions_val.json").read_text())]
        config = (out / "config.yaml").read_text()
        assert f"data_format: {fmt}" in config
        if fmt != "coco":  # predict on the labelled set: the evaluation's own detections, with its image ids
            source = data[1] if fmt == "voc" else str(Path(data[1]) / "data.yaml")
            load_script("predict_retinanet").main(["--weights", str(out / "last"), "--source", source, "--batch_size", "2",
                                                   "--score_thresh", "0", "--output_dir", str(tmp_path / f"pred_{fmt}"),
                                                   "--no_images", "--num_workers", "0"]
                                                  + (["--data_format", "voc"] if fmt == "voc" else []))
            predicted = json.loads((tmp_path / f"pred_{fmt}" / "predictions.json").read_text())
            assert predicted == json.loads((out / "predictions_val.json").read_text())
    assert len(preds["coco"]) > 100  # score threshold 0: the untrained model's every kept detection
    assert stats["voc"] == stats["coco"] and stats["yolo"] == stats["coco"]
    assert preds["voc"] == preds["coco"] and preds["yolo"] == preds["coco"]


# ---- VOC's own faults


def voc_root(tmp_path: Path, objects: dict[str, list[dict]], size=(100, 80), lists=None) -> Path:
    """A VOC folder of 100x80 noise images: {id: [object dicts of voc_xml's fields]}; ImageSets/Main/train.txt and
    val.txt list the first id / the others unless `lists` says {split: ids}."""
    root = tmp_path / "VOC"
    names = {}
    ids = list(objects)
    for k, (vid, objs) in enumerate(objects.items()):
        write_image(root / "JPEGImages" / f"{vid}.jpg", *size, seed=k)
        anns = []
        for o in objs:
            cid = names.setdefault(o["name"], len(names) + 1)
            anns.append({**o, "category_id": cid})
        im = {"file_name": f"{vid}.jpg", "width": size[0], "height": size[1]}
        (root / "Annotations").mkdir(parents=True, exist_ok=True)
        (root / "Annotations" / f"{vid}.xml").write_text(voc_xml(im, anns, {v: k for k, v in names.items()}))
    (root / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
    for split, listed in (lists or {"train": ids[:1], "val": ids[1:]}).items():
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(i + "\n" for i in listed))
    return root


def finding(report: DataReport, text: str):
    (f,) = [f for f in report.findings if text in f.message]
    return f


def test_voc_xmin_ymin_are_one_based_and_difficult_objects_are_ignore_regions(tmp_path):
    # whole image in VOC's 1-based inclusive indices, a difficult box and a truncated one
    root = voc_root(tmp_path, {"a": [{"name": "cat", "bbox": [0, 0, 99, 79]}, {"name": "dog", "bbox": [5, 5, 9, 9]}],
                               "b": [{"name": "cat", "bbox": [9, 19, 31, 21], "iscrowd": 1},
                                     {"name": "dog", "bbox": [49, 9, 11, 11], "truncated": 1}]})
    t, v, _ = converted(root)
    a = t["annotations"][0]  # <xmin>1</xmin><ymin>1</ymin><xmax>99</xmax><ymax>79</ymax>
    assert a["bbox"] == [0.0, 0.0, 99.0, 79.0]  # xmin = 1 -> 0: detectron2's `bbox[0] -= 1`
    by_cat = {c["name"]: c["id"] for c in v["categories"]}
    assert by_cat == {"cat": 1, "dog": 2}  # the sorted names of every xml, so train and val agree
    crowd, trunc = sorted(v["annotations"], key=lambda a: a["category_id"])
    assert crowd["iscrowd"] == 1 and crowd["difficult"] == 1 and crowd["bbox"] == [9.0, 19.0, 31.0, 21.0]
    assert trunc["iscrowd"] == 0 and trunc["truncated"] == 1
    report = report_of(root)
    assert report.summaries["val (voc)"]["difficult (ignored, as crowd)"] == 1
    assert report.summaries["val (voc)"]["truncated"] == 1
    # in training the difficult box is an ignore region, not a target
    from detlib.data.coco import CocoDetection

    ds = CocoDetection(str(root / "JPEGImages"), v, train=False)
    item = ds[0]
    assert item["boxes"].tolist() == [[49.0, 9.0, 60.0, 20.0]] and item["crowd_boxes"].tolist() == [[9.0, 19.0, 40.0, 40.0]]


def test_voc_missing_extra_and_damaged_xml_files_are_each_reported(tmp_path):
    root = voc_root(tmp_path, {"a": [{"name": "cat", "bbox": [10, 10, 20, 20]}], "b": [{"name": "cat", "bbox": [5, 5, 9, 9]}],
                               "c": [{"name": "cat", "bbox": [5, 5, 9, 9]}], "d": [{"name": "cat", "bbox": [1, 1, 9, 9]}]},
                    lists={"train": ["a", "gone", "a", "broken"], "val": ["b", "c"]})
    (root / "Annotations" / "broken.xml").write_text("<annotation><object>")
    write_image(root / "JPEGImages" / "broken.jpg", 100, 80)
    report = report_of(root)
    assert finding(report, "without Annotations/<id>.xml").examples == ["gone"]
    assert finding(report, "do not parse").examples == ["broken.xml"]
    assert finding(report, "listed twice").examples == ["a"]
    unlisted = finding(report, "in no ImageSets/Main list")
    assert unlisted.level == "warning" and unlisted.examples == ["d.xml"]
    assert report.ok and report.summaries["train"]["images"] == 1


def test_voc_objects_without_name_or_box_and_xml_without_size(tmp_path):
    root = voc_root(tmp_path, {"a": [{"name": "cat", "bbox": [10, 10, 20, 20]}], "b": [{"name": "cat", "bbox": [0, 0, 5, 5]}]})
    xml = (root / "Annotations" / "a.xml").read_text()
    xml = xml.replace("<size><width>100</width><height>80</height><depth>3</depth></size>", "")
    xml = xml.replace("</annotation>", "<object><name>dog</name></object><object><bndbox><xmin>1</xmin></bndbox></object>"
                      "<object><name>dog</name><bndbox><xmin>1</xmin><ymin>a</ymin><xmax>5</xmax><ymax>5</ymax></bndbox>"
                      "</object></annotation>")
    (root / "Annotations" / "a.xml").write_text(xml)
    report = report_of(root)
    assert finding(report, "without 4 numbers in <bndbox>").count == 2
    assert finding(report, "without a <name>").examples == ["a.xml object 3"]  # each object named by file and index
    assert finding(report, "without a usable <size>").examples == ["a.jpg"]
    assert "written 0-based" not in report.format()  # b's xmin 1 is VOC's first pixel
    xml = (root / "Annotations" / "b.xml").read_text().replace("<xmin>1</xmin>", "<xmin>0</xmin>")
    (root / "Annotations" / "b.xml").write_text(xml)
    report = report_of(root)
    assert finding(report, "written 0-based").examples == ["b.xml object 1 (cat)"]
    assert report.ok and report.summaries["train"]["annotations"] == 1


def test_voc_missing_split_list_names_the_file_and_the_splits_there(tmp_path):
    root = voc_root(tmp_path, {"a": [{"name": "cat", "bbox": [10, 10, 20, 20]}]}, lists={"trainval": ["a"]})
    with pytest.raises(FileNotFoundError, match=r"ImageSets/Main/val.txt \(splits there: trainval\)"):
        data_dir_paths(str(root), None, None, None)
    assert data_dir_paths(str(root), None, "trainval", "trainval")["val_annotations"].endswith("trainval.txt")
    (tmp_path / "VOCdevkit").mkdir()
    os.rename(root, tmp_path / "VOCdevkit" / "VOC2012")
    with pytest.raises(FileNotFoundError, match="a VOCdevkit folder"):
        detect_format(str(tmp_path / "VOCdevkit"))


# ---- YOLO's own faults


def yolo_root(tmp_path: Path, labels: dict[str, str | None], names=("cat", "dog"), size=(100, 50), val=None) -> Path:
    """images/train/<stem>.jpg noise images with labels/train/<stem>.txt (None: no label file); val the same or
    the first train image."""
    root = tmp_path / "yolo"
    for k, (stem, rows) in enumerate(labels.items()):
        write_image(root / "images" / "train" / f"{stem}.jpg", *size, seed=k)
        if rows is not None:
            (root / "labels" / "train").mkdir(parents=True, exist_ok=True)
            (root / "labels" / "train" / f"{stem}.txt").write_text(rows)
    write_image(root / "images" / "val" / "v.jpg", *size, seed=99)
    (root / "labels" / "val").mkdir(parents=True, exist_ok=True)
    (root / "labels" / "val" / "v.txt").write_text(val or "0 0.5 0.5 0.2 0.4\n")
    (root / "data.yaml").write_text(f"path: .\ntrain: images/train\nval: images/val\nnames: {list(names)}\n")
    return root


def test_yolo_normalised_cxcywh_become_pixels_and_an_image_without_labels_has_no_boxes(tmp_path):
    root = yolo_root(tmp_path, {"a": "0 0.5 0.5 0.2 0.4\n1 0.25 0.5 0.1 0.2\n", "b": None, "c": "",
                                "p": "1 0.1 0.2 0.3 0.2 0.3 0.6 0.1 0.6\n"})
    t, v, _ = converted(root)
    by_file = {im["file_name"]: im["id"] for im in t["images"]}
    assert sorted(by_file) == ["a.jpg", "b.jpg", "c.jpg", "p.jpg"]
    boxes = {(a["image_id"], a["category_id"]): [round(x, 9) for x in a["bbox"]] for a in t["annotations"]}
    # 100 x 50 image: cx 0.5 * 100 = 50, w 0.2 * 100 = 20 -> x 40; cy 0.5 * 50 = 25, h 0.4 * 50 = 20 -> y 15
    assert boxes == {(by_file["a.jpg"], 0): [40.0, 15.0, 20.0, 20.0], (by_file["a.jpg"], 1): [20.0, 20.0, 10.0, 10.0],
                     (by_file["p.jpg"], 1): [10.0, 10.0, 20.0, 20.0]}  # a polygon row: its extent
    assert [(c["id"], c["name"]) for c in t["categories"]] == [(0, "cat"), (1, "dog")]
    report = report_of(root)
    assert report.summaries["train (yolo)"]["images without a label file or rows (background)"] == 2
    assert report.ok and not report.findings


def test_yolo_class_ids_outside_names_bad_rows_pixels_and_orphan_labels_are_each_reported(tmp_path):
    root = yolo_root(tmp_path, {"a": "0 0.5 0.5 0.2 0.4\n2 0.5 0.5 0.2 0.4\n-1 0.5 0.5 0.1 0.1\n0 0.5 0.5 0.2 0.4\n",
                                "b": "0 0.5 0.5\nx 0.5 0.5 0.2 0.4\n0 50 25 20 20\n0.5 0.5 0.5 0.2 0.2\n"})
    (root / "labels" / "train" / "gone.txt").write_text("0 0.5 0.5 0.2 0.4\n")
    (root / "labels" / "train" / "classes.txt").write_text("cat\ndog\n")  # LabelImg's class list: not a label file
    report = report_of(root)
    bad_class = finding(report, "class id is not one of names (0..1)")  # an error (E09): label files named from the root
    assert bad_class.level == "error"
    assert bad_class.examples == ["labels/train/a.txt:2 (class 2)", "labels/train/a.txt:3 (class -1)"]
    assert finding(report, "duplicate label rows").examples == ["labels/train/a.txt:4"]
    assert finding(report, "not `class cx cy w h`").count == 3
    assert finding(report, "pixels instead of normalised").examples == ["labels/train/b.txt:3"]
    orphan = finding(report, "label files without an image")
    assert orphan.level == "warning" and orphan.examples == [str(root / "labels" / "train" / "gone.txt")]
    assert report.errors == [bad_class] and report.summaries["train"]["annotations"] == 1


def test_yolo_yaml_faults_are_one_line_errors(tmp_path):
    root = yolo_root(tmp_path, {"a": "0 0.5 0.5 0.2 0.4\n"})
    (root / "data.yaml").write_text("train: images/train\nval: images/val\n")
    with pytest.raises(ValueError, match="has no `names`"):
        data_dir_paths(str(root), None, None, None)
    (root / "data.yaml").write_text("train: images/train\nnames: {0: cat, 1: dog}\n")
    with pytest.raises(ValueError, match="has no `val:`"):
        data_dir_paths(str(root), None, None, None)
    (root / "data.yaml").write_text("train: images/train\nval: images/nowhere\nnames: {0: cat, 1: dog}\nnc: 2\n")
    with pytest.raises(FileNotFoundError, match="`val: images/nowhere` not found"):
        data_dir_paths(str(root), None, None, None)
    assert data_dir_paths(str(root / "data.yaml"), None, None, "train")["format"] == "yolo"  # the yaml itself


def test_train_script_names_a_data_dir_of_no_known_layout_in_one_line(tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    with pytest.raises(SystemExit) as e:
        load_script("train_retinanet").main(["--data_dir", str(tmp_path / "photos"), "--output_dir", str(tmp_path / "run"),
                                             "--report_to", "none"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "is not a data set root of a known layout" in line and "Traceback" not in err


# ---- scripts/check_dataset.py on a data set root


@needs_coco_subset
def test_check_dataset_reads_voc_and_yolo_roots_and_writes_their_coco_json(tmp_path, capsys):
    train, val = reference_coco(n_train=3, n_val=2)
    check = load_script("check_dataset")
    for fmt, root in (("voc", write_voc(tmp_path / "VOC", {"train": train, "val": val})),
                      ("yolo", write_yolo(tmp_path / "yolo", {"train": train, "val": val}))):
        out, out_val = tmp_path / f"{fmt}_train.json", tmp_path / f"{fmt}_val.json"
        assert check.main(["--data_dir", str(root), "--write_fixed", str(out), "--write_fixed_val", str(out_val)]) == 0
        printed = capsys.readouterr().out
        verdict = printed.rstrip().splitlines()[-1]  # the counts line ends the block
        assert verdict.startswith(f"{fmt.upper()} data check: 0 errors") and "wrote the repaired json of" in printed
        written = json.loads(out.read_text())
        shift = 1 if fmt == "yolo" else 0
        written["categories"] = [{**c, "id": c["id"] + shift} for c in written["categories"]]
        written["annotations"] = [{**a, "category_id": a["category_id"] + shift} for a in written["annotations"]]
        assert_same_data(written, normalised(train, "train"), 1e-9)
        assert len(json.loads(out_val.read_text())["images"]) == 2
    # a fault of the layout: exit 1, no json written
    (tmp_path / "yolo" / "data.yaml").write_text("train: images/train\nval: images/val\n")
    assert check.main(["--data_dir", str(tmp_path / "yolo")]) == 1
    assert "has no `names`" in capsys.readouterr().err
