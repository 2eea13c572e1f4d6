"""E cases of VOC and YOLO reading (../shared/cases/README.md, "E cases"): class names spelt two ways and a class
list (E06), YOLO class ids outside `names` or written from 1 (E09), YOLO labels beside their images (E10), text
files from Windows (E11), YOLO splits as image lists (E13), every dropped or repaired box named by its file (E25).
Each set is written from the real COCO subset (formats_fixtures.reference_coco: 6 train images with 34 boxes, 3 val
images with 38) and then damaged."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import yaml

from conftest import needs_coco_subset
from detlib.data.coco import CocoDetection
from detlib.data.formats import check_coco_for_training, data_dir_paths, read_data_dir_splits
from detlib.datacheck.coco import check_coco_data
from detlib.datacheck.report import DataCheckError, DataReport
from formats_fixtures import reference_coco, write_voc, write_yolo

pytestmark = needs_coco_subset


def checked(root: Path, **kw) -> tuple[dict | None, dict | None, DataReport]:
    """(train, val, report) of the data check the training script runs on a VOC / YOLO root (errors included)."""
    paths = data_dir_paths(str(root), None, None, None)
    report = DataReport()
    dicts = read_data_dir_splits(paths, {"train": None, "val": None}, report=report, **kw)
    train, val, report = check_coco_data(paths, converted=dicts, report=report, check_images=False)
    return train, val, report


def finding(report: DataReport, text: str):
    found = [f for f in report.findings if text in f.message]
    assert len(found) == 1, (text, report.format())
    return found[0]


def boxes(d: dict) -> list[tuple]:
    """(file name, class name, x1, y1, x2, y2 rounded to 1e-6) of every annotation, sorted."""
    files = {im["id"]: im["file_name"] for im in d["images"]}
    names = {c["id"]: c["name"] for c in d["categories"]}
    return sorted((files[a["image_id"]], names[a["category_id"]], *(round(v, 6) for v in (
        a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]))) for a in d["annotations"])


@pytest.fixture
def coco_pair():
    return reference_coco()


# ---- E06: VOC class names


def rename_objects(xml: Path, old: str, new: str, only: int | None = None) -> None:
    """Rename the objects `old` of a VOC xml to `new` (the first `only` of them, or all)."""
    text = xml.read_text()
    xml.write_text(text.replace(f"<name>{old}</name>", f"<name>{new}</name>", -1 if only is None else only))


def test_case_e06_voc_class_spelt_with_another_case_or_spaces_is_one_class(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_voc(tmp_path / "VOC", {"train": train, "val": val})
    _, ref_val, _ = checked(write_voc(tmp_path / "ref", {"train": train, "val": val}))
    val_xmls = [root / "Annotations" / im["file_name"].replace(".jpg", ".xml") for im in val["images"]]
    first = next(x for x in val_xmls if "<name>chair</name>" in x.read_text())
    rename_objects(first, "chair", "CHAIR", only=1)  # val's annotator wrote one `CHAIR`, then `Chair ` (trailing space)
    for xml in val_xmls:
        rename_objects(xml, "chair", "Chair ")
    t, v, report = checked(root)
    # one class `chair` (its most frequent spelling) with all 9 boxes, the others numbered as before: 25 classes
    assert [c["name"] for c in t["categories"]] == [c["name"] for c in train["categories"]]
    assert [c["name"] for c in v["categories"]].count("chair") == 1 and len(v["categories"]) == 25
    assert boxes(v) == boxes(ref_val) and sum(b[1] == "chair" for b in boxes(t) + boxes(v)) == 9
    merged = finding(report, "differ only in case, spaces")
    assert merged.level == "repair" and merged.examples == ["'CHAIR' / 'Chair' -> 'chair' (4 objects)"]
    # a class only in val is named: its boxes have no training box
    untrained = finding(report, "val boxes of categories without any training box")
    assert "'bottle' (6 boxes)" in " ".join(untrained.examples)


def test_case_e06_voc_close_class_names_are_named_in_one_warning(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_voc(tmp_path / "VOC", {"train": train, "val": val})
    rename_objects(root / "Annotations" / "000000000790.xml", "potted plant", "potted plants")
    _, _, report = checked(root)
    close = finding(report, "close to another")
    assert close.level == "warning" and close.examples == ["'potted plant' ~ 'potted plants'"]


def test_case_e06_voc_class_list_fixes_the_classes_and_their_order(tmp_path, coco_pair):
    from detlib.data.voc import read_class_names

    train, val = coco_pair
    root = write_voc(tmp_path / "VOC", {"train": train, "val": val})
    rename_objects(root / "Annotations" / "000000037777.xml", "chair", "Chair")
    names = [c["name"] for c in reversed(train["categories"]) if c["name"] != "elephant"]
    listing = tmp_path / "classes.txt"
    listing.write_text("# my classes\n" + "".join(f"{n}\n" for n in names) + "\n")
    assert read_class_names(str(listing)) == names == read_class_names(", ".join(names))
    t, v, report = checked(root, class_names=read_class_names(str(listing)))
    assert [(c["id"], c["name"]) for c in t["categories"]] == list(enumerate(names, 1))  # the list's order
    dropped = finding(report, "not in the class list")
    assert dropped.level == "repair" and dropped.count == 4  # train's 4 elephants, each named by file and object
    assert all(re.fullmatch(r"\d{12}\.xml object \d+ \(elephant\)", e) for e in dropped.examples)
    assert finding(report, "differ only in case").examples == ["'Chair' -> 'chair' (3 objects)"]
    assert sum(b[1] == "chair" for b in boxes(t)) == 5
    # a list naming one class twice, and a list for another layout, are one-line errors
    with pytest.raises(ValueError, match="'Chair' and 'chair' are one class"):
        read_class_names("Chair,dog,chair ")
    yolo = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    with pytest.raises(ValueError, match="for a VOC set only: a YOLO set names its classes itself"):
        checked(yolo, class_names=names)


# ---- E09: YOLO class ids


def label_files(root: Path, split: str = "train") -> list[Path]:
    return sorted((root / "labels" / split).glob("*.txt"))


def shift_classes(root: Path, by: int) -> None:
    for f in label_files(root, "train") + label_files(root, "val"):
        f.write_text("".join(f"{int(r.split()[0]) + by} {' '.join(r.split()[1:])}\n" for r in f.read_text().splitlines()))


def test_case_e09_yolo_class_id_outside_names_stops_with_the_file_and_line(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    f = root / "labels" / "train" / "000000037777.txt"
    rows = f.read_text().splitlines()
    rows[2] = "25 " + rows[2].split(" ", 1)[1]  # 25 names: classes 0..24
    rows[5] = "-1 " + rows[5].split(" ", 1)[1]
    f.write_text("\n".join(rows) + "\n")
    paths = data_dir_paths(str(root), None, None, None)
    fmt = paths.pop("format")
    with pytest.raises(DataCheckError) as e:
        check_coco_for_training(paths, None, data_format=fmt, check_images=False)
    (error,) = e.value.report.errors
    assert error.message.startswith("label rows whose class id is not one of names (0..24)")
    assert error.examples == ["labels/train/000000037777.txt:3 (class 25)", "labels/train/000000037777.txt:6 (class -1)"]


def test_case_e09_yolo_labels_written_from_1_are_refused(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    shift_classes(root, 1)  # classes 1..25 for names 0..24: the last class's row is one past the end
    _, _, report = checked(root)
    shifted = finding(report, "look written from 1")
    assert shifted.level == "error" and shifted.count == 1  # val's one `wine glass` row, class 25
    assert "subtract 1 from every class id" in shifted.message
    (row,) = finding(report, "not one of names").examples
    assert re.fullmatch(r"labels/val/\d{12}\.txt:\d+ \(class 25\)", row)


def test_case_e09_yolo_labels_that_never_use_class_0_are_said(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    yaml_file = root / "data.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("names:\n", "names:\n- zebra\n"))  # 26 names, `zebra` 0
    shift_classes(root, 1)  # every id inside names: maybe shifted, maybe class 0 has no box
    t, _, report = checked(root)
    assert report.ok
    said = finding(report, "no label row has class 0 ('zebra') while rows of classes 1..25 do")
    assert said.level == "warning" and said.split == "train"
    assert [c["name"] for c in t["categories"]][:2] == ["zebra", "banana"]


# ---- E10: YOLO label location


def move_beside(root: Path, split: str, files: list[Path]) -> None:
    for f in files:
        shutil.move(f, root / "images" / split / f.name)


def test_case_e10_yolo_labels_beside_their_images_are_read_and_said(tmp_path, coco_pair):
    train, val = coco_pair
    ref_train, ref_val, _ = checked(write_yolo(tmp_path / "ref", {"train": train, "val": val}))
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    for split in ("train", "val"):
        move_beside(root, split, label_files(root, split))
    t, v, report = checked(root)
    assert boxes(t) == boxes(ref_train) and len(t["annotations"]) == 34  # before: none read, "no usable box"
    assert boxes(v) == boxes(ref_val)
    beside = [f for f in report.findings if "beside their images, not under labels/" in f.message]
    assert [(f.split, f.level, f.count) for f in beside] == [("train", "warning", 6), ("val", "warning", 3)]
    assert beside[0].examples[0] == "images/train/000000011813.txt"


def test_case_e10_yolo_labels_half_beside_half_under_labels_are_all_read(tmp_path, coco_pair):
    train, val = coco_pair
    ref_train, _, _ = checked(write_yolo(tmp_path / "ref", {"train": train, "val": val}))
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    move_beside(root, "train", label_files(root)[::2])
    t, _, report = checked(root)
    assert boxes(t) == boxes(ref_train)  # before: 20 of the 34 boxes lost, their images trained as background
    assert finding(report, "beside their images, not under labels/").count == 3
    # an image with a label file in both places: labels/ is read, the one beside it named as not used
    f = root / "labels" / "train" / "000000022892.txt"
    (root / "images" / "train" / f.name).write_text(f.read_text().splitlines()[0] + "\n")
    t, _, report = checked(root)
    assert boxes(t) == boxes(ref_train)
    assert finding(report, "that the image's labels/ file replaces").examples == ["images/train/000000022892.txt"]


def test_case_e10_yolo_split_without_any_label_file_says_where_it_looked(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    shutil.rmtree(root / "labels" / "train")
    _, _, report = checked(root)
    looked = finding(report, "no image has a label file")
    assert looked.split == "train" and looked.count == 6
    assert "looked for labels/train/000000011813.txt and images/train/000000011813.txt" in looked.message
    assert any("no usable (non-crowd, non-degenerate) box" in f.message for f in report.errors)


# ---- E11: text files from Windows


def windows_text(path: Path, bom: bool = False, tabs: bool = False, blank_end: bool = False) -> None:
    """Rewrite a text file as Windows tools write it: CRLF; a UTF-8 BOM (Notepad), or tabs between fields and a blank
    last line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if tabs:
        lines = ["\t".join(line.split(" ")) for line in lines]
    text = "\r\n".join(lines + ([""] if blank_end else [])) + "\r\n"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))


