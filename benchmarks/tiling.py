"""Tiled prediction on the issue 40 setup: which merge across tiles, what AP, what it costs.

The built-in model (a default built-in run's best/: `python scripts/train_retinanet.py`, 128 px) on one 1024 x 1024
mosaic of the first 64 built-in val images (by id) at their native 128 px, 8 x 8, ground truth shifted with them:
predicted whole (resized to 128 px, objects 8x smaller) and in 128 px tiles at 64 px steps (--tile 128 --tile_overlap
0.5), the tiles' detections merged four ways:
  nms         class-wise NMS on IoU 0.5 (torchvision `batched_nms`), the issue's hand-made baseline;
  ios         greedy class-wise matching on intersection over the smaller box (IoS) > 0.5, the matched boxes dropped
              (what --tile used before issue 52);
  greedy_nmm  the same matching, the matched boxes merged into the kept one's box (their union): sahi's GREEDYNMM;
  merge       `detlib.tiling.merge_detections`, what --tile uses (issue 52): only boxes of different windows, matched
              on IoU where both windows saw, the kept box extended past its window's edges by its matches.
Reported: COCO AP / AP50 / APs (pycocotools), the share of detections above 0.3 that are fragments (>= 90 % of their
area inside a higher-scored detection of the same class), and images per second (one mosaic, median of 3 runs).

    python benchmarks/tiling.py --weights outputs/retinanet_builtin/best [--out benchmarks/results_tiling.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from detlib.boxes import batched_nms, box_area, box_xyxy_to_xywh  # noqa: E402
from detlib.data import EvaluationCollate, build_transform, make_synthetic_coco  # noqa: E402
from detlib.inference import load_retinanet  # noqa: E402
from detlib.retinanet import anchor_generator_from_config, decode_detections  # noqa: E402
from detlib.tiling import _window_item, detect_tiled, merge_detections  # noqa: E402

GRID, SIDE = 8, 128  # 8 x 8 images of 128 px: a 1024 px mosaic


def build_mosaic(folder: str) -> tuple[torch.Tensor, dict]:
    """The mosaic [3, 1024, 1024] uint8 and its COCO json (one image, id 1)."""
    paths = make_synthetic_coco()
    val = json.load(open(paths["val_annotations"]))
    images = sorted(val["images"], key=lambda im: im["id"])[:GRID * GRID]
    canvas = np.zeros((GRID * SIDE, GRID * SIDE, 3), np.uint8)
    annotations = []
    for k, im in enumerate(images):
        y, x = divmod(k, GRID)
        canvas[y * SIDE:(y + 1) * SIDE, x * SIDE:(x + 1) * SIDE] = np.asarray(
            Image.open(os.path.join(paths["val_images"], im["file_name"])).convert("RGB"))
        for a in val["annotations"]:
            if a["image_id"] == im["id"]:
                bx, by, bw, bh = a["bbox"]
                annotations.append({**a, "id": len(annotations) + 1, "image_id": 1, "bbox": [bx + x * SIDE, by + y * SIDE,
                                                                                           bw, bh]})
    Image.fromarray(canvas).save(os.path.join(folder, "mosaic.png"))
    gt = {"images": [{"id": 1, "file_name": "mosaic.png", "width": GRID * SIDE, "height": GRID * SIDE}],
          "annotations": annotations, "categories": val["categories"]}
    return torch.from_numpy(canvas).permute(2, 0, 1).contiguous(), gt


def nms(boxes, scores, labels, sources, windows, thresh):
    keep = batched_nms(boxes, scores, labels, thresh)
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]}


def greedy_nmm(boxes, scores, labels, sources, windows, thresh):
    """Greedy matching on intersection over the smaller box (IoS), each kept box the union of its group (sahi's
    GREEDYNMM)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    boxes, scores, labels = boxes[order], scores[order], labels[order]
    area, left, keep, union = box_area(boxes), torch.ones(len(boxes), dtype=torch.bool), [], []
    for i in range(len(boxes)):
        if left[i]:
            inter = (torch.minimum(boxes[i, 2:], boxes[:, 2:]) - torch.maximum(boxes[i, :2], boxes[:, :2])).clamp(min=0)
            group = left & (labels == labels[i]) & (inter.prod(1) / torch.minimum(area[i], area).clamp(min=1e-12) > thresh)
            group[i] = True
            left &= ~group
            keep.append(i)
            union.append(torch.cat((boxes[group, :2].amin(0), boxes[group, 2:].amax(0))))
    return {"boxes": torch.stack(union), "scores": scores[keep], "labels": labels[keep]}


