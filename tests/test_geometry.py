"""Box conversions, IoU / IoA, anchors and the box coder, against values worked out by hand."""

import math

import pytest
import torch

from detlib.boxes import (box_cxcywh_to_xyxy, box_ioa, box_iou, box_xywh_to_xyxy, box_xyxy_to_cxcywh,
                          box_xyxy_to_xywh, clip_boxes_to_image)
from detlib.retinanet import box_coder
from detlib.retinanet.anchors import AnchorGenerator, cell_anchors


def test_xywh_to_xyxy_worked_value_case_b03():
    # B03: a valid xywh box whose w < x must become [53, 89, 60, 115], converted exactly once.
    assert box_xywh_to_xyxy(torch.tensor([[53.0, 89.0, 7.0, 26.0]])).tolist() == [[53.0, 89.0, 60.0, 115.0]]


def test_conversions_round_trip_and_values():
    xyxy = torch.tensor([[10.0, 20.0, 30.0, 60.0], [0.0, 0.0, 1.0, 1.0]])
    assert box_xyxy_to_xywh(xyxy).tolist() == [[10.0, 20.0, 20.0, 40.0], [0.0, 0.0, 1.0, 1.0]]
    assert box_xyxy_to_cxcywh(xyxy).tolist() == [[20.0, 40.0, 20.0, 40.0], [0.5, 0.5, 1.0, 1.0]]
    boxes = torch.rand(50, 4) * 100
    boxes[:, 2:] += boxes[:, :2]
    torch.testing.assert_close(box_xywh_to_xyxy(box_xyxy_to_xywh(boxes)), boxes)
    torch.testing.assert_close(box_cxcywh_to_xyxy(box_xyxy_to_cxcywh(boxes)), boxes)


def test_conversions_keep_leading_dims():
    boxes = torch.rand(2, 3, 4)
    assert box_xyxy_to_cxcywh(boxes).shape == (2, 3, 4)


def test_iou_and_ioa_worked_values():
    a = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    b = torch.tensor([[5.0, 5.0, 15.0, 15.0], [20.0, 20.0, 30.0, 30.0], [0.0, 0.0, 10.0, 10.0]])
    torch.testing.assert_close(box_iou(a, b), torch.tensor([[25 / 175, 0.0, 1.0]]))
    # a 2x2 anchor fully inside a big crowd box: IoU is tiny, IoA is 1
    small = torch.tensor([[1.0, 1.0, 3.0, 3.0], [9.0, 9.0, 11.0, 11.0]])
    torch.testing.assert_close(box_ioa(small, a), torch.tensor([[1.0], [0.25]]))


def test_clip_boxes_case_b03():
    boxes = torch.tensor([[90.0, 90.0, 120.0, 120.0], [-5.0, 3.0, 10.0, 200.0]])
    assert clip_boxes_to_image(boxes, 100, 100).tolist() == [[90.0, 90.0, 100.0, 100.0], [0.0, 3.0, 10.0, 100.0]]
    # per-image sizes broadcast over a batch
    batch = torch.tensor([[[0.0, 0.0, 80.0, 80.0]], [[0.0, 0.0, 80.0, 80.0]]])
    out = clip_boxes_to_image(batch, torch.tensor([[50.0], [100.0]]), torch.tensor([[60.0], [100.0]]))
    assert out.tolist() == [[[0.0, 0.0, 60.0, 50.0]], [[0.0, 0.0, 80.0, 80.0]]]


def test_cell_anchors_ratio_is_h_over_w_at_constant_area():
    cell = cell_anchors(16, scales=(1.0,), ratios=(0.5, 1.0, 2.0))
    w = cell[:, 2] - cell[:, 0]
    h = cell[:, 3] - cell[:, 1]
    torch.testing.assert_close(h / w, torch.tensor([0.5, 1.0, 2.0]))
    torch.testing.assert_close(w * h, torch.full((3,), 256.0))


def test_anchors_on_a_tiny_grid_by_hand():
    gen = AnchorGenerator(strides=(16,), sizes=(16,), scales=(1.0,), ratios=(0.5, 1.0, 2.0))
    anchors, counts = gen(32, 32)
    assert counts == [12] and anchors.shape == (12, 4)
    s = math.sqrt(2.0)
    w05, h05 = 16 * s, 16 / s  # ratio 0.5: wide
    expected_first_location = torch.tensor([
        [8 - w05 / 2, 8 - h05 / 2, 8 + w05 / 2, 8 + h05 / 2],
        [0.0, 0.0, 16.0, 16.0],
        [8 - h05 / 2, 8 - w05 / 2, 8 + h05 / 2, 8 + w05 / 2],
    ])
    torch.testing.assert_close(anchors[:3], expected_first_location)
    # order level -> y -> x -> anchor: index 3..5 is cell (y=0, x=1), centre (24, 8); 6..8 is (y=1, x=0)
    centres = ((anchors[:, :2] + anchors[:, 2:]) / 2)[::3]
    assert centres.tolist() == [[8.0, 8.0], [24.0, 8.0], [8.0, 24.0], [24.0, 24.0]]


def test_default_anchor_counts_and_scales():
    gen = AnchorGenerator()
    anchors, counts = gen(640, 640)
    assert counts == [9 * 80 * 80, 9 * 40 * 40, 9 * 20 * 20, 9 * 10 * 10, 9 * 5 * 5]
    # P3's square anchors at the three octave scales: 32, 40.3, 50.8 px
    sq = anchors[3:6]
    torch.testing.assert_close(sq[:, 2] - sq[:, 0], torch.tensor([32.0, 32 * 2 ** (1 / 3), 32 * 2 ** (2 / 3)]))
    # P6/P7 round up: a 320 px input has a 3x3 P7 (stride 128)
    assert AnchorGenerator().grid_sizes(320, 352) == [(40, 44), (20, 22), (10, 11), (5, 6), (3, 3)]
    with pytest.raises(ValueError, match="multiple of 32"):
        gen(100, 640)


def test_encode_decode_round_trip():
    torch.manual_seed(0)
    anchors = torch.rand(200, 4) * 300
    anchors[:, 2:] = anchors[:, :2] + 8 + torch.rand(200, 2) * 200
    gt = torch.rand(200, 4) * 300
    gt[:, 2:] = gt[:, :2] + 2 + torch.rand(200, 2) * 300
    deltas = box_coder.encode(gt, anchors)
    torch.testing.assert_close(box_coder.decode(deltas, anchors), gt, rtol=1e-5, atol=1e-3)


def test_encode_worked_value():
    anchor = torch.tensor([[0.0, 0.0, 10.0, 20.0]])  # centre (5, 10), 10 x 20
    gt = torch.tensor([[5.0, 10.0, 25.0, 30.0]])  # centre (15, 20), 20 x 20
    d = box_coder.encode(gt, anchor)
    torch.testing.assert_close(d, torch.tensor([[1.0, 0.5, math.log(2.0), 0.0]]))


def test_decode_clamps_huge_deltas():
    out = box_coder.decode(torch.tensor([[0.0, 0.0, 50.0, 50.0]], dtype=torch.float16), torch.tensor([[0.0, 0.0, 16.0, 16.0]]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 2] - out[0, 0], torch.tensor(1000.0))
