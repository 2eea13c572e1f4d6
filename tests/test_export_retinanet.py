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

from detlib.data.images import load_rgb
from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.decode import decode_detections
from detlib.retinanet.export import canvas_size, compare_detections, head_candidates, prepare_input
from detlib.retinanet.model import build_retinanet_from_config

from conftest import COCO_SUBSET, needs_coco_subset, traceback_through_our_code
from detlib.weights import load_model_weights
from helpers import error_lines, fresh_root_logging, run_main
from tiny_retinanet import spread_retinanet

pytestmark = [needs_coco_subset, pytest.mark.slow]
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny RetinaNet whose scores spread like a trained model's (`tiny_retinanet.spread_retinanet`)."""
    return spread_retinanet(tmp_path_factory.mktemp("weights"))


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
    ours = [ln for ln in lines if " export_retinanet: " in ln]
    assert "parity on 3 images: pass" in ours[-2] and "AP on 30 images of instances_val.json: onnx: AP" in ours[-1]
    assert [ln.split(": ", 1)[0].split()[-1] for ln in lines if ln not in ours] in ([], ["detlib.deploy.runner"])
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


def test_case_g11_predict_larger_than_an_exports_fixed_canvas_is_one_line_naming_its_size(weights, tmp_path, capfd):
    """An export decoding inside has a fixed canvas (128 px here); predict_retinanet.py --image_size 256 with it stops
    at start in one line that says the export's size and both ways on (it was a ValueError traceback through
    scripts/ and detlib/deploy/runner.py at the first batch); --image_size within the canvas predicts."""
    out = tmp_path / "fixed.onnx"
    _export(weights, out, capfd, "--num_check_images", "1")
    photos = tmp_path / "photos"
    photos.mkdir()
    first = sorted((COCO_SUBSET / "images").iterdir())[0]
    (photos / first.name).write_bytes(first.read_bytes())
    argv = ["--weights", out, "--source", photos, "--no_images", "--cpu"]
    fresh_root_logging()
    code, stdout, stderr = run_main("predict_retinanet", argv + ["--image_size", "256", "--output_dir", tmp_path / "p"],
                                    capfd)
    assert code == 1 and not traceback_through_our_code(stdout + stderr), stderr[-3000:]
    (line,) = error_lines(stderr)
    assert line == (f"error: {out} was exported for images of 128 px on a fixed 128x128 canvas (decoding inside): "
                    "--image_size 256 needs a 256x256 one; predict without --image_size (the export's 128), or export "
                    "again with --image_size 256 (or with --decode outside, which takes any size)")
    assert not (tmp_path / "p" / "predictions.json").exists()
    fresh_root_logging()
    code, stdout, stderr = run_main("predict_retinanet", argv + ["--image_size", "96", "--output_dir", tmp_path / "q"],
                                    capfd)
    assert code == 0 and (tmp_path / "q" / "predictions.json").is_file(), stderr[-3000:]
