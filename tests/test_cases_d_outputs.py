"""D cases on what the scripts write and what they are told (../shared/cases/README.md): outputs never overwrite
each other (D01), a parity verdict that means something (D16), nothing the model depends on filled in silently
(D17), a bad backbone or model name stopped before the work (D19). In-process where the behaviour allows."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from conftest import COCO_SUBSET, REPO, SHARED_DATA, needs_coco_subset

CATSDOGS = SHARED_DATA / "catsdogs"
needs_catsdogs = pytest.mark.skipif(not (CATSDOGS / "val" / "cat").is_dir(), reason="../shared/data/catsdogs is not present")


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def coco_photos(n: int, first: int = 0) -> list:
    return sorted((COCO_SUBSET / "images").iterdir())[first:first + n]


def save_retinanet(folder, config: dict, seed: int = 0):
    """A freshly initialised RetinaNet saved as the training script saves it (weights + the given model_config)."""
    from detlib.retinanet.model import build_retinanet_from_config

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = build_retinanet_from_config(config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps(config))
    return folder


TINY_CONFIG = {"num_classes": 3, "backbone": "resnet18", "fpn_channels": 8, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 64, "max_size": None,
               "category_ids": [1, 2, 3], "category_names": ["person", "bicycle", "car"]}


@pytest.fixture(scope="module")
def tiny_retinanet(tmp_path_factory):
    return save_retinanet(tmp_path_factory.mktemp("d_cases") / "best", TINY_CONFIG)


# ---- D01: outputs never overwrite each other

def test_output_names_are_distinct_and_stay_inside():
    from detlib.inference import output_names

    assert output_names(["a.jpg", "a.png", "a.jpeg", "b.jpg", "sub/a.jpg"]) == ["a.jpg", "a.png", "a.jpeg", "b", "sub/a"]
    # a.jpg vs a.JPG: the same stem; distinct ignoring case too
    names = output_names(["a.jpg", "a.JPG", "A.jpg"])
    assert len({n.casefold() for n in names}) == 3 and names[0] == "a.jpg"
    # an input whose stem is another input's whole name: the later one gets ~2, nothing shared
    assert output_names(["a.jpg", "a.png", "a.png.jpg"]) == ["a.jpg", "a.png", "a.png~2"]
    assert output_names(["../x/a.jpg", "/abs/b.jpg"]) == ["__/x/a", "abs/b"]
    assert output_names(["a.jpg", "A.jpg", "a~2.jpg"], keep_extension=True) == ["a.jpg", "A~3.jpg", "a~2.jpg"]


@needs_coco_subset
def test_case_d01_same_stem_photos_get_one_drawn_image_and_one_json_each(tiny_retinanet, tmp_path):
    """Three different real photos a.jpg, a.png, a.jpeg (and a.JPG in a sub-folder pair): one drawn image and one
    json per input, each carrying its own photo's size and name."""
    src = tmp_path / "photos"
    src.mkdir()
    sizes = {}
    for name, photo in zip(["a.jpg", "a.png", "a.jpeg", "sub/a.jpg", "sub/a.JPG"], coco_photos(5)):
        (src / name).parent.mkdir(exist_ok=True)
        img = Image.open(photo).convert("RGB")
        img.save(src / name, format="PNG" if name.endswith(".png") else "JPEG")
        sizes[name] = img.size
    assert len(set(sizes.values())) == 5  # five different photos
    out = tmp_path / "out"
    load_script("predict_retinanet").main(["--weights", str(tiny_retinanet), "--source", str(src), "--output_dir", str(out),
                                           "--save_json_per_image", "--score_thresh", "0", "--draw_thresh", "0",
                                           "--num_workers", "0", "--batch_size", "2", "--cpu"])
    drawn = sorted(str(p.relative_to(out / "images")) for p in (out / "images").rglob("*") if p.is_file())
    jsons = sorted(str(p.relative_to(out / "json")) for p in (out / "json").rglob("*") if p.is_file())
    # sub/a.jpg and sub/a.JPG: distinct here, one file on a case-insensitive file system, so the later one gets ~2
    base = {"a.jpg": "a.jpg", "a.png": "a.png", "a.jpeg": "a.jpeg", "sub/a.JPG": "sub/a.JPG", "sub/a.jpg": "sub/a.jpg~2"}
    assert drawn == sorted(f"{b}.jpg" for b in base.values()) and jsons == sorted(f"{b}.json" for b in base.values())
    preds = json.loads((out / "predictions.json").read_text())
    assert sorted({p["file_name"] for p in preds}) == sorted(sizes)
    for name, size in sizes.items():
        assert Image.open(out / "images" / f"{base[name]}.jpg").size == size, name  # its own photo, drawn
        per_image = json.loads((out / "json" / f"{base[name]}.json").read_text())
        # its own detections: those predictions.json gives its file, box for box (how many survive NMS at score 0
        # depends on the photo's shape: 72 to 100 of the cap here)
        own = [(p["bbox"], p["score"]) for p in preds if p["file_name"] == name]
        assert per_image["file_name"] == name and 0 < len(per_image["detections"]) <= 100
        assert [(d["bbox"], d["score"]) for d in per_image["detections"]] == own, name


