"""Batched decoding against torchvision's per-image RetinaNet post-processing (a reference computed another way)."""

import torch
import torchvision

from detlib.anchors import AnchorGenerator
from detlib.decode import decode_detections


def _torchvision_reference(cls_logits, box_deltas, anchors, counts, image_sizes, K, topk=1000, max_det=100):
    tv = torchvision.models.detection.retinanet_resnet50_fpn(weights=None, weights_backbone=None, num_classes=K)
    tv.score_thresh, tv.nms_thresh, tv.detections_per_img, tv.topk_candidates = 0.05, 0.5, max_det, topk
    head = {"cls_logits": list(cls_logits.split(counts, dim=1)), "bbox_regression": list(box_deltas.split(counts, dim=1))}
    B = cls_logits.shape[0]
    per_image_anchors = [list(anchors.split(counts)) for _ in range(B)]
    return tv.postprocess_detections(head, per_image_anchors, [tuple(s) for s in image_sizes.tolist()])


def _random_outputs(B, K, H, W, seed):
    g = torch.Generator().manual_seed(seed)
    anchors, counts = AnchorGenerator()(H, W)
    A = anchors.shape[0]
    logits = torch.randn(B, A, K, generator=g) * 2 - 3  # a few thousand candidates above 0.05
    deltas = torch.randn(B, A, 4, generator=g) * 0.3
    return logits, deltas, anchors, counts


def test_decoding_equals_torchvision_postprocess():
    B, K = 3, 5
    logits, deltas, anchors, counts = _random_outputs(B, K, 128, 160, seed=0)
    sizes = torch.tensor([[128, 160], [100, 160], [128, 90]])
    ours = decode_detections(logits, deltas, anchors, counts, sizes).per_image(B)
    ref = _torchvision_reference(logits, deltas, anchors, counts, sizes, K)
    for o, r in zip(ours, ref):
        assert o["boxes"].shape[0] == r["boxes"].shape[0] == 100
        torch.testing.assert_close(o["scores"], r["scores"])
        torch.testing.assert_close(o["boxes"], r["boxes"])
        assert torch.equal(o["labels"], r["labels"])


def test_small_topk_and_cap_equal_torchvision():
    B, K = 2, 3
    logits, deltas, anchors, counts = _random_outputs(B, K, 96, 96, seed=1)
    sizes = torch.tensor([[96, 96], [96, 64]])
    ours = decode_detections(logits, deltas, anchors, counts, sizes, topk_per_level=7, max_detections=13).per_image(B)
    ref = _torchvision_reference(logits, deltas, anchors, counts, sizes, K, topk=7, max_det=13)
    for o, r in zip(ours, ref):
        assert o["boxes"].shape[0] == r["boxes"].shape[0] <= 13
        torch.testing.assert_close(o["boxes"], r["boxes"])
        torch.testing.assert_close(o["scores"], r["scores"])


def test_no_candidate_gives_empty_detections():
    logits, deltas, anchors, counts = _random_outputs(2, 3, 64, 64, seed=2)
    dets = decode_detections(logits - 100, deltas, anchors, counts, torch.tensor([[64, 64], [64, 64]]))
    parts = dets.per_image(2)
    assert [p["boxes"].shape for p in parts] == [(0, 4), (0, 4)]
    assert parts[0]["labels"].dtype == torch.int64


def test_boxes_are_clipped_and_mapped_back_to_original_pixels():
    logits, deltas, anchors, counts = _random_outputs(1, 2, 64, 64, seed=3)
    sizes = torch.tensor([[50, 64]])
    plain = decode_detections(logits, deltas, anchors, counts, sizes)
    assert plain.boxes[:, [0, 2]].max() <= 64 and plain.boxes[:, [1, 3]].max() <= 50
    scaled = decode_detections(logits, deltas, anchors, counts, sizes, scales=torch.tensor([[0.5, 0.25]]))
    torch.testing.assert_close(scaled.boxes, plain.boxes / torch.tensor([0.25, 0.5, 0.25, 0.5]))
