"""D cases on what the scripts write and what they are told (../shared/cases/README.md): outputs never overwrite
each other (D01), a parity verdict that means something (D16), nothing the model depends on filled in silently
(D17), a bad backbone or model name stopped before the work (D19). In-process where the behaviour allows."""

from __future__ import annotations

import importlib.util
import json
import shutil

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
    from detlib.model import build_retinanet_from_config

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = build_retinanet_from_config(config)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps(config))
    return folder


TINY_CONFIG = {"num_classes": 3, "backbone": "resnet18", "fpn_channels": 8, "image_size": 64, "max_size": None,
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
    for name, size in sizes.items():
        assert Image.open(out / "images" / f"{base[name]}.jpg").size == size, name  # its own photo, drawn
        per_image = json.loads((out / "json" / f"{base[name]}.json").read_text())
        assert per_image["file_name"] == name and len(per_image["detections"]) == 100
    preds = json.loads((out / "predictions.json").read_text())
    assert sorted({p["file_name"] for p in preds}) == sorted(sizes)


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
