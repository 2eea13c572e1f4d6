"""A tiny RetinaNet trained for 2 steps on real COCO images, shared by the predict and export tests.

resnet18, fpn_channels 16, 128 px: a few seconds on a CPU. The weights barely differ from the initialisation,
but they are what the training script writes (last/model.safetensors + model_config.json), and with
score threshold 0 every image still gets its 100 detections to compare. It trains in-process (`main(argv)`):
nothing about it needs a process of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from detlib.data.images import load_rgb
from detlib.retinanet.export import prepare_input
from detlib.retinanet.model import build_retinanet_from_config

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


def spread_retinanet(root: Path) -> Path:
    """A tiny RetinaNet saved as the training script saves it (model.safetensors + model_config.json).

    Untrained, its scores would all sit at the prior (0.01) within float rounding, and which of thousands of
    tied candidates survives top-k and NMS would be decided by rounding in any runtime. So the FPN and heads
    get He initialisation, the BatchNorm statistics are measured on 16 real images, and the scores spread over
    0.2-1 like a trained model's: the check then compares real decisions.
    """
    folder = root / "best"
    folder.mkdir()
    cats = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())["categories"]
    config = {"num_classes": len(cats), "backbone": "resnet18", "fpn_channels": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 128, "max_size": None,
              "category_ids": [c["id"] for c in cats], "category_names": [c["name"] for c in cats]}
    torch.manual_seed(0)
    model = build_retinanet_from_config(config)
    for m in [*model.fpn.modules(), *model.cls_head.modules(), *model.box_head.modules()]:
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    with torch.no_grad():
        model.cls_head.out.weight.mul_(0.3)
        model.box_head.out.weight.mul_(0.3)
        model.cls_head.out.bias.fill_(-3.0)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.reset_running_stats()
                m.momentum = None  # a plain average over the calibration batch
        files = sorted((COCO_SUBSET / "images").iterdir())[-16:]
        batch = torch.cat([prepare_input(torch.from_numpy(np.asarray(load_rgb(f)[0]).copy()).permute(2, 0, 1), 128, None, 128)["images"]
                           for f in files])
        model.train()(batch)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps(config))
    return folder
