"""The data check (detlib.datacheck.report, cococheck, foldercheck; issue 10): one fixture per kind of fault, cases C01, C03, C04, C05,
C13, C19 by name, what training (CocoDetection) and evaluation (CocoEvaluator) then do, and the round trip:
the ground truth fed back as detections scores AP exactly 1.0 on every repaired fixture, with both backends."""

from __future__ import annotations

import contextlib
import io
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from detlib.data.coco import CocoDetection
from detlib.datacheck.coco import check_coco, check_coco_data, check_train_val
from detlib.datacheck.coco_fields import coco_area, fallback_box, ids_after, int_id, number, positive_size
from detlib.datacheck.report import DataCheckError, DataReport, Findings, publish_report
from detlib.evaluation.coco import CocoEvaluator, evaluate_coco

from conftest import COCO_SUBSET, needs_coco_subset, write_image

IMAGES = str(COCO_SUBSET / "images")
# Four val images with 2, 3, 7 and 1 boxes (13 in all, none crowd).
FOUR = (802, 22192, 100667, 163497)
BACKENDS = ("pycocotools", "faster")
# pycocotools divides tp by (tp + fp + eps), so a perfect AP is 1 - 2e-16, not the float 1.0
AP_1 = pytest.approx(1.0, abs=1e-9)


def _subset(ids=FOUR, split: str = "val") -> dict:
    d = json.loads((COCO_SUBSET / "annotations" / f"instances_{split}.json").read_text())
    d["images"] = [im for im in d["images"] if im["id"] in ids]
    d["annotations"] = [a for a in d["annotations"] if a["image_id"] in ids]
    return d


def _perfect(gt: dict) -> list[dict]:
    """The non-crowd ground-truth boxes of a (clean) json as score-1 detections."""
    return [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": [float(v) for v in a["bbox"]],
             "score": 1.0} for a in gt["annotations"] if not a.get("iscrowd")]


def _round_trip(gt_raw: dict, detections: list[dict], backend: str) -> dict:
    """AP of `detections` (internal image ids) against the raw json, through CocoEvaluator as the script uses it."""
    ev = CocoEvaluator(gt_raw, backend=backend)
    for im in ev.gt_dataset["images"]:
        ev.add(im["id"], [d for d in detections if d["image_id"] == im["id"]])
    return ev.evaluate()[0]


def _messages(report: DataReport, level: str) -> str:
    return "\n".join(f.message for f in report.of_level(level))


def _find(report: DataReport, text: str):
    hits = [f for f in report.findings if text in f.message]
    assert len(hits) == 1, (text, report.format())
    return hits[0]


# ---- the named cases


@needs_coco_subset
@pytest.mark.parametrize("backend", BACKENDS)
def test_case_c01_annotation_ids_from_zero_score_ap_1(backend):
    gt = _subset()
    for k, a in enumerate(gt["annotations"]):
        a["id"] = k  # 0..N-1
    # the fault is real: pycocotools on the raw json cannot match the box whose id is 0
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        raw = COCO()
        raw.dataset = {**gt, "info": {}, "licenses": []}
        raw.createIndex()
        ev = COCOeval(raw, raw.loadRes(_perfect(gt)), "bbox")
        ev.evaluate(), ev.accumulate(), ev.summarize()
    assert ev.stats[0] < 1.0

    check = check_coco(gt, IMAGES, split="val")
    f = _find(check.report, "annotation ids pycocotools mishandles")
    assert f.level == "repair" and f.count == 1 and f.examples == [0]
    assert sorted(a["id"] for a in check.dataset["annotations"]) == list(range(1, 14))
    stats = _round_trip(gt, _perfect(gt), backend)
    assert stats["AP"] == AP_1 and stats["AR100"] == AP_1
    # variant: one image, one box, id 0 (scored 0.0 before)
    one = _subset((163497,))
    one["annotations"][0]["id"] = 0
    assert _round_trip(one, _perfect(one), backend)["AP"] == AP_1


@needs_coco_subset
def test_case_c03_two_files_with_one_image_id_stop_at_start(tmp_path):
    gt = _subset()
    gt["images"][1]["id"] = gt["images"][0]["id"]
    for a in gt["annotations"]:
        if a["image_id"] == FOUR[1]:
            a["image_id"] = FOUR[0]
    path = tmp_path / "c03.json"
    path.write_text(json.dumps(gt))
    check = check_coco(str(path), IMAGES, split="val")
    f = _find(check.report, "image id used by two different files")
    assert f.level == "error" and f.examples == ["802: 000000000802.jpg, 000000022192.jpg"]
    with pytest.raises(ValueError, match="image id used by two different files"):
        CocoDetection(IMAGES, str(path))
    with pytest.raises(ValueError, match="image id used by two different files"):
        CocoEvaluator(gt)


