"""Batched decoding against torchvision's per-image RetinaNet post-processing (a reference computed another way)."""

import torch
import torchvision

from conftest import assert_same_detections, cap_cut, level_cuts
from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.decode import decode_detections


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
    for b, (o, r) in enumerate(zip(ours, ref)):
        _assert_same(o, r, logits[b], counts, topk=1000, cap=100)
        assert o["boxes"].shape[0] == r["boxes"].shape[0] == 100


def _assert_same(o: dict, r: dict, logits, counts, topk: int, cap: int) -> None:
    """The same detections as a set (float32 rounding: scores 1e-5, boxes 1e-4 px), sorted by score on both sides;
    ties within rounding may come in any order, and where one straddles a cut (the cap, a level's top-k) either
    member may be kept (`conftest.assert_same_detections`)."""
    for d in (o, r):
        assert bool((d["scores"][1:] <= d["scores"][:-1]).all())  # by decreasing score
    cuts = cap_cut(o["scores"], r["scores"], cap) + level_cuts(logits, counts, topk, 0.05)
    assert_same_detections((o["boxes"], o["scores"], o["labels"]), (r["boxes"], r["scores"], r["labels"]),
                           score_atol=1e-5, box_atol=1e-4, cuts=cuts)


def test_small_topk_and_cap_equal_torchvision():
    B, K = 2, 3
    logits, deltas, anchors, counts = _random_outputs(B, K, 96, 96, seed=1)
    sizes = torch.tensor([[96, 96], [96, 64]])
    ours = decode_detections(logits, deltas, anchors, counts, sizes, topk_per_level=7, max_detections=13).per_image(B)
    ref = _torchvision_reference(logits, deltas, anchors, counts, sizes, K, topk=7, max_det=13)
    for b, (o, r) in enumerate(zip(ours, ref)):
        assert o["boxes"].shape[0] == r["boxes"].shape[0] <= 13
        _assert_same(o, r, logits[b], counts, topk=7, cap=13)


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


def test_detection_sets_may_differ_only_in_a_tie_at_a_cut():
    """The comparison the parity tests use (conftest.assert_same_detections; the export's own check,
    detlib.retinanet.export.compare_detections, is tested with real head outputs in test_cases_d_outputs): a run of scores
    tied within rounding straddles the cap of 300 (an Intel Xeon keeps another member than this machine), so the
    300th detection differs: the same. A wrong label away from the cut: a difference."""
    import pytest

    g = torch.Generator().manual_seed(0)
    n = 305
    scores = torch.linspace(0.9, 0.2, n)
    scores[295:] = 0.2 + torch.arange(10, 0, -1) * 1e-7  # 10 scores tied within 1e-6 across the cap
    xy = torch.rand(n, 2, generator=g) * 300
    boxes = torch.cat([xy, xy + 20 + torch.rand(n, 2, generator=g) * 50], 1)
    labels = torch.randint(0, 80, (n,), generator=g)
    ref = (boxes[:300], scores[:300], labels[:300])
    keep = torch.tensor(list(range(299)) + [301])  # the other machine keeps the 302nd instead of the 300th
    other = (boxes[keep], scores[keep], labels[keep])
    cuts = cap_cut(ref[1], other[1], 300)
    assert assert_same_detections(other, ref, score_atol=1e-5, box_atol=0.0, cuts=cuts) == 299
    wrong = (other[0], other[1], other[2].clone())
    wrong[2][100] = (wrong[2][100] + 1) % 80
    with pytest.raises(AssertionError, match="without a partner away from any cut"):
        assert_same_detections(wrong, ref, score_atol=1e-5, box_atol=0.0, cuts=cuts)


