"""Every fast path against a slow reference computed another way (tiny inputs; no timing here).

* IoU: `pairwise_iou` is bit for bit `torchvision.ops.box_iou`.
* Matching: chunked (both low-quality strategies) == unchunked == torchvision's `box_iou` + `Matcher`,
  image by image, including padding in the middle, empty images, ties and the many-small-boxes case (B29).
* Loss: the batched loss equals a per-image Python loop with torchvision's focal loss.
* Decoding: the fused batched decoder gives the same detections as a per-image, per-level loop in the
  style of torchvision's `RetinaNet.postprocess_detections`.
* Model: folding the frozen BatchNorm into the convs and channels_last change nothing but float rounding,
  and keep the state dict keys.
* COCO evaluation: the faster-coco-eval backend gives pycocotools' 12 stats to 1e-6 on jittered real data.
* Benchmark peer: torchvision's RetinaNet built by `devtools/peers.py` (shared with `benchmarks/`) really carries our weights.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torchvision.models.detection._utils import Matcher
from torchvision.ops import batched_nms, box_area, box_iou, sigmoid_focal_loss
from torchvision.ops.misc import FrozenBatchNorm2d

from detlib.boxes import clip_boxes_to_image
from detlib.evaluation.coco import STAT_NAMES, evaluate_coco
from detlib.labels import BACKGROUND, IGNORE
from detlib.retinanet import box_coder
from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.decode import decode_detections
from detlib.retinanet.loss import retinanet_loss
from detlib.retinanet.matching import match_anchors, pairwise_iou
from detlib.retinanet.model import RetinaNet, _Conv2dFrozenBN

from conftest import assert_same_detections, cap_cut, level_cuts
from devtools.peers import COCO_SUBSET_JSON, coco_eval_inputs, head_output_gap, torchvision_retinanet


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads can make these tiny ops 10-40x
    slower (a 0.6 s test took 24 s), and nothing here is about parallel speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_boxes(n: int, size: float, gen: torch.Generator, min_wh: float = 2.0, max_wh: float = 80.0) -> torch.Tensor:
    xy = torch.rand(n, 2, generator=gen) * size
    wh = min_wh + torch.rand(n, 2, generator=gen) * (max_wh - min_wh)
    return torch.cat([xy, xy + wh], dim=1)


# ---------------------------------------------------------------- IoU

def test_pairwise_iou_is_box_iou_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    anchors, _ = AnchorGenerator()(128, 96)
    boxes = torch.cat([_random_boxes(40, 128, gen),
                       torch.tensor([[0.0, 0.0, 0.0, 0.0], [10, 10, 10, 30], [500, 500, 600, 600]])])  # degenerate, outside
    fast = pairwise_iou(boxes, anchors.T.contiguous(), box_area(boxes)[:, None], box_area(anchors))
    assert fast.shape == (boxes.shape[0], anchors.shape[0])
    assert torch.equal(fast, box_iou(boxes, anchors))


# ---------------------------------------------------------------- matching

def _torchvision_assignment(anchors, gt_boxes, gt_labels):
    """Image by image: torchvision's box_iou + Matcher on the real (unpadded) boxes, mapped to slot indices."""
    matcher = Matcher(0.5, 0.4, allow_low_quality_matches=True)
    out = []
    for boxes, labels in zip(gt_boxes, gt_labels):
        slots = (labels >= 0).nonzero().flatten()
        if slots.numel() == 0:
            out.append(torch.full((anchors.shape[0],), BACKGROUND, dtype=torch.int64))
            continue
        m = matcher(box_iou(boxes[slots], anchors))  # -1 below 0.4, -2 between: our BACKGROUND and IGNORE
        out.append(torch.where(m >= 0, slots[m.clamp(min=0)], m))
    return torch.stack(out)


