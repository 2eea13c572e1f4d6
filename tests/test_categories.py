"""Category meaning is never silently changed: where a trained model meets a COCO json (predict with a json source,
`--evaluate_only`, `--init_from`), its classes are matched by id and name; ids whose names differ stop with one
line naming both sides, unless `--categories_by_name` maps them by name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO, write_coco, write_image
from detlib.labels import CategoryMap, describe_mapping, match_categories, model_classes_in_data
from detlib.retinanet.model import RetinaNet, reorder_class_outputs

SHAPES = [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}, {"id": 3, "name": "triangle"}]
COCO_FIRST = [{"id": 1, "name": "person"}, {"id": 2, "name": "bicycle"}, {"id": 3, "name": "car"}]
SHAPES_OTHER_IDS = [{"id": 1, "name": "triangle"}, {"id": 2, "name": "circle"}, {"id": 7, "name": "square"}]


def cmap(cats: list[dict]) -> CategoryMap:
    return CategoryMap([c["id"] for c in cats], [c["name"] for c in cats])


def test_match_by_id_refuses_other_names_and_by_name_maps_ids():
    with pytest.raises(ValueError) as e:
        match_categories(cmap(SHAPES), cmap(COCO_FIRST), model_source="best/", data_source="val.json")
    line = str(e.value)
    assert "\n" not in line and "id 3 is 'triangle' in best/ but 'car' in val.json" in line and "--categories_by_name" in line
    # a json that lists a subset with the same names, or names in another case, is the same classes
    assert match_categories(cmap(SHAPES), cmap([{"id": 3, "name": " Triangle"}])) == {1: 1, 2: 2, 3: 3}
    mapping = match_categories(cmap(SHAPES), cmap(SHAPES_OTHER_IDS), by_name=True)
    assert mapping == {1: 2, 2: 7, 3: 1}
    assert describe_mapping(mapping, cmap(SHAPES)) == "ids mapped by name: circle 1->2, square 2->7, triangle 3->1"
    assert match_categories(cmap(SHAPES), cmap(COCO_FIRST), by_name=True) == {1: None, 2: None, 3: None}
    with pytest.raises(ValueError, match="both named"):
        match_categories(cmap(SHAPES), cmap([{"id": 1, "name": "a"}, {"id": 2, "name": "A"}]), by_name=True)


def test_reorder_class_outputs_moves_each_class_with_its_anchors():
    torch.manual_seed(0)
    model = RetinaNet(3, "resnet18", fpn_channels=16)
    before = model.cls_head.out.weight.detach().clone(), model.cls_head.out.bias.detach().clone()
    reorder_class_outputs(model, [2, 0, None])
    w, b = model.cls_head.out.weight.detach(), model.cls_head.out.bias.detach()
    for a in range(w.shape[0] // 3):
        assert torch.equal(w[3 * a], before[0][3 * a + 2]) and torch.equal(b[3 * a + 1], before[1][3 * a])
        assert not torch.equal(w[3 * a + 2], before[0][3 * a + 2])  # no source: started from the prior
        assert float(b[3 * a + 2]) == pytest.approx(-4.59512, abs=1e-4)  # -log((1 - 0.01) / 0.01)


@pytest.fixture(scope="module")
def shapes_model(tmp_path_factory) -> Path:
    """An untrained detector of the built-in classes (ids 1-3 = circle, square, triangle), saved as a run's best/."""
    folder = tmp_path_factory.mktemp("shapes") / "best"
    folder.mkdir()
    torch.manual_seed(0)
    model = RetinaNet(3, "resnet18", fpn_channels=16)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    (folder / "model_config.json").write_text(json.dumps({
        "num_classes": 3, "backbone": "resnet18", "fpn_channels": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 64, "max_size": None,
        "category_ids": [1, 2, 3], "category_names": ["circle", "square", "triangle"]}))
    return folder


