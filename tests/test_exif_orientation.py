"""Every EXIF orientation, square or not, in every data format and in predict (issue 36 point 2): the pixels are
turned as PIL's `ImageOps.exif_transpose` shows them, the labels refer to the image as shown, and the data check
names every turned file; an annotation file (COCO json, VOC xml) that gives the stored size of a sideways image is
the one exception (docs/data_check.md, "EXIF orientation").

Each image is a black picture, as shown, with a red rectangle off its centre (no flip or turn maps it onto itself),
stored so that `exif_transpose` shows that picture, with the EXIF tag of its orientation. Its one label is the
rectangle on the shown picture."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import yaml
from PIL import Image, ImageOps

from detlib.data.coco import CocoDetection
from detlib.data.formats import check_coco_for_training, data_dir_paths
from detlib.data.images import DetectionImageFiles
from helpers import load_script

ORIENTATIONS = range(1, 9)
SHAPES = {"wide": (48, 32), "square": (40, 40)}  # shown (width, height)
BOX = (6, 4, 20, 14)  # the red rectangle on the shown picture, xyxy pixels


def shown_picture(width: int, height: int) -> Image.Image:
    arr = np.zeros((height, width, 3), np.uint8)
    x1, y1, x2, y2 = BOX
    arr[y1:y2, x1:x2, 0] = 255
    return Image.fromarray(arr)


def write_photo(path, orientation: int, shape: str) -> None:
    """A JPEG that `exif_transpose` shows as `shown_picture(*SHAPES[shape])`: the stored pixels are the one transpose
    of the picture that the orientation's turn undoes (found by trying PIL's, not from a table of ours)."""
    shown = shown_picture(*SHAPES[shape])
    exif = Image.Exif()
    exif[0x0112] = orientation
    for method in [None, *Image.Transpose]:
        stored = shown if method is None else shown.transpose(method)
        probe = stored.copy()
        probe.getexif()[0x0112] = orientation
        if np.array_equal(np.asarray(ImageOps.exif_transpose(probe)), np.asarray(shown)):
            break
    stored.save(path, quality=100, subsampling=0, exif=exif.tobytes())


def photos(folder) -> dict[str, tuple[int, str]]:
    """Every orientation x shape as `o<orientation>_<shape>.jpg` in `folder`: {file name: (orientation, shape)}."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for o in ORIENTATIONS:
        for shape in SHAPES:
            name = f"o{o}_{shape}.jpg"
            write_photo(folder / name, o, shape)
            out[name] = (o, shape)
    return out


def as_shown(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))


def red_extent(image: np.ndarray) -> list[int]:
    """xyxy pixel edges of the red pixels of an [H, W, 3] uint8 image."""
    ys, xs = np.nonzero((image[..., 0] > 128) & (image[..., 1] < 128))
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]


def assert_read_as_shown(ds, folder, names: dict) -> None:
    """Every item of a data set: pixels equal to exif_transpose's of its file, its boxes (when it has any) on the red
    rectangle."""
    seen = set()
    for i in range(len(ds)):
        path = ds.records[i]["path"] if isinstance(ds, CocoDetection) else ds.paths[i]
        name = path.rsplit("/", 1)[-1]
        item = ds[i]
        image = item["image"].permute(1, 2, 0).numpy()
        assert np.array_equal(image, as_shown(folder / name)), name
        assert red_extent(image) == list(BOX), name
        if item["boxes"].numel():
            assert item["boxes"].tolist() == [[float(v) for v in BOX]], name
        seen.add(name)
    assert seen == set(names)


def write_coco(root, names: dict) -> None:
    x1, y1, x2, y2 = BOX
    images = [{"id": k, "file_name": n, "width": SHAPES[s][0], "height": SHAPES[s][1]}
              for k, (n, (_, s)) in enumerate(sorted(names.items()), 1)]
    anns = [{"id": k, "image_id": k, "category_id": 1, "bbox": [x1, y1, x2 - x1, y2 - y1],
             "area": (x2 - x1) * (y2 - y1), "iscrowd": 0} for k in range(1, len(images) + 1)]
    (root / "annotations").mkdir(parents=True)
    for split in ("train2017", "val2017"):
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(
            {"images": images, "annotations": anns, "categories": [{"id": 1, "name": "red"}]}))