def _padded_batch(gen, anchors_size, counts, tiny=False):
    """gt [B, M, 4] with padding slots in the middle of the real ones (not only at the end)."""
    M = max(counts) + 2
    boxes = torch.zeros((len(counts), M, 4))
    labels = torch.full((len(counts), M), -1, dtype=torch.int64)
    for b, n in enumerate(counts):
        slots = torch.randperm(M, generator=gen)[:n]
        if tiny:
            corner = torch.rand(n, 2, generator=gen) * (anchors_size - 8)
            boxes[b, slots] = torch.cat([corner, corner + 8], dim=1)
        else:
            boxes[b, slots] = _random_boxes(n, anchors_size - 40, gen, 4, 90)
        labels[b, slots] = torch.randint(0, 5, (n,), generator=gen)
    # a padded slot holding a non-zero box must still never be matched
    labels[0, -1], boxes[0, -1] = -1, torch.tensor([5.0, 5.0, 60.0, 60.0])
    return boxes, labels


@pytest.mark.parametrize("tiny", [False, True], ids=["mixed_boxes", "many_8px_boxes"])
def test_matching_chunked_unchunked_and_torchvision_agree(tiny):
    gen = torch.Generator().manual_seed(1 if tiny else 2)
    anchors, _ = AnchorGenerator()(160, 128)
    counts = [60, 0, 7] if tiny else [9, 0, 3, 14]
    gt_boxes, gt_labels = _padded_batch(gen, 128, counts, tiny=tiny)
    if tiny:  # ties: identical 8 px boxes reach the same best IoU on several anchors
        gt_boxes[0, :2] = torch.tensor([[40.0, 40.0, 48.0, 48.0]])
        gt_labels[0, :2] = 3
    unchunked = match_anchors(anchors, gt_boxes, gt_labels, max_elements=1 << 40)
    reference = _torchvision_assignment(anchors, gt_boxes, gt_labels)
    assert torch.equal(unchunked, reference)
    M = gt_boxes.shape[1]
    for max_elements in (len(counts) * M * 97, len(counts) * M * 1000):  # 40 and 4 chunks
        kept_ties = match_anchors(anchors, gt_boxes, gt_labels, max_elements=max_elements, keep_ties=True)
        recomputed = match_anchors(anchors, gt_boxes, gt_labels, max_elements=max_elements, keep_ties=False)
        assert torch.equal(kept_ties, unchunked), max_elements
        assert torch.equal(recomputed, unchunked), max_elements
    assert (unchunked[1] == BACKGROUND).all()
    assert (unchunked[0] != M - 1).all()  # the padded slot holding a box is never matched
    assert (unchunked >= 0).any()
    if not tiny:  # 8 px boxes never reach IoU 0.4 with an anchor of 32 px or more
        assert (unchunked == IGNORE).any()


def test_matching_with_crowd_regions_is_chunk_independent():
    gen = torch.Generator().manual_seed(3)
    anchors, _ = AnchorGenerator()(128, 128)
    gt_boxes, gt_labels = _padded_batch(gen, 128, [5, 2])
    crowd = torch.zeros((2, 2, 4))
    crowd[0, 0] = torch.tensor([0.0, 0.0, 90.0, 70.0])
    full = match_anchors(anchors, gt_boxes, gt_labels, crowd, max_elements=1 << 40)
    for max_elements in (2 * 7 * 300, 2 * 7 * 1000):
        assert torch.equal(match_anchors(anchors, gt_boxes, gt_labels, crowd, max_elements=max_elements), full)
    assert (full == IGNORE).sum() > (match_anchors(anchors, gt_boxes, gt_labels) == IGNORE).sum()


# ---------------------------------------------------------------- loss

def _loss_per_image(cls_logits, box_deltas, anchors, gt_boxes, gt_labels):
    """A Python loop over images, torchvision-style, normalised by the batch's positives as ours is."""
    focal_sum, box_sum, num_pos = 0.0, 0.0, 0
    matcher = Matcher(0.5, 0.4, allow_low_quality_matches=True)
    for logits, deltas, boxes, labels in zip(cls_logits, box_deltas, gt_boxes, gt_labels):
        real = labels >= 0
        boxes, labels = boxes[real], labels[real]
        if boxes.numel() == 0:
            m = torch.full((anchors.shape[0],), -1, dtype=torch.int64)
        else:
            m = matcher(box_iou(boxes, anchors))
        pos = m >= 0
        target = torch.zeros_like(logits)
        target[pos, labels[m[pos]]] = 1.0
        valid = m != IGNORE
        focal_sum = focal_sum + sigmoid_focal_loss(logits[valid], target[valid], reduction="sum")
        if pos.any():
            target_deltas = box_coder.encode(boxes[m[pos]], anchors[pos])
            box_sum = box_sum + F.l1_loss(deltas[pos], target_deltas, reduction="sum")
        num_pos += int(pos.sum())
    norm = max(1, num_pos)
    return focal_sum / norm, box_sum / norm, num_pos


