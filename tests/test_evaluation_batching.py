"""Issue 36, item 1: an image's detections are those of the image evaluated by itself (`EvaluationBatchSampler`,
`EvaluationCollate`, docs/evaluation.md "Batches and padding").

A small RetinaNet (resnet18, random initialisation with a fixed seed) on CPU, the real val images of the shared
subset (landscape, portrait and near-square: several padded shapes): every image's detections are bit-identical to
those of the image alone (padded to a multiple of 32, in a batch of its own) at eval batch sizes 1-4 on 1, 2 and 3
simulated processes, and the gathered results and 12 stats are the same. Control: padding to one canvas for the whole
set (the rule before) changes an image's detections.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from detlib.data.coco import (MIN_EVALUATION_BATCH, CocoDetection, EvaluationCollate, collate_detection,
                              evaluation_shapes)
from detlib.data.sampler import EvaluationBatchSampler
from detlib.data.transforms import PAD_VALUE, RESIZE_MODES, build_transform, make_sample
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
    shapes = evaluation_shapes([r["size"] for r in ds.records], SIZE)
    samples = [ds[i] for i in range(len(ds))]
    return {"ds": ds, "model": model, "shapes": shapes, "gt": val, "samples": samples}


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


@pytest.mark.parametrize("mode", RESIZE_MODES)
@pytest.mark.parametrize("size,max_size", [(160, None), (600, None), (224, 320), (800, 1333)])
@needs_coco_subset
def test_evaluation_shapes_are_the_padded_transform_outputs(mode, size, max_size):
    """For every image size of the subset (both splits), the shape `evaluation_shapes` predicts from the json is the
    transform's output rounded up to a multiple of 32, in both resize modes."""
    sizes = sorted({(im["height"], im["width"]) for split in ("train", "val") for im in
                    json.loads((COCO_SUBSET / "annotations" / f"instances_{split}.json").read_text())["images"]})
    transform = build_transform(size, "none", max_size, mode)
    empty = torch.zeros((0, 4))
    for (h, w), shape in zip(sizes, evaluation_shapes(sizes, size, max_size, mode)):
        out = transform(make_sample(torch.zeros((3, h, w), dtype=torch.uint8), empty, torch.zeros(0, dtype=torch.int64),
                                    torch.zeros(0, dtype=torch.bool)))["image"]
        assert shape == tuple(-(-s // 32) * 32 for s in out.shape[-2:]), (h, w)


def test_sampler_gives_each_image_once_in_batches_of_one_shape():
    shapes = [(224, 320)] * 7 + [(320, 224)] * 4 + [(256, 224)] + [(224, 320)] * 2
    for batch_size in (1, 2, 3, 4, 8):
        for processes in (1, 2, 3, 4):
            per_process = [list(EvaluationBatchSampler(shapes, batch_size, processes, r)) for r in range(processes)]
            assert len({len(p) for p in per_process}) == 1  # as many batches on every process (some empty)
            batches = [b for p in per_process for b in p if b]
            assert sorted(i for b in batches for i in b) == list(range(len(shapes)))
            assert all(len(b) <= batch_size and len({shapes[i] for i in b}) == 1 for b in batches)
            assert len(batches) == sum(-(-n // batch_size) for n in (9, 4, 1))
    with pytest.raises(ValueError, match="process_index"):
        EvaluationBatchSampler(shapes, 2, 2, 2)


@needs_coco_subset
def test_collate_pads_to_the_images_own_shape_and_fills_a_lone_image(setup, caplog):
    samples, shapes = setup["samples"], setup["shapes"]
    i = next(k for k in range(len(shapes)) if shapes[k] != (SIZE, SIZE))
    batch = EvaluationCollate()([samples[i]])
    assert tuple(batch["images"].shape) == (MIN_EVALUATION_BATCH, 3, *shapes[i])
    assert batch["image_ids"].tolist() == [samples[i]["image_id"]] * MIN_EVALUATION_BATCH
    assert EvaluationCollate()([]) == {}  # a process's filler batch
    j = next(k for k in range(len(shapes)) if shapes[k] != shapes[i])
    with caplog.at_level(logging.WARNING, logger="detlib.data.coco"):
        EvaluationCollate()([samples[i], samples[j]])
    assert "its detections depend on its batch" in caplog.text


@needs_coco_subset
def test_detections_equal_the_image_alone_at_any_batch_size_and_process_count(setup):
    samples, shapes = setup["samples"], setup["shapes"]
    assert len(set(shapes)) >= 3  # landscape, portrait, near-square
    alone = {}
    for s in samples:  # each image by itself: its own padding, a batch of its copies
        alone.update(detect(setup, collate_detection([s] * MIN_EVALUATION_BATCH)))
    for batch_size in (1, 2, 3, 4):
        for processes in (1, 2, 3):
            seen = []
            for rank in range(processes):
                for indices in EvaluationBatchSampler(shapes, batch_size, processes, rank):
                    batch = EvaluationCollate()([samples[i] for i in indices])
                    if not batch:
                        continue
                    for iid, found in detect(setup, batch).items():
                        assert len(found[1]) == 100
                        assert same(found, alone[iid]), (batch_size, processes, iid)
                        seen.append(iid)
            assert sorted(seen) == sorted(s["image_id"] for s in samples)
    # control: one canvas for the whole set (the rule before) changes the detections of an image smaller than it
    small = next(k for k in range(len(samples)) if shapes[k] != (SIZE, SIZE))
    iid = samples[small]["image_id"]
    canvas = collate_detection([samples[small]] * MIN_EVALUATION_BATCH)
    padded = torch.tensor(PAD_VALUE, dtype=torch.uint8).view(1, 3, 1, 1).repeat(MIN_EVALUATION_BATCH, 1, SIZE, SIZE)
    padded[:, :, :canvas["images"].shape[2], :canvas["images"].shape[3]] = canvas["images"]
    assert not same(detect(setup, {**canvas, "images": padded})[iid], alone[iid])


@needs_coco_subset
def test_one_two_three_processes_give_the_same_stats(setup):
    ds, gt = setup["ds"], setup["gt"]
    cmap = CategoryMap([c["id"] for c in gt["categories"]])
    per_process_count = {}
    for n in (1, 2, 3):
        shards = []
        for rank in range(n):
            ev = CocoEvaluator(gt, backend="pycocotools")
            for indices in EvaluationBatchSampler(setup["shapes"], 3, n, rank):
                if indices:
                    batch = EvaluationCollate()([setup["samples"][i] for i in indices])
                    for iid, (b, s, l) in detect(setup, batch).items():
                        ev.add(iid, detections_to_coco(b, s, cmap.to_category_ids(l), iid))
            shards.append(ev.per_image)
        merged = CocoEvaluator(gt, backend="pycocotools")
        for per_image in shards:  # CocoEvaluator.gather: rank order, the first copy of an id kept
            for iid, res in per_image.items():
                assert iid not in merged.per_image  # each image on one process only
                merged.per_image[iid] = res
        stats, _ = merged.evaluate()
        per_process_count[n] = (merged.num_images_evaluated, stats, sorted(merged.results, key=lambda r: r["image_id"]))
    assert per_process_count[1][0] == per_process_count[2][0] == per_process_count[3][0] == len(ds)
    assert per_process_count[1][2] == per_process_count[2][2] == per_process_count[3][2]
    assert per_process_count[1][1] == per_process_count[2][1] == per_process_count[3][1]
    assert len(per_process_count[1][2]) == 100 * len(ds)


@pytest.mark.parametrize("exif_transpose", [True, False])
def test_predict_input_shapes_from_headers_are_the_read_images_shapes(tmp_path, exif_transpose):
    """A folder's padded input shapes, read from the file headers (`detlib.inference.input_shapes`), are those of the
    images as predict reads them, for every EXIF orientation 1-8 (5-8 swap width and height) with and without the
    turn; a file that is no image gets a key of its own."""
    from PIL import Image

    from detlib.data.images import DetectionImageFiles
    from detlib.inference import input_shapes

    paths = []
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = tmp_path / f"o{orientation}.jpg"
        Image.new("RGB", (200, 90), (10, 20, 30)).save(path, exif=exif)
        paths.append(str(path))
    (tmp_path / "broken.jpg").write_bytes(b"not an image")
    paths.append(str(tmp_path / "broken.jpg"))
    shapes = input_shapes(paths, exif_transpose, 128)
    ds = DetectionImageFiles(paths[:-1], build_transform(128, "none"), exif_transpose=exif_transpose)
    for i in range(len(ds)):
        h, w = ds[i]["image"].shape[-2:]
        assert shapes[i] == (-(-h // 32) * 32, -(-w // 32) * 32), (i + 1, exif_transpose)
    assert {shapes[i] for i in range(8)} == ({(64, 128), (128, 64)} if exif_transpose else {(64, 128)})
    assert shapes[-1] == ("unread", 8)
