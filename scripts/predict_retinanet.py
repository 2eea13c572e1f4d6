r"""Detect objects in images with a trained RetinaNet: drawn images, COCO-format predictions, a summary.

A folder of photos (recursively), on the CPU or a GPU:
    python scripts/predict_retinanet.py --weights outputs/r50_600 --source photos/ --output_dir outputs/predict

One file, a glob, per-image json, a higher score threshold:
    python scripts/predict_retinanet.py --weights outputs/r50_600/best --source img.jpg --output_dir out
    python scripts/predict_retinanet.py --weights outputs/r50_600/last/model.safetensors --source "data/**/*.png" \
        --output_dir out --save_json_per_image --score_thresh 0.3

A COCO json (the results carry its image ids; equal to what --evaluate_only writes for the same weights,
--image_size and --batch_size = its --per_device_eval_batch_size):
    python scripts/predict_retinanet.py --weights outputs/r50_600/best --source /data/coco/annotations/instances_val2017.json \
        --images /data/coco/val2017 --output_dir out

Several processes (each takes its share of the batches; results merged, no image twice):
    accelerate launch --config_file accelerate_configs/2gpu.yaml scripts/predict_retinanet.py --weights ... --source ...

Writes OUT/predictions.json (COCO results: image_id, category_id, bbox [x, y, w, h] pixels of the original
image, score; plus file_name when the source is not a COCO json), OUT/images/<name>.jpg with the detections
scoring >= --draw_thresh drawn, OUT/json/<name>.json with --save_json_per_image, OUT/skipped.txt listing
unreadable images, and a summary line of detections per class.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections import Counter

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from detlib.anchors import anchor_generator_from_config
from detlib.coco_eval import detections_to_coco
from detlib.data import CocoDetection, collate_detection
from detlib.decode import decode_detections
from detlib.flags import float_range, int_at_least
from detlib.inference import (DetectionImageFiles, list_image_files, load_retinanet, prediction_parser, shard_batches,
                              start_prediction)
from detlib.transforms import build_transform
from detlib.visualize import boxes_from_coco, class_color, draw_detections, save_image, upright_image_and_boxes
from detlib.weights import weights_path

logger = logging.getLogger("predict_retinanet")


def build_parser() -> argparse.ArgumentParser:
    # 8 images per forward pass: the training script's --per_device_eval_batch_size
    p, groups = prediction_parser(__doc__, batch_size=8)
    g = groups["data"]
    g.add_argument("--source", required=True, help="an image file, a folder (recursive), a glob pattern, or a COCO json")
    g.add_argument("--images", help="image folder of a COCO-json source (default: none; needed with a json --source)")
    g.add_argument("--image_size", type=int_at_least(32), help="resize size (default None: the training run's, from model_config.json)")
    g.add_argument("--max_size", type=int_at_least(32), help="default None: from model_config.json")

    g = p.add_argument_group("detection")
    g.add_argument("--score_thresh", type=float_range(0, 1), default=0.05, help="lowest score kept (as in the evaluation)")
    g.add_argument("--nms_thresh", type=float_range(0, 1, lo_open=True), default=0.5, help="IoU of class-wise NMS")
    g.add_argument("--detections_per_image", type=int_at_least(1), default=100, help="detections kept per image")

    g = groups["output"]
    g.add_argument("--draw_thresh", type=float_range(0, 1), default=0.3, help="lowest score drawn on OUT/images")
    g.add_argument("--no_images", action="store_true", help="do not write the drawn images")
    g.add_argument("--save_json_per_image", action="store_true", help="also OUT/json/<name>.json per image")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_dataset(args, transform):
    """(data set, names relative to the source root, COCO image ids or None, exif applied, skipped files)."""
    if args.source.lower().endswith(".json") and os.path.isfile(args.source):
        if not args.images:
            raise SystemExit("error: a COCO-json --source needs --images DIR (its image folder)")
        # The evaluation's own data set: same order (by image id), same decoding, same sizes.
        ds = CocoDetection(args.images, args.source, transform, train=False)
        names = [os.path.relpath(r["path"], args.images) for r in ds.records]
        return ds, names, [r["id"] for r in ds.records], False, list(ds.missing_images)
    root, paths = list_image_files(args.source)
    ds = DetectionImageFiles(paths, transform, exif_transpose=not args.no_exif_transpose)
    return ds, [os.path.relpath(p, root) for p in paths], None, not args.no_exif_transpose, []


def write_outputs(args, ds, shards: list, skipped: list[str], names: dict[int, str]) -> list[dict]:
    """predictions.json, skipped.txt and the summary line from every process's share (main process)."""
    merged: dict[int, list[dict]] = {}
    for part, fail in shards:
        merged.update(part)
        skipped = skipped + [ds_path(ds, k) + " (unreadable)" for k in fail]
    results = [r for k in sorted(merged) for r in merged[k]]
    with open(os.path.join(args.output_dir, "predictions.json"), "w") as f:
        json.dump(results, f)
    with open(os.path.join(args.output_dir, "skipped.txt"), "w") as f:
        f.write("".join(s + "\n" for s in skipped))
    if skipped:
        logger.warning("skipped %d unreadable images (listed in %s/skipped.txt), e.g. %s", len(skipped),
                       args.output_dir, skipped[:3])
    per_class = Counter(names.get(r["category_id"], r["category_id"]) for r in results)
    logger.info("%d images, %d detections with score >= %g: %s", len(merged), len(results), args.score_thresh,
                ", ".join(f"{k} {v}" for k, v in per_class.most_common()) or "none")
    return results


