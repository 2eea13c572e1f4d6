"""Issue 29: `report.evaluation_diagnostics`, the one call after `CocoEvaluator.evaluate()`: files, the metrics line's
keys and values, the log line, the trackers; any backend; nothing detected."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

from detlib.evaluation import diagnostics as dg
from detlib.evaluation.coco import CocoEvaluator, evaluate_coco
from detlib.evaluation.report import evaluation_diagnostics, log_diagnostics_to_trackers

from conftest import REPO, needs_coco_subset

sys.path.insert(0, str(REPO / "benchmarks"))
from coco_eval_cases import model_like_detections, real_json  # noqa: E402


def evaluated(gt, results, backend):
    ev = CocoEvaluator(gt, backend=backend)
    for im in gt["images"]:
        ev.add(im["id"], [r for r in results if r["image_id"] == im["id"]])
    ev.evaluate()
    return ev


@needs_coco_subset
@pytest.mark.parametrize("backend", ["pycocotools", "hotcoco"])
def test_diagnostics_files_metrics_and_line(backend, tmp_path, monkeypatch):
    from detlib.evaluation import report

    monkeypatch.setattr(report, "_KEYED", set())  # as in a new process (pytest may hand the next case this tmp_path)
    gt = real_json("val")
    results = model_like_detections(gt, seed=0)
    ev = evaluated(gt, results, backend)
    out = evaluation_diagnostics(ev, str(tmp_path), epoch=3, n_bootstrap=20, seed=0, label_errors=True)
    m = out["metrics"]
    direct = evaluate_coco(gt, results, backend="hotcoco", return_cocoeval=True)[2]
    assert m["num_images_evaluated"] == 30
    assert m["errors"]["count"] == dg.error_breakdown(direct)["count"]
    assert m["errors"]["dAP"] == dg.error_breakdown(direct)["dAP"]
    assert m["calibration"]["ECE"] == dg.calibration(direct)["ECE"]
    interval = dg.bootstrap_interval(direct, results, n_bootstrap=20, seed=0)
    assert m["AP_ci95"] == [interval["AP"]["lower"], interval["AP"]["upper"]]
    assert m["AP_ci95"][0] < ev.coco_eval.stats[0] < m["AP_ci95"][1]
    assert sum(m["label_errors"].values()) > 0
    folder = tmp_path / "plots" / "epoch_0003"
    for name in ("error_breakdown.png", "error_breakdown.json", "reliability.png", "reliability.json", "bootstrap.json"):
        assert (folder / name).stat().st_size > 100, name
    assert json.loads((folder / "error_breakdown.json").read_text())["count"] == m["errors"]["count"]
    assert json.loads((tmp_path / "label_errors.json").read_text())["errors"][0]["rank"] == 1
    json.dumps(m)  # the metrics line is plain JSON
    first, key = out["line"].split("\n")  # the run's first line comes with its key, the next ones without
    assert first.startswith("errors dAP50/count: ") and key == dg.DIAGNOSTICS_KEY
    again = evaluation_diagnostics(ev, str(tmp_path), epoch=4, n_bootstrap=20, seed=0)["line"]
    assert again == first


def test_nothing_detected(tmp_path):
    gt = {"images": [{"id": 1, "width": 50, "height": 50}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [5, 5, 20, 20], "area": 400, "iscrowd": 0}],
          "categories": [{"id": 1, "name": "x"}]}
    ev = CocoEvaluator(gt)
    ev.add(1, [])
    ev.evaluate()
    out = evaluation_diagnostics(ev, str(tmp_path), epoch=None, label_errors=True)
    assert out["metrics"] == {"num_images_evaluated": 1, "label_errors": {"wrong_class": 0, "badly_placed": 0,
                                                                            "missing_box": 0}}
    assert out["line"] == "no diagnostics (nothing detected)"


@needs_coco_subset
def test_trackers_get_scalars_and_plots(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    gt = real_json("val")
    ev = evaluated(gt, model_like_detections(gt, seed=0), "hotcoco")
    out = evaluation_diagnostics(ev, str(tmp_path), epoch=1, n_bootstrap=10)
    writer = SummaryWriter(str(tmp_path / "tb"))
    tracker = SimpleNamespace(name="tensorboard")
    accelerator = SimpleNamespace(is_main_process=True, trackers=[tracker], get_tracker=lambda name, unwrap: writer)
    log_diagnostics_to_trackers(accelerator, out, step=7)
    writer.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Scalars("errors/count_background")[0].value == out["metrics"]["errors"]["count"]["background"]
    assert acc.Scalars("calibration/ECE")[0].step == 7
    assert {"plots/error_breakdown", "plots/reliability"} <= set(acc.Tags()["images"])
    assert os.path.isdir(tmp_path / "plots" / "epoch_0001")
