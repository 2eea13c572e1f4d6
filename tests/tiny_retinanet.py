"""A tiny RetinaNet trained for 2 steps on real COCO images, shared by the predict and export tests.

resnet18, fpn_channels 16, 128 px: a few seconds on a CPU. The weights barely differ from the initialisation,
but they are what the training script writes (last/model.safetensors + model_config.json), and with
score threshold 0 every image still gets its 100 detections to compare. It trains in-process (`main(argv)`):
nothing about it needs a process of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import COCO_SUBSET
from helpers import run_ok

TINY = ["--backbone", "resnet18", "--image_size", "128", "--fpn_channels", "16", "--per_device_batch_size", "2",
        "--num_workers", "0", "--lr", "1e-3", "--max_steps", "2", "--epochs", "1", "--report_to", "none"]


def subset_json(path: Path, split: str, n: int) -> Path:
    """The first n images (by id) of a split of the real subset, with their annotations."""
    d = json.loads((COCO_SUBSET / "annotations" / f"instances_{split}.json").read_text())
    images = sorted(d["images"], key=lambda im: im["id"])[:n]
    ids = {im["id"] for im in images}
    d["images"] = images
    d["annotations"] = [a for a in d["annotations"] if a["image_id"] in ids]
    path.write_text(json.dumps(d))
    return path


def train_tiny(root: Path) -> dict[str, Path]:
    """Train for 2 steps on 8 train images; returns {"run", "val_json" (6 val images), "images"}."""
    train = subset_json(root / "train.json", "train", 8)
    val = subset_json(root / "val.json", "val", 6)
    images = COCO_SUBSET / "images"
    run = root / "run"
    run_ok("train_retinanet", [f"--train_images={images}", f"--train_annotations={train}",
                                         f"--val_images={images}", f"--val_annotations={val}", "--output_dir", run,
                                         "--eval_interval", "10", "--per_device_eval_batch_size", "2", *TINY])
    return {"run": run, "val_json": val, "images": images}
