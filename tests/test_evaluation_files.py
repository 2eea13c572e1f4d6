"""Issue 36 points 3 and 5, issue 37 F01, F02, F04, F06: intervals that hold the AP, a predictions file evaluated on
its own, and the comparison and evaluation of files that cover other images, carry other ids or other area units."""

from __future__ import annotations

import json
import logging
import sys

import numpy as np
import pytest

from detlib.evaluation import diagnostics as dg
from detlib.evaluation.coco import CocoEvaluator, area_ranges_from_edges, evaluate_coco
from detlib.evaluation.report import evaluation_diagnostics

from conftest import COCO_SUBSET, REPO, needs_coco_subset, read_metrics, traceback_through_our_code

sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))
from coco_eval_cases import all_cases, model_like_detections, real_json  # noqa: E402
import compare_predictions  # noqa: E402
import evaluate_predictions  # noqa: E402

VAL_JSON = str(COCO_SUBSET / "annotations" / "instances_val.json")
TINY = ["--backbone", "resnet18", "--image_size", "128", "--fpn_channels", "32", "--per_device_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--num_workers", "0", "--log_interval", "1"]


def hot(gt, results):
    return evaluate_coco(gt, results, backend="hotcoco", return_cocoeval=True)[2]


def test_resampled_ap_at_unit_weights_is_cocoevals_ap():
    """The bootstrap's accumulation over drawn images is COCOeval's: every image once gives its AP and AP50."""
    for name, case in all_cases().items():
        ev = evaluate_coco(case["gt"], case["results"], image_ids=case.get("img_ids"), backend="hotcoco",
                           return_cocoeval=True, area_ranges=case.get("area_rng"))[2]
        per_class, npig = dg._image_matches(ev, case["results"])
        got = dg._resampled_ap(per_class, npig, np.ones((1, len(ev.params.imgIds))), np.asarray(ev.params.recThrs))
        assert got[0] == pytest.approx(list(ev.stats[:2]), abs=1e-12), name


@needs_coco_subset
@pytest.mark.parametrize("split", ["val", "subset"])
def test_bootstrap_interval_holds_the_reported_ap(split):
    """The issue's case: on the 130-image subset the old percentile interval [0.2321, 0.2726] missed AP 0.2292."""
    gt = real_json(split)
    results = model_like_detections(gt, seed=0)
    ev = hot(gt, results)
    interval = dg.bootstrap_interval(ev, results, n_bootstrap=100, seed=0)
    for m, value in zip(("AP", "AP50"), ev.stats[:2]):
        assert interval[m]["value"] == value
        assert interval[m]["lower"] <= value <= interval[m]["upper"], (m, interval[m])
        assert interval[m]["upper"] - interval[m]["lower"] > 0.005
    assert dg.bootstrap_interval(ev, results, n_bootstrap=100, seed=0) == interval  # the seed repeats it


def one_image_gt():
    return {"images": [{"id": 7, "width": 100, "height": 80, "file_name": "a.jpg"}],
            "annotations": [{"id": 1, "image_id": 7, "category_id": 1, "bbox": [10, 10, 30, 30], "area": 900, "iscrowd": 0},
                            {"id": 2, "image_id": 7, "category_id": 1, "bbox": [50, 40, 20, 20], "area": 400, "iscrowd": 0}],
            "categories": [{"id": 1, "name": "x"}]}


def test_one_image_val_set_gets_no_interval_and_says_why(tmp_path, caplog):
    """F06: one image cannot be resampled; no zero-width "95 %" interval, one line saying why."""
    ev = CocoEvaluator(one_image_gt())
    ev.add(7, [{"image_id": 7, "category_id": 1, "bbox": [12, 11, 30, 28], "score": 0.9},
               {"image_id": 7, "category_id": 1, "bbox": [0, 0, 20, 20], "score": 0.5}])
    ev.evaluate()
    with caplog.at_level(logging.WARNING):
        out = evaluation_diagnostics(ev, str(tmp_path), epoch=1, n_bootstrap=100)
    m = out["metrics"]
    assert "AP_ci95" not in m and "AP50_ci95" not in m and "std_err_AP" not in m["bootstrap"]
    assert "too few to resample" in m["bootstrap"]["no_interval"]
    line = out["line"].splitlines()[0]  # the first evaluation of a folder is followed by the key's line
    assert "no interval: 1 image(s): too few to resample" in line and "[" not in line.split("|")[-1]
    assert [r.getMessage() for r in caplog.records if "interval" in r.getMessage()] == [
        "no 95 % interval of AP or AP50: " + m["bootstrap"]["no_interval"]]


def test_no_spread_gets_no_interval():
    """F06, the other kind: resamples that all score the same (every image the same) give no interval."""
    gt = one_image_gt()
    gt["images"].append(dict(gt["images"][0], id=8, file_name="b.jpg"))
    gt["annotations"] += [dict(a, id=a["id"] + 2, image_id=8) for a in gt["annotations"]]
    results = [{"image_id": i, "category_id": 1, "bbox": [10, 10, 30, 30], "score": 0.9} for i in (7, 8)]
    interval = dg.bootstrap_interval(hot(gt, results), results, n_bootstrap=50)
    assert interval["AP"]["none"].startswith("every resample gives the same value") and "lower" not in interval["AP"]


def write(tmp_path, name, results):
    (tmp_path / name).write_text(json.dumps(results))
    return str(tmp_path / name)