def test_batched_loss_equals_per_image_loop():
    gen = torch.Generator().manual_seed(4)
    anchors, _ = AnchorGenerator()(96, 128)
    gt_boxes, gt_labels = _padded_batch(gen, 96, [4, 0, 6])
    B, A, K = 3, anchors.shape[0], 5
    cls_logits = torch.randn(B, A, K, generator=gen)
    box_deltas = 0.1 * torch.randn(B, A, 4, generator=gen)
    for max_elements in (1 << 40, 300):
        out = retinanet_loss(cls_logits, box_deltas, anchors, gt_boxes, gt_labels, max_elements=max_elements)
        cls_ref, box_ref, num_pos = _loss_per_image(cls_logits, box_deltas, anchors, gt_boxes, gt_labels)
        assert int(out["num_pos"]) == num_pos > 0
        torch.testing.assert_close(out["cls_loss"], torch.as_tensor(cls_ref, dtype=torch.float32), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["box_loss"], torch.as_tensor(box_ref, dtype=torch.float32), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- decoding

def _decode_reference(cls_logits, box_deltas, anchors, per_level, image_sizes, score_thresh, topk, nms, max_det):
    """torchvision's postprocess_detections, reproduced: a loop over images and levels, threshold first."""
    out = []
    for b in range(cls_logits.shape[0]):
        boxes_all, scores_all, labels_all = [], [], []
        for logits, deltas, anc in zip(cls_logits[b].split(per_level), box_deltas[b].split(per_level), anchors.split(per_level)):
            K = logits.shape[-1]
            scores = torch.sigmoid(logits).flatten()
            idx = torch.where(scores > score_thresh)[0]
            scores, order = scores[idx].topk(min(topk, idx.numel()))
            idx = idx[order]
            a = idx // K
            boxes = clip_boxes_to_image(box_coder.decode(deltas[a], anc[a]), *image_sizes[b].tolist())
            boxes_all.append(boxes), scores_all.append(scores), labels_all.append(idx % K)
        boxes, scores, labels = torch.cat(boxes_all), torch.cat(scores_all), torch.cat(labels_all)
        keep = batched_nms(boxes, scores, labels, nms)[:max_det]
        out.append({"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]})
    return out


@pytest.mark.parametrize("topk,max_det", [(1000, 100), (7, 5)])
def test_fused_decoding_equals_per_image_per_level_loop(topk, max_det):
    gen = torch.Generator().manual_seed(5)
    gen_anchors = AnchorGenerator()
    anchors, per_level = gen_anchors(128, 96)
    B, A, K = 3, anchors.shape[0], 4
    cls_logits = torch.randn(B, A, K, generator=gen) - 2.0  # about 40 % of the candidates above 0.05
    box_deltas = 0.2 * torch.randn(B, A, 4, generator=gen)
    image_sizes = torch.tensor([[128, 96], [100, 80], [64, 96]])
    dets = decode_detections(cls_logits, box_deltas, anchors, per_level, image_sizes, score_thresh=0.05,
                             topk_per_level=topk, nms_thresh=0.5, max_detections=max_det).per_image(B)
    ref = _decode_reference(cls_logits, box_deltas, anchors, per_level, image_sizes, 0.05, topk, 0.5, max_det)
    for b, (d, r) in enumerate(zip(dets, ref)):
        assert d["boxes"].shape[0] == r["boxes"].shape[0] > 0
        # bit-identical values, compared as sets: exact ties (float32 sigmoids) may come in either order, and
        # either member of a tie that straddles the cap or a level's top-k may be kept
        cuts = cap_cut(d["scores"], r["scores"], max_det) + level_cuts(cls_logits[b], per_level, topk, 0.05)
        assert_same_detections((d["boxes"], d["scores"], d["labels"]), (r["boxes"], r["scores"], r["labels"]),
                               score_atol=0.0, box_atol=0.0, cuts=cuts)


def test_fused_decoding_with_nothing_above_the_threshold():
    anchors, per_level = AnchorGenerator()(64, 64)
    A = anchors.shape[0]
    dets = decode_detections(torch.full((2, A, 3), -10.0), torch.zeros(2, A, 4), anchors, per_level,
                             torch.tensor([[64, 64], [64, 64]]))
    assert dets.boxes.shape == (0, 4) and dets.scores.shape == dets.labels.shape == dets.batch_idx.shape == (0,)
    assert [d["boxes"].shape[0] for d in dets.per_image(2)] == [0, 0]


# ---------------------------------------------------------------- model

def _randomise_frozen_bn(model):
    gen = torch.Generator().manual_seed(6)
    for m in model.modules():
        if isinstance(m, FrozenBatchNorm2d):
            m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=gen))
            m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen))
            m.running_mean.copy_(0.2 * torch.randn(m.running_mean.shape, generator=gen))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))