def ds_path(ds, index: int) -> str:
    return ds.records[index]["path"] if isinstance(ds, CocoDetection) else ds.paths[index]


def write_image_outputs(args, path: str, image_id: int, name: str, res: list[dict], exif_applied: bool,
                        names: dict[int, str], size: tuple[int, int] | None = None) -> None:
    """OUT/images/<name>.jpg (detections >= --draw_thresh on the upright image) and, with --save_json_per_image,
    OUT/json/<name>.json; written by the process that predicted the image."""
    stem = os.path.splitext(name)[0]
    if not args.no_images:
        shown = [r for r in res if r["score"] >= args.draw_thresh]
        image, boxes = upright_image_and_boxes(path, boxes_from_coco([r["bbox"] for r in shown]), exif_applied, size)
        labels = [f"{names.get(r['category_id'], r['category_id'])} {r['score']:.2f}" for r in shown]
        drawn = draw_detections(image, boxes, labels, [class_color(r["category_id"]) for r in shown])
        save_image(drawn, os.path.join(args.output_dir, "images", stem + ".jpg"))
    if args.save_json_per_image:
        out = os.path.join(args.output_dir, "json", stem + ".json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        dets = [{"category_id": r["category_id"], "category_name": names.get(r["category_id"], str(r["category_id"])),
                 "score": r["score"], "bbox": r["bbox"]} for r in res]
        with open(out, "w") as f:
            json.dump({"file_name": name, "image_id": image_id, "detections": dets}, f, indent=1)


@torch.no_grad()
def main(argv=None):
    args = parse_args(argv)
    accelerator = start_prediction(args)  # CPU or GPU, any number of processes; OUTPUT_DIR/predict.log

    # ---- model (rebuilt from model_config.json, class names included)
    try:
        model, config, category_map = load_retinanet(args.weights)
    except (FileNotFoundError, RuntimeError, KeyError) as e:
        logger.error("%s", e, extra={"console": False})  # to predict.log; the console gets the line below
        raise SystemExit(f"error: {e}") from None
    logger.info("loaded %s (%s, fpn_channels %d, %d classes)", weights_path(args.weights), config["backbone"],
                config["fpn_channels"], len(category_map))
    image_size = args.image_size or config.get("image_size") or 600
    max_size = args.max_size if args.image_size or args.max_size else config.get("max_size")
    model.to(accelerator.device)
    anchor_gen = anchor_generator_from_config(config)  # a converted model's anchor convention, else ours
    names = dict(zip(category_map.category_ids, category_map.names))

    # ---- data: the evaluation transform; this process's share of the batches
    try:
        ds, rel_names, coco_ids, exif_applied, skipped = build_dataset(args, build_transform(image_size, "none", max_size,
                                                                                     config.get("resize_mode", "antialias")))
    except (FileNotFoundError, ValueError) as e:
        logger.error("%s", e, extra={"console": False})  # to predict.log; the console gets the line below
        raise SystemExit(f"error: {e}") from None
    if "category_names" not in config:
        if isinstance(ds, CocoDetection) and ds.category_map.category_ids == category_map.category_ids:
            names = dict(zip(ds.category_map.category_ids, ds.category_map.names))
        elif accelerator.is_main_process:
            logger.warning("model_config.json has no category_names: classes are named by their category ids")
    batches = shard_batches(len(ds), args.batch_size, accelerator.process_index, accelerator.num_processes)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, collate_fn=collate_detection,
                                         num_workers=min(args.num_workers, os.cpu_count() or 1))
    logger.info("%d images from %s at %d px (max %s), %d process(es), batch size %d", len(ds), args.source, image_size,
                max_size, accelerator.num_processes, args.batch_size)

    # ---- predict (the decoding of scripts/train_retinanet.py's evaluate)
    index_of = {iid: k for k, iid in enumerate(coco_ids)} if coco_ids is not None else None
    per_image: dict[int, list[dict]] = {}
    failed: list[int] = []
    for batch in tqdm(loader, desc="predict", disable=not accelerator.is_local_main_process):
        images = batch["images"].to(accelerator.device)
        with accelerator.autocast():
            out = model(images)
        anchors, counts = anchor_gen(*images.shape[-2:], device=images.device)
        dets = decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, batch["image_sizes"],
                                 batch["scales"], score_thresh=args.score_thresh, nms_thresh=args.nms_thresh,
                                 max_detections=args.detections_per_image)
        for i, d in enumerate(dets.per_image(len(batch["image_ids"]))):
            image_id = int(batch["image_ids"][i])  # the json's id, or the file's index in the sorted list
            index = image_id if index_of is None else index_of[image_id]
            if not bool(batch["valid"][i]):
                failed.append(index)
                continue
            res = detections_to_coco(d["boxes"], d["scores"], category_map.to_category_ids(d["labels"]), image_id)
            if coco_ids is None:
                for r in res:
                    r["file_name"] = rel_names[index]
            per_image[index] = res
            size = ds.records[index]["size"] if isinstance(ds, CocoDetection) else None  # the json's, boxes refer to it
            write_image_outputs(args, ds_path(ds, index), image_id, rel_names[index], res, exif_applied, names, size)

    # ---- merge (every process's share, by index: no image twice) and write
    shards = gather_object([(per_image, failed)])
    results = None
    if accelerator.is_main_process:
        results = write_outputs(args, ds, shards, skipped, names)
    # a clean end of the process group: a rank that exits while another still tears down gloo can abort
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


if __name__ == "__main__":
    main()
