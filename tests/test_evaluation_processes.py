"""Issue 29, item 1, end to end: `train_retinanet.py --evaluate_only` of one set of weights gives the same 12 stats,
to the bit, on 1, 2 and 3 gloo processes (forked with the rank variables of cpu_2proc.yaml) and at eval batch sizes 3
and 4, on 29 real val images of the shared subset (a count that neither 2, 3 nor 4 divides), and metrics.jsonl counts
the 29 distinct images. The weights: a ResNet-18 RetinaNet, random initialisation with a fixed seed, scored at
--score_thresh 0 so that every image has its 100 detections (an untrained model's scores sit near the prior), on the
boxes as one class "object" (so that the random detections match some of them: stats that are not all 0)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import COCO_SUBSET, needs_coco_subset, read_metrics
from helpers import forked_ok

pytestmark = [pytest.mark.slow, needs_coco_subset]
STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def test_the_12_stats_are_the_same_on_1_2_and_3_processes_at_any_eval_batch(tmp_path):
    from detlib.retinanet.model import RetinaNet

    val = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    images = sorted(val["images"], key=lambda im: im["id"])[:29]
    ids = {im["id"] for im in images}
    val.update(images=images, annotations=[{**a, "category_id": 1} for a in val["annotations"] if a["image_id"] in ids],
               categories=[{"id": 1, "name": "object"}])
    (tmp_path / "val.json").write_text(json.dumps(val))
    categories = [1]
    torch.manual_seed(0)
    model = RetinaNet(len(categories), "resnet18", fpn_channels=32, freeze_backbone_bn=False)
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights / "model.safetensors"))
    (weights / "model_config.json").write_text(json.dumps({
        "num_classes": len(categories), "backbone": "resnet18", "fpn_channels": 32, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 192,
        "max_size": None, "category_ids": categories,
        "category_names": ["object"]}))
    common = ["--val_images", COCO_SUBSET / "images", "--val_annotations", tmp_path / "val.json", "--evaluate_only",
              weights, "--score_thresh", "0", "--report_to", "none", "--num_workers", "0", "--num_log_images", "0",
              "--eval_bootstrap", "0"]
    stats = {}
    for processes, batch in ((1, 3), (2, 3), (3, 3), (2, 4)):
        out = tmp_path / f"p{processes}_b{batch}"
        forked_ok("train_retinanet.py", common + ["--per_device_eval_batch_size", batch, "--output_dir", out], processes)
        (line,) = read_metrics(out / "evaluate_only")
        assert line["num_images_evaluated"] == 29, line["num_images_evaluated"]
        stats[processes, batch] = {k: line[k] for k in STATS}
    reference = stats[1, 3]
    assert reference["AR100"] > 0  # detections that match: the stats are not all 0
    for key, value in stats.items():
        assert value == reference, (key, {k: (value[k], reference[k]) for k in STATS if value[k] != reference[k]})
