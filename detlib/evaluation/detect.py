"""A detector run over batches to COCO results, gathered across processes: the one path of the training script's
evaluation and of predict (images and video frames).

The batches are `EvaluationBatchSampler` / `EvaluationCollate`'s: images of one padded shape, each image on one
process, so that an image's detections are those of the image alone on any process count and batch size.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm import tqdm  # not tqdm.auto: its asyncio bar calls iter() on a DataLoader as it is made (workers twice)

from ..retinanet import decode_detections
from .coco import detections_to_coco


@torch.no_grad()
def decode_batch(model, anchor_gen, batch: dict, score_thresh: float, nms_thresh: float, max_detections: int,
                 autocast=None) -> list[dict[str, torch.Tensor]]:
    """The model and its decoding on one collated batch (`images` [B, 3, H, W] on the model's device, `image_sizes`,
    `scales`, `image_ids`): per image {"boxes" [n, 4] float32 xyxy pixels of the image before the transform,
    "scores" [n], "labels" [n] int64}. `autocast`: what makes the context manager around the forward
    (`accelerator.autocast`; called per forward: tiles make several).
    With `anchor_gen` None, `model` is an exported model's runner (`detlib.deploy.ExportRunner`), which decodes itself."""
    if anchor_gen is None:
        return model(batch)
    images = batch["images"]
    if images.device.type == "cpu":
        # oneDNN's CPU convolutions are faster on NHWC input: R50-FPN at 512 px, batch 2, 0.90x the NCHW time (torch
        # 2.14, docs/benchmarks.md). The input only: the weights stay NCHW, whose backward is the faster one in training.
        images = images.contiguous(memory_format=torch.channels_last)
    with autocast() if autocast is not None else contextlib.nullcontext():
        out = model(images)
    anchors, counts = anchor_gen(*images.shape[-2:], device=images.device)
    return decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, batch["image_sizes"],
                             batch["scales"], score_thresh=score_thresh, nms_thresh=nms_thresh,
                             max_detections=max_detections).per_image(len(batch["image_ids"]))


@torch.no_grad()
def detect(model, anchor_gen, batch: dict, to_ids: torch.Tensor, score_thresh: float, nms_thresh: float,
           max_detections: int, min_scores: torch.Tensor | None = None, autocast=None,
           tiles: dict | None = None) -> list[list[dict] | None]:
    """One batch -> per image its COCO result dicts (`detections_to_coco`: xywh pixels of the original image), None
    for an image that could not be read. The batch is `decode_batch`'s, or with `tiles` native [3, H, W] uint8 images
    (`detlib.tiling.collate_images`), each detected by tiles: `tiles` holds `detect_tiled`'s keyword arguments
    (`detlib.tiling.tile_settings`). `to_ids`: [K] int64, the category id written for each label, -1 for a class left
    out; `min_scores`: [K], each class's lowest kept score (beside `score_thresh`, decoding's)."""
    def decode(b):
        return decode_batch(model, anchor_gen, b, score_thresh, nms_thresh, max_detections, autocast)

    if tiles is None:
        dets = decode(batch)
    else:
        from ..tiling import detect_tiled

        dets = [detect_tiled(lambda b: decode({**b, "images": b["images"].to(batch["device"])}), image, **tiles,
                             max_detections=max_detections) if valid else None
                for image, valid in zip(batch["images"], batch["valid"])]
    found = []
    for i, d in enumerate(dets):
        if not bool(batch["valid"][i]):
            found.append(None)
            continue
        labels = d["labels"].long()
        ids = to_ids.to(labels.device)[labels]
        keep = (ids >= 0) if min_scores is None else (ids >= 0) & (d["scores"] >= min_scores.to(labels.device)[labels])
        found.append(detections_to_coco(d["boxes"][keep], d["scores"][keep], ids[keep], int(batch["image_ids"][i])))
    return found


def detect_images(model, anchor_gen, loader, accelerator, to_ids: torch.Tensor, score_thresh: float,
                  nms_thresh: float, max_detections: int, min_scores: torch.Tensor | None = None, autocast: bool = False,
                  poll=None, poll_every: int = 10, on_image=None, desc: str = "eval",
                  tiles: dict | None = None) -> tuple[dict[int, list[dict]], set[int]]:
    """`detect` over this process's `loader`, then every process's results gathered (collective: every process has
    as many batches, some empty). `poll()`: called before batches 0, `poll_every`, ... (with `tiles` also after the
    last: results of images whose windows a stop cut short, `detect_tiled`'s poll, never leave here);
    `on_image(image_id, results)`: on the process that detected the image (its per-image files); `tiles`: `detect`'s
    (the loader then gives native images, `detlib.tiling.tiled_loader`). Returns
    ({image id: COCO result dicts}, the ids of unreadable images), the same on every process."""
    from accelerate.utils import gather_object, send_to_device

    per_image, failed = {}, set()
    for i, batch in enumerate(tqdm(loader, desc=desc, disable=not accelerator.is_local_main_process, leave=False)):
        if poll is not None and i % poll_every == 0:
            poll()
        if not batch:  # a process's filler batch (EvaluationBatchSampler): no image
            continue
        # tiles are cut on the CPU from the native image; each tile batch goes to the device
        batch = {**batch, "device": accelerator.device} if tiles else send_to_device(batch, accelerator.device,
                                                                                      non_blocking=True)
        found = detect(model, anchor_gen, batch, to_ids, score_thresh, nms_thresh, max_detections, min_scores,
                       accelerator.autocast if autocast else None, tiles)
        for image_id, res in zip(batch["image_ids"].tolist(), found):
            if image_id in per_image or image_id in failed:  # a copy that fills the batch (EvaluationCollate)
                continue
            if res is None:
                failed.add(image_id)
                continue
            per_image[image_id] = res
            if on_image is not None:
                on_image(image_id, res)
    if poll is not None and tiles:  # after the last batch too: a stop that cut an image's windows short ends here
        poll()
    if accelerator.num_processes == 1:
        return per_image, failed
    merged, all_failed = {}, set()
    for part, fail in gather_object([(per_image, sorted(failed))]):
        merged.update(part)
        all_failed.update(fail)
    return merged, all_failed