def test_case_e11_yolo_files_from_windows_every_row_read(tmp_path, coco_pair):
    train, val = coco_pair
    ref_train, ref_val, _ = checked(write_yolo(tmp_path / "ref", {"train": train, "val": val}))
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    names = yaml.safe_load((root / "data.yaml").read_text())["names"]
    for split in ("train", "val"):
        for k, f in enumerate(sorted((root / "labels" / split).glob("*.txt"))):
            windows_text(f, bom=k % 2 == 0, tabs=k % 2 == 1, blank_end=k % 2 == 1)
        (root / "labels" / split / "classes.txt").write_text("".join(f"{n}\n" for n in names))  # LabelImg's, in order
        windows_text(root / "labels" / split / "classes.txt", bom=True)
    # the val split as an image list, and the yaml, written by Notepad too
    (root / "val.txt").write_text("".join(f"./images/val/{im['file_name']}\n" for im in val["images"]))
    (root / "data.yaml").write_text((root / "data.yaml").read_text().replace("val: images/val", "val: val.txt"))
    windows_text(root / "val.txt", bom=True)
    windows_text(root / "data.yaml", bom=True)
    t, v, report = checked(root)
    assert boxes(t) == boxes(ref_train) and len(t["annotations"]) == 34  # before: 31 of 34 rows dropped as bad
    assert [b[1:] for b in boxes(v)] == [b[1:] for b in boxes(ref_val)] and len(v["images"]) == 3
    unexpected = [f for f in report.findings if f.level != "warning" or "label" in f.message]
    assert report.ok and not unexpected, report.format()