def test_folded_frozen_bn_and_channels_last_match_the_plain_model():
    torch.manual_seed(0)
    plain = RetinaNet(3, "resnet18", fpn_channels=32, fold_frozen_bn=False)
    _randomise_frozen_bn(plain)
    folded = RetinaNet(3, "resnet18", fpn_channels=32)
    assert sum(isinstance(m, _Conv2dFrozenBN) for m in folded.modules()) == 20  # stem + 16 block convs + 3 downsample
    assert list(folded.state_dict()) == list(plain.state_dict())
    folded.load_state_dict(plain.state_dict())
    images = torch.randint(0, 256, (2, 3, 64, 96), dtype=torch.uint8)
    ref = plain(images)
    # decode_batch passes a CPU batch in channels_last to the NCHW model ("input_channels_last")
    variants = {"folded": folded, "folded_channels_last": copy.deepcopy(folded).to(memory_format=torch.channels_last),
                "folded_input_channels_last": folded}
    for name, model in variants.items():
        x = images.contiguous(memory_format=torch.channels_last) if "channels_last" in name else images
        out = model(x)
        for key in ("cls_logits", "box_deltas"):
            assert out[key].shape == ref[key].shape
            torch.testing.assert_close(out[key], ref[key], rtol=1e-4, atol=1e-4, msg=f"{name} {key}")
    # the gradient reaches the unfolded weight parameter exactly as before (up to float rounding)
    (ref["cls_logits"].sum() + ref["box_deltas"].square().sum()).backward()
    out = folded(images)
    (out["cls_logits"].sum() + out["box_deltas"].square().sum()).backward()
    for (name, p), q in zip(plain.named_parameters(), folded.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4, msg=name)
    # the folded convs follow the BatchNorm buffers when they change (e.g. a checkpoint is loaded)
    folded.backbone.bn1.running_var.mul_(4.0)
    assert not torch.allclose(folded(images)["cls_logits"], out["cls_logits"])


# ---------------------------------------------------------------- COCO evaluation

def test_faster_coco_eval_gives_pycocotools_stats():
    pytest.importorskip("faster_coco_eval")
    if not os.path.isfile(COCO_SUBSET_JSON):
        pytest.skip("shared COCO subset not found")
    gt, results = coco_eval_inputs(150, 30)
    ref, _ = evaluate_coco(gt, results, backend="pycocotools")
    fast, _ = evaluate_coco(gt, results, backend="faster")
    assert 0.05 < ref["AP"] < 0.95  # jittered copies: a non-trivial AP
    for k in STAT_NAMES:
        assert abs(fast[k] - ref[k]) <= 1e-6, k


# ---------------------------------------------------------------- benchmark peer

def test_torchvision_peer_carries_our_weights():
    torch.manual_seed(0)
    ours = RetinaNet(5, "resnet50", fpn_channels=256)
    tv = torchvision_retinanet(ours, 64)
    images = torch.randint(0, 256, (1, 3, 64, 64), dtype=torch.uint8)
    assert head_output_gap(ours, tv, images) < 1e-3
