"""Overfit 8 real COCO images: a from-scratch ResNet-18 RetinaNet must learn them (AP50 >= 0.8).

Trains and evaluates on the same 8 images of ../shared/data/coco_subset (instances_train.json), 320 px,
no augmentation, one batch of 8 per step, through scripts/train_retinanet.py itself. A model, loss,
matcher, decoder or evaluator bug shows up here as an AP50 that never rises.

    python benchmarks/overfit_coco8.py                 # 200 steps, prints the AP50 curve
    python benchmarks/overfit_coco8.py --steps 200 --fpn_channels 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from detlib.flags import HelpFormatter

REPO = Path(__file__).resolve().parents[1]
COCO = REPO.parent / "shared" / "data" / "coco_subset"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps on the 8 images")
    p.add_argument("--eval_every", type=int, default=100, help="steps between evaluations")
    p.add_argument("--fpn_channels", type=int, default=64, help="FPN and head width")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--output_dir", default=None, help="run folder (default: a temporary one)")
    return p


def main() -> int:
    args = build_parser().parse_args()
    if not (COCO / "annotations" / "instances_train.json").is_file():
        sys.exit(f"needs {COCO}")

    d = json.loads((COCO / "annotations" / "instances_train.json").read_text())
    with_boxes = {a["image_id"] for a in d["annotations"] if not a["iscrowd"]}
    images = sorted((im for im in d["images"] if im["id"] in with_boxes), key=lambda im: im["id"])[:8]
    ids = {im["id"] for im in images}
    d["images"], d["annotations"] = images, [a for a in d["annotations"] if a["image_id"] in ids]
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="overfit8_"))
    out.mkdir(parents=True, exist_ok=True)
    ann = out / "coco8.json"
    ann.write_text(json.dumps(d))
    n_boxes = sum(1 for a in d["annotations"] if not a["iscrowd"])
    print(f"8 images, {n_boxes} boxes, {len({a['category_id'] for a in d['annotations']})} categories; output {out}")

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml"),
           str(REPO / "scripts" / "train_retinanet.py"),
           "--train_images", str(COCO / "images"), "--train_annotations", str(ann),
           "--val_images", str(COCO / "images"), "--val_annotations", str(ann),
           "--backbone", "resnet18", "--image_size", "320", "--fpn_channels", str(args.fpn_channels),
           "--augmentation", "none", "--per_device_batch_size", "8", "--per_device_eval_batch_size", "8",
           "--epochs", str(args.steps), "--eval_interval", str(args.eval_every), "--lr", str(args.lr),
           "--lr_scheduler", "constant", "--warmup_steps", "0", "--num_workers", "2", "--log_interval", "10",
           "--checkpoint_total_limit", "1", "--checkpoint_interval", str(args.steps), "--output_dir", str(out / "run"), "--report_to", "none"]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    minutes = (time.time() - t0) / 60
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "AP50" in x]
    for e in evals:
        print(f"step {e['step']:5d}  AP {e['AP']:.3f}  AP50 {e['AP50']:.3f}  AR100 {e['AR100']:.3f}")
    final = evals[-1]["AP50"]
    print(f"final AP50 {final:.3f} after {evals[-1]['step']} steps ({minutes:.1f} min): {'PASS' if final >= 0.8 else 'FAIL'} (goal >= 0.8)")
    return 0 if final >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