def predict(argv: list) -> list[dict]:
    spec = importlib.util.spec_from_file_location("predict_retinanet", REPO / "scripts" / "predict_retinanet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(a) for a in argv])
    out = Path(argv[argv.index("--output_dir") + 1])
    return json.loads((out / "predictions.json").read_text())


def coco_source(root: Path, categories: list[dict]) -> list:
    images = [{"id": i + 1, "file_name": f"{i}.png", "width": 64, "height": 64} for i in range(2)]
    for i in range(2):
        write_image(root / "img" / f"{i}.png", 64, 64, seed=i)
    anns = [{"image_id": 1, "category_id": categories[0]["id"], "bbox": [4, 4, 30, 30]}]
    write_coco(root / "val.json", images, anns, categories)
    return ["--source", root / "val.json", "--images", root / "img"]


FLAGS = ["--num_workers", "0", "--score_thresh", "0.0", "--no_images", "--detections_per_image", "50"]


def test_predict_refuses_a_json_whose_ids_name_other_classes(shapes_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        predict(["--weights", shapes_model, *coco_source(tmp_path, COCO_FIRST), *FLAGS, "--output_dir", tmp_path / "out"])
    err = capsys.readouterr().err  # engine.stop: the line on stderr, exit 1
    assert e.value.code == 1 and "'triangle'" in err and "'car'" in err and "--categories_by_name" in err
    assert not (tmp_path / "out" / "predictions.json").exists()


def test_predict_maps_the_same_names_under_other_ids(shapes_model, tmp_path):
    own = predict(["--weights", shapes_model, *coco_source(tmp_path / "own", SHAPES), *FLAGS, "--output_dir", tmp_path / "a"])
    with pytest.raises(SystemExit):  # the same names under other ids: refused without the flag
        predict(["--weights", shapes_model, *coco_source(tmp_path / "other", SHAPES_OTHER_IDS), *FLAGS,
                 "--output_dir", tmp_path / "b"])
    mapped = predict(["--weights", shapes_model, *coco_source(tmp_path / "other", SHAPES_OTHER_IDS), *FLAGS,
                      "--categories_by_name", "--output_dir", tmp_path / "c"])
    to_json_id = {1: 2, 2: 7, 3: 1}  # circle, square, triangle in SHAPES_OTHER_IDS
    assert len(own) > 10 and len(mapped) == len(own)
    # the same detections under the json's ids (listed by score, equal scores by id: so compared as sets)
    key = lambda r: (r["image_id"], r["score"], r["bbox"], r["category_id"])  # noqa: E731
    assert sorted(map(key, mapped)) == sorted(key({**r, "category_id": to_json_id[r["category_id"]]}) for r in own)


def test_classifier_weights_of_other_class_names_stop_or_map_by_name(tmp_path, capsys):
    from helpers import make_tiny_folder, run_main

    from detlib.classification import build_classifier

    data = make_tiny_folder(tmp_path / "data", [4, 4])  # classes horizontal, vertical
    folder = tmp_path / "weights"
    folder.mkdir()
    model = build_classifier("test_resnet", 2)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    (folder / "model_config.json").write_text(json.dumps({"model": "test_resnet", "num_classes": 2,
                                                          "classes": ["vertical", "horizontal"], "image_size": 32}))
    common = ["--train_dir", data, "--val_dir", data, "--model", "test_resnet", "--image_size", "32", "--weights", folder / "model.safetensors",
              "--max_steps", "1", "--report_to", "none", "--num_workers", "0"]  # in-process: no workers
    code, _, err = run_main("train_catsdogs", common + ["--output_dir", tmp_path / "a"], capsys)
    assert code != 0
    assert "output 0 is 'vertical' in" in err and "'horizontal' in this data" in err, err[-2000:]
    code, out, err = run_main("train_catsdogs", common + ["--classes_by_name", "--output_dir", tmp_path / "b"], capsys)
    assert code == 0 and "--classes_by_name: outputs of" in out + err


def test_evaluate_only_scores_the_model_classes_under_the_json_ids():
    """`train_retinanet.py --evaluate_only`'s class map: refused when ids name other classes; with the flag, each
    model class evaluated under the json's id of its name (a class the json lacks under an id it does not use)."""
    with pytest.raises(ValueError, match="id 3 is 'triangle' in best/ but 'car' in val.json"):
        model_classes_in_data(cmap(SHAPES), cmap(COCO_FIRST), False, "best/", "val.json")
    ids, source = model_classes_in_data(cmap(SHAPES), cmap(SHAPES_OTHER_IDS[:2]), True, "best/", "val.json")
    assert ids == [2, None, 1] and source == [2, 0]  # square: not in the json; json labels triangle, circle