def ios_greedy(boxes, scores, labels, sources, windows, thresh):
    """Greedy on IoS, the matched boxes dropped (sahi's GREEDYNMM matching; --tile's merge before issue 52)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    boxes, scores, labels = boxes[order], scores[order], labels[order]
    area, left, keep = box_area(boxes), torch.ones(len(boxes), dtype=torch.bool), []
    for i in range(len(boxes)):
        if left[i]:
            inter = (torch.minimum(boxes[i, 2:], boxes[:, 2:]) - torch.maximum(boxes[i, :2], boxes[:, :2])).clamp(min=0)
            left &= ~((labels == labels[i]) & (inter.prod(1) / torch.minimum(area[i], area).clamp(min=1e-12) > thresh))
            keep.append(i)
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]}


def fragments(d: dict, score: float = 0.3, inside: float = 0.9) -> float:
    """Share of the detections above `score` with >= `inside` of their area in a higher-scored one of their class."""
    keep = d["scores"] > score
    boxes, labels = d["boxes"][keep], d["labels"][keep]  # by decreasing score
    if not len(boxes):
        return 0.0
    lt = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    rb = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    ioa = (rb - lt).clamp(min=0).prod(-1) / box_area(boxes)[:, None].clamp(min=1e-12)
    higher = torch.ones_like(ioa, dtype=torch.bool).tril(-1)  # column j scored above row i
    hit = (ioa >= inside) & higher & (labels[:, None] == labels[None, :])
    return float(hit.any(dim=1).float().mean())


def coco_stats(gt: dict, d: dict, category_ids: list[int]) -> dict:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    results = [{"image_id": 1, "category_id": category_ids[int(c)], "bbox": b, "score": float(s)}
               for b, s, c in zip(box_xyxy_to_xywh(d["boxes"]).tolist(), d["scores"], d["labels"])]
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = gt
        coco.createIndex()
        e = COCOeval(coco, coco.loadRes(results) if results else COCO(), "bbox")
        e.params.maxDets = [1, 10, 1000]  # the mosaic holds ~220 objects: the default 100 would cap the recall
        e.evaluate()
        e.accumulate()
    # precision [T, R, K, A, M] at the last maxDets (1000); summarize()'s AP would look for maxDets 100
    precision = e.eval["precision"][..., -1]

    def mean(p):
        return round(float(p[p > -1].mean()), 4) if (p > -1).any() else -1.0

    return {"AP": mean(precision[..., 0]), "AP50": mean(precision[0, ..., 0]), "APs": mean(precision[..., 1])}


def build_parser() -> argparse.ArgumentParser:
    from detlib.engine.flags import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--weights", required=True, help="the built-in model's weights (a run's best/)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results_tiling.json"),
                   help="the results json")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    return p

def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, config, category_map = load_retinanet(args.weights)
    anchor_gen = anchor_generator_from_config(config)
    transform = build_transform(config["image_size"], "none", config.get("max_size"))

    @torch.no_grad()
    def decode(batch):
        out = model(batch["images"])
        anchors, counts = anchor_gen(*batch["images"].shape[-2:])
        return decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, batch["image_sizes"],
                                 batch["scales"], max_detections=100).per_image(len(batch["image_ids"]))

    def whole(image):
        return decode(EvaluationCollate()([_window_item(image, transform, 1)]))[0]

    with tempfile.TemporaryDirectory() as folder:
        image, gt = build_mosaic(folder)
    runs = {"whole": lambda: whole(image)}
    for name, merge in (("nms", nms), ("ios", ios_greedy), ("greedy_nmm", greedy_nmm), ("merge", merge_detections)):
        runs[f"tile128_overlap0.5_{name}"] = lambda merge=merge: detect_tiled(decode, image, transform, 128, 0.5, 8,
                                                                             max_detections=1000, merge=merge)
    runs["tile128_overlap0.5_merge_full"] = lambda: detect_tiled(decode, image, transform, 128, 0.5, 8, full=True,
                                                                      max_detections=1000)
    runs["tile256_overlap0.25_merge"] = lambda: detect_tiled(decode, image, transform, 256, 0.25, 8,
                                                                  max_detections=1000)
    results = {}
    for name, run in runs.items():
        times = []
        for _ in range(3):
            t = time.perf_counter()
            d = run()
            times.append(time.perf_counter() - t)
        results[name] = {**coco_stats(gt, d, category_map.category_ids), "fragments_above_0.3": round(fragments(d), 4),
                         "detections": len(d["scores"]), "images_per_s": round(1 / statistics.median(times), 3)}
        print(name, results[name], flush=True)
    record = {"setup": f"built-in model {args.weights}, {GRID}x{GRID} mosaic of {SIDE} px val images, "
                       f"{len(gt['annotations'])} objects, CPU {args.threads} threads, torch {torch.__version__}",
              "results": results}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
