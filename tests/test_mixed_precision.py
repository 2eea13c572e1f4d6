"""Mixed precision with clipping (B16): fp32 master weights, unscaled clipping, norm close to fp32's."""

import copy

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.loss import retinanet_loss
from detlib.retinanet.model import RetinaNet


def _grad_norm(model, mixed_precision, batch):
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = accelerator.prepare(model, opt)
    images, boxes, labels = batch
    with accelerator.autocast():
        out = model(images)
    anchors, _ = AnchorGenerator()(*images.shape[-2:])
    loss = retinanet_loss(out["cls_logits"], out["box_deltas"], anchors, boxes, labels)
    accelerator.backward(loss["loss"])
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    dtypes = {p.dtype for p in model.parameters()}
    AcceleratorState._reset_state(True)
    return float(norm), dtypes, out["cls_logits"].dtype


def test_bf16_autocast_keeps_fp32_weights_and_grad_norm_case_b16():
    torch.manual_seed(0)
    model = RetinaNet(3, "resnet18", fpn_channels=16, freeze_backbone_bn=False)
    # 128 px, not 64: at 64 px P6 is 1x1, and PyTorch's CPU bf16 conv weight-gradient for a 1x1 input
    # with stride 2 and padding 1 (the P7 conv) intermittently returns NaN (an upstream kernel bug).
    images = torch.randint(0, 255, (2, 3, 128, 128), dtype=torch.uint8)
    boxes = torch.tensor([[[4.0, 4.0, 40.0, 40.0]], [[10.0, 20.0, 60.0, 50.0]]])
    labels = torch.tensor([[0], [2]])
    n32, d32, l32 = _grad_norm(model, "no", (images, boxes, labels))
    n16, d16, l16 = _grad_norm(model, "bf16", (images, boxes, labels))
    # accelerate returns fp32 outputs from the prepared model; bf16 compute shows in the differing norm
    assert l32 == l16 == torch.float32 and n16 != n32
    assert d32 == d16 == {torch.float32}  # master weights stay fp32
    assert n16 == pytest.approx(n32, rel=0.1)  # the clipped norm is the real (unscaled) one


# ---- fp16 on a CPU (accelerate itself runs fp16 on a CPU in fp32: tests/helpers.py's enable_cpu_fp16)

def test_losses_are_fp32_from_fp16_logits_under_autocast_case_b17():
    """Focal and box losses come out float32 from fp16 logits and deltas, inside fp16 autocast, and equal the
    losses of the same values given as float32 outside it."""
    anchors, _ = AnchorGenerator()(64, 64)
    A = anchors.shape[0]
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, A, 3, generator=g) * 3).half()
    deltas = (torch.randn(2, A, 4, generator=g) * 0.3).half()
    boxes = torch.tensor([[[4.0, 4.0, 40.0, 40.0]], [[10.0, 20.0, 60.0, 50.0]]])
    labels = torch.tensor([[0], [2]])
    for box_loss in ("l1", "giou"):
        with torch.autocast("cpu", torch.float16):
            half = retinanet_loss(logits, deltas, anchors, boxes, labels, box_loss=box_loss)
        ref = retinanet_loss(logits.float(), deltas.float(), anchors, boxes, labels, box_loss=box_loss)
        for k in ("loss", "cls_loss", "box_loss"):
            assert half[k].dtype == torch.float32, (box_loss, k)
            assert float(half[k]) == pytest.approx(float(ref[k]), rel=1e-6), (box_loss, k)


