"""Issue 38: one path decodes and collects detections for the training script's evaluation and for predict
(`detlib.evaluation.detect`): per image its COCO results, an image repeated to fill a batch counted once, an
unreadable image listed, classes left out or held to their own threshold, the preemption poll every 10 batches."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from detlib.evaluation import detect, detect_images
from detlib.retinanet import AnchorGenerator, RetinaNet


def batch_of(image_ids: list[int], valid: list[bool], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = len(image_ids)
    return {"images": torch.randint(0, 256, (n, 3, 64, 96), generator=g, dtype=torch.uint8),
            "image_ids": torch.tensor(image_ids), "image_sizes": torch.tensor([[60, 90]] * n),
            "scales": torch.ones(n, 2), "valid": torch.tensor(valid)}


def test_detect_images_collects_each_image_once_and_lists_the_unreadable():
    torch.manual_seed(0)
    model, anchors = RetinaNet(3, "resnet18", fpn_channels=16).eval(), AnchorGenerator()
    to_ids = torch.tensor([7, 8, 9])  # labels 0..2 written as the data set's ids
    one = batch_of([5, 5], [True, True], 0)  # an image alone, filled with its copy (EvaluationCollate)
    two = batch_of([6, 4], [True, False], 1)  # image 4 unreadable
    loader = [one, {}, two] + [{}] * 9  # a process's filler batches: no image
    seen, polls = [], []
    found, failed = detect_images(model, anchors, loader, Accelerator(cpu=True), to_ids, 0.0, 0.5, 20,
                                  poll=lambda: polls.append(1), on_image=lambda image_id, res: seen.append(image_id))
    assert sorted(found) == [5, 6] and failed == {4} and seen == [5, 6] and len(polls) == 2
    detect_images(model, anchors, loader, Accelerator(cpu=True), to_ids, 0.0, 0.5, 20, poll=lambda: polls.append(1),
                  poll_every=1)  # a predict script's poll: before every batch
    assert len(polls) == 2 + len(loader)
    alone = detect(model, anchors, one, to_ids, 0.0, 0.5, 20)
    assert found[5] == alone[0] and 0 < len(found[5]) <= 20
    assert {r["category_id"] for r in found[5]} <= {7, 8, 9} and all(r["image_id"] == 5 for r in found[5])
    assert detect(model, anchors, two, to_ids, 0.0, 0.5, 20)[1] is None

    # a class left out (-1: a model class the data set lacks) and per-class lowest scores (best-F1 thresholds)
    kept = detect(model, anchors, one, torch.tensor([7, -1, 9]), 0.0, 0.5, 20, min_scores=torch.tensor([0.0, 0.0, 1.0]))
    assert kept[0] == [r for r in alone[0] if r["category_id"] == 7]
