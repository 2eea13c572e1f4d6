"""Library pieces used instead of our own (torchvision's image extensions) give the values ours gave; the
built-in data sets keep their cache folders."""

from __future__ import annotations

import json

from detlib import imagefolder, synthetic


def test_image_extensions_are_torchvisions_and_cover_ours():
    ours_before = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    assert set(ours_before) <= set(imagefolder.IMG_EXTENSIONS)
    assert all(e == e.lower() for e in imagefolder.IMG_EXTENSIONS)  # the scan lower-cases names before the check


# ---- the built-in data sets share one cache root; their folders are those of before


def test_built_in_data_sets_keep_their_cache_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("DETLIB_CACHE", str(tmp_path))
    assert synthetic.cache_root() == str(tmp_path)
    dirs = synthetic.make_synthetic_image_folder(num_train=1, num_val=1, image_size=16)
    assert dirs == {"train_dir": str(tmp_path / "synthetic_imagefolder_v2" / "train"),
                    "val_dir": str(tmp_path / "synthetic_imagefolder_v2" / "val")}
    assert json.loads((tmp_path / "synthetic_imagefolder_v2" / "generator.json").read_text()) == {
        "version": 2, "num_train": 1, "num_val": 1, "image_size": 16, "seed": 0}
    paths = synthetic.make_synthetic_coco(num_train=1, num_val=1, image_size=64, min_object=12, max_object=30)
    assert paths["train_annotations"] == str(tmp_path / "synthetic_shapes_v1" / "annotations" / "instances_train.json")
    assert paths["train_images"] == str(tmp_path / "synthetic_shapes_v1" / "images")
    assert json.loads((tmp_path / "synthetic_shapes_v1" / "generator.json").read_text())["version"] == 1
    monkeypatch.delenv("DETLIB_CACHE")
    assert synthetic.cache_root().endswith("/.cache/detlib")
