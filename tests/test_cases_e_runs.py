"""E cases of the training runs (../shared/cases/README.md, "E cases"): E20, best-F1 thresholds from an evaluation
with no true detection; E21, the EMA of weights resumed without --model_ema. (E06-E25's data and predict cases:
tests/test_cases_e_data.py, tests/test_cases_e_predict.py.)"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from conftest import COCO_SUBSET, needs_coco_subset
from helpers import load_script, make_tiny_folder, run_main


@needs_coco_subset
def test_case_e20_best_f1_with_no_true_detection_says_so_and_the_card_does_not_recommend_it(tmp_path, capsys):
    """An evaluation whose detections never hit (every detection of a class the image lacks): best_f1_thresholds
    finds no threshold; predict's --score_thresh best_f1 says so in one line (it was: "score_thresholds.json is
    damaged ... TypeError ... NoneType") and the model card recommends neither best_f1 nor the file."""
    from detlib.evaluation import best_f1_thresholds, detector_card, write_score_thresholds
    from detlib.retinanet.model import RetinaNet

    val = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    images = sorted(val["images"], key=lambda im: im["id"])[:3]
    ids = {im["id"] for im in images}
    val.update(images=images, annotations=[a for a in val["annotations"] if a["image_id"] in ids])
    present = {a["category_id"] for a in val["annotations"]}
    absent = next(c["id"] for c in val["categories"] if c["id"] not in present)
    results = [{"image_id": a["image_id"], "category_id": absent, "bbox": a["bbox"], "score": 0.9}
               for a in val["annotations"]]
    best_f1 = best_f1_thresholds(val, results)
    assert best_f1["all"]["score_thresh"] is None  # no true detection: no threshold maximises F1
    cats = sorted(c["id"] for c in val["categories"])
    config = {"num_classes": len(cats), "backbone": "resnet18", "fpn_channels": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 64, "max_size": None,
              "category_ids": cats, "category_names": [c["name"] for c in sorted(val["categories"], key=lambda c: c["id"])]}
    weights = tmp_path / "best"
    weights.mkdir()
    model = RetinaNet(len(cats), "resnet18", fpn_channels=16, freeze_backbone_bn=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights / "model.safetensors"))
    (weights / "model_config.json").write_text(json.dumps(config))
    evaluation = {"epoch": 1, "step": 3, "AP": 0.0, "best_f1": best_f1}
    write_score_thresholds(str(weights), best_f1, evaluation)
    with pytest.raises(SystemExit) as stop:
        load_script("predict_retinanet").main(["--weights", str(weights), "--source", str(COCO_SUBSET / "images" / images[0]["file_name"]),
                                               "--output_dir", str(tmp_path / "pred"), "--score_thresh", "best_f1",
                                               "--num_workers", "0"])
    message = capsys.readouterr().err.strip().splitlines()[-1]  # engine.stop: the line on stderr, exit 1
    assert stop.value.code == 1 and message.startswith(f"error: --score_thresh best_f1: no threshold was found in {weights}/score_thresholds.json: "
                              "the evaluation of these weights had no true detection"), message
    assert "give --score_thresh a number" in message and "TypeError" not in message and "damaged" not in message
    card = str(detector_card(config, evaluation=evaluation, dataset={"name": "subset"}, command="train", weights_name="best",
                             where=str(weights)))
    assert "--score_thresh best_f1" not in card and "score_thresholds.json" not in card
    found = {**best_f1, "all": {**best_f1["all"], "score_thresh": 0.4, "F1": 0.5, "precision": 0.5, "recall": 0.5}}
    card = str(detector_card(config, evaluation={**evaluation, "best_f1": found}, dataset={"name": "subset"},
                             command="train", weights_name="best", where=str(weights)))
    assert "--score_thresh best_f1" in card  # where a threshold was found it is still recommended


@pytest.mark.slow  # two short in-process trainings with an evaluation (seconds)
def test_case_e21_a_resume_without_model_ema_says_the_average_is_dropped_before_anything_is_written(tmp_path, capsys):
    """A --model_ema run resumed without the flag: one warning, before any checkpoint of the resumed run is written
    (which would rotate the average away), that the average is dropped; the flag comparison names it; the summary
    calls the stale last_ema/ what it is (it called it the final EMA)."""
    data = make_tiny_folder(tmp_path / "data", [8, 8])
    common = ["--model", "test_resnet", "--image_size", "32", "--train_dir", str(data), "--val_dir", str(data),
              "--per_device_batch_size", "4", "--num_workers", "0", "--report_to", "none", "--output_dir",
              str(tmp_path / "run"), "--checkpoint_total_limit", "1"]
    code, _, err = run_main("train_catsdogs", common + ["--epochs", "1", "--model_ema", "0.9"], capsys)
    assert code == 0, err[-2000:]
    stale = (tmp_path / "run" / "last_ema" / "model.safetensors").read_bytes()
    code, out, err = run_main("train_catsdogs", common + ["--epochs", "2", "--resume_from_checkpoint", "latest"], capsys)
    assert code == 0, err[-2000:]
    dropped = out.index("holds EMA weights but this run has no --model_ema: the average is dropped")
    assert "--model_ema 0.9 -> None" in out[:dropped]  # the flag comparison said it too
    assert dropped < out.index("saved checkpoint")  # said before the checkpoint that rotates the average away
    summary = out[out.index("summary:"):]
    assert "last_ema/ (the EMA of an earlier part of the run, not of its end)" in summary and "final EMA" not in summary
    assert (tmp_path / "run" / "last_ema" / "model.safetensors").read_bytes() == stale  # left as it was
    assert not any(p.name == "model_ema.safetensors" for p in (tmp_path / "run" / "checkpoints").rglob("*"))
    # and the other way: --model_ema on a checkpoint without an average starts it from the resumed weights, said
    code, out, _ = run_main("train_catsdogs", common + ["--epochs", "3", "--model_ema", "0.9", "--resume_from_checkpoint",
                                                        "latest"], capsys)
    assert code == 0 and "holds no EMA weights (its run had no --model_ema): the average starts from the resumed" in out
