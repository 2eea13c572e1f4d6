"""What a training run leaves in best/ and last/ for the people who use the model: the score thresholds that
maximise F1 (predict's --score_thresh best_f1), the model card, the Hub."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from conftest import COCO_SUBSET, REPO, needs_coco_subset, read_metrics

pytestmark = [needs_coco_subset]

TINY = ["--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "16", "--per_device_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--num_workers", "2", "--epochs", "2", "--eval_interval", "1",
        "--lr", "1e-3", "--report_to", "none", "--score_thresh", "0.0", "--num_log_images", "1"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_coco(root: Path, n: int = 4) -> list[str]:
    """The first n val images of the subset as both train and val set (so an evaluation finds something)."""
    d = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    d["images"] = sorted(d["images"], key=lambda im: im["id"])[:n]
    ids = {im["id"] for im in d["images"]}
    d["annotations"] = [a for a in d["annotations"] if a["image_id"] in ids]
    root.mkdir(parents=True, exist_ok=True)
    (root / "set.json").write_text(json.dumps(d))
    images = str(COCO_SUBSET / "images")
    return ["--train_images", images, "--train_annotations", str(root / "set.json"), "--val_images", images,
            "--val_annotations", str(root / "set.json")]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_run")
    out = root / "run"
    load_script("train_retinanet").main([*tiny_coco(root / "data"), *TINY, "--output_dir", str(out)])
    return out


@pytest.mark.slow
def test_each_evaluation_reports_the_best_f1_threshold_per_class(tiny_run):
    evals = [m for m in read_metrics(tiny_run) if "AP" in m]
    assert len(evals) == 2
    for e in evals:
        best = e["best_f1"]
        assert best["iou"] == 0.5 and set(best["per_class"]) == set(e["per_class"])  # the classes with ground truth
        for v in best["per_class"].values():
            assert set(v) == {"category_id", "score_thresh", "F1", "precision", "recall", "num_gt"}
            assert 0 <= v["F1"] <= 1 and (v["score_thresh"] is None) == (v["F1"] == 0)
        assert "curves" not in best
    found = [v for v in evals[-1]["best_f1"]["per_class"].values() if v["score_thresh"] is not None]
    assert found, "the tiny run should find something at score 0"
    assert (tiny_run / "plots" / "epoch_0001" / "f1_curve.png").is_file()
    curves = json.loads((tiny_run / "plots" / "epoch_0001" / "f1_curve.json").read_text())
    assert curves["per_class"] == evals[-1]["best_f1"]["per_class"] and len(curves["curves"]["all"]) == 101
    # beside the weights: the thresholds of the evaluation of those weights (last/: the final one)
    last = json.loads((tiny_run / "last" / "score_thresholds.json").read_text())
    assert last == {**evals[-1]["best_f1"], "epoch": 1, "step": evals[-1]["step"]}
    best_step = json.loads((tiny_run / "best" / "best.json").read_text())["step"]
    (of_best,) = [e for e in evals if e["step"] == best_step]
    assert json.loads((tiny_run / "best" / "score_thresholds.json").read_text())["per_class"] == of_best["best_f1"]["per_class"]


@pytest.mark.slow
def test_predict_with_score_thresh_best_f1_keeps_each_class_above_its_threshold(tiny_run, tmp_path):
    weights = tmp_path / "weights"
    shutil.copytree(tiny_run / "last", weights)
    thresholds = json.loads((weights / "score_thresholds.json").read_text())
    predict = load_script("predict_retinanet")
    source = str(COCO_SUBSET / "images" / "000000000790.jpg")
    common = ["--weights", str(weights), "--source", source, "--no_images", "--num_workers", "0"]
    every = predict.main([*common, "--score_thresh", "0", "--output_dir", str(tmp_path / "all")])
    # hand-set thresholds among the highest scores that no two detections share (an early model ties many low
    # scores, and NMS and the cap of 100 choose among ties by position): person (1) its own, the others the pooled
    scores = sorted((r["score"] for r in every), reverse=True)
    distinct = next((k for k in range(1, len(scores)) if scores[k] == scores[k - 1]), len(scores))
    top = scores[:distinct]
    assert len(top) >= 4
    for t_person, t_pooled in ((top[len(top) // 2], 1.0), (None, top[len(top) // 2])):
        thresholds["per_class"] = {} if t_person is None else {"person": {**next(iter(thresholds["per_class"].values())),
                                                                          "category_id": 1, "score_thresh": t_person}}
        thresholds["all"]["score_thresh"] = t_pooled
        (weights / "score_thresholds.json").write_text(json.dumps(thresholds))
        kept = predict.main([*common, "--score_thresh", "best_f1", "--output_dir", str(tmp_path / "best")])
        expected = [r for r in every if r["score"] >= (t_person if r["category_id"] == 1 and t_person else t_pooled)]
        assert kept == expected and 0 < len(kept) < len(every)
    # no thresholds beside the weights: one line naming the file
    (weights / "score_thresholds.json").unlink()
    with pytest.raises(SystemExit, match="--score_thresh best_f1: no score_thresholds.json beside the weights"):
        predict.main([*common, "--score_thresh", "best_f1", "--output_dir", str(tmp_path / "none")])