@needs_coco_subset
def test_case_d01_output_folder_inside_the_source_is_not_read_back(tiny_retinanet, tmp_path, capsys):
    """--output_dir inside --source, run twice: the second run predicts the 2 photos again, not the first run's
    drawn images and json (which it would also write over)."""
    src = tmp_path / "photos"
    src.mkdir()
    for name, photo in zip(["x.jpg", "y.jpg"], coco_photos(2, first=10)):
        shutil.copy(photo, src / name)
    argv = ["--weights", str(tiny_retinanet), "--source", str(src), "--output_dir", str(src / "pred"), "--num_workers", "0",
            "--save_json_per_image", "--cpu"]
    script = load_script("predict_retinanet")
    script.main(argv)
    capsys.readouterr()
    results = script.main(argv)
    assert {r["file_name"] for r in results} <= {"x.jpg", "y.jpg"}
    assert sorted(p.name for p in (src / "pred" / "images").rglob("*") if p.is_file()) == ["x.jpg", "y.jpg"]
    log = capsys.readouterr().out  # the scripts' console log
    assert "left out 2 files" in log and "already holds the outputs of an earlier prediction (2 in images/, 2 in json/)" in log


@needs_catsdogs
def test_case_d01_classifier_copies_one_per_input_and_not_read_back(tmp_path):
    from detlib.classification import build_classifier

    weights = tmp_path / "best"
    weights.mkdir()
    torch.manual_seed(0)
    model = build_classifier("resnet18", 2)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights / "model.safetensors"))
    (weights / "model_config.json").write_text(json.dumps({"model": "resnet18", "classes": ["cat", "dog"], "image_size": 32}))
    src = tmp_path / "photos"
    src.mkdir()
    cats = sorted((CATSDOGS / "val" / "cat").iterdir())[:3]
    for name, photo in zip(["a.jpg", "a.png", "a.JPG"], cats):
        Image.open(photo).convert("RGB").save(src / name, format="PNG" if name.endswith(".png") else "JPEG")
    out = src / "out"  # inside the source
    argv = ["--weights", str(weights), "--source", str(src), "--output_dir", str(out), "--copy_to_class_folders",
            "--num_workers", "0", "--cpu"]
    script = load_script("predict_catsdogs")
    for _ in range(2):
        merged = script.main(argv)
        assert len(merged) == 3  # the copies of the first run are not inputs of the second
    copies = sorted(p.name for p in (out / "by_class").rglob("*") if p.is_file())
    assert sorted(n.casefold() for n in copies) == sorted({n.casefold() for n in copies})  # distinct ignoring case
    assert len(copies) == 3 and "a.png" in copies