def _reference_with_ties_broken_by_flat_index(logits, deltas, anchors, counts, size, topk, max_det, thresh=0.05):
    """One image's decoding written out in plain Python: candidates ordered by (logit desc, flat index asc), per-level
    top-k, threshold, greedy class-wise NMS at IoU 0.5 in that order, the first `max_det`. Returns (flat, boxes)."""
    from detlib.boxes import box_iou, clip_boxes_to_image
    from detlib.retinanet import box_coder

    K = logits.shape[1]
    flat_logits = logits.reshape(-1).tolist()
    chosen, start = [], 0
    for n in counts:
        level = sorted(range(start * K, (start + n) * K), key=lambda f: (-flat_logits[f], f))
        chosen += level[:topk]
        start += n
    chosen = [f for f in sorted(chosen, key=lambda f: (-flat_logits[f], f))
              if torch.sigmoid(torch.tensor(flat_logits[f])) > thresh]
    idx = torch.tensor(chosen, dtype=torch.int64)
    boxes = clip_boxes_to_image(box_coder.decode(deltas[idx // K], anchors[idx // K]), float(size[0]), float(size[1]))
    kept = []
    for i in range(len(chosen)):
        # a box is suppressed by a kept one of its class above IoU 0.5 (a degenerate box's NaN IoU suppresses nothing)
        if not any(chosen[j] % K == chosen[i] % K and box_iou(boxes[i:i + 1], boxes[j:j + 1])[0, 0] > 0.5 for j in kept):
            kept.append(i)
    kept = kept[:max_det]
    return [chosen[i] for i in kept], boxes[kept]


def test_ties_are_broken_by_the_lower_flat_index_at_topk_nms_and_cap():
    """Logits on a coarse grid (runs of thousands of equal values, as a near-prior model gives): the top-k boundary,
    NMS and the cap keep the lower flat index (anchor * K + class) of equal logits, as the plain reference does, on 1
    and 3 threads."""
    B, K, H, W = 2, 3, 96, 64
    g = torch.Generator().manual_seed(4)
    anchors, counts = AnchorGenerator()(H, W)
    A = anchors.shape[0]
    logits = torch.randint(-2, 1, (B, A, K), generator=g).float() - 0.5  # {-2.5, -1.5, -0.5}: all above 0.05
    deltas = torch.randn(B, A, 4, generator=g) * 0.3
    sizes = torch.tensor([[96, 64], [80, 64]])
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            ours = decode_detections(logits, deltas, anchors, counts, sizes, topk_per_level=40,
                                     max_detections=25).per_image(B)
            for b in range(B):
                flat, boxes = _reference_with_ties_broken_by_flat_index(logits[b], deltas[b], anchors, counts, sizes[b],
                                                                        40, 25)
                assert len(flat) == 25
                assert ours[b]["labels"].tolist() == [f % K for f in flat], (n_threads, b)
                assert torch.equal(ours[b]["boxes"], boxes), (n_threads, b)
                assert torch.equal(ours[b]["scores"], torch.sigmoid(logits[b].reshape(-1)[flat])), (n_threads, b)
    finally:
        torch.set_num_threads(threads)


def test_an_images_detections_do_not_depend_on_its_batch_position_or_thread_count():
    """The same head outputs decoded alone, and at every position of batches of 2 to 7 images of other outputs, on 1
    and 4 threads: bit-identical candidates (scores included: a CPU's vectorised sigmoid and its scalar tail round
    differently)."""
    K, H, W = 80, 128, 160
    anchors, counts = AnchorGenerator()(H, W)
    A = anchors.shape[0]
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, A, K, generator=g) - 3.0
    deltas = torch.randn(8, A, 4, generator=g) * 0.3
    sizes = torch.tensor([[H, W]] * 8)

    def decode(rows):
        # every candidate kept (no threshold, no suppression, no cap): the lowest ones too, which sat at the end of
        # the batch's sigmoid
        d = decode_detections(logits[rows], deltas[rows], anchors, counts, sizes[rows], score_thresh=0.0,
                              nms_thresh=1.0, max_detections=5000)
        return d.per_image(len(rows))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = decode([0])[0]
        for n_threads in (1, 4):
            torch.set_num_threads(n_threads)
            for size in range(2, 8):
                for position in range(size):
                    rows = list(range(1, size))
                    rows.insert(position, 0)
                    got = decode(rows)[position]
                    for key in ("boxes", "scores", "labels"):
                        assert torch.equal(got[key], alone[key]), (n_threads, size, position, key)
    finally:
        torch.set_num_threads(threads)
