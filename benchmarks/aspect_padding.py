"""Padding fraction of one training epoch with and without aspect-ratio grouping (detlib.data.sampler).

    python benchmarks/aspect_padding.py [--image_size 600] [--batch_size 8]

On the real COCO subset (../shared/data/coco_subset, the 100 training images), resized as the training script
does (longer side --image_size, no augmentation), batched by the script's collate (padding to the batch's
largest image, rounded up to 32): padded pixels / all pixels of the batches, over 3 epochs (seeds 0, 1, 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from detlib.data.coco import CocoDetection, collate_detection
from detlib.data.sampler import GroupedBatchSampler, aspect_groups
from detlib.data.transforms import build_transform
from detlib.engine.flags import HelpFormatter

SUBSET = Path(__file__).resolve().parents[2] / "shared" / "data" / "coco_subset"


def padding_fraction(ds, batches) -> float:
    padded = total = 0
    for batch in batches:
        b = collate_detection([ds[i] for i in batch])
        canvas = b["images"].shape[-2] * b["images"].shape[-1]
        total += canvas * len(batch)
        padded += sum(canvas - int(h) * int(w) for h, w in b["image_sizes"].tolist())
    return padded / total


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--image_size", type=int, default=600, help="longer image side in pixels, as --image_size of training")
    p.add_argument("--batch_size", type=int, default=8, help="images per batch")
    return p


def main() -> None:
    args = build_parser().parse_args()
    ds = CocoDetection(str(SUBSET / "images"), str(SUBSET / "annotations" / "instances_train.json"),
                       build_transform(args.image_size, "none"), seed=0)
    groups = aspect_groups([r["size"] for r in ds.records])
    for epoch in range(3):
        g = torch.Generator().manual_seed(epoch)
        order = torch.randperm(len(ds), generator=g).tolist()
        plain = [order[i:i + args.batch_size] for i in range(0, len(order) - args.batch_size + 1, args.batch_size)]
        grouped = GroupedBatchSampler(groups, args.batch_size, seed=epoch)
        print(f"epoch {epoch}: {len(ds)} images ({groups.count(0)} landscape or square, {groups.count(1)} portrait), "
              f"batch {args.batch_size}, longer side {args.image_size}: padding {padding_fraction(ds, plain):.3f} of the "
              f"pixels with random batches, {padding_fraction(ds, list(grouped)):.3f} grouped")


if __name__ == "__main__":
    main()
