"""scripts/predict_catsdogs.py on the real cats/dogs images: the same top-1 class and probability as
train_catsdogs.py --evaluate_only, 2 processes equal to 1, top-k CSV / JSON, per-class copies, unreadable files.

The 2-process prediction is forked from the test process (`helpers.forked_ok`); the evaluation and the 1-process predictions
run `main(argv)` in-process (a launch adds ~8 s of start-up per process; the exit paths of predict are
tests/test_exit_paths.py's)."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from detlib.classification import build_classifier, classification_transform
from detlib.data.images import load_rgb

from conftest import SHARED_DATA
from helpers import forked_ok, run_ok

CATSDOGS = SHARED_DATA / "catsdogs"
pytestmark = [pytest.mark.skipif(not (CATSDOGS / "val" / "cat").is_dir(), reason="../shared/data/catsdogs is not present"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """resnet18 (torchvision) for 2 classes at 64 px, saved as the training script saves it. Its BatchNorm
    statistics are measured on 32 real training images so the probabilities are not all saturated at 0 / 1."""
    folder = tmp_path_factory.mktemp("cd") / "best"
    folder.mkdir()
    torch.manual_seed(0)
    model = build_classifier("resnet18", 2)
    tf = classification_transform(64, train=False)
    files = sorted((CATSDOGS / "train" / "cat").iterdir())[:16] + sorted((CATSDOGS / "train" / "dog").iterdir())[:16]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.reset_running_stats()
                m.momentum = None
        model.train()(torch.stack([tf(load_rgb(f)[0]) for f in files]))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps({"model": "resnet18", "num_classes": 2, "classes": ["cat", "dog"],
                                                          "image_size": 64}))
    return folder


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predict_equals_evaluate_only(weights, tmp_path, capsys):
    ev = tmp_path / "eval"
    run_ok("train_catsdogs", ["--val_dir", CATSDOGS / "val", "--evaluate_only", weights, "--num_workers", "0",
                                  "--per_device_eval_batch_size", "32", "--output_dir", ev, "--report_to", "none"], capsys)
    expected = {r["path"]: r for r in _csv(ev / "evaluate_only" / "predictions_val.csv")}
    out = tmp_path / "pred"
    stdout = run_ok("predict_catsdogs", ["--weights", weights, "--source", CATSDOGS / "val", "--num_workers", "0",
                                             "--batch_size", "32", "--output_dir", out], capsys)
    rows = _csv(out / "predictions.csv")
    assert len(rows) == len(expected) == 100
    assert list(rows[0]) == ["file", "class_1", "prob_1", "class_2", "prob_2"]  # top-5 capped at the 2 classes
    for r in rows:
        e = expected[str(CATSDOGS / "val" / r["file"])]
        assert r["class_1"] == e["pred"]
        assert float(r["prob_1"]) == pytest.approx(float(e["confidence"]), abs=2e-6)
        assert float(r["prob_1"]) + float(r["prob_2"]) == pytest.approx(1.0, abs=2e-6)
    n_cat = sum(r["class_1"] == "cat" for r in rows)
    assert 0 < n_cat < 100  # the probe model is no classifier, but it is not constant either
    assert f"100 images classified: cat {n_cat}, dog {100 - n_cat}" in stdout


def test_two_processes_equal_one_topk_json_copies_and_unreadable(weights, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(CATSDOGS / "odd", src / "odd")
    for f in sorted((CATSDOGS / "val" / "dog").iterdir())[:5]:
        shutil.copy(f, src / f.name)
    (src / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")
    outs = {}
    for n in (1, 2):  # 1 process in-process, 2 forked
        out = tmp_path / f"out{n}"
        args = ["--weights", weights, "--source", src, "--batch_size", "2", "--topk", "1", "--num_workers", "0",
                "--copy_to_class_folders", "--output_dir", out]
        if n == 1:
            run_ok("predict_catsdogs", args, capsys)
        else:
            forked_ok("predict_catsdogs.py", args)
        outs[n] = json.loads((out / "predictions.json").read_text())
        assert (out / "skipped.txt").read_text() == f"{src / 'broken.jpg'} (unreadable)\n"
        copied = sorted(str(p.relative_to(out / "by_class")) for p in (out / "by_class").rglob("*") if p.is_file())
        assert copied == sorted(f"{r['topk'][0]['class']}/{r['file_name']}" for r in outs[n])
    assert outs[1] == outs[2]
    assert [r["file_name"] for r in outs[1]] == sorted(["odd/cat/Cat1018.png", "odd/cat/Cat1045.jpeg", "odd/dog/dog.4367.jpg"] +
                                                       [f.name for f in sorted((CATSDOGS / "val" / "dog").iterdir())[:5]])
    assert all(len(r["topk"]) == 1 and 0.5 <= r["topk"][0]["prob"] <= 1 for r in outs[1])