def test_loss_stays_finite_with_saturated_fp16_logits_case_b17():
    """Logits at fp16's largest value, wrong for every anchor: each anchor's focal term is about 0.75 x 65504,
    and their sum over 12,000 (anchor, class) pairs would overflow fp16 (inf); in float32 it is finite."""
    anchors, _ = AnchorGenerator()(64, 64)
    A = anchors.shape[0]
    fp16_max = torch.finfo(torch.float16).max
    logits = torch.full((2, A, 3), fp16_max, dtype=torch.float16)  # every class "present" with certainty
    deltas = torch.full((2, A, 4), fp16_max, dtype=torch.float16)  # boxes exp(65504) wide before the clamp
    boxes = torch.tensor([[[4.0, 4.0, 40.0, 40.0]], [[10.0, 20.0, 60.0, 50.0]]])
    labels = torch.tensor([[0], [2]])
    for box_loss in ("l1", "smooth_l1", "giou"):
        with torch.autocast("cpu", torch.float16):
            out = retinanet_loss(logits, deltas, anchors, boxes, labels, box_loss=box_loss)
        assert all(torch.isfinite(out[k]) for k in ("loss", "cls_loss", "box_loss")), box_loss
        assert float(out["cls_loss"]) > fp16_max  # the sum itself is beyond fp16: it was not summed in fp16


def test_enable_cpu_fp16_refuses_other_settings():
    from helpers import enable_cpu_fp16

    AcceleratorState._reset_state(True)
    try:
        with pytest.raises(ValueError, match="mixed_precision fp16"):
            enable_cpu_fp16(Accelerator(cpu=True, mixed_precision="no"))
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.slow
def test_fp16_inf_gradient_backs_off_scale_and_skips_on_every_rank_case_b16(tmp_path):
    """2 gloo processes, autocast("cpu", float16) + GradScaler("cpu") through the scripts' step (StepGuard.check,
    optimizer.step, TrainState.step_done; tests/probes/fp16_step_probe.py): rank 1 alone gets an inf gradient at
    step 2."""
    import json

    from conftest import REPO, read_metrics
    from helpers import forked_ok

    result = tmp_path / "result.json"
    forked_ok(REPO / "tests" / "probes" / "fp16_step_probe.py", [tmp_path / "run", result])  # 2 processes, forked
    data = json.loads(result.read_text())
    assert data["num_processes"] == 2
    for r in data["ranks"]:
        assert r["scaler"] == "torch.amp.grad_scaler.GradScaler"
        assert r["head_dtypes"] == ["torch.float16"]  # the forward ran in fp16
        assert r["param_dtypes"] == ["torch.float32"]  # fp32 master weights
        steps = {s["step"]: s for s in r["steps"]}
        assert [steps[i]["scale_before"] for i in (1, 2, 3, 4)] == [65536.0, 65536.0, 32768.0, 32768.0]
        assert steps[2]["scale_after"] == 32768.0  # halved by the inf gradient, on both ranks
        assert not steps[2]["changed"] and steps[2]["update_norm"] == 0.0  # skipped on both ranks
        for i in (1, 3, 4):
            s = steps[i]
            assert s["changed"] and s["loss_dtype"] == "torch.float32" and s["output_dtype"] == "torch.float32"
            assert 0.1 < s["unscaled_norm"] < 100  # the real norm (the scaled one would be ~65536 times larger)
            # SGD at lr 1 moves the weights by the clipped gradient: clipped to --max_grad_norm 0.1 in real units
            assert s["update_norm"] == pytest.approx(0.1, rel=1e-3)
        assert r["skipped_steps"] == 1
    lines = {m["step"]: m for m in read_metrics(tmp_path / "run") if "loss_scale" in m}
    assert [lines[i]["loss_scale"] for i in (1, 2, 3, 4)] == [65536.0, 32768.0, 32768.0, 32768.0]
    assert [lines[i]["skipped_steps"] for i in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert lines[2]["grad_norm"] == "nan"
    rank0 = {s["step"]: s for s in data["ranks"][0]["steps"]}
    for i in (1, 3, 4):  # the logged pre-clip norm is the unscaled one
        assert lines[i]["grad_norm"] == pytest.approx(rank0[i]["unscaled_norm"], rel=1e-4)
    assert "step 2: fp16 gradient overflow" in (tmp_path / "run" / "train.log").read_text()
