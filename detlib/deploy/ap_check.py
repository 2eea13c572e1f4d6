"""Each export held to the metric that matters: its COCO AP on a labelled set beside PyTorch's.

Every runner (`detlib.deploy.runner`) sees the same images, read and resized as the evaluation reads them
(`CocoDetection`, the evaluation transform), one at a time; the detections go through the same COCO evaluation.
PyTorch's AP is that of the evaluation (the model on the image padded to a multiple of 32); an export's is that of
the file as it will be deployed. A drop of more than `max_ap_drop` AP points fails.
"""

from __future__ import annotations

import torch

from ..data import CocoDetection, build_transform
from ..data.coco import collate_detection
from ..evaluation.coco import detections_to_coco, evaluate_coco


def ap_of_runners(runners: dict, annotations: str, image_dir: str, image_size: int, max_size: int | None,
                  category_ids: list[int]) -> dict[str, dict]:
    """COCO AP of each runner on a labelled set.

    Args:
        runners: {name: callable(batch) -> per-image {"boxes", "scores", "labels"}} (`ExportRunner`, `TorchRunner`).
        annotations, image_dir: the COCO json and its image folder.
        image_size, max_size: the evaluation's resize; category_ids: the model's, label order.
    Returns:
        {name: {"AP": points 0..100 (COCO AP@[.5:.95]), "AP50": points, "num_images": images evaluated}}.
    """
    ds = CocoDetection(image_dir, annotations, build_transform(image_size, "none", max_size), train=False)
    ids = torch.tensor(category_ids)
    results = {name: [] for name in runners}
    for k in range(len(ds)):
        sample = ds[k]
        if not sample["valid"]:  # unreadable: left out of every runner's results alike
            continue
        batch = collate_detection([sample])
        for name, run in runners.items():
            d = run(batch)[0]
            results[name] += detections_to_coco(d["boxes"], d["scores"], ids[d["labels"].long()], int(sample["image_id"]))
    out = {}
    for name, rows in results.items():
        stats, _ = evaluate_coco(ds.dataset, rows, checked=True)
        out[name] = {"AP": round(100 * stats["AP"], 2), "AP50": round(100 * stats["AP50"], 2), "num_images": len(ds)}
    return out


# what to try when an export's AP drops, by the kind of format (its name's last part)
ADVICE = {"int8": "try more --calibration_images, --float_head (the heads' last convolutions in float), or a float format",
          "fp16": "its weights rounded to fp16 cost that much: deploy the fp32 IR (FILE.xml)",
          "fp32": "a float graph on another canvas than the evaluation's input: with the decoding inside, images of "
                  "another aspect ratio than the canvas are padded further; export with --decode outside"}


def ap_verdict(ap: dict[str, dict], max_ap_drop: float, reference: str = "pytorch") -> tuple[list[str], list[str]]:
    """(one line per export: its AP beside the reference's; the lines of the exports whose AP fell more than
    `max_ap_drop` points below it, each with what to try)."""
    ref = ap[reference]["AP"]
    lines, failed = [], []
    for name, r in ap.items():
        if name == reference:
            continue
        drop = ref - r["AP"]
        line = f"{name}: AP {r['AP']:.2f} (AP50 {r['AP50']:.2f}) vs PyTorch {ref:.2f} ({-drop:+.2f})"
        lines.append(line)
        if drop > max_ap_drop:
            failed.append(f"{line}: a drop of {drop:.2f} AP points, more than --max_ap_drop {max_ap_drop:g}; "
                          + ADVICE.get(name.split("_")[-1], ADVICE["fp32"]))
    return lines, failed
