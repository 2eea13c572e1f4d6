"""The built-in synthetic data set and the main job's no-data default (in-process; the Ctrl-C stop is launched,
it needs a signal to a real process)."""

import hashlib
import json
import signal
from collections import Counter, defaultdict

import pytest

from detlib.data.builtin import make_synthetic_coco
from detlib.data.coco import CocoDetection

from conftest import read_metrics
from helpers import run_main


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


def test_default_set_keeps_every_shape_visible_at_anchor_sizes(tmp_path):
    """The built-in set (version 2): 128 px images of 2-5 shapes of 24-64 px, sizes the smallest anchors (32 px)
    match at IoU >= 0.5; a shape drawn later covers at most 30 % of an earlier one's box (version 1 let a small
    shape lie inside a big one's box, at IoU < 0.3, and be painted over: a target nobody could see)."""
    paths = make_synthetic_coco(str(tmp_path), num_train=150, num_val=1)
    data = json.loads(open(paths["train_annotations"]).read())
    assert {(im["width"], im["height"]) for im in data["images"]} == {(128, 128)}
    by_image = defaultdict(list)
    for a in sorted(data["annotations"], key=lambda a: a["id"]):  # in drawing order
        by_image[a["image_id"]].append(a["bbox"])
    assert len(by_image) == 150 and set(Counter(len(b) for b in by_image.values())) <= {2, 3, 4, 5}
    for boxes in by_image.values():
        for i, (x, y, w, h) in enumerate(boxes):
            assert 24 <= w == h <= 64
            for X, Y, W, H in boxes[i + 1:]:
                covered = max(0, min(x + w, X + W) - max(x, X)) * max(0, min(y + h, Y + H) - max(y, Y))
                assert covered < 0.3 * min(w * h, W * H), (boxes, i)


@pytest.mark.slow
def test_default_run_without_data_uses_the_builtin_set(tmp_path, monkeypatch, capsys):
    """The first screen says it is the built-in set, what the run takes and that its model is only useful at the
    end; the heads are the built-in recipe's GroupNorm ones; the summary's verdict gives the AP50 reached."""
    out = tmp_path / "o"
    monkeypatch.setenv("DETLIB_CACHE", str(tmp_path / "cache"))
    code, stdout, stderr = run_main("train_retinanet", ["--max_steps", "2", "--epochs", "1", "--num_workers", "0",
                                                        "--output_dir", out, "--report_to", "none"], capsys)
    assert code == 0, (stdout + stderr)[-4000:]
    lines = stdout.splitlines()
    (start,) = [i for i, ln in enumerate(lines) if "no data given" in ln]
    assert start < 5, lines[:start + 1]  # the first screen
    assert ("built-in synthetic shapes data set (resnet18, GroupNorm heads, 128 px, fpn_channels 64, lr 0.001, 1 epochs): "
            "with the defaults about 3.5 min on 2 CPU cores, about 1 min on a GPU, to val AP50 above 0.9; the model is only "
            "useful after the full run") in lines[start]
    assert json.loads((out / "last" / "model_config.json").read_text())["head_norm"] == "gn"
    ev = [m for m in read_metrics(out) if "AP" in m]
    assert len(ev) == 1 and ev[0]["step"] == 2
    assert lines[-1].strip().startswith("run finished in ") and lines[-1].endswith(f", AP50 {ev[0]['AP50']:.4f}"), lines[-1]


@pytest.mark.slow
def test_builtin_run_stopped_by_ctrl_c_says_its_model_is_not_ready(tmp_path, monkeypatch):
    """A user who stops the built-in run early is told the weights are not worth using yet, in the stop line."""
    from helpers import ForkedRun

    monkeypatch.setenv("DETLIB_CACHE", str(tmp_path / "cache"))
    # forked (`python scripts/...` without its imports): with no DataLoader workers, the terminal's Ctrl-C reaches
    # the one process (a group's Ctrl-C with workers: tests/test_exit_paths.py)
    run = ForkedRun("train_retinanet.py", ["--num_workers", "0", "--output_dir", tmp_path / "o", "--report_to", "none"])
    run.wait_for("training: 450 optimizer steps (75 per epoch")  # 6 epochs of 600 images / batch 8
    run.signal(signal.SIGINT)
    code, _ = run.finish("built-in run, Ctrl-C")
    lines = [ln for ln in run.text.replace("\r", "\n").splitlines() if ln.strip()]
    assert code == 75, run.text[-3000:]
    assert lines[-1].startswith("stopped: preempted by SIGINT at step "), lines[-1]
    assert lines[-1].endswith("; the built-in run's model is only useful after all 6 epochs (with the defaults about 3.5 "
                              "min on 2 CPU cores, about 1 min on a GPU, to val AP50 above 0.9): stopped early it "
                              "detects the shapes poorly"), lines[-1]
