"""Bad inputs of the D round that concern a whole run: data that cannot teach what the run claims (D03), logs that
grow with the number of classes (D04), trackers that cannot start (D12), saves that fail (D21)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO, SHARED_DATA, write_coco, write_image
from detlib.cococheck import check_coco_data
from detlib.foldercheck import check_folder_scans
from detlib.imagefolder import scan_image_folder

CATSDOGS = SHARED_DATA / "catsdogs"
needs_catsdogs = pytest.mark.skipif(not (CATSDOGS / "train" / "cat").is_dir(), reason="../shared/data/catsdogs is not present")
# the smallest in-process classifier run: no workers (a fork per test), no tracker, 16 px
FAST = ["--report_to", "none", "--num_workers", "0", "--image_size", "16", "--epochs", "1", "--verify_images", "header"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def real_images(cls: str, n: int, split: str = "train") -> list[Path]:
    return sorted((CATSDOGS / split / cls).glob("*.jpg"))[:n]


def image_folder(root: Path, files: dict[str, list[Path]]) -> Path:
    """root/<class>/<file> copies of real images ({class: files}; an empty list makes an empty class folder)."""
    for cls, paths in files.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copy(p, root / cls / p.name)
    return root


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# ---- D03: a data set that cannot teach what the run claims

@needs_catsdogs
def test_case_d03_one_class_image_folder_stops_at_start(tmp_path, capsys):
    train = image_folder(tmp_path / "train", {"cat": real_images("cat", 6)})
    val = image_folder(tmp_path / "val", {"cat": real_images("cat", 2, "val")})
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        load_script("train_catsdogs").main([*FAST, "--train_dir", str(train), "--val_dir", str(val), "--output_dir", str(out)])
    assert e.value.code == 1
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert "Traceback" not in err
    assert "a classifier needs at least 2 classes" in err and "e.g. cat" in err
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "failed" and status["global_step"] == 0
    assert not (out / "best").exists() and not (out / "checkpoints").exists()


def test_case_d03_val_folders_whose_accuracy_means_nothing(tmp_path):
    for cls in ("cat", "dog"):
        for i in range(3):
            write_image(tmp_path / "train" / cls / f"{i}.png", 20, 20, seed=hash((cls, i)) % 1000)
    # val: images of one class only (the other folder empty) -> a warning; no image at all -> an error
    write_image(tmp_path / "val1" / "cat" / "a.png", 20, 20, seed=7)
    (tmp_path / "val1" / "dog").mkdir()
    (tmp_path / "val0" / "cat").mkdir(parents=True)
    (tmp_path / "val0" / "dog").mkdir()
    train = scan_image_folder(str(tmp_path / "train"), verify="header")
    _, report = check_folder_scans({"train": train, "val": scan_image_folder(str(tmp_path / "val1"), verify="header")})
    assert report.ok
    (w,) = [f for f in report.findings if "one class only" in f.message]
    assert w.level == "warning" and w.examples == ["cat"] and "accuracy 1.0" in w.message
    _, report = check_folder_scans({"train": train, "val": scan_image_folder(str(tmp_path / "val0"), verify="header")})
    (e,) = report.errors
    assert e.split == "val" and "the accuracy cannot be computed" in e.message
    # two classes in train: no "at least 2 classes" error
    _, report = check_folder_scans({"train": train})
    assert report.ok and not report.findings


def _coco_pair(tmp_path: Path, train_anns: list[dict], val_anns: list[dict]) -> dict:
    images = [{"id": i, "file_name": f"{i}.png", "width": 40, "height": 40} for i in (1, 2)]
    for i in (1, 2):
        write_image(tmp_path / "img" / f"{i}.png", 40, 40, seed=i)
    cats = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]
    return {"train_annotations": str(write_coco(tmp_path / "train.json", images, train_anns, cats)),
            "val_annotations": str(write_coco(tmp_path / "val.json", images, val_anns, cats)),
            "train_images": str(tmp_path / "img"), "val_images": str(tmp_path / "img")}


def test_case_d03_detection_val_sets_whose_ap_is_undefined_or_trivially_zero(tmp_path):
    def box(img, cat, crowd=0):
        return {"image_id": img, "category_id": cat, "bbox": [5, 5, 20, 20], "iscrowd": crowd}

    # train boxes all of one class: fine for a detector (no finding about it)
    _, _, report = check_coco_data(_coco_pair(tmp_path, [box(1, 1), box(2, 1)], [box(1, 1)]), progress=False)
    assert report.ok and not [f for f in report.findings if f.kind in ("boxes", "categories") and f.split == "val"]
    # val without any box, or with crowd boxes only: AP undefined
    for val in ([], [box(1, 1, crowd=1)]):
        _, _, report = check_coco_data(_coco_pair(tmp_path, [box(1, 1)], val), progress=False)
        (e,) = report.errors
        assert e.split == "val" and "AP is undefined" in e.message
    # val boxes only of a category that no training box has: AP 0 whatever is learnt (error); some of them: warning
    _, _, report = check_coco_data(_coco_pair(tmp_path, [box(1, 1)], [box(1, 2)]), progress=False)
    (e,) = report.errors
    assert "AP is 0 whatever the model learns" in e.message and e.examples == ["2 'dog' (1 boxes)"]
    _, _, report = check_coco_data(_coco_pair(tmp_path, [box(1, 1)], [box(1, 1), box(2, 2)]), progress=False)
    assert report.ok
    (w,) = [f for f in report.findings if "without any training box" in f.message]
    assert w.level == "warning" and w.examples == ["2 'dog' (1 boxes)"]
