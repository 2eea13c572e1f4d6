r"""Classify images with a trained classifier (scripts/train_catsdogs.py): top-k classes with probabilities.

A folder (recursively), a file or a glob, on the CPU or a GPU:
    python scripts/predict_catsdogs.py --weights outputs/catsdogs/best --source photos/ --output_dir outputs/predict_cd

Top-3, and a copy of every image into a folder named after its predicted class:
    python scripts/predict_catsdogs.py --weights outputs/catsdogs --source "photos/**/*.jpg" --output_dir out \
        --topk 3 --copy_to_class_folders

Several processes (each takes its share of the batches; results merged, no image twice):
    OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/predict_catsdogs.py --weights ... --source ...

Writes OUT/predictions.csv (file, class_1, prob_1, ..., class_k, prob_k), OUT/predictions.json (the same as
a list of {"file_name", "topk": [{"class", "prob"}, ...]}), OUT/skipped.txt (unreadable files), with
--copy_to_class_folders OUT/by_class/<class>/<file>, and a summary line of images per predicted class.
Preprocessing is the evaluation's (shorter side to image_size / 0.875, centre crop), at the training size.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import shutil
from collections import Counter

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from detlib.classification import classification_transform
from detlib.flags import int_at_least
from detlib.inference import (ClassificationImageFiles, list_image_files, load_classifier, prediction_parser, shard_batches,
                              start_prediction)
from detlib.weights import weights_path

logger = logging.getLogger("predict_catsdogs")


def build_parser() -> argparse.ArgumentParser:
    p, groups = prediction_parser(__doc__, batch_size=64)
    g = groups["data"]
    g.add_argument("--source", required=True, help="an image file, a folder (recursive) or a glob pattern")
    g.add_argument("--image_size", type=int_at_least(16), help="default None: the training size from model_config.json")
    g = groups["output"]
    g.add_argument("--topk", type=int_at_least(1), default=5, help="classes per image (at most the number of classes)")
    g.add_argument("--copy_to_class_folders", action="store_true", help="copy each image to OUT/by_class/<top-1 class>/")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def write_outputs(args, paths: list[str], root: str, classes: list[str], k: int, shards: list) -> dict:
    """predictions.csv / .json, skipped.txt and the summary line from every process's share (main process)."""
    merged: dict[int, list[tuple[str, float]]] = {}
    skipped = []
    for part, fail in shards:
        merged.update(part)
        skipped += [paths[i] for i in fail]
    names = {i: os.path.relpath(paths[i], root) for i in merged}
    with open(os.path.join(args.output_dir, "predictions.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file"] + [c for j in range(1, k + 1) for c in (f"class_{j}", f"prob_{j}")])
        for i in sorted(merged):
            w.writerow([names[i]] + [v for c, p in merged[i] for v in (c, f"{p:.6f}")])
    with open(os.path.join(args.output_dir, "predictions.json"), "w") as f:
        json.dump([{"file_name": names[i], "topk": [{"class": c, "prob": p} for c, p in merged[i]]} for i in sorted(merged)], f)
    with open(os.path.join(args.output_dir, "skipped.txt"), "w") as f:
        f.write("".join(f"{p} (unreadable)\n" for p in sorted(skipped)))
    if skipped:
        logger.warning("skipped %d unreadable images (listed in %s/skipped.txt), e.g. %s", len(skipped), args.output_dir, skipped[:3])
    top1 = Counter(merged[i][0][0] for i in merged)
    logger.info("%d images classified: %s", len(merged), ", ".join(f"{c} {top1[c]}" for c in classes if top1[c]) or "none")
    return merged


@torch.no_grad()
def main(argv=None):
    args = parse_args(argv)
    accelerator = start_prediction(args)  # CPU or GPU, any number of processes; OUTPUT_DIR/predict.log
    try:
        model, config = load_classifier(args.weights)
        root, paths = list_image_files(args.source)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        logger.error("%s", e, extra={"console": False})  # to predict.log; the console gets the line below
        raise SystemExit(f"error: {e}") from None
    classes = config["classes"]
    image_size = args.image_size or config.get("image_size") or 224
    k = max(1, min(args.topk, len(classes)))
    model.to(accelerator.device)
    logger.info("loaded %s (%s, classes %s); %d images from %s at %d px, %d process(es)", weights_path(args.weights),
                config["model"], classes, len(paths), args.source, image_size, accelerator.num_processes)

    ds = ClassificationImageFiles(paths, classification_transform(image_size, train=False), not args.no_exif_transpose)
    batches = shard_batches(len(ds), args.batch_size, accelerator.process_index, accelerator.num_processes)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, num_workers=min(args.num_workers, os.cpu_count() or 1))
    rows: dict[int, list[tuple[str, float]]] = {}
    failed: list[int] = []
    for batch in tqdm(loader, desc="predict", disable=not accelerator.is_local_main_process):
        with accelerator.autocast():
            logits = model(batch["image"].to(accelerator.device))
        prob, idx = logits.float().softmax(-1).topk(k, dim=-1)
        for i, index in enumerate(batch["index"].tolist()):
            if not bool(batch["valid"][i]):
                failed.append(index)
                continue
            rows[index] = [(classes[c], p) for c, p in zip(idx[i].tolist(), prob[i].tolist())]
            if args.copy_to_class_folders:
                dst = os.path.join(args.output_dir, "by_class", rows[index][0][0], os.path.relpath(paths[index], root))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(paths[index], dst)

    shards = gather_object([(rows, failed)])
    merged = None
    if accelerator.is_main_process:
        merged = write_outputs(args, paths, root, classes, k, shards)
    # a clean end of the process group: a rank that exits while another still tears down gloo can abort
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return merged


if __name__ == "__main__":
    main()