@needs_coco_subset
@pytest.mark.parametrize("backend", BACKENDS)
def test_case_c04_polygon_without_bbox_gets_its_box(backend):
    clean = _subset()
    gt = json.loads(json.dumps(clean))
    removed = []
    for a in gt["annotations"][::3]:
        del a["bbox"]
        removed.append(a["id"])
    check = check_coco(gt, IMAGES, split="val")
    f = _find(check.report, "derived from the segmentation")
    assert f.level == "repair" and f.count == len(removed) == 5 and f.examples == removed
    want = {a["id"]: a["bbox"] for a in clean["annotations"]}
    for a in check.dataset["annotations"]:
        np.testing.assert_allclose(a["bbox"], want[a["id"]], atol=0.02)  # COCO's bbox is the polygon's extent
    ds = CocoDetection(IMAGES, check.dataset)
    assert sum(len(r["boxes"]) for r in ds.records) == 13
    assert _round_trip(gt, _perfect(clean), backend)["AP"] == AP_1


@needs_coco_subset
@pytest.mark.parametrize("backend", BACKENDS)
def test_case_c05_bbox_and_area_as_strings_are_parsed_for_training_and_evaluation(backend):
    clean = _subset()
    gt = json.loads(json.dumps(clean))
    for a in gt["annotations"]:
        a["bbox"] = [str(v) for v in a["bbox"]]
        a["area"] = str(a["area"])
    check = check_coco(gt, IMAGES, split="val")
    f = _find(check.report, "numeric strings: parsed")
    assert f.level == "repair" and f.count == 13  # annotations, each with its bbox and area as strings
    assert all(type(v) is float for a in check.dataset["annotations"] for v in a["bbox"] + [a["area"]])
    ds = CocoDetection(IMAGES, check.dataset, train=False)
    assert ds[0]["boxes"].shape == (2, 4)
    stats = _round_trip(gt, _perfect(clean), backend)
    assert stats["AP"] == AP_1 and stats["APs"] in (1.0, -1.0)


def _huge_png(path, width=13_500, height=13_400):
    # mode "1" keeps the file and the memory small; only the header is read by the check
    Image.new("1", (width, height)).save(path, compress_level=1)


@needs_coco_subset
def test_case_c13_large_image_refused_at_start_naming_the_flag_then_accepted(tmp_path, monkeypatch):
    img = tmp_path / "img"
    img.mkdir()
    _huge_png(img / "aerial.png")
    (img / "small.jpg").write_bytes((COCO_SUBSET / "images" / "000000163497.jpg").read_bytes())
    gt = {"images": [{"id": 1, "file_name": "aerial.png", "width": 13_500, "height": 13_400},
                     {"id": 2, "file_name": "small.jpg", "width": 500, "height": 333}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1000, 1000, 8000, 8000], "area": 6.4e7,
                           "iscrowd": 0},
                          {"id": 2, "image_id": 2, "category_id": 1, "bbox": [10, 10, 100, 100], "area": 1e4, "iscrowd": 0}],
          "categories": [{"id": 1, "name": "field"}]}
    check = check_coco(gt, str(img))
    f = _find(check.report, "larger than the pixel limit")
    assert f.level == "error" and f.examples == ["aerial.png (13500x13400)"] and "--max_image_pixels 180900000" in f.message
    ok = check_coco(gt, str(img), max_image_pixels=200_000_000)
    assert ok.report.ok and len(ok.dataset["images"]) == 2
    assert _round_trip(ok.dataset, _perfect(gt), "pycocotools")["AP"] == AP_1  # the large image is evaluated
    # the raised limit also holds where the image is opened (PIL refuses this file by default)
    opened = []

    def header_only(path, exif_transpose=True, labelled_size=None):
        with Image.open(path) as im:
            opened.append(im.size)
        return Image.new("RGB", (8, 8)), False

    monkeypatch.setattr("detlib.data.coco.load_rgb", header_only)
    ds = CocoDetection(str(img), ok.dataset, max_image_pixels=200_000_000)
    ds._load(0)
    assert opened == [(13_500, 13_400)]
    ds.max_image_pixels = Image.MAX_IMAGE_PIXELS = 89_478_485
    with pytest.raises(Image.DecompressionBombError):
        ds._load(0)


@needs_coco_subset
@pytest.mark.parametrize("backend", BACKENDS)
def test_case_c19_val_with_only_its_categories_is_accepted_a_conflict_lists_only_the_pairs(backend):
    train, val = _subset(split="train", ids=(790, 802)), _subset()
    train = json.loads((COCO_SUBSET / "annotations" / "instances_train.json").read_text())
    used = {a["category_id"] for a in val["annotations"]}
    val["categories"] = [c for c in val["categories"] if c["id"] in used]
    assert len(train["categories"]) == 80 and len(val["categories"]) == len(used) == 8
    report = DataReport()
    t = check_coco(train, IMAGES, split="train", report=report)
    v = check_coco(val, IMAGES, split="val", report=report)
    check_train_val(t, v)
    assert report.ok and [c["id"] for c in v.dataset["categories"]] == [c["id"] for c in train["categories"]]
    assert "consistent with train's 80" in report.summaries["val"]["categories"]
    tr = CocoDetection(IMAGES, t.dataset)
    va = CocoDetection(IMAGES, v.dataset, train=False, category_map=tr.category_map)
    assert va.num_classes == 80
    assert _round_trip(v.dataset, _perfect(val), backend)["AP"] == AP_1

    val["categories"][0] = {**val["categories"][0], "name": "renamed"}
    val["categories"][1] = {**val["categories"][1], "name": "other"}
    report = DataReport()
    t = check_coco(train, IMAGES, split="train", report=report)
    v = check_coco(val, IMAGES, split="val", report=report)
    check_train_val(t, v)
    f = _find(report, "another name in val than in train")
    c0, c1 = (val["categories"][i]["id"] for i in (0, 1))
    names = {c["id"]: c["name"] for c in train["categories"]}
    assert f.level == "error" and f.examples == [f"{c0}: train {names[c0]!r}, val 'renamed'",
                                                 f"{c1}: train {names[c1]!r}, val 'other'"]