def write_voc(root, names: dict) -> None:
    x1, y1, x2, y2 = BOX
    (root / "Annotations").mkdir(parents=True)
    (root / "ImageSets" / "Main").mkdir(parents=True)
    for n, (_, s) in names.items():
        w, h = SHAPES[s]
        (root / "Annotations" / n.replace(".jpg", ".xml")).write_text(
            f"<annotation><filename>{n}</filename><size><width>{w}</width><height>{h}</height><depth>3</depth></size>"
            f"<object><name>red</name><difficult>0</difficult><bndbox><xmin>{x1 + 1}</xmin><ymin>{y1 + 1}</ymin>"
            f"<xmax>{x2}</xmax><ymax>{y2}</ymax></bndbox></object></annotation>")
    for split in ("train", "val"):
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(n[:-4] + "\n" for n in sorted(names)))


def write_yolo(root, names: dict) -> None:
    x1, y1, x2, y2 = BOX
    for split in ("train", "val"):
        (root / "labels" / split).mkdir(parents=True)
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        for n, (_, s) in names.items():
            w, h = SHAPES[s]
            (root / "images" / split / n).write_bytes((root / "JPEGImages" / n).read_bytes())
            (root / "labels" / split / n.replace(".jpg", ".txt")).write_text(
                f"0 {(x1 + x2) / 2 / w} {(y1 + y2) / 2 / h} {(x2 - x1) / w} {(y2 - y1) / h}\n")
    (root / "data.yaml").write_text(yaml.safe_dump({"path": ".", "train": "images/train", "val": "images/val",
                                                    "names": ["red"]}))


def data_set(tmp_path, fmt: str) -> tuple:
    """(root, the folder of the images, {file name: (orientation, shape)}) of a `fmt` set of every photo."""
    root = tmp_path / fmt
    folder = root / {"coco": "train2017", "voc": "JPEGImages", "yolo": "JPEGImages"}[fmt]
    names = photos(folder)
    if fmt == "coco":
        (root / "val2017").symlink_to(folder)
        write_coco(root, names)
    elif fmt == "voc":
        write_voc(root, names)
    else:
        write_yolo(root, names)
    return root, (root / "images" / "train" if fmt == "yolo" else folder), names


@pytest.mark.parametrize("fmt", ["coco", "voc", "yolo"])
def test_every_exif_orientation_square_or_not_is_read_as_shown_and_named_by_the_data_check(tmp_path, fmt, caplog):
    root, folder, names = data_set(tmp_path, fmt)
    paths = data_dir_paths(str(root), fmt, None, None)
    with caplog.at_level(logging.INFO):
        train, val = check_coco_for_training(paths, str(tmp_path / "out"), data_format=fmt)
    assert_read_as_shown(CocoDetection(paths["train_images"], train, train=True), folder, names)
    assert_read_as_shown(CocoDetection(paths["val_images"], val, train=False), folder, names)
    turned = {n: f"orientation {o}" for n, (o, _) in names.items() if o != 1}
    report = json.loads((tmp_path / "out" / "data_report.json").read_text())
    assert report["summaries"]["train (turned upright by their EXIF orientation)"] == turned
    assert report["summaries"]["val (turned upright by their EXIF orientation)"] == turned
    console = caplog.text
    assert all(f"{n} orientation {o}" in console for n, (o, _) in names.items() if o != 1)
    assert not any(f["level"] == "error" or "EXIF" in f["message"] for f in report["findings"])


def test_predict_reads_every_exif_orientation_as_shown_from_files_and_labelled_sources(tmp_path):
    predict = load_script("predict_retinanet")
    folder = tmp_path / "photos"
    names = photos(folder)
    assert_read_as_shown(DetectionImageFiles(sorted(str(p) for p in folder.iterdir())), folder, names)
    for fmt in ("coco", "voc", "yolo"):
        root, images, _ = data_set(tmp_path, fmt)
        source = ["--source", str(root / "annotations" / "instances_val2017.json"), "--images", str(images)] \
            if fmt == "coco" else ["--source", str(root), "--data_format", fmt]
        args = predict.parse_args(["--weights", str(tmp_path), "--output_dir", str(tmp_path / "out"), *source])
        ds, _, _, exif, _ = predict.build_dataset(args, None)
        assert_read_as_shown(ds, images, names)
        assert exif  # its drawn images are shown as the model saw them


