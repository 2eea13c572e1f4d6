"""scripts/predict_retinanet.py on real COCO images: the same detections as --evaluate_only, the same on 2
processes as on 1, folders / globs / unreadable files, per-image json, class names.

The 2-process prediction is forked from the test process (`helpers.forked_ok`); the training, the evaluation
and every 1-process prediction run `main(argv)` in-process (a launch adds ~8 s of start-up per process; the exit
paths of predict are tests/test_exit_paths.py's)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from conftest import needs_coco_subset, write_image
from helpers import forked_launch, forked_ok, load_script, run_main, run_ok
from tiny_retinanet import train_tiny

pytestmark = [needs_coco_subset]  # the runs are marked slow one by one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_retinanet")
    t = train_tiny(root)
    out = root / "eval"
    run_ok("train_retinanet", [f"--val_images={t['images']}", f"--val_annotations={t['val_json']}",
                                         "--evaluate_only", t["run"] / "last", "--per_device_eval_batch_size", "2",
                                         "--score_thresh", "0.0", "--num_workers", "0", "--output_dir", out,
                                         "--report_to", "none"])
    t["eval_predictions"] = json.loads((out / "evaluate_only" / "predictions_val.json").read_text())
    return t


@pytest.mark.slow
def predict(args: list, capsys) -> str:
    """scripts/predict_retinanet.py's `main(args)` in-process, as a 1-process launch; returns its stdout."""
    code, out, err = run_main("predict_retinanet", args, capsys)
    assert code == 0, (out + err)[-4000:]
    return out


def test_predict_on_coco_json_equals_evaluate_only(tiny, tmp_path, capsys):
    out = tmp_path / "pred"
    stdout = predict(["--weights", tiny["run"] / "last", "--source", tiny["val_json"], "--images", tiny["images"],
                      "--batch_size", "2", "--score_thresh", "0.0", "--num_workers", "0", "--output_dir", out], capsys)
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == 6 * 100  # score threshold 0: every image keeps its 100 best
    assert preds == tiny["eval_predictions"]  # the same dicts, the same floats, the same order
    val = json.loads(tiny["val_json"].read_text())
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(im["file_name"] for im in val["images"])
    assert "6 images, 600 detections with score >= 0:" in stdout
    # the config has no category_names: the COCO json's names are used
    summary = stdout.split("600 detections with score >= 0: ")[1].splitlines()[0]
    names = {c["name"] for c in val["categories"]}
    assert summary and all(item.rsplit(" ", 1)[0] in names for item in summary.split(", ")), summary
    assert "file_name" not in preds[0]  # the results carry the json's image ids


