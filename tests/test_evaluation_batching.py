"""Issue 29, item 1: an image's detections do not depend on its batch (`detlib.data.coco.EvaluationCollate`).

A small RetinaNet (resnet18, random initialisation with a fixed seed) on CPU, the real val images of the shared
subset: every image's detections are bit-identical at batch sizes 1-4 and whatever its batch companions and their
order; the batches of 1, 2 and 3 simulated processes (accelerate's own `BatchSamplerShard`, even batches, 11 images
that neither 2 nor 3 divides) gathered as `CocoEvaluator.gather` does give identical per-image results and the same
12 stats (bit for bit). Control: `collate_detection` (padding to the batch's largest image) changes an image's
detections. (A batch of 1 against a batch of 2 changes the logits on some CPUs and models, not on all: the
measurement behind `MIN_EVALUATION_BATCH` is in docs/evaluation.md; the fill makes it moot.)
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard

from detlib.data.coco import (MIN_EVALUATION_BATCH, CocoDetection, EvaluationCollate, collate_detection,
                              evaluation_canvas)
from detlib.data.transforms import build_transform
from detlib.evaluation.coco import CocoEvaluator, detections_to_coco
from detlib.labels import CategoryMap
from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.decode import decode_detections
from detlib.retinanet.model import RetinaNet

from conftest import COCO_SUBSET, needs_coco_subset

SIZE = 160
NUM_IMAGES = 11  # neither 2 nor 3 divides it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    val = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    images = sorted(val["images"], key=lambda im: im["id"])[:NUM_IMAGES]
    ids = {im["id"] for im in images}
    val["images"] = images
    val["annotations"] = [a for a in val["annotations"] if a["image_id"] in ids]
    ds = CocoDetection(str(COCO_SUBSET / "images"), val, build_transform(SIZE, "none"), train=False)
    torch.manual_seed(0)
    model = RetinaNet(len(ds.category_map), "resnet18", fpn_channels=32).eval()
    canvas = evaluation_canvas([r["size"] for r in ds.records], SIZE)
    return {"ds": ds, "model": model, "canvas": canvas, "gt": val, "samples": [ds[i] for i in range(len(ds))]}


@torch.no_grad()
def detect(setup, batch: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{image id: (boxes, scores, labels)} of a collated batch (the first copy of an id wins, as in the evaluator)."""
    out = setup["model"](batch["images"])
    anchors, counts = AnchorGenerator()(*batch["images"].shape[-2:], device=batch["images"].device)
    dets = decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, batch["image_sizes"],
                             batch["scales"], score_thresh=0.0, max_detections=100)
    found = {}
    for i, d in enumerate(dets.per_image(len(batch["image_ids"]))):
        found.setdefault(int(batch["image_ids"][i]), (d["boxes"], d["scores"], d["labels"]))
    return found


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@needs_coco_subset
def test_canvas_holds_every_image_and_fills_batches(setup):
    canvas = setup["canvas"]
    assert canvas == (SIZE, SIZE)  # the subset has landscape and portrait images
    collate = EvaluationCollate(canvas, batch_size=3)
    batch = collate(setup["samples"][:2])
    assert batch["images"].shape == (3, 3, SIZE, SIZE)
    assert batch["image_ids"].tolist() == [setup["samples"][0]["image_id"]] + [setup["samples"][1]["image_id"]] * 2
    assert EvaluationCollate(canvas, batch_size=1)(setup["samples"][:1])["images"].shape[0] == MIN_EVALUATION_BATCH
    with pytest.raises(ValueError, match="larger than the evaluation canvas"):
        EvaluationCollate((64, 64), batch_size=2)(setup["samples"][:1])
    with pytest.raises(ValueError, match="multiples of 32"):
        EvaluationCollate((100, 160), batch_size=2)


@needs_coco_subset
def test_detections_do_not_depend_on_batch_size_or_companions(setup):
    samples, canvas = setup["samples"], setup["canvas"]
    reference = detect(setup, EvaluationCollate(canvas, 2)([samples[0], samples[1]]))
    reference.update(detect(setup, EvaluationCollate(canvas, 2)([samples[2], samples[3]])))
    rng = random.Random(0)
    for batch_size in (1, 2, 3, 4):
        chosen = [samples[i] for i in rng.sample(range(4, len(samples)), batch_size - 1)] if batch_size > 1 else []
        for target in rng.sample(range(4), 2):
            batch = chosen + [samples[target]]
            rng.shuffle(batch)
            got = detect(setup, EvaluationCollate(canvas, batch_size)(batch))
            iid = samples[target]["image_id"]
            assert len(got[iid][1]) == 100
            assert same(got[iid], reference[iid]), (batch_size, iid)
    # control: under the old padding rule an image's detections change with a companion of another shape
    small = min(range(len(samples)), key=lambda i: samples[i]["image"].shape[-2] * samples[i]["image"].shape[-1])
    other = next(i for i in range(len(samples)) if samples[i]["image"].shape[-2:] != samples[small]["image"].shape[-2:])
    iid = samples[small]["image_id"]
    old_rule = detect(setup, collate_detection([samples[small], samples[other]]))
    old_alone = detect(setup, collate_detection([samples[small], samples[small]]))
    assert not same(old_rule[iid], old_alone[iid])


@needs_coco_subset
def test_one_two_three_processes_give_the_same_stats(setup):
    ds, gt = setup["ds"], setup["gt"]
    cmap = CategoryMap([c["id"] for c in gt["categories"]])
    batch_size = 2
    per_process_count = {}
    for n in (1, 2, 3):
        collate = EvaluationCollate(setup["canvas"], batch_size)
        sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(len(ds))), batch_size, False)
        shards = []
        for rank in range(n):
            ev = CocoEvaluator(gt, backend="pycocotools")
            for indices in BatchSamplerShard(sampler, n, rank, split_batches=False, even_batches=True):
                for iid, (b, s, l) in detect(setup, collate([setup["samples"][i] for i in indices])).items():
                    ev.add(iid, detections_to_coco(b, s, cmap.to_category_ids(l), iid))
            shards.append(ev.per_image)
        merged = CocoEvaluator(gt, backend="pycocotools")
        for per_image in shards:  # CocoEvaluator.gather: rank order, the first copy of an id kept
            for iid, res in per_image.items():
                merged.per_image.setdefault(iid, res)
        stats, _ = merged.evaluate()
        per_process_count[n] = (merged.num_images_evaluated, stats, merged.results)
    assert per_process_count[1][0] == per_process_count[2][0] == per_process_count[3][0] == NUM_IMAGES
    assert per_process_count[1][2] == per_process_count[2][2] == per_process_count[3][2]
    assert per_process_count[1][1] == per_process_count[2][1] == per_process_count[3][1]
    assert len(per_process_count[1][2]) == 100 * NUM_IMAGES