def test_case_e11_voc_files_from_windows_every_object_read(tmp_path, coco_pair):
    from detlib.data.voc import read_class_names

    train, val = coco_pair
    ref_train, ref_val, _ = checked(write_voc(tmp_path / "ref", {"train": train, "val": val}))
    root = write_voc(tmp_path / "VOC", {"train": train, "val": val})
    texts = sorted((root / "Annotations").glob("*.xml")) + sorted((root / "ImageSets" / "Main").glob("*.txt"))
    for k, f in enumerate(texts):
        windows_text(f, bom=k % 2 == 0, blank_end=True)
    listing = tmp_path / "classes.txt"
    listing.write_text("".join(f"{c['name']}\n" for c in train["categories"]))
    windows_text(listing, bom=True, blank_end=True)
    assert read_class_names(str(listing)) == [c["name"] for c in train["categories"]]
    t, v, report = checked(root, class_names=read_class_names(str(listing)))
    assert boxes(t) == boxes(ref_train) and boxes(v) == boxes(ref_val)  # before: the first id of a BOM list missing
    assert report.ok and not [f for f in report.findings if f.level != "warning"], report.format()


# ---- E13: YOLO splits as .txt image lists


def test_case_e13_yolo_splits_as_image_lists_are_read_as_the_folder_form(tmp_path, coco_pair):
    train, val = coco_pair
    ref = write_yolo(tmp_path / "ref", {"train": train, "val": val})
    ref_train, ref_val = check_coco_for_training(data_dir_paths(str(ref), None, None, None), None, data_format="yolo")
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    # ultralytics' coco.yaml form: lists at the root, lines ./images/<split>/<name>; val: one line absolute, one
    # without ./, and its list in a subfolder (lines relative to the set's root)
    (root / "train.txt").write_text("".join(f"./images/train/{im['file_name']}\n" for im in train["images"]))
    (root / "lists").mkdir()
    files = [im["file_name"] for im in val["images"]]
    (root / "lists" / "val.txt").write_text(f"{root / 'images' / 'val' / files[0]}\nimages/val/{files[1]}\n"
                                            f"./images/val/{files[2]}\n")
    (root / "data.yaml").write_text((root / "data.yaml").read_text().replace("train: images/train", "train: train.txt")
                                    .replace("val: images/val", "val: lists/val.txt"))
    paths = data_dir_paths(str(root), None, None, None)
    t, v = check_coco_for_training(paths, str(tmp_path / "out"), data_format="yolo")  # before: 0 images, stopped
    for got, want in ((t, ref_train), (v, ref_val)):
        assert [b[1:] for b in boxes(got)] == [b[1:] for b in boxes(want)]
    assert len(CocoDetection(paths["train_images"], t)) == 6
    assert len(CocoDetection(paths["val_images"], v, train=False)) == 3
    # a listed image that is really missing is named with the folders it was looked for in
    with open(root / "train.txt", "a") as f:
        f.write("./images/train/gone.jpg\n")
    _, _, report = checked(root)
    assert finding(report, "images listed that do not exist").examples == [
        f"train.txt: ./images/train/gone.jpg (looked for in {root})"]