# ---- one fixture per kind


def _tiny(tmp_path, images, annotations, categories=None, files=True):
    if files:
        for im in images:
            if isinstance(im.get("file_name"), str):
                write_image(tmp_path / "img" / im["file_name"], 64, 48, seed=len(im["file_name"]))
    (tmp_path / "img").mkdir(exist_ok=True)
    return {"images": images, "annotations": annotations, "categories": categories or [{"id": 1, "name": "thing"}]}


def _img(i, name=None, w=64, h=48):
    return {"id": i, "file_name": name or f"{i}.jpg", "width": w, "height": h}


def _ann(i, image_id, bbox=(4, 4, 20, 10), cat=1, **kw):
    return {"id": i, "image_id": image_id, "category_id": cat, "bbox": list(bbox), "area": 200.0, "iscrowd": 0, **kw}


def test_structure_faults_are_errors_in_one_report(tmp_path):
    (tmp_path / "broken.json").write_text('{"images": [')
    r = check_coco(str(tmp_path / "broken.json")).report
    assert not r.ok and "not json" in r.errors[0].message and "broken.json" in r.errors[0].message
    (tmp_path / "list.json").write_text("[]")
    assert "not an object" in check_coco(str(tmp_path / "list.json")).report.errors[0].message
    r = check_coco({"images": [], "categories": []}).report
    assert _find(r, "required lists").examples == ["annotations"]
    gt = {"images": [_img(1), {"id": 2, "width": 64, "height": 48}, "junk"],
          "annotations": [_ann(1, 1), 7], "categories": [{"id": 1, "name": "a"}, {"id": "x", "name": "b"}]}
    r = check_coco(gt).report
    assert {f.message for f in r.errors} == {"images without a file_name (ids shown)", "images that are not objects",
                                            "annotations that are not objects", "categories without an integer id"}
    text = r.format()
    assert text.splitlines()[-1].startswith("data check: 4 errors") and "e.g. 2" in text  # the verdict last
    with pytest.raises(FileNotFoundError, match="nope.json"):
        check_coco(str(tmp_path / "nope.json"))


def test_id_faults_image_ids_strings_mixed_duplicates_and_predictions_map_back(tmp_path):
    gt = _tiny(tmp_path, [_img("a", "a.jpg"), _img("7", "b.jpg"), _img(3, "c.jpg"), _img(3, "c.jpg"), _img(9, "c.jpg")],
               [_ann(5, "a"), _ann(5, "7", (10, 10, 30, 20)), _ann("6", 3), _ann(None, 9, (30, 30, 20, 10)),
                _ann(8, 404), _ann(9, 3, cat=2)])
    check = check_coco(gt, str(tmp_path / "img"))
    r = check.report
    assert r.ok, r.format()
    assert _find(r, "not integers (or missing): numbered").examples == ["a"]
    assert _find(r, "image ids given as strings").examples == ["7"]
    assert _find(r, "listed twice with the same id and file").examples == [3]
    assert _find(r, "file listed under two image ids: merged").examples == ["c.jpg: 9 -> 3"]
    assert _find(r, "image_id is not in images").examples == [8]
    assert _find(r, "category_id is not in categories").examples == [9]
    f = _find(r, "annotation ids pycocotools mishandles")
    assert f.count == 3 and "1 duplicate" in f.message and "1 missing" in f.message
    anns = check.dataset["annotations"]
    assert sorted(a["id"] for a in anns) == [5, 6, 7, 8] and all(type(a["image_id"]) is int for a in anns)
    images = {im["file_name"]: im for im in check.dataset["images"]}
    assert images["a.jpg"]["id"] == 10 and images["a.jpg"]["original_id"] == "a" and images["b.jpg"]["id"] == 7
    ds = CocoDetection(str(tmp_path / "img"), check.dataset, train=False)
    assert [s["image_id"] for s in (ds[0], ds[1], ds[2])] == [3, 7, 10]
    assert ds[0]["boxes"].shape == (2, 4)  # both files' boxes on the one file
    for backend in BACKENDS:
        ev = CocoEvaluator(gt, backend=backend)
        for im in check.dataset["images"]:
            ev.add(im["id"], [{**d, "image_id": im["id"]} for d in _perfect(check.dataset) if d["image_id"] == im["id"]])
        assert ev.evaluate()[0]["AP"] == AP_1
        assert {d["image_id"] for d in ev.results} == {3, "7", "a"} - {"7"} | {7}  # the json's own ids
    # evaluate_coco on the raw json takes results with the json's own ids
    res = [{**d, "image_id": "a"} for d in _perfect(check.dataset) if d["image_id"] == 10]
    assert evaluate_coco(gt, res, image_ids=[10])[0]["AP"] == AP_1


