"""The built-in synthetic data set and the main job's no-data default."""

import hashlib
import json

from detlib.data import CocoDetection
from detlib.synthetic import make_synthetic_coco

from conftest import read_metrics, run_script


def _digest(paths):
    h = hashlib.sha256()
    for key in ("train_annotations", "val_annotations"):
        with open(paths[key], "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def test_generation_is_deterministic_cached_and_coco_format(tmp_path):
    a = make_synthetic_coco(str(tmp_path / "a"), num_train=6, num_val=3, image_size=64, min_object=12, max_object=30)
    b = make_synthetic_coco(str(tmp_path / "b"), num_train=6, num_val=3, image_size=64, min_object=12, max_object=30)
    assert _digest(a) == _digest(b)
    mtime = (tmp_path / "a" / "annotations" / "instances_train.json").stat().st_mtime_ns
    again = make_synthetic_coco(str(tmp_path / "a"), num_train=6, num_val=3, image_size=64, min_object=12, max_object=30)
    assert again == a and (tmp_path / "a" / "annotations" / "instances_train.json").stat().st_mtime_ns == mtime
    ds = CocoDetection(a["train_images"], a["train_annotations"])
    assert len(ds) == 6 and ds.num_classes == 3 and ds.num_target_boxes() >= 6
    val = json.loads(open(a["val_annotations"]).read())
    assert {im["id"] for im in val["images"]}.isdisjoint({r["id"] for r in ds.records})
    for r in ds.records:
        assert ((r["boxes"][:, 2:] - r["boxes"][:, :2]) >= 12).all()


def test_default_run_without_data_uses_the_builtin_set(tmp_path):
    out = tmp_path / "o"
    proc = run_script("train_retinanet.py", ["--max_steps", "2", "--epochs", "1", "--num_workers", "0", "--output_dir", str(out),
                                             "--report_to", "none"], env={"DETLIB_CACHE": str(tmp_path / "cache")})
    assert "built-in synthetic shapes data set" in proc.stdout
    ev = [m for m in read_metrics(out) if "AP" in m]
    assert len(ev) == 1 and ev[0]["step"] == 2