# ---- E25: every dropped or repaired box named by its file


def test_case_e25_voc_boxes_dropped_or_clipped_are_named_by_xml_and_object(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_voc(tmp_path / "VOC", {"train": train, "val": val}, fmt="{:.0f}")
    xml = root / "Annotations" / "000000037777.xml"
    objects = xml.read_text().split("<object>")  # [head, object 1, object 2, ...]
    x = re.search(r"<xmin>(\d+)</xmin>.*<xmax>(\d+)</xmax>", objects[2])
    objects[2] = objects[2].replace(f"<xmin>{x[1]}</xmin>", f"<xmin>{x[2]}</xmin>", 1).replace(
        f"<xmax>{x[2]}</xmax>", f"<xmax>{x[1]}</xmax>", 1)  # corners swapped
    objects[3] = re.sub(r"<xmax>\d+</xmax>", "<xmax>900</xmax>", objects[3])  # past the image's right border
    objects[4] = re.sub(r"<ymin>\d+</ymin>", "<ymin>800</ymin>", re.sub(r"<ymax>\d+</ymax>", "<ymax>900</ymax>", objects[4]))
    xml.write_text("<object>".join(objects))
    name = [re.search(r"<name>(.*?)</name>", o)[1] for o in objects[1:]]
    _, _, report = checked(root)
    assert finding(report, "xmin > xmax or ymin > ymax").examples == [f"000000037777.xml object 2 ({name[1]})"]
    assert finding(report, "crossing the image border").examples == [f"000000037777.xml object 3 ({name[2]})"]
    assert finding(report, "degenerate boxes").examples == [f"000000037777.xml object 4 ({name[3]})"]  # before: "8"


def test_case_e25_yolo_boxes_clipped_are_named_by_label_file_and_line(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    f = root / "labels" / "train" / "000000022892.txt"
    rows = f.read_text().splitlines()
    c, cx, cy, w, h = rows[1].split()
    rows[1] = f"{c} {1.004 - float(w) / 2} {cy} {w} {h}"  # 0.004 past the right border: clipped by the check
    f.write_text("\n".join(rows) + "\n")
    _, _, report = checked(root)
    assert finding(report, "crossing the image border").examples == ["labels/train/000000022892.txt:2"]


def test_case_e06_predict_reads_a_voc_source_with_the_training_runs_class_list(tmp_path, coco_pair, capsys):
    import json

    import torch
    from safetensors.torch import save_file

    from detlib.retinanet.model import build_retinanet_from_config
    from helpers import fresh_accelerate, run_main

    train, val = coco_pair
    root = write_voc(tmp_path / "VOC", {"train": train, "val": val})
    names = [c["name"] for c in reversed(train["categories"])]  # a run trained with --class_names in this order
    (tmp_path / "classes.txt").write_text("".join(f"{n}\n" for n in names))
    config = {"num_classes": len(names), "backbone": "resnet18", "fpn_channels": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 64, "max_size": None,
              "category_ids": list(range(1, len(names) + 1)), "category_names": names}
    torch.manual_seed(0)
    weights = tmp_path / "weights"
    weights.mkdir()
    model = build_retinanet_from_config(config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights / "model.safetensors"))
    (weights / "model_config.json").write_text(json.dumps(config))
    common = ["--weights", weights, "--source", root, "--data_format", "voc", "--no_images", "--num_workers", "0",
              "--score_thresh", "0.0"]
    fresh_accelerate()
    code, _, err = run_main("predict_retinanet", [*common, "--output_dir", tmp_path / "a"], capsys)
    assert code == 1 and "the model's classes are not this data set's" in err  # the xml names, sorted: not its order
    fresh_accelerate()
    code, _, err = run_main("predict_retinanet", [*common, "--class_names", tmp_path / "classes.txt", "--output_dir",
                                                  tmp_path / "b"], capsys)
    fresh_accelerate()
    assert code == 0, err
    predicted = json.loads((tmp_path / "b" / "predictions.json").read_text())
    assert len(predicted) == 300 and {p["category_id"] for p in predicted} <= set(range(1, 26))


def test_case_e09_yolo_classes_txt_in_another_order_than_names_stops_the_run(tmp_path, coco_pair):
    train, val = coco_pair
    root = write_yolo(tmp_path / "yolo", {"train": train, "val": val})
    names = [c["name"] for c in sorted(train["categories"], key=lambda c: c["id"])]
    # LabelImg's class list beside the labels: the ids were written in its order, two classes swapped against names
    swapped = [names[1], names[0], *names[2:]]
    (root / "labels" / "train" / "classes.txt").write_text("".join(f"{n}\n" for n in swapped))
    (root / "labels" / "val" / "classes.txt").write_text("".join(f"{n}\n" for n in names + ["zebra"]))  # same, + 1
    _, _, report = checked(root)
    (error,) = report.errors
    assert error.message.startswith("classes.txt files (LabelImg's class list")
    assert error.examples == [f"labels/train/classes.txt: class 0 is {names[1]!r} there, {names[0]!r} in names"]