def test_box_faults_degenerate_outside_garbage_rle_and_missing_area(tmp_path):
    from pycocotools import mask as mask_utils

    m = np.zeros((48, 64), dtype=np.uint8, order="F")
    m[10:20, 30:50] = 1
    rle = mask_utils.encode(m)
    rle["counts"] = rle["counts"].decode()
    anns = [_ann(1, 1, (10, 10, 0, 5)), _ann(2, 1, (100, 100, 5, 5)), _ann(3, 1, (50, 40, 30, 30)),
            _ann(4, 1, ("x", 1, 2, 3)), _ann(5, 1, (1, 2, float("nan"), 3)), {**_ann(6, 1), "bbox": "[2, 3, 10, 10]"},
            {"id": 7, "image_id": 1, "category_id": 1, "segmentation": rle, "iscrowd": 1},
            {"id": 8, "image_id": 1, "category_id": 1, "bbox": [5, 5, 10, 10]}]
    check = check_coco(_tiny(tmp_path, [_img(1)], anns), str(tmp_path / "img"))
    r = check.report
    assert _find(r, "degenerate boxes").examples == [1, 2]
    assert _find(r, "clipped to the image").examples == [3]
    assert _find(r, "without a usable bbox").examples == [4, 5]
    assert _find(r, "numeric strings").examples == [6]
    assert _find(r, "derived from the segmentation").examples == [7]
    assert _find(r, "area missing").examples == [7, 8]
    boxes = {a["id"]: a["bbox"] for a in check.dataset["annotations"]}
    assert boxes == {3: [50.0, 40.0, 14.0, 8.0], 6: [2.0, 3.0, 10.0, 10.0], 7: [30.0, 10.0, 20.0, 10.0],
                     8: [5.0, 5.0, 10.0, 10.0]}
    areas = {a["id"]: a["area"] for a in check.dataset["annotations"]}
    assert areas[7] == 200.0 and areas[8] == 100.0  # the mask's pixels; the box's without a segmentation
    ds = CocoDetection(str(tmp_path / "img"), check.dataset)
    assert ds.records[0]["boxes"].tolist() == [[50, 40, 64, 48], [2, 3, 12, 13], [30, 10, 50, 20], [5, 5, 15, 15]]
    assert ds.records[0]["iscrowd"].tolist() == [False, False, True, False]
    for backend in BACKENDS:
        assert _round_trip(check.dataset, _perfect(check.dataset), backend)["AP"] == AP_1