@needs_coco_subset
def test_compare_restricts_to_the_images_both_files_cover(tmp_path, capsys):
    """F01: B ran on half the val images with A's detections there: the same model, not a worse one."""
    gt = real_json("val")
    a = model_like_detections(gt, seed=0)
    half = set(sorted(im["id"] for im in gt["images"])[::2])
    b = [r for r in a if r["image_id"] in half]
    argv = ["--annotations", VAL_JSON, "--a", write(tmp_path, "a.json", a), "--b", write(tmp_path, "b.json", b),
            "--n_bootstrap", "30"]
    c = compare_predictions.main(argv)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"val images: 30; A covers {len({r['image_id'] for r in a})}, B covers 15"
    assert "comparing on the 15 images both cover" in out
    assert c["num_images"] == 15 and c["AP"]["delta"] == 0 and c["AP"]["lower"] == c["AP"]["upper"] == 0
    every = compare_predictions.main(argv + ["--all_images"])
    assert every["num_images"] == 30 and every["AP"]["delta"] < 0  # asked for: the missing images count as misses


@needs_coco_subset
@pytest.mark.parametrize("script", [compare_predictions, evaluate_predictions])
def test_results_by_file_name_are_matched_and_unknown_ids_named_in_one_line(script, tmp_path, capsys):
    """F02: predict_retinanet.py on a folder numbers images by their place in the sorted list and keeps file_name."""
    gt = real_json("val")
    a = model_like_detections(gt, seed=0)
    names = {im["id"]: im["file_name"] for im in gt["images"]}
    index = {iid: k for k, iid in enumerate(sorted(names, key=names.get))}
    by_folder = [dict(r, image_id=index[r["image_id"]], file_name=names[r["image_id"]]) for r in a]
    good, folder = write(tmp_path, "a.json", a), write(tmp_path, "folder.json", by_folder)
    args = (lambda p: ["--a", good, "--b", p, "--n_bootstrap", "20"]) if script is compare_predictions else (
        lambda p: ["--predictions", p, "--n_bootstrap", "20"])
    matched = script.main(["--annotations", VAL_JSON] + args(folder))
    assert "matched to the ground truth by file_name (30 images" in capsys.readouterr().out
    assert matched["AP"]["delta"] == 0 if script is compare_predictions else matched["AP"] == evaluate_coco(gt, a)[0]["AP"]
    no_names = write(tmp_path, "no_names.json", [{k: v for k, v in r.items() if k != "file_name"} for r in by_folder])
    with pytest.raises(SystemExit) as e:
        script.main(["--annotations", VAL_JSON] + args(no_names))
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1 and not traceback_through_our_code(err)
    assert "result image ids are not in the ground truth" in err and "predict on the json" in err and "file_name" in err


@needs_coco_subset
def test_area_ranges_given_as_areas_are_warned_of(caplog):
    """F04: `0 1024 9216` (pycocotools' areaRng in px^2) as side edges: every box is small, said once with the fix."""
    gt = real_json("val")
    for edges, warned in (([0, 1024, 9216], True), ([0, 32, 96], False), ([0, 16, 32, 96], False), ([0, 32, 2000], True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            CocoEvaluator(gt, area_ranges=area_ranges_from_edges(edges))
        text = " ".join(r.getMessage() for r in caplog.records)
        assert ("not in px^2" in text) == warned, (edges, text)
    import train_retinanet

    help_text = " ".join(train_retinanet.build_parser().format_help().split())
    assert "px of the box side, sqrt(area), not px^2 of the area" in help_text


@pytest.mark.slow
@needs_coco_subset
def test_evaluate_predictions_gives_the_runs_numbers(tmp_path, capsys):
    """Issue 36, point 5: a run's predictions_val.json evaluated on its own gives the run's final evaluation line."""
    from helpers import run_ok

    gt = json.loads(open(VAL_JSON).read())
    gt["images"] = sorted(gt["images"], key=lambda im: im["id"])[:6]
    gt["annotations"] = [a for a in gt["annotations"] if a["image_id"] in {im["id"] for im in gt["images"]}]
    val = tmp_path / "val.json"
    val.write_text(json.dumps(gt))
    out = tmp_path / "run"
    run_ok("train_retinanet", [f"--train_images={COCO_SUBSET / 'images'}", f"--train_annotations={val}",
                               f"--val_images={COCO_SUBSET / 'images'}", f"--val_annotations={val}", *TINY,
                               "--epochs", "1", "--score_thresh", "0.0", "--eval_bootstrap", "30", "--output_dir", out,
                               "--report_to", "none"], capsys)
    line = [m for m in read_metrics(out) if "AP" in m][-1]
    got = evaluate_predictions.main(["--annotations", str(val), "--predictions", str(out / "predictions_val.json"),
                                     "--n_bootstrap", "30", "--out", str(tmp_path / "eval.json"), "--plots",
                                     str(tmp_path / "plots")])
    shared = set(line) & set(got)
    assert set(line) - shared <= {"epoch", "step", "time"}, set(line) - shared
    for k in shared - {"epoch", "step"}:
        assert json.loads(json.dumps(got[k])) == line[k], k
    assert json.loads((tmp_path / "eval.json").read_text()) == json.loads(json.dumps(got))
    assert (tmp_path / "plots" / "plots" / "final" / "per_class_ap.png").is_file()


@pytest.mark.parametrize("script", ["evaluate_predictions", "compare_predictions"])
def test_help_of_the_file_commands_imports_no_torch(script):
    """Issue 36 point 5: --help is fast, so it loads none of torch, timm or accelerate (13 s on this machine before)."""
    import subprocess

    code = ("import runpy, sys\nsys.argv = ['x', '--help']\ntry:\n    runpy.run_path("
            f"{str(REPO / 'scripts' / (script + '.py'))!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'timm', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "--annotations" in out.stdout and out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:] + out.stderr
