"""Anchor matching and the RetinaNet loss: worked examples, edge cases B01, B04, B05, B17, B29."""

import math

import pytest
import torch

from detlib.labels import BACKGROUND, IGNORE
from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.loss import retinanet_loss
from detlib.retinanet.matching import match_anchors
from detlib.retinanet.model import RetinaNet


def _gt(boxes, labels):
    return torch.tensor([boxes], dtype=torch.float32).reshape(1, -1, 4), torch.tensor([labels], dtype=torch.int64).reshape(1, -1)


def test_matching_thresholds_worked_example():
    anchors = torch.tensor([
        [0.0, 0.0, 10.0, 10.0],   # IoU 1.0  -> positive
        [0.0, 0.0, 10.0, 6.0],    # IoU 0.6  -> positive
        [0.0, 0.0, 10.0, 4.5],    # IoU 0.45 -> ignored
        [0.0, 0.0, 10.0, 3.0],    # IoU 0.3  -> background
        [50.0, 50.0, 60.0, 60.0], # IoU 0    -> background
    ])
    boxes, labels = _gt([[0.0, 0.0, 10.0, 10.0]], [4])
    m = match_anchors(anchors, boxes, labels)
    assert m.tolist() == [[0, 0, IGNORE, BACKGROUND, BACKGROUND]]


def test_matching_with_zero_targets_is_all_background():
    anchors, _ = AnchorGenerator()(64, 64)
    m = match_anchors(anchors, torch.zeros(2, 0, 4), torch.zeros(2, 0, dtype=torch.int64))
    assert m.shape == (2, anchors.shape[0]) and (m == BACKGROUND).all()


def test_padding_slots_never_match():
    anchors = torch.tensor([[0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    boxes = torch.tensor([[[20.0, 20.0, 30.0, 30.0], [0.0, 0.0, 10.0, 10.0]]])
    labels = torch.tensor([[1, -1]])  # second slot is padding, although it overlaps anchor 0 perfectly
    assert match_anchors(anchors, boxes, labels).tolist() == [[BACKGROUND, 0]]


def test_low_quality_match_gives_each_box_its_best_anchor_case_b04():
    # B04: a 2x2 px box has IoU < 0.4 with every anchor; it still gets its best anchor as a positive.
    anchors, _ = AnchorGenerator()(512, 512)
    boxes, labels = _gt([[100.0, 100.0, 102.0, 102.0]], [0])
    m = match_anchors(anchors, boxes, labels)
    assert (m == 0).sum() >= 1
    m_strict = match_anchors(anchors, boxes, labels, allow_low_quality=False)
    assert (m_strict == 0).sum() == 0


def test_crowd_region_turns_background_into_ignore_case_b05():
    anchors = torch.tensor([[10.0, 10.0, 20.0, 20.0], [0.0, 0.0, 10.0, 10.0], [200.0, 200.0, 210.0, 210.0]])
    boxes, labels = _gt([[0.0, 0.0, 10.0, 10.0]], [2])
    crowd = torch.tensor([[[0.0, 0.0, 100.0, 100.0]]])
    m = match_anchors(anchors, boxes, labels, crowd)
    # anchor 0 lies inside the crowd: ignored instead of background; the positive stays positive
    assert m.tolist() == [[IGNORE, 0, BACKGROUND]]
    # zero boxes are padding and change nothing
    assert match_anchors(anchors, boxes, labels, torch.zeros(1, 3, 4)).tolist() == [[BACKGROUND, 0, BACKGROUND]]


def test_chunked_matching_equals_unchunked_case_b29():
    torch.manual_seed(0)
    anchors, _ = AnchorGenerator()(256, 256)
    xy = torch.rand(2, 300, 2) * 248
    boxes = torch.cat([xy, xy + 8], dim=-1)  # 300 boxes of 8 px per image (B29 in small)
    boxes[:, :10, 2:] += 40  # and a few larger ones
    labels = torch.randint(0, 5, (2, 300))
    labels[1, 250:] = -1
    crowd = torch.tensor([[[0.0, 0.0, 64.0, 64.0]], [[0.0, 0.0, 0.0, 0.0]]])
    boxes[0, 20] = boxes[0, 21]  # two identical boxes: ties for the low-quality pass
    full = match_anchors(anchors, boxes, labels, crowd, max_elements=1 << 40)
    for keep_ties in (None, True, False):  # the CPU's default, pairs kept per chunk, IoU recomputed
        chunked = match_anchors(anchors, boxes, labels, crowd, max_elements=50_000, keep_ties=keep_ties)
        assert torch.equal(full, chunked), keep_ties
    assert (full >= 0).sum() > 0


def _focal_reference(logits, targets, alpha=0.25, gamma=2.0):
    p = torch.sigmoid(logits.double())
    t = targets.double()
    p_t = p * t + (1 - p) * (1 - t)
    alpha_t = alpha * t + (1 - alpha) * (1 - t)
    return (-alpha_t * (1 - p_t) ** gamma * torch.log(p_t)).sum()


def test_focal_loss_matches_direct_formula():
    torch.manual_seed(0)
    anchors = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 4.5], [50.0, 50.0, 60.0, 60.0]])
    boxes, labels = _gt([[0.0, 0.0, 10.0, 10.0]], [1])
    logits = torch.randn(1, 3, 3)
    deltas = torch.zeros(1, 3, 4)
    out = retinanet_loss(logits, deltas, anchors, boxes, labels)
    # anchor 0 positive for class 1, anchor 1 ignored, anchor 2 background; 1 positive -> normaliser 1
    targets = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    expected = _focal_reference(logits[0, [0, 2]], targets)
    torch.testing.assert_close(out["cls_loss"].double(), expected, rtol=1e-5, atol=1e-6)
    assert out["num_pos"].item() == 1.0
    # box loss: zero deltas vs the exact-match target (0, 0, 0, 0) -> 0
    assert out["box_loss"].item() == 0.0


