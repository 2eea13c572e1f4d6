"""scripts/export_retinanet.py: ONNX (and torch.export) parity with PyTorch on 3 real val images, decoding
inside and outside the graph; the exported graph run here with onnxruntime as a user would.

The exports run `main(argv)` in-process (nothing here needs a process of its own), the console captured at the
file descriptors (`capfd`: the exporters' own prints included) with the root logger emptied first, as in a fresh
process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from detlib.data.images import load_rgb
from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.decode import decode_detections
from detlib.retinanet.export import canvas_size, compare_detections, head_candidates, prepare_input
from detlib.retinanet.model import build_retinanet_from_config

from conftest import COCO_SUBSET, needs_coco_subset
from detlib.weights import load_model_weights
from helpers import fresh_root_logging, run_main

pytestmark = [needs_coco_subset, pytest.mark.slow]
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny RetinaNet saved as the training script saves it (model.safetensors + model_config.json).

    Untrained, its scores would all sit at the prior (0.01) within float rounding, and which of thousands of
    tied candidates survives top-k and NMS would be decided by rounding in any runtime. So the FPN and heads
    get He initialisation, the BatchNorm statistics are measured on 16 real images, and the scores spread over
    0.2-1 like a trained model's: the check then compares real decisions.
    """
    folder = tmp_path_factory.mktemp("weights") / "best"
    folder.mkdir()
    cats = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())["categories"]
    config = {"num_classes": len(cats), "backbone": "resnet18", "fpn_channels": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 128, "max_size": None,
              "category_ids": [c["id"] for c in cats], "category_names": [c["name"] for c in cats]}
    torch.manual_seed(0)
    model = build_retinanet_from_config(config)
    for m in [*model.fpn.modules(), *model.cls_head.modules(), *model.box_head.modules()]:
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    with torch.no_grad():
        model.cls_head.out.weight.mul_(0.3)
        model.box_head.out.weight.mul_(0.3)
        model.cls_head.out.bias.fill_(-3.0)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.reset_running_stats()
                m.momentum = None  # a plain average over the calibration batch
        files = sorted((COCO_SUBSET / "images").iterdir())[-16:]
        batch = torch.cat([prepare_input(torch.from_numpy(np.asarray(load_rgb(f)[0]).copy()).permute(2, 0, 1), 128, None, 128)["images"]
                           for f in files])
        model.train()(batch)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps(config))
    return folder


def _export(weights, out, capfd, *extra) -> str:
    """scripts/export_retinanet.py's `main` in-process; returns its console (stdout + stderr)."""
    fresh_root_logging()  # its logging.basicConfig prints to this test's stderr, as in a process of its own
    code, stdout, stderr = run_main("export_retinanet", ["--weights", weights, "--output", out, "--check_source",
                                                         COCO_SUBSET / "annotations" / "instances_val.json",
                                                         "--check_images", COCO_SUBSET / "images", *extra], capfd)
    assert code == 0, (stdout + stderr)[-4000:]
    return stdout + stderr


def test_onnx_and_torch_export_parity_decoding_inside(weights, tmp_path, capfd):
    out = tmp_path / "retinanet.onnx"
    console = _export(weights, out, capfd, "--format", "both")
    # a quiet console: our lines only (the ONNX exporter's ~80 INFO lines need --verbose; detlib's own say what the AP
    # check met: the val images of other aspect ratios than the canvas), the verdict, then the AP
    lines = [ln for ln in console.splitlines() if ln.strip()]
    assert lines and all(" export_retinanet: " in ln or " detlib." in ln for ln in lines), lines
    assert "parity on 3 images: pass" in lines[-2] and "AP on 30 images of instances_val.json: onnx: AP" in lines[-1]
    parity = json.loads((tmp_path / "retinanet.parity.json").read_text())
    assert parity["pass"] and parity["tolerance"] == {"box_px": 0.01, "score": 1e-5}
    assert [r["format"] for r in parity["images"]] == ["onnx", "pt2"] * 3
    for r in parity["images"]:  # the same detections but (at most) a tie at the 100 cap, in any order
        assert r["labels_equal"] and r["num_detections"][0] == r["num_detections"][1] > 10
        assert r["num_paired"] + r["num_tie_paired"] == r["num_detections"][0] and r["num_unexplained"] == 0
        assert r["max_abs_box_px"] <= 0.01 and r["max_abs_score"] <= 1e-5
    meta = json.loads((tmp_path / "retinanet.json").read_text())
    assert meta["canvas"] == 128 and meta["inputs"] == ["images", "image_size", "scale"] and meta["category_names"][0] == "person"

    # run the exported graph as docs/predict_export.md shows, on an image the check did not use
    model = build_retinanet_from_config(meta)
    
    load_model_weights(model, str(weights))
    model.eval()
    path = str(COCO_SUBSET / "images" / sorted(p.name for p in (COCO_SUBSET / "images").iterdir())[-1])
    pil, _ = load_rgb(path)
    x = prepare_input(torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1), 128, None, canvas_size(128))
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    boxes, scores, labels = session.run(None, {k: x[k].numpy() for k in meta["inputs"]})
    with torch.no_grad():
        o = model(x["images"])
    anchors, counts = AnchorGenerator()(128, 128)
    ref = decode_detections(o["cls_logits"], o["box_deltas"], anchors, counts, x["image_size"][None], x["scale"][None])
    candidates = head_candidates(o["cls_logits"], o["box_deltas"], anchors, x["image_size"], x["scale"])
    diff = compare_detections((ref.boxes, ref.scores, ref.labels), (boxes, scores, labels), candidates=candidates,
                              score_thresh=0.05)
    assert diff["num_detections"] == [100, 100] and diff["labels_equal"]
    assert diff["num_paired"] + diff["num_tie_paired"] == 100
    assert diff["max_abs_box_px"] <= 0.01 and diff["max_abs_score"] <= 1e-5
    # both by decreasing score (the order of scores tied within rounding is either runtime's own)
    assert (np.diff(scores) <= 0).all() and (np.diff(ref.scores.numpy()) <= 0).all()
    assert boxes[:, 2].max() <= pil.width + 1e-3 and boxes[:, 3].max() <= pil.height + 1e-3  # original pixels


def test_onnx_parity_decoding_outside(weights, tmp_path, capfd):
    out = tmp_path / "raw.onnx"
    _export(weights, out, capfd, "--decode", "outside")
    parity = json.loads((tmp_path / "raw.parity.json").read_text())
    assert parity["pass"] and len(parity["images"]) == 3
    assert all(r["max_abs_cls_logits"] <= 1e-3 and r["max_abs_box_deltas"] <= 1e-3 for r in parity["images"])
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["cls_logits", "box_deltas"]
    # any batch and padded size (multiples of 32): the graph runs the evaluation's batches as they are
    model = build_retinanet_from_config(json.loads((tmp_path / "raw.json").read_text()))
    load_model_weights(model, str(weights))
    x = torch.rand(2, 3, 96, 128) * 255
    cls_logits, box_deltas = session.run(None, {"images": x.numpy()})
    assert cls_logits.shape == (2, sum(h * w for h, w in AnchorGenerator().grid_sizes(96, 128)) * 9, 80)
    with torch.no_grad():
        ref = model.eval()(x)
    assert np.abs(cls_logits - ref["cls_logits"].numpy()).max() < 1e-3 and np.abs(box_deltas - ref["box_deltas"].numpy()).max() < 1e-3
