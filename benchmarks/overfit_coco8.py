"""Overfit 8 real COCO images: a from-scratch ResNet-18 RetinaNet must learn them (AP50 >= 0.8).

Trains and evaluates on the same 8 images of ../shared/data/coco_subset (instances_train.json), 320 px,
no augmentation, one batch of 8 per step, through scripts/train_retinanet.py itself. A model, loss,
matcher, decoder or evaluator bug shows up here as an AP50 that never rises.

    python benchmarks/overfit_coco8.py                 # 200 steps, prints the AP50 curve
    python benchmarks/overfit_coco8.py --steps 200 --fpn_channels 64
    python benchmarks/overfit_coco8.py --mixed_precision bf16 --seed 1 --json_out bf16.json   # on a GPU: 1gpu.yaml

The images: ../shared/data/coco_subset (or `DETLIB_COCO_SUBSET`); where it is absent, the first 8 images of the
built-in synthetic set (said in the output).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from detlib.engine.flags import HelpFormatter

REPO = Path(__file__).resolve().parents[1]
COCO = Path(os.environ.get("DETLIB_COCO_SUBSET", REPO.parent / "shared" / "data" / "coco_subset"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps on the 8 images")
    p.add_argument("--eval_every", type=int, default=100, help="steps between evaluations")
    p.add_argument("--fpn_channels", type=int, default=64, help="FPN and head width")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--image_size", type=int, default=320, help="training and evaluation size (px)")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="default: the accelerate config's")
    p.add_argument("--seed", type=int, default=0, help="the run's seed")
    p.add_argument("--config_file", help="accelerate config (default: 1gpu.yaml with CUDA, else cpu.yaml)")
    p.add_argument("--json_out", help="write the final AP, AP50, steps and minutes here as JSON (default: not written)")
    p.add_argument("--output_dir", default=None, help="run folder (default: a temporary one)")
    return p


def main() -> int:
    args = build_parser().parse_args()
    train_json, image_dir = COCO / "annotations" / "instances_train.json", COCO / "images"
    source = "COCO subset"
    if not train_json.is_file():
        sys.path.insert(0, str(REPO))
        from detlib.data.builtin import make_synthetic_coco

        paths = make_synthetic_coco()
        train_json, image_dir, source = Path(paths["train_annotations"]), Path(paths["train_images"]), "built-in synthetic set"
        print(f"no {COCO}: overfitting 8 images of the {source}")
    if args.config_file is None:
        import torch

        args.config_file = "1gpu.yaml" if torch.cuda.is_available() else "cpu.yaml"

    d = json.loads(train_json.read_text())
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

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / args.config_file), str(REPO / "scripts" / "train_retinanet.py"),
           "--train_images", str(image_dir), "--train_annotations", str(ann),
           "--val_images", str(image_dir), "--val_annotations", str(ann), "--seed", str(args.seed),
           *(["--mixed_precision", args.mixed_precision] if args.mixed_precision else []),
           "--backbone", "resnet18", "--image_size", str(args.image_size), "--fpn_channels", str(args.fpn_channels),
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
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "AP": evals[-1]["AP"], "AP50": evals[-1]["AP50"], "steps": evals[-1]["step"], "minutes": minutes,
            "mixed_precision": args.mixed_precision or "accelerate config", "seed": args.seed, "data": source,
            "image_size": args.image_size, "config_file": args.config_file}))
    return 0 if final >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