@pytest.mark.parametrize("kind", ["l1", "smooth_l1", "giou"])
def test_box_loss_is_positive_for_wrong_deltas_and_normalised(kind):
    anchors = torch.tensor([[0.0, 0.0, 10.0, 10.0], [100.0, 100.0, 110.0, 110.0]])
    boxes, labels = _gt([[0.0, 0.0, 10.0, 10.0], [100.0, 100.0, 110.0, 110.0]], [0, 0])
    deltas = torch.tensor([[[0.1, 0.0, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0]]])
    out = retinanet_loss(torch.zeros(1, 2, 1), deltas, anchors, boxes, labels, box_loss=kind)
    if kind == "l1":
        torch.testing.assert_close(out["box_loss"], torch.tensor(0.1))  # (0.1 + 0.1) / 2 positives
    elif kind == "smooth_l1":
        torch.testing.assert_close(out["box_loss"], torch.tensor(0.5 * 0.1 ** 2 / 0.1))
    else:
        assert out["box_loss"].item() > 0


def test_image_without_boxes_case_b01():
    # B01: a batch of one image with no annotation: cls loss finite and > 0, box loss exactly 0, and every
    # trainable parameter still receives a gradient (so DDP never waits for an unused parameter).
    torch.manual_seed(0)
    model = RetinaNet(3, "resnet18", fpn_channels=16, freeze_backbone_bn=False)
    images = torch.randint(0, 255, (1, 3, 64, 64), dtype=torch.uint8)
    out = model(images)
    anchors, _ = AnchorGenerator()(64, 64)
    loss = retinanet_loss(out["cls_logits"], out["box_deltas"], anchors, torch.zeros(1, 0, 4),
                          torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, 4))
    assert math.isfinite(loss["cls_loss"].item()) and loss["cls_loss"].item() > 0
    assert loss["box_loss"].item() == 0.0 and loss["num_pos"].item() == 0
    loss["loss"].backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []


def test_tiny_box_loss_is_finite_case_b04():
    anchors, _ = AnchorGenerator()(512, 512)
    A = anchors.shape[0]
    boxes, labels = _gt([[100.0, 100.0, 102.0, 102.0]], [0])
    out = retinanet_loss(torch.zeros(1, A, 2), torch.zeros(1, A, 4), anchors, boxes, labels)
    assert all(math.isfinite(v.item()) for v in out.values())
    assert out["num_pos"].item() >= 1


def test_focal_loss_with_saturated_fp16_logits_case_b17():
    # B17: +12 on a negative anchor and -12 on a positive one; in fp16 sigmoid saturates to 1.0 / 0.0.
    anchors = torch.tensor([[0.0, 0.0, 10.0, 10.0], [50.0, 50.0, 60.0, 60.0]])
    boxes, labels = _gt([[0.0, 0.0, 10.0, 10.0]], [0])
    logits16 = torch.tensor([[[-12.0], [12.0]]], dtype=torch.float16, requires_grad=True)
    deltas = torch.zeros(1, 2, 4, dtype=torch.float16, requires_grad=True)
    out16 = retinanet_loss(logits16, deltas, anchors, boxes, labels)
    out16["loss"].backward()
    assert torch.isfinite(out16["loss"]) and torch.isfinite(logits16.grad).all()
    out32 = retinanet_loss(logits16.detach().float(), deltas.detach().float(), anchors, boxes, labels)
    torch.testing.assert_close(out16["cls_loss"], out32["cls_loss"], rtol=1e-3, atol=1e-3)
    expected = _focal_reference(torch.tensor([-12.0, 12.0]), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out16["cls_loss"].double(), expected, rtol=1e-4, atol=1e-4)


def test_loss_rejects_anchors_of_another_size():
    anchors, _ = AnchorGenerator()(64, 64)
    with pytest.raises(ValueError, match="anchors"):
        retinanet_loss(torch.zeros(1, 10, 2), torch.zeros(1, 10, 4), anchors, torch.zeros(1, 0, 4), torch.zeros(1, 0, dtype=torch.int64))