def test_case_d01_check_dataset_outputs_never_replace_each_other_or_an_input(tmp_path, capsys):
    script = load_script("check_dataset")
    for argv in (["--write_fixed", str(tmp_path / "f.json"), "--write_fixed_val", str(tmp_path / "f.json")],
                 ["--write_fixed", str(tmp_path / "train.json")],
                 ["--report_json", str(tmp_path / "val.json")]):
        with pytest.raises(SystemExit) as e:
            script.parse_args(["--annotations", str(tmp_path / "train.json"), "--val_annotations", str(tmp_path / "val.json"),
                               "--skip_image_check", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "one would replace the other" in err and "Traceback" not in err


# ---- D16: a parity verdict that means something

def test_compare_detections_pairs_tied_scores_only_with_a_box_the_reference_gives():
    from detlib.retinanet.export import compare_detections

    a, b, c, far = [0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50], [60, 60, 70, 70]
    ref = (np.array([a, b], np.float32), np.array([0.5, 0.5], np.float32), np.array([1, 1]))
    # the export chose c instead of b: tied with it (within 1e-5) and one of the candidates PyTorch's outputs give
    got = (np.array([a, c], np.float32), np.array([0.5, 0.500001], np.float32), np.array([1, 1]))
    boxes = np.array([a, b, c], np.float32)
    scores = np.zeros((3, 2), np.float32)
    scores[:, 1] = [0.5, 0.5, 0.500001]
    d = compare_detections(ref, got, candidates=(boxes, scores))
    assert d["num_paired"] == 1 and d["num_tie_paired"] == 1 and d["num_unexplained"] == 0 and d["labels_equal"]
    # without the reference's candidates, or with a box no anchor gives, the swap is a difference
    assert compare_detections(ref, got)["num_unexplained"] == 2
    bad = (np.array([a, far], np.float32), got[1], got[2])
    d = compare_detections(ref, bad, candidates=(boxes, scores))
    assert d["num_unexplained"] == 2 and not d["labels_equal"] and d["max_abs_box_px"] == float("inf")
    # a score off by more than the tolerance is never a tie
    off = (got[0], np.array([0.5, 0.6], np.float32), got[2])
    scores[2, 1] = 0.6
    assert compare_detections(ref, off, candidates=(boxes, scores))["num_unexplained"] == 2


@pytest.fixture(scope="module")
def early_model(tmp_path_factory):
    """A RetinaNet as it is at the start of training: every score at the prior 0.01, tied within 1e-7 over all
    anchors and classes (below the default --score_thresh 0.05)."""
    cats = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())["categories"]
    config = {"num_classes": len(cats), "backbone": "resnet18", "fpn_channels": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 128, "max_size": None,
              "category_ids": [c["id"] for c in cats], "category_names": [c["name"] for c in cats]}
    return save_retinanet(tmp_path_factory.mktemp("early") / "best", config)


def _export(weights, out, *extra):
    return load_script("export_retinanet").main(
        ["--weights", str(weights), "--output", str(out), "--check_source",
         str(COCO_SUBSET / "annotations" / "instances_val.json"), "--check_images", str(COCO_SUBSET / "images"), *extra])


@needs_coco_subset
@pytest.mark.slow
def test_case_d16_parity_with_no_detection_compared_is_no_pass(early_model, tmp_path, caplog):
    with pytest.raises(SystemExit) as e:
        _export(early_model, tmp_path / "m.onnx", "--opset", "11")
    assert e.value.code == 1
    parity = json.loads((tmp_path / "m.parity.json").read_text())
    assert parity["verdict"] == "no verdict" and not parity["pass"] and parity["num_compared"] == 0
    assert all(r["num_detections"] == [0, 0] for r in parity["images"])
    line = [r.getMessage() for r in caplog.records if "no verdict" in r.getMessage()]
    assert len(line) == 1 and "0 detections compared on 3 images" in line[0] and "--score_thresh 0" in line[0]
    assert (tmp_path / "m.onnx").is_file()  # the export itself is kept
    # an export option the exporter cannot honour is said, and the file records what it is
    opset = [r.getMessage() for r in caplog.records if "--opset 11" in r.getMessage()]
    meta = json.loads((tmp_path / "m.json").read_text())
    assert len(opset) == 1 and f"wrote opset {meta['opset']}" in opset[0] and meta["opset"] != 11


@needs_coco_subset
@pytest.mark.slow
def test_case_d16_scores_tied_within_the_tolerance_are_paired_not_failed(early_model, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    result = _export(early_model, tmp_path / "m.onnx", "--score_thresh", "0", "--format", "both")
    parity = json.loads((tmp_path / "m.parity.json").read_text())
    assert parity["pass"] and parity["verdict"] == "pass" and parity["num_compared"] == 600  # 3 images x 100 x 2 formats
    assert sum(r["num_tie_paired"] for r in parity["images"]) > 0
    assert all(r["num_unexplained"] == 0 for r in result["parity"])
    line = [r.getMessage() for r in caplog.records if "parity on 3 images: pass" in r.getMessage()]
    assert len(line) == 1 and "600 detections compared" in line[0] and "paired by scores tied within 1e-05" in line[0]


def test_export_flags_it_does_not_use_are_said(tmp_path, capsys):
    script = load_script("export_retinanet")
    defaults = {a.dest: a.default for a in script.build_parser()._actions}
    args = script.parse_args(["--weights", "w", "--output", str(tmp_path / "m.onnx"), "--format", "pt2", "--opset", "17",
                              "--logit_atol", "0.1", "--check_images", "imgs"])
    lines = script.ignored_flags(args, defaults)
    assert any(x.startswith("--opset 17 is not used: --format pt2") for x in lines)
    assert any(x.startswith("--logit_atol 0.1 is not used: --decode inside") for x in lines)
    assert any(x.startswith("--check_images imgs is not used") for x in lines)
    assert script.ignored_flags(script.parse_args(["--weights", "w", "--output", "m.onnx"]), defaults) == []
    # nonsense values and an --output whose files would replace each other: one line at start
    for argv in (["--num_check_images", "0"], ["--score_thresh", "2"], ["--opset", "0"], ["--output", str(tmp_path / "m.json")]):
        with pytest.raises(SystemExit) as e:
            script.parse_args(["--weights", "w", "--output", str(tmp_path / "m.onnx"), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and ": error: " in err.strip().splitlines()[-1] and "Traceback" not in err, err


# ---- D17: nothing the model depends on is filled in silently

# a model_config.json written before image_size (with the normalisation, which nothing completes: tests/test_backbones.py)
OLD_KEYS = ("num_classes", "backbone", "fpn_channels", "category_ids", "mean", "std")


def old_copy(best, folder):
    """A copy of best/ whose model_config.json holds only OLD_KEYS."""
    shutil.copytree(best, folder)
    cfg = json.loads((folder / "model_config.json").read_text())
    (folder / "model_config.json").write_text(json.dumps({k: cfg[k] for k in OLD_KEYS}))
    return folder


@needs_coco_subset
def test_case_d17_a_model_config_without_its_size_stops_predict_in_one_line_naming_the_flag(tiny_retinanet, tmp_path,
                                                                                          capsys):
    """Nothing is filled in: not from the run's config.yaml beside the weights (there is no earlier release to stay
    compatible with), not from a default; the line names the key and the flag that supplies it."""
    photos = tmp_path / "photos"
    photos.mkdir()
    shutil.copy(coco_photos(1)[0], photos / "p.jpg")
    script = load_script("predict_retinanet")
    run = tmp_path / "run"
    old_copy(tiny_retinanet, run / "best")
    (run / "config.yaml").write_text("backbone: resnet18\nfpn_channels: 8\nimage_size: 64\nmax_size: null\nnum_classes: 3\n")
    with pytest.raises(SystemExit) as e:
        script.main(["--weights", str(run / "best"), "--source", str(photos), "--output_dir", str(tmp_path / "o1"),
                     "--cpu", "--num_workers", "0"])
    assert e.value.code == 1 and capsys.readouterr().err == (
        f"error: {run / 'best' / 'model_config.json'} lacks image_size: pass --image_size (and --max_size) with the "
        "size the model was trained at (the training script writes every key into best/, last/ and each checkpoint)\n")
    # given --image_size: used, nothing to say
    script.main(["--weights", str(run / "best"), "--source", str(photos), "--output_dir", str(tmp_path / "o4"), "--cpu",
                 "--num_workers", "0", "--image_size", "96"])
    assert "at 96 px" in (tmp_path / "o4" / "predict.log").read_text()


@needs_coco_subset
def test_an_evaluation_prints_its_12_stats_once_under_which_weights_with_the_key_of_its_diagnostics(tiny_retinanet,
                                                                                                    tmp_path):
    """The console and train.log: the 12 stats in pycocotools' table once (no second line of the same numbers),
    headed by the weights evaluated; the diagnostics line followed by its key at the run's first evaluation."""
    from detlib.evaluation import diagnostics, report

    report._KEYED.clear()  # as in a new process
    val = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    val["categories"] = [c for c in val["categories"] if c["id"] in TINY_CONFIG["category_ids"]]
    val["annotations"] = [a for a in val["annotations"] if a["category_id"] in TINY_CONFIG["category_ids"]]
    (tmp_path / "val.json").write_text(json.dumps(val))
    out = tmp_path / "ev"
    load_script("train_retinanet").main([f"--val_images={COCO_SUBSET / 'images'}", f"--val_annotations={tmp_path / 'val.json'}",
                                         "--evaluate_only", str(tiny_retinanet),
                                         "--output_dir", str(out), "--report_to", "none", "--num_workers", "0",
                                         "--score_thresh", "0", "--per_device_eval_batch_size", "4",
                                         "--num_log_images", "0", "--eval_bootstrap", "0"])
    log = (out / "evaluate_only" / "train.log").read_text()
    stats = re.findall(r"^ Average (?:Precision|Recall) .* = +(-?[\d.]+)", log, re.M)
    assert len(stats) == 12 and "AP50=" not in log, log[-3000:]
    assert f"evaluation of {tiny_retinanet / 'model.safetensors'}: COCO evaluation on 30 images:" in log
    assert diagnostics.DIAGNOSTICS_KEY in log


@needs_coco_subset
def test_case_d17_evaluate_only_without_the_training_size_stops_and_says_which_flags_it_replaces(tiny_retinanet,
                                                                                               tmp_path, capsys):
    run = tmp_path / "run"
    old_copy(tiny_retinanet, run / "best")
    (run / "config.yaml").write_text("backbone: resnet18\nfpn_channels: 8\nimage_size: 64\nmax_size: null\n")
    val = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    val["images"] = sorted(val["images"], key=lambda im: im["id"])[:2]
    ids = {im["id"] for im in val["images"]}
    val["annotations"] = [a for a in val["annotations"] if a["image_id"] in ids]
    keep = {1, 2, 3}  # the tiny model's 3 category ids
    val["categories"] = [c for c in val["categories"] if c["id"] in keep]
    val["annotations"] = [a for a in val["annotations"] if a["category_id"] in keep]
    (tmp_path / "val.json").write_text(json.dumps(val))
    data = [f"--val_images={COCO_SUBSET / 'images'}", f"--val_annotations={tmp_path / 'val.json'}", "--report_to", "none",
            "--num_workers", "0", "--per_device_eval_batch_size", "2", "--num_log_images", "0"]
    with pytest.raises(SystemExit) as e:  # the run's config.yaml is not read to fill it
        load_script("train_retinanet").main([*data, "--evaluate_only", str(run / "best"), "--output_dir", str(tmp_path / "e0")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "model_config.json lacks image_size: pass --image_size" in err
    out = tmp_path / "ev"
    load_script("train_retinanet").main([*data, "--evaluate_only", str(run / "best"), "--backbone", "resnet50",
                                         "--fpn_channels", "256", "--image_size", "64", "--output_dir", str(out)])
    log = (out / "evaluate_only" / "train.log").read_text()
    assert "--backbone resnet50 is not used: --evaluate_only rebuilds the model its model_config.json describes " \
           "(backbone resnet18)" in log
    assert "--fpn_channels 256 is not used" in log and "(fpn_channels 8)" in log
    import yaml

    cfg = yaml.safe_load((out / "evaluate_only" / "config.yaml").read_text())
    assert cfg["image_size"] == 64 and cfg["backbone"] == "resnet18"
    # weights without any model_config.json: built from the flags, and said
    (tmp_path / "bare").mkdir()
    shutil.copy(run / "best" / "model.safetensors", tmp_path / "bare" / "model.safetensors")
    out = tmp_path / "ev2"
    load_script("train_retinanet").main([*data, "--evaluate_only", str(tmp_path / "bare"), "--backbone", "resnet18",
                                         "--fpn_channels", "8", "--image_size", "64", "--output_dir", str(out)])
    assert "no model_config.json beside" in (out / "evaluate_only" / "train.log").read_text()


def test_require_model_keys_by_hand(tmp_path):
    from detlib.weights import WeightsFileError, require_model_keys

    best = tmp_path / "run" / "best"
    best.mkdir(parents=True)
    (best / "model.safetensors").write_bytes(b"")
    (best / "model_config.json").write_text("{}")
    (tmp_path / "run" / "config.yaml").write_text("image_size: 128\nfpn_channels: 32\n")  # never read for it
    cfg = {"num_classes": 2, "backbone": "resnet18", "image_size": 128}
    require_model_keys(cfg, str(best), {"image_size": "--image_size", "backbone": "--backbone"})  # nothing missing
    with pytest.raises(WeightsFileError) as e:
        require_model_keys(cfg, str(best), {"fpn_channels": "--fpn_channels", "max_size": "--max_size", "mean": ""})
    assert str(e.value).startswith(f"{best / 'model_config.json'} lacks fpn_channels, max_size, mean: pass "
                                   "--fpn_channels and --max_size (")


@needs_catsdogs
def test_case_d17_classifier_config_without_its_model_or_size_stops_and_topk_beyond_the_classes_is_said(tmp_path, capsys):
    from detlib.classification import build_classifier

    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in build_classifier("resnet18", 2).state_dict().items()},
              str(run / "best" / "model.safetensors"))
    (run / "best" / "model_config.json").write_text(json.dumps({"classes": ["cat", "dog"]}))  # no model, no image_size
    (run / "config.yaml").write_text("model: resnet18\nimage_size: 48\n")  # not read to fill them
    photos = tmp_path / "photos"
    photos.mkdir()
    shutil.copy(sorted((CATSDOGS / "val" / "cat").iterdir())[0], photos / "c.jpg")
    argv = ["--weights", str(run / "best"), "--source", str(photos), "--output_dir", str(tmp_path / "o"), "--topk", "5",
            "--cpu", "--num_workers", "0"]
    with pytest.raises(SystemExit) as e:
        load_script("predict_catsdogs").main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith(f"error: {run / 'best' / 'model_config.json'} lacks model (")
    (run / "best" / "model_config.json").write_text(json.dumps({"classes": ["cat", "dog"], "model": "resnet18"}))
    with pytest.raises(SystemExit) as e:
        load_script("predict_catsdogs").main(argv)
    assert "lacks image_size: pass --image_size with the size the model was trained at" in capsys.readouterr().err
    load_script("predict_catsdogs").main([*argv, "--image_size", "48"])
    out = capsys.readouterr().out
    assert "at 48 px" in out
    assert "--topk 5: the model has 2 classes, so 2 per image" in out
    rows = json.loads((tmp_path / "o" / "predictions.json").read_text())
    assert len(rows[0]["topk"]) == 2


# ---- D19: bad choices stop before the work

@pytest.mark.parametrize("backbone,message", [
    ("vit_tiny_patch16_224", "gives features at strides [16, 16, 16]; RetinaNet's FPN needs strides 8, 16 and 32"),
    ("resnet_does_not_exist", "'resnet_does_not_exist' is not a timm model name (close names: resnet"),
    ("swin_tiny_patch4_window7_224", "inputs fail in the model (AssertionError: Input height"),
])
def test_case_d19_backbone_that_cannot_work_is_one_line_before_the_data_check(backbone, message, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:  # the data does not exist: the backbone is refused before it is looked at
        load_script("train_retinanet").main(["--data_dir", str(tmp_path / "no_data"), "--backbone", backbone,
                                             "--output_dir", str(out), "--report_to", "none"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: --backbone: ") and message in err, err
    assert not out.exists()  # nothing started: no run folder


def test_case_d19_other_values_checkable_without_data(tmp_path, capsys):
    retinanet, catsdogs = load_script("train_retinanet"), load_script("train_catsdogs")
    # (--freeze_at means the same on every family now, 0-5 by stride: nothing to refuse there)
    cases = [(retinanet, ["--backbone", "resnet18", "--backbone_weights", str(tmp_path / "none.safetensors")],
              "weights file not found: "),
             (retinanet, ["--evaluate_only", str(tmp_path / "none")], "--evaluate_only: no model weights at"),
             (catsdogs, ["--model", "resnet_does_not_exist"], "error: --model: 'resnet_does_not_exist' is not a timm model name"),
             (catsdogs, ["--model", "vit_tiny_patch16_224", "--image_size", "64"], "'vit_tiny_patch16_224' at --image_size 64"),
             (catsdogs, ["--weights", str(tmp_path / "none.pth")], "error: weights file not found: ")]
    for script, argv, message in cases:
        out = tmp_path / "out"
        data = ["--data_dir", str(tmp_path / "no_data")] if script is retinanet else \
            ["--train_dir", str(tmp_path / "no_data"), "--val_dir", str(tmp_path / "no_data")]
        with pytest.raises(SystemExit) as e:
            script.main([*data, *argv, "--output_dir", str(out), "--report_to", "none"])
        err = capsys.readouterr().err
        assert e.value.code in (1, 2) and err.count("\n") == 1 and message in err and "Traceback" not in err, (argv, err)
        assert not out.exists()


def test_close_names_by_hand():
    from detlib.logtext import close_names

    names = ["resnet18", "resnet50", "resnet50d", "convnext_tiny", "efficientnet_b0"]
    assert close_names("resnt50", names)[0] == "resnet50"
    assert close_names("efficientnet-b0", names) == ["efficientnet_b0"]
    assert close_names("resnet_does_not_exist", names)[0].startswith("resnet")
    assert close_names("xyz", names) == []


@needs_catsdogs
@pytest.mark.slow
def test_case_d17_resume_with_another_lr_or_optimizer_is_refused_and_another_length_said(tmp_path, capsys):
    data = tmp_path / "data"
    for cls in ("cat", "dog"):
        (data / cls).mkdir(parents=True)
        for f in sorted((CATSDOGS / "val" / cls).iterdir())[:4]:
            shutil.copy(f, data / cls / f.name)
    common = ["--train_dir", str(data), "--val_dir", str(data), "--image_size", "32", "--per_device_batch_size", "4",
              "--num_workers", "0", "--report_to", "none", "--output_dir", str(tmp_path / "run"), "--verify_images", "none"]
    script = load_script("train_catsdogs")
    script.main([*common, "--epochs", "1", "--lr", "1e-3"])
    capsys.readouterr()
    config = (tmp_path / "run" / "config.yaml").read_text()
    for flag, value, said in (("--lr", "0.5", "--lr 0.001 -> 0.5"), ("--optimizer", "sgd", "--optimizer adamw -> sgd")):
        with pytest.raises(SystemExit) as e:  # the optimizer's state would bring the old values back: refused
            script.main([*common, "--epochs", "2", flag, value, "--resume_from_checkpoint", "latest"])
        err = capsys.readouterr().err
        assert e.value.code == 1 and "Traceback" not in err
        assert "it does not fit this run: " in err and said in err and "(fixed by the checkpoint's state)" in err
        assert (tmp_path / "run" / "config.yaml").read_text() == config  # the refused run recorded nothing
    script.main([*common, "--epochs", "2", "--resume_from_checkpoint", "latest"])
    assert "with other flags than its run's: --epochs 1 -> 2" in capsys.readouterr().out


def test_export_without_the_onnx_packages_is_one_line_that_says_what_to_install(tmp_path, monkeypatch, capsys):
    """The README's export after its first command (requirements.txt only): no onnxscript. One line naming what is
    missing and the install command, before any model is loaded; --format pt2 needs none of it."""
    script = load_script("export_retinanet")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("onnxscript", "onnxruntime") else real_find_spec(name, *a))
    assert script.missing_onnx_packages() == ["onnxscript", "onnxruntime"]
    for fmt in ("onnx", "both"):
        with pytest.raises(SystemExit) as e:
            script.main(["--weights", str(tmp_path / "no_such_run"), "--output", str(tmp_path / "m.onnx"), "--format", fmt])
        assert e.value.code == 1 and capsys.readouterr().err == (
            f"error: --format {fmt} needs onnxscript, onnxruntime (not installed): pip install -e '.[export]' (or -r "
            "requirements-dev.txt); --format pt2 needs nothing more\n")
    with pytest.raises(SystemExit) as e:  # pt2 goes on to the weights, which are missing here
        script.main(["--weights", str(tmp_path / "no_such_run"), "--output", str(tmp_path / "m.onnx"), "--format", "pt2"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: no model weights at ") and "not installed" not in err
