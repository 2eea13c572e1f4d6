"""samples/train_batch.jpg: the first training batch as the model sees it, after the augmentation (ultralytics'
train_batch0.jpg, what users look at first when a run goes wrong: boxes off their objects, a crop or jitter too
strong, labels swapped). Written once per run, by the main process, from its own first batch."""

from __future__ import annotations

import logging
import os

import torch

from .drawing import class_color, draw_batch, save_image

logger = logging.getLogger(__name__)

TRAIN_BATCH_FILE = os.path.join("samples", "train_batch.jpg")
MAX_IMAGES = 16  # a 4 x 4 grid: larger batches are cut, so the file stays a glance


def write_train_batch(output_dir: str, images: torch.Tensor, class_names: list[str], labels: torch.Tensor,
                      boxes: torch.Tensor | None = None, mean=None, std=None) -> str:
    """Draw the batch into `output_dir/samples/train_batch.jpg` (the first MAX_IMAGES images); returns the path.

    Args:
        images: [B, 3, H, W] on any device: uint8 or float 0-255 (RetinaNet's input, which it normalises itself),
            or normalised float, de-normalised as x * std + mean (`mean`, `std`: per channel, 0-1 units, timm's).
        class_names: the label indices' names.
        labels: detection: [B, M] int64 box labels, negative ones padding; classification: [B] int64.
        boxes: detection: [B, M, 4] float xyxy pixels of `images`; None for a classifier.
    """
    images, labels = images[:MAX_IMAGES].detach().float().cpu(), labels[:MAX_IMAGES].cpu()
    if mean is not None:
        images = images * torch.tensor(std).view(1, 3, 1, 1) * 255 + torch.tensor(mean).view(1, 3, 1, 1) * 255
    images = images.round().clamp(0, 255).to(torch.uint8)
    if boxes is None:
        texts = [[class_names[int(k)]] for k in labels]
        colors = [[class_color(int(k))] for k in labels]
        kept = None
    else:
        kept = [b[k >= 0] for b, k in zip(boxes[:MAX_IMAGES].detach().float().cpu(), labels)]
        texts = [[class_names[int(c)] for c in k[k >= 0]] for k in labels]
        colors = [[class_color(int(c)) for c in k[k >= 0]] for k in labels]
    path = os.path.join(output_dir, TRAIN_BATCH_FILE)
    save_image(draw_batch(images, kept, texts, colors), path)
    logger.info("the first training batch as the model sees it: %s", path)
    return path