def _exif_rotated_jpeg(path, width, height, orientation=6):
    im = Image.fromarray(np.random.RandomState(0).randint(0, 255, (height, width, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = orientation
    im.save(path, exif=exif.tobytes())


def test_image_file_faults_missing_unreadable_sizes_and_exif(tmp_path):
    images = [_img(1, "ok.jpg"), _img(2, "gone.jpg"), _img(3, "text.jpg"), _img(4, "half.jpg", 128, 96),
              _img(5, "wrong.jpg", 64, 64), {"id": 6, "file_name": "nosize.jpg"}, _img(7, "turned.jpg", 48, 64),
              _img(8, "empty.jpg")]
    gt = _tiny(tmp_path, images, [_ann(i, i) for i in range(1, 9)], files=False)
    for name in ("ok.jpg", "half.jpg", "wrong.jpg", "nosize.jpg"):
        write_image(tmp_path / "img" / name, 64, 48)
    (tmp_path / "img" / "text.jpg").write_text("not an image")
    (tmp_path / "img" / "empty.jpg").write_bytes(b"")
    _exif_rotated_jpeg(tmp_path / "img" / "turned.jpg", 64, 48)  # stored 64x48, shown 48x64
    check = check_coco(gt, str(tmp_path / "img"), cache_file=str(tmp_path / "cache.json"))
    r = check.report
    assert _find(r, "missing or empty").examples == ["gone.jpg (missing)", "empty.jpg (empty file)"]
    assert _find(r, "cannot be read as images").examples[0].startswith("text.jpg (unreadable")
    assert _find(r, "by a resize").examples == ["half.jpg (json 128x96, file 64x48)"]
    assert _find(r, "another aspect ratio").examples == ["wrong.jpg (json 64x64, file 64x48)"]
    assert _find(r, "taken from the file").examples == ["nosize.jpg"]
    assert r.summaries["train (turned upright by their EXIF orientation)"] == {"turned.jpg": "orientation 6"}
    assert [f.level for f in r.errors] == ["error"]
    assert sorted(im["id"] for im in check.dataset["images"]) == [1, 4, 5, 6, 7]
    assert sorted(a["image_id"] for a in check.dataset["annotations"]) == [1, 4, 5, 6, 7]  # not "unknown image"
    del check.dataset["images"][[im["id"] for im in check.dataset["images"]].index(5)]
    ds = CocoDetection(str(tmp_path / "img"), check.dataset, train=False)
    shapes = {s["image_id"]: tuple(s["image"].shape[-2:]) for s in (ds[i] for i in range(len(ds)))}
    assert shapes == {1: (48, 64), 4: (96, 128), 6: (48, 64), 7: (64, 48)}  # the json's size, EXIF applied
    for backend in BACKENDS:
        assert _round_trip(check.dataset, _perfect(check.dataset), backend)["AP"] == AP_1
    # the cache answers the second process without reading the files
    (tmp_path / "img" / "ok.jpg").rename(tmp_path / "ok.bak")
    again = check_coco(gt, str(tmp_path / "img"), cache_file=str(tmp_path / "cache.json"))
    assert "ok.jpg (missing)" in _find(again.report, "missing or empty").examples


def test_header_pass_in_worker_processes_matches_the_serial_one(tmp_path, monkeypatch):
    from detlib.datacheck import report

    paths = [str(write_image(tmp_path / f"{i}.png", 8 + i, 5)) for i in range(6)] + [str(tmp_path / "none.png")]
    limit = Image.MAX_IMAGE_PIXELS
    serial = report.read_image_headers(paths, num_workers=1)
    monkeypatch.setattr(report, "PARALLEL_MIN_IMAGES", 2)
    parallel = report.read_image_headers(paths, num_workers=2, progress=False)
    assert parallel == serial and serial[0] == ("ok", 8, 5, 1) and serial[-1] == ("missing", 0, 0, 1)
    assert Image.MAX_IMAGE_PIXELS == limit  # lifted in the readers only


def test_category_faults_and_val_against_train(tmp_path):
    cats = [{"id": 1, "name": "a"}, {"id": "2", "name": "b"}, {"id": 2, "name": "b"}, {"id": 3}, {"id": 4, "name": "a"},
            {"id": 5, "name": "e"}]
    gt = _tiny(tmp_path, [_img(1)], [_ann(1, 1, cat=1), _ann(2, 1, cat=2)], cats)
    r = check_coco(gt, str(tmp_path / "img")).report
    assert r.ok
    assert _find(r, "parsed").examples == ["2"] and _find(r, "kept once").examples == ["2 'b' / 'b'"]
    assert _find(r, "named by their id").examples == [3] and _find(r, "share a name").examples == ["a"]
    assert _find(r, "without any annotation").examples == ["3 '3'", "4 'a'", "5 'e'"]
    r = check_coco({**gt, "categories": [{"id": 1, "name": "a"}, {"id": 1, "name": "z"}]}).report
    assert _find(r, "listed twice with different names").level == "error"

    train = _tiny(tmp_path, [_img(1)], [_ann(1, 1)], [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}])
    val = _tiny(tmp_path, [_img(2)], [_ann(1, 2, cat=3)], [{"id": 1, "name": "a"}, {"id": 3, "name": "c"},
                                                          {"id": 4, "name": "d"}])
    tj, vj = tmp_path / "t.json", tmp_path / "v.json"
    tj.write_text(json.dumps(train)), vj.write_text(json.dumps(val))
    paths = {"train_annotations": str(tj), "train_images": str(tmp_path / "img"), "val_annotations": str(vj),
             "val_images": str(tmp_path / "img")}
    _, _, r = check_coco_data(paths)
    assert _find(r, "unknown to train that val boxes use").examples == ["3 'c' (1 boxes)"]
    assert _find(r, "no val box uses").examples == ["4 'd'"]
    val["images"].append(_img(1))
    vj.write_text(json.dumps(val))
    assert _find(check_coco_data(paths)[2], "also in the training set").examples == ["1.jpg"]


def test_strict_mode_turns_repairs_into_errors_and_publish_stops(tmp_path):
    gt = _tiny(tmp_path, [_img(1)], [_ann(0, 1, ("1", "2", "10", "10"))])
    assert check_coco(gt, str(tmp_path / "img")).report.ok
    r = check_coco(gt, str(tmp_path / "img"), strict=True).report
    assert not r.ok and len(r.errors) == 2 and all("strict" in f.message for f in r.errors)
    with pytest.raises(DataCheckError, match="2 kinds of error .*data_report.json.*\n  train  ids "):
        publish_report(r, str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "data_report.json").read_text())
    assert saved["ok"] is False and saved["counts"] == {"error": 2, "repair": 0, "warning": 0}


def test_field_readers_parse_what_converters_write_and_refuse_the_rest():
    assert [int_id(v) for v in (7, 7.0, "7", " 7 ", "7.0", "1e3")] == [7, 7, 7, 7, 7, 1000]
    assert [int_id(v) for v in (True, 7.5, "7.5", "x", None, [7])] == [None] * 6
    assert [number(v) for v in (2, 2.5, "2.5", " -1 ")] == [2.0, 2.5, 2.5, -1.0]
    assert [number(v) for v in (False, "nan", float("inf"), "", None)] == [None] * 5
    assert [positive_size(v) for v in (640, "479.6", 0, -3, "x")] == [640, 480, None, None, None]
    assert fallback_box({"bbox": "[1, 2, 3, 4]"}) == ([1.0, 2.0, 3.0, 4.0], "strings")
    assert fallback_box({"bbox": ["1", 2, "3.5", 4]}) == ([1.0, 2.0, 3.5, 4.0], "strings")
    # no bbox: the polygons' own extent (floats, not rounded to pixels)
    poly = {"segmentation": [[10.5, 20, 30, 20, 30, 44.25], [5, 25, 6, 26]]}
    assert fallback_box(poly) == ([5.0, 20.0, 25.0, 24.25], "segmentation")
    assert fallback_box({"bbox": [1, 2, None, 4], "segmentation": []}) == (None, None)
    # a 20 x 10 rectangle as a polygon: its mask area; without a segmentation the box's
    rect = {"segmentation": [[0, 0, 20, 0, 20, 10, 0, 10]]}
    assert coco_area(rect, 1.0, 1.0, 50, 50) == 200.0  # the mask's, not the w * h given
    assert coco_area({}, 4.0, 2.5, 50, 50) == 10.0
    assert list(zip(range(3), ids_after({4, 9, 2}))) == [(0, 10), (1, 11), (2, 12)]
    assert next(ids_after(set())) == 1


def test_findings_are_added_in_table_order_with_their_fields_and_only_when_found():
    table = {"b": ("repair", "ids", "second in code, first in the table"), "a": ("error", "boxes", "limit {limit}"),
             "none": ("warning", "images", "never found")}
    found = Findings(table)
    found["a"].extend([3, 1])
    found["b"].append("x")
    report = DataReport()
    found.add_to(report, "val", limit=12)
    assert [(f.level, f.kind, f.split, f.message, f.count, f.examples) for f in report.findings] == [
        ("repair", "ids", "val", "second in code, first in the table", 1, ["x"]),
        ("error", "boxes", "val", "limit 12", 2, [3, 1])]


def test_normalised_json_checks_clean_again(tmp_path):
    gt = _tiny(tmp_path, [_img("a", "a.jpg"), _img(2, "b.jpg")], [_ann(0, "a", ("1", 2, 80, 10)), _ann(0, 2)])
    first = check_coco(gt, str(tmp_path / "img"))
    assert [f.message.split(" ")[0:3] for f in first.report.findings] == [
        ["image", "ids", "that"], ["annotation", "ids", "pycocotools"], ["bbox", "/", "area"], ["boxes", "crossing", "the"]]
    second = check_coco(first.dataset, str(tmp_path / "img"))
    assert second.report.findings == [] and second.dataset["annotations"] == first.dataset["annotations"]
    assert math.isclose(second.dataset["annotations"][0]["bbox"][2], 63.0)


# ---- ImageFolder

CATSDOGS = COCO_SUBSET.parent / "catsdogs"
needs_catsdogs = pytest.mark.skipif(not (CATSDOGS / "train" / "cat").is_dir(), reason="../shared/data/catsdogs is absent")


def _real(split, cls, k):
    return sorted((CATSDOGS / split / cls).iterdir())[k]


def _folder(root, files: dict[str, object]):
    """files: relative path -> a real file to copy, or bytes."""
    for rel, src in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(src if isinstance(src, bytes) else src.read_bytes())
    return root


@needs_catsdogs
def test_image_folder_faults_two_labels_symlinks_loops_hidden_and_val_classes(tmp_path):
    from detlib.data.imagefolder import scan_image_folder
    from detlib.datacheck.imagefolder import check_folder_scans

    cat = [_real("train", "cat", k) for k in range(3)]
    dog = [_real("train", "dog", k) for k in range(3)]
    train = _folder(tmp_path / "train", {"cat/a.jpg": cat[0], "cat/b.jpg": cat[1], "cat/fake.jpg": b"text",
                                        "cat/b_copy.jpg": cat[1], "dog/c.jpg": dog[0], "dog/d.jpg": dog[1],
                                        "dog/also_a.jpg": cat[0], ".ipynb_checkpoints/x.jpg": dog[2]})
    (train / "dog" / "link_to_b.jpg").symlink_to(train / "cat" / "b.jpg")  # the same file in two classes
    (train / "cat" / "loop").symlink_to(train / "cat")  # os.walk would list cat/ again and again
    (train / "dog" / "sub").mkdir()
    (train / "dog" / "sub" / "again").symlink_to(train / "dog" / "sub")
    val = _folder(tmp_path / "val", {"cat/e.jpg": _real("val", "cat", 0), "dog/c_again.jpg": dog[0],
                                    "bird/f.jpg": _real("val", "dog", 0)})
    scans = {"train": scan_image_folder(str(train), verify="header"), "val": scan_image_folder(str(val), verify="header")}
    assert len(scans["train"].samples) == 7  # loops not followed: each file once
    out, r = check_folder_scans(scans)
    f = _find(r, "files in two classes")
    assert f.level == "repair" and sorted(f.examples) == sorted(
        [f"{train}/cat/a.jpg (cat)", f"{train}/cat/b.jpg (cat)", f"{train}/cat/b_copy.jpg (cat)",
         f"{train}/dog/also_a.jpg (dog)", f"{train}/dog/link_to_b.jpg (dog)"])
    assert sorted(p for p, _ in out["train"].samples) == [f"{train}/dog/c.jpg", f"{train}/dog/d.jpg"]
    assert _find(r, "cannot be read").examples[0].startswith(f"{train}/cat/fake.jpg (not an image")
    assert sorted(_find(r, "reached again through a symlink").examples) == [f"{train}/cat/loop", f"{train}/dog/sub/again"]
    assert _find(r, "hidden entries").examples == [".ipynb_checkpoints"]
    assert _find(r, "classes without a usable image (a class needs").examples == ["cat"]  # all its files conflict
    assert _find(r, "class folders differ").examples == ["only in val: bird"]
    assert _find(r, "also in train").examples == [f"{val}/dog/c_again.jpg"]
    assert len(r.errors) == 2


# ---- scripts/check_dataset.py, as a new user runs it


def _check_dataset(capsys, *args) -> SimpleNamespace:
    """`main(argv)` of scripts/check_dataset.py in-process: its exit code and what it printed."""
    from helpers import run_main

    code, out, err = run_main("check_dataset", list(args), capsys)
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


@needs_coco_subset
def test_check_dataset_script_reports_writes_fixed_json_and_exits_nonzero_on_errors(tmp_path, capsys):
    gt = _subset()
    for k, a in enumerate(gt["annotations"]):
        a["id"] = k
        a["bbox"] = [str(v) for v in a["bbox"]]
    del gt["annotations"][1]["bbox"]
    bad = tmp_path / "faults.json"
    bad.write_text(json.dumps(gt))
    proc = _check_dataset(capsys, "--annotations", bad, "--images", IMAGES, "--write_fixed", tmp_path / "fixed.json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1] == "COCO data check: 0 errors, 3 repairs, 1 warnings"  # the verdict last
    assert "Traceback" not in proc.stderr
    assert "derived from the segmentation [1]" in proc.stdout
    fixed = _check_dataset(capsys, "--annotations", tmp_path / "fixed.json", "--images", IMAGES)
    assert fixed.returncode == 0 and "0 repairs" in fixed.stdout

    gt["images"][1]["id"] = gt["images"][0]["id"]  # C03 and a 40 MP limit under the files' size
    bad.write_text(json.dumps(gt))
    proc = _check_dataset(capsys, "--annotations", bad, "--images", IMAGES, "--max_image_pixels", 1000, "--strict",
                          "--write_fixed", tmp_path / "never.json", "--report_json", tmp_path / "r.json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "image id used by two different files" in proc.stdout and "--max_image_pixels 307200" in proc.stdout
    assert not (tmp_path / "never.json").exists() and json.loads((tmp_path / "r.json").read_text())["ok"] is False
    missing = _check_dataset(capsys, "--annotations", tmp_path / "nope.json", "--images", IMAGES)
    assert missing.returncode == 2 and "annotation file not found" in missing.stderr


# ---- the scripts at start (end to end, tiny)

TINY = ["--backbone", "resnet18", "--fpn_channels", "16", "--epochs", "1", "--report_to", "none", "--num_workers", "0",
        "--image_size", "64", "--per_device_batch_size", "2", "--per_device_eval_batch_size", "2"]


def _faulty_pair(tmp_path):
    """4 train + 2 val real images with C01 (ids from 0), C04 (every third bbox missing), C05 (numbers as strings)
    and C19 (val lists only the categories it uses)."""
    train, val = _subset((790, 802, 22192, 100667)), _subset((163497, 174632))
    for d in (train, val):
        for k, a in enumerate(d["annotations"]):
            a["id"], a["bbox"], a["area"] = k, [str(v) for v in a["bbox"]], str(a["area"])
            if k % 3 == 0:
                del a["bbox"]
    val["categories"] = [c for c in val["categories"] if c["id"] in {a["category_id"] for a in val["annotations"]}]
    (tmp_path / "train.json").write_text(json.dumps(train))
    (tmp_path / "val.json").write_text(json.dumps(val))
    return ["--train_images", IMAGES, "--train_annotations", str(tmp_path / "train.json"), "--val_images", IMAGES,
            "--val_annotations", str(tmp_path / "val.json")]


@needs_coco_subset
@pytest.mark.slow
def test_retinanet_two_processes_train_and_evaluate_on_the_repaired_json(tmp_path, capsys):
    from conftest import read_metrics
    from helpers import forked_launch, run_main

    out = tmp_path / "run"
    run = forked_launch("train_retinanet.py", _faulty_pair(tmp_path) + TINY + ["--score_thresh", "0", "--output_dir", out])
    assert run.codes == [0, 0], run.texts[0][-3000:] + run.texts[1][-3000:]
    text = run.texts[0]
    assert "2 process(es)" in text and "COCO evaluation on 2 images" in text
    report = json.loads((out / "data_report.json").read_text())
    assert report["ok"] and report["counts"] == {"error": 0, "repair": 6, "warning": 2}
    found = {(f["split"], f["message"].split(":")[0]): f["count"] for f in report["findings"]}
    assert found[("train", "bbox missing or not 4 finite numbers")] == 15
    assert found[("val", "bbox / area / iscrowd given as numeric strings")] == 16
    assert "consistent with train's 80" in report["summaries"]["val"]["categories"]
    # 4 of the val categories have no box in the 4 training images: their AP can only be 0
    assert found[("val", "val boxes of categories without any training box (their AP will be 0)")] == 4
    assert text.count("data check: 0 errors, 6 repairs, 2 warnings") == 1  # one block, from the main process
    assert "data check" not in run.texts[1]
    ev = [m for m in read_metrics(out) if "AP" in m]
    assert len(ev) == 1 and all(math.isfinite(ev[0][k]) for k in ("AP", "AP50", "AR100"))
    assert (out / "checkpoints" / "epoch_0001").is_dir()
    preds = json.loads((out / "predictions_val.json").read_text())
    assert {p["image_id"] for p in preds} == {163497, 174632}
    headers = json.loads((out / "image_header_cache.json").read_text())
    assert len(headers) == 6  # read once by the main process, the other one reused the cache
    # evaluation only (in-process): the checkpoint's 80 classes, a val json that lists 8 (C19), its faults repaired alike
    code, stdout, stderr = run_main("train_retinanet", ["--val_images", IMAGES, "--val_annotations", tmp_path / "val.json",
                                                        "--evaluate_only", out / "best", "--num_workers", "0", "--report_to",
                                                        "none", "--score_thresh", "0", "--output_dir", tmp_path / "ev"], capsys)
    assert code == 0 and "COCO evaluation on 2 images" in stdout, (stdout + stderr)[-4000:]
    ev_only = [m for m in read_metrics(tmp_path / "ev" / "evaluate_only") if "AP" in m]
    assert ev_only[0]["AP"] == pytest.approx(ev[0]["AP"], abs=1e-6)


@needs_coco_subset
def test_retinanet_stops_at_start_on_data_errors_with_the_report_case_c03(tmp_path, capsys):
    import time

    from helpers import run_main

    args = _faulty_pair(tmp_path)
    val = json.loads((tmp_path / "val.json").read_text())
    val["images"][1]["id"] = val["images"][0]["id"]
    for a in val["annotations"]:
        a["image_id"] = val["images"][0]["id"]
    (tmp_path / "val.json").write_text(json.dumps(val))
    out = tmp_path / "run"
    t = time.time()
    code, stdout, stderr = run_main("train_retinanet", args + TINY + ["--output_dir", str(out)], capsys)
    assert code != 0 and time.time() - t < 60
    text = stdout + stderr
    assert ("val    ids        image id used by two different files (whose boxes are whose cannot be known) [1]; "
            "e.g. 163497: 000000163497.jpg, 000000174632.jpg") in text
    assert "the data check found 1 kinds of error" in text and "Traceback" not in stdout
    assert json.loads((out / "data_report.json").read_text())["ok"] is False
    assert not (out / "checkpoints").exists()
    # --strict_data: the repairs of the same files stop the run too
    (tmp_path / "val.json").write_text(json.dumps(_subset((163497, 174632))))
    code, stdout, stderr = run_main("train_retinanet", args + TINY + ["--output_dir", str(out), "--strict_data"], capsys)
    assert code != 0 and "an error under strict checking" in stdout + stderr


@needs_catsdogs
@pytest.mark.slow
def test_catsdogs_leaves_out_a_file_in_two_classes_and_reports_it(tmp_path, capsys):
    from helpers import run_main

    files = {f"train/{c}/{k}.jpg": _real("train", c, k) for c in ("cat", "dog") for k in range(3)}
    files.update({f"val/{c}/{k}.jpg": _real("val", c, k) for c in ("cat", "dog") for k in range(2)})
    files["train/dog/copy_of_cat_0.jpg"] = _real("train", "cat", 0)
    _folder(tmp_path / "d", files)
    out = tmp_path / "run"
    code, stdout, stderr = run_main("train_catsdogs", ["--train_dir", tmp_path / "d" / "train", "--val_dir",
                                                       tmp_path / "d" / "val", "--image_size", "32", "--epochs", "1",
                                                       "--per_device_batch_size", "4", "--num_workers", "0", "--report_to",
                                                       "none", "--output_dir", out], capsys)
    assert code == 0, (stdout + stderr)[-4000:]
    report = json.loads((out / "data_report.json").read_text())
    f = [f for f in report["findings"] if f["message"].startswith("files in two classes")]
    assert len(f) == 1 and f[0]["count"] == 2 and report["summaries"]["train"]["images"] == 5
    cfg = (out / "config.yaml").read_text()
    assert "num_train_images: 5" in cfg


@pytest.mark.parametrize("missing", ["height", "width"])
def test_image_with_one_side_missing_is_a_finding_not_a_crash(missing):
    # without the image-file check nothing fills the side in: a report, never a TypeError from the box checks
    img = _img(1)
    img.pop(missing)
    gt = {"images": [img], "annotations": [_ann(1, 1)], "categories": [{"id": 1, "name": "a"}]}
    r = check_coco(gt).report
    assert _find(r, "images without a valid width / height").examples == [img["file_name"]]
    assert not r.ok


def test_a_finding_line_stays_readable_whatever_the_data_roots_length(tmp_path):
    """Case D04's bounded lines with data under a long root: each example of a finding's line is cut in its middle
    (its start and file name kept), data_report.json keeps every example whole."""
    from detlib.datacheck import DataReport

    root = "/" + "/".join(["a_rather_long_folder_name"] * 12)  # 313 characters
    paths = [f"{root}/class_{i:03d}/img_{i}.jpg" for i in range(300)]
    report = DataReport()
    report.add("warning", "images", "val", "val files that are also in train (same bytes or same file): val accuracy "
               "will be optimistic", paths[:5], count=300)
    line = report.findings[0].line()
    assert len(line) < 600, len(line)
    assert line.count("…") == 5 and "/class_004/img_4.jpg" in line and line.startswith("val    images")
    report.write(str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["findings"][0]["examples"] == paths[:5]