def test_nothing_skipped_leaves_no_skipped_txt_and_the_last_line_names_predictions_json(tmp_path, caplog):
    """A prediction that read every input writes no skipped.txt and removes an earlier prediction's; its last log
    line names the file it wrote."""
    import argparse
    import logging

    predict = load_script("predict_retinanet")
    (tmp_path / "skipped.txt").write_text("/src/old.jpg (unreadable)\n")  # an earlier prediction's
    ds = argparse.Namespace(paths=["/src/a.jpg"])
    shards = [({0: [{"image_id": 0, "category_id": 1, "bbox": [1, 1, 2, 2], "score": 0.9}]}, [], {}, {})]
    args = argparse.Namespace(output_dir=str(tmp_path), score_thresh=0.5, no_images=False, draw_thresh=0.3, format="coco")
    with caplog.at_level(logging.INFO):
        predict.write_outputs(args, ds, shards, [], {1: "circle"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions.json"]
    last = caplog.records[-1].getMessage()
    assert last.startswith(f"wrote {tmp_path / 'predictions.json'}: 1 images, 1 detections with score >= 0.5: circle 1")


@pytest.mark.slow
def test_predict_folder_two_processes_equal_one_and_skips_unreadable(tiny, tmp_path, capsys):
    """A folder with the 6 val images, a text file saved as .jpg (sorted last) and a hidden file: 1 and 2
    processes give the same predictions, the broken file is listed, never a crash; the boxes and scores are
    those of the evaluation (same files, same order, same batches)."""
    src = tmp_path / "photos"
    val = json.loads(tiny["val_json"].read_text())
    for im in val["images"]:
        (src / "a").mkdir(parents=True, exist_ok=True)
        shutil.copy(tiny["images"] / im["file_name"], src / "a" / im["file_name"])
    (src / "zz").mkdir()
    (src / "zz" / "broken.jpg").write_text("not an image")
    (src / "a" / ".hidden.jpg").write_text("never read")
    weights = tmp_path / "weights"
    shutil.copytree(tiny["run"] / "last", weights)
    cfg = json.loads((weights / "model_config.json").read_text())
    cats = {c["id"]: c["name"] for c in val["categories"]}
    cfg["category_names"] = [cats[c] for c in cfg["category_ids"]]
    (weights / "model_config.json").write_text(json.dumps(cfg))

    outs = {}
    for n in (1, 2):  # 1 process in-process, 2 forked
        out = tmp_path / f"out{n}"
        args = ["--weights", weights / "model.safetensors", "--source", src, "--batch_size", "2", "--score_thresh", "0.0",
                "--num_workers", "0", "--save_json_per_image", "--output_dir", out]
        stdout = predict(args, capsys) if n == 1 else forked_ok("predict_retinanet.py", args)
        assert f"{n} process(es)" in stdout
        outs[n] = json.loads((out / "predictions.json").read_text())
        assert (out / "skipped.txt").read_text().strip() == f"{src / 'zz' / 'broken.jpg'} (unreadable)"
        assert sorted(p.name for p in (out / "images" / "a").iterdir()) == sorted(im["file_name"] for im in val["images"])
        per_image = json.loads((out / "json" / "a" / val["images"][0]["file_name"].replace(".jpg", ".json")).read_text())
        assert per_image["file_name"] == f"a/{val['images'][0]['file_name']}" and len(per_image["detections"]) == 100
        assert {d["category_name"] for d in per_image["detections"]} <= set(cats.values())
    assert outs[1] == outs[2]
    assert len(outs[1]) == 600
    # file_name and index-based image ids instead of the json's; boxes and scores as the evaluation's
    by_name = {im["file_name"]: im["id"] for im in val["images"]}
    as_eval = [dict(p, image_id=by_name[p.pop("file_name")[2:]]) for p in outs[1]]
    assert as_eval == tiny["eval_predictions"]


@pytest.mark.slow
def test_predict_glob_single_file_and_sideways_photo(tiny, tmp_path, capsys):
    val = json.loads(tiny["val_json"].read_text())
    one = tiny["images"] / val["images"][1]["file_name"]
    out = tmp_path / "one"
    predict(["--weights", tiny["run"], "--source", one, "--score_thresh", "0.0", "--no_images", "--num_workers", "0",
             "--output_dir", out], capsys)
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == 100 and {p["file_name"] for p in preds} == {one.name} and {p["image_id"] for p in preds} == {0}
    assert not (out / "images").exists()
    out = tmp_path / "glob"
    stdout = predict(["--weights", tiny["run"] / "best", "--source", tiny["images"] / "00000000079*.jpg",
                      "--num_workers", "0", "--score_thresh", "0.0", "--output_dir", out], capsys)
    n = len(list(tiny["images"].glob("00000000079*.jpg")))
    assert f"{n} images, {100 * n} detections" in stdout
    # a photo stored sideways (EXIF orientation 6): predicted and drawn upright, boxes in upright pixels
    arr = np.asarray(Image.open(one).convert("RGB"))[:200, :300]
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(tmp_path / "side.jpg", exif=exif)
    out = tmp_path / "side"
    predict(["--weights", tiny["run"], "--source", tmp_path / "side.jpg", "--score_thresh", "0.0", "--draw_thresh", "0.0",
             "--num_workers", "0", "--output_dir", out], capsys)
    boxes = np.array([p["bbox"] for p in json.loads((out / "predictions.json").read_text())])
    assert len(boxes) == 100
    assert (boxes[:, 0] + boxes[:, 2]).max() <= 200 + 1e-3 and (boxes[:, 1] + boxes[:, 3]).max() <= 300 + 1e-3
    assert Image.open(out / "images" / "side.jpg").size == (200, 300)  # (width, height) upright


def test_missing_weights_is_one_line(tmp_path, capsys):
    one = write_image(tmp_path / "one.jpg", 64, 48)
    code, _, err = run_main("predict_retinanet", ["--weights", tmp_path / "nothing", "--source", one,
                                                  "--output_dir", tmp_path / "x"], capsys)
    assert code != 0 and f"no model weights at {tmp_path / 'nothing'}" in err


def test_skipped_txt_lists_inputs_in_the_same_order_on_2_processes_as_on_1(tmp_path):
    """skipped.txt from the shards of 2 processes (batches and videos dealt round-robin) equals the 1-process file:
    the unsupported files, then the unreadable images in input order, then the unreadable videos in input order."""
    import argparse

    predict = load_script("predict_retinanet")
    paths = [f"/src/{n}.jpg" for n in "abcdef"]
    ds = argparse.Namespace(paths=paths)
    video = {v: f"/src/v{v}.mp4 (unreadable video)" for v in range(3)}
    one = [({}, [0, 1, 2, 4], {}, video)]
    # batches of 1: process 0 has images 0, 2, 4 and videos 0, 2; process 1 images 1, 3, 5 and video 1
    two = [({}, [0, 2, 4], {}, {0: video[0], 2: video[2]}), ({}, [1], {}, {1: video[1]})]
    texts = []
    for n, shards in ((1, one), (2, two)):
        args = argparse.Namespace(output_dir=str(tmp_path / str(n)), score_thresh=0.5, no_images=True, format="coco")
        (tmp_path / str(n)).mkdir()
        predict.write_outputs(args, ds, shards, ["/src/notes.txt (unsupported file type .txt)"], {})
        texts.append((tmp_path / str(n) / "skipped.txt").read_text())
    assert texts[0].splitlines() == ["/src/notes.txt (unsupported file type .txt)", "/src/a.jpg (unreadable)",
                                     "/src/b.jpg (unreadable)", "/src/c.jpg (unreadable)", "/src/e.jpg (unreadable)",
                                     video[0], video[1], video[2]]
    assert texts[1] == texts[0]


def test_a_model_config_json_that_is_no_json_object_is_one_line(tmp_path, capsys):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"never read: the config is read first")
    (weights / "model_config.json").write_text("[]")
    one = write_image(tmp_path / "one.jpg", 64, 48)
    code, _, err = run_main("predict_retinanet", ["--weights", weights, "--source", one, "--output_dir", tmp_path / "x"],
                            capsys)
    assert code != 0 and f"{weights / 'model_config.json'} is damaged ([], not a JSON object)" in err


@pytest.mark.slow
@pytest.mark.parametrize("script", ["predict_retinanet.py", "predict_catsdogs.py"])
def test_an_error_at_start_on_2_processes_is_one_line(script, tmp_path):
    """Weights that are not there: every process finds it, the first prints the one `error:` line (and writes it to
    predict.log), the other exits 1 without a line of its own (`detlib.engine.stop`)."""
    run = forked_launch(script, ["--weights", tmp_path / "missing", "--source", tmp_path, "--num_workers", "0",
                                 "--output_dir", tmp_path / "out"])
    errors = [[ln for ln in text.splitlines() if ln.startswith("error:")] for text in run.texts]
    assert run.codes == [1, 1], run.texts
    assert len(errors[0]) == 1 and str(tmp_path / "missing") in errors[0][0], run.texts
    assert str(tmp_path / "missing") not in run.texts[1], run.texts[1]  # neither an error line nor a log line
    assert errors[0][0][len("error: "):] in (tmp_path / "out" / "predict.log").read_text()