def test_drawn_samples_show_every_exif_orientation_upright_with_the_boxes_on_the_pattern(tmp_path):
    from detlib.evaluation.drawing import sample_detections

    root, folder, names = data_set(tmp_path, "coco")
    gt = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    results = [{"image_id": a["image_id"], "category_id": 1, "bbox": a["bbox"], "score": 0.9}
               for a in gt["annotations"]]
    samples = sample_detections(gt, results, str(folder), [im["id"] for im in gt["images"]])
    assert sorted(s["file_name"] for s in samples) == sorted(names)
    for s in samples:
        assert np.array_equal(s["image"].permute(1, 2, 0).numpy(), as_shown(folder / s["file_name"])), s["file_name"]
        assert s["gt_boxes"].tolist() == s["boxes"].tolist() == [[float(v) for v in BOX]], s["file_name"]


@pytest.mark.parametrize("fmt", ["coco", "voc"])
@pytest.mark.parametrize("orientation", [5, 6, 7, 8])
def test_an_annotation_file_giving_the_stored_size_of_a_sideways_image_is_read_as_stored(tmp_path, orientation, fmt):
    """The one exception: the COCO json's width / height (or the VOC xml's <size>) is the stored size (labels drawn on
    the stored pixels, as a tool that ignores EXIF writes them): read unturned, boxes on the stored pixels, and a
    warning names the file."""
    root = tmp_path / fmt
    folder = root / ("val2017" if fmt == "coco" else "JPEGImages")
    folder.mkdir(parents=True)
    write_photo(folder / "side.jpg", orientation, "wide")
    with Image.open(folder / "side.jpg") as im:
        stored = np.asarray(im.convert("RGB"))
    x1, y1, x2, y2 = red_extent(stored)
    if fmt == "coco":
        (root / "annotations").mkdir()
        (root / "annotations" / "instances_val2017.json").write_text(json.dumps({
            "images": [{"id": 1, "file_name": "side.jpg", "width": 32, "height": 48}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "iscrowd": 0, "bbox": [x1, y1, x2 - x1, y2 - y1],
                             "area": 1.0}], "categories": [{"id": 1, "name": "red"}]}))
    else:
        (root / "Annotations").mkdir()
        (root / "ImageSets" / "Main").mkdir(parents=True)
        (root / "ImageSets" / "Main" / "val.txt").write_text("side\n")
        (root / "Annotations" / "side.xml").write_text(
            "<annotation><size><width>32</width><height>48</height></size><object><name>red</name><bndbox>"
            f"<xmin>{x1 + 1}</xmin><ymin>{y1 + 1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax>"
            "</bndbox></object></annotation>")
    paths = data_dir_paths(str(root), fmt, None, None, need_train=False)
    _, val = check_coco_for_training(paths, str(tmp_path / "out"), data_format=fmt)
    report = json.loads((tmp_path / "out" / "data_report.json").read_text())
    (warning,) = [f for f in report["findings"] if "EXIF" in f["message"]]
    assert warning["level"] == "warning"
    assert warning["examples"] == [f"side.jpg (orientation {orientation}, json 32x48)"]
    assert "val (turned upright by their EXIF orientation)" not in report["summaries"]
    sets = [CocoDetection(paths["val_images"], val, train=False)]
    if fmt == "coco":  # the loader decides by the same rule where the check did not run (predict on a json)
        sets.append(CocoDetection(paths["val_images"], paths["val_annotations"], train=False))
    for ds in sets:
        item = ds[0]
        assert np.array_equal(item["image"].permute(1, 2, 0).numpy(), stored)
        assert item["boxes"].tolist() == [[x1, y1, x2, y2]]
