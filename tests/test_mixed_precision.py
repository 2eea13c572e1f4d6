"""Mixed precision with clipping (B16): fp32 master weights, unscaled clipping, norm close to fp32's."""

import copy

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from detlib.anchors import AnchorGenerator
from detlib.loss import retinanet_loss
from detlib.model import RetinaNet


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
