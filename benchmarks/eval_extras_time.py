"""Time of the evaluation extras (detlib.evaluation.report.log_evaluation_extras) against the evaluation itself.

The evaluation is what scripts/train_retinanet.py's `evaluate` does on one process: forward, decoding and
COCOeval over the val set. The extras are the per-class table, the PR / confusion / per-class / training-curve
plots, 16 sample images drawn and saved, all logged to a wandb offline run and TensorBoard. Each evaluation
is repeated (epochs 0, 1, ...) as in a training run; the first extras call also pays one-off imports
(matplotlib, wandb media) and is reported apart.

    # a trained run (its model_config.json gives the model and size), the real subset's val set
    python benchmarks/eval_extras_time.py --weights outputs/run --val_images ../shared/data/coco_subset/images \
        --val_annotations ../shared/data/coco_subset/annotations/instances_val.json
    # the default recipe's model (ResNet-50, 600 px, 256 channels) with untrained weights, for its evaluation time
    python benchmarks/eval_extras_time.py --untrained resnet50 --image_size 600 --fpn_channels 256 ...

Writes a JSON summary (--out) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from detlib.data.coco import CocoDetection, collate_detection
from detlib.data.transforms import build_transform
from detlib.engine.flags import HelpFormatter
from detlib.engine import make_accelerator, start_trackers
from detlib.evaluation.coco import CocoEvaluator, detections_to_coco
from detlib.evaluation.report import log_evaluation_extras
from detlib.inference import load_retinanet
from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.decode import decode_detections
from detlib.retinanet.model import build_retinanet_from_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--weights", help="trained weights (run folder, best/, last/, ...; default: none, give it or --untrained)")
    p.add_argument("--untrained", metavar="BACKBONE", help="time an untrained model of this backbone instead "
                   "(default: none)")
    p.add_argument("--fpn_channels", type=int, default=256, help="FPN width of the --untrained model")
    p.add_argument("--image_size", type=int, help="evaluation size (default: the weights' training size, else 600)")
    p.add_argument("--val_images", required=True, help="image folder of the validation set")
    p.add_argument("--val_annotations", required=True, help="COCO json of the validation set")
    p.add_argument("--batch_size", type=int, default=8, help="images per forward pass")
    p.add_argument("--repeats", type=int, default=3, help="timed evaluations; medians are reported")
    p.add_argument("--score_thresh", type=float, default=0.05, help="lowest score kept, as in training")
    p.add_argument("--output_dir", help="run folder for the extras (default: a temporary one)")
    p.add_argument("--sample_format", default="png", choices=["jpg", "png"], help="file format of the drawn samples")
    p.add_argument("--out", default="benchmarks/eval_extras_time.json", help="where the timings are written")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")

    if args.untrained:
        model = build_retinanet_from_config({"num_classes": 80, "backbone": args.untrained, "fpn_channels": args.fpn_channels, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}).eval()
        image_size, max_size, what = args.image_size or 600, None, f"untrained {args.untrained}, fpn {args.fpn_channels}"
    else:
        model, config, _ = load_retinanet(args.weights)
        image_size, max_size = args.image_size or config["image_size"], config.get("max_size")
        what = f"{args.weights} ({config['backbone']}, fpn {config['fpn_channels']})"
    ds = CocoDetection(args.val_images, args.val_annotations, build_transform(image_size, "none", max_size), train=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, collate_fn=collate_detection)
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="eval_extras_")
    accelerator = make_accelerator("no", 1, "all", out_dir, cpu=True)
    start_trackers(accelerator, "detlib-eval-extras", {"what": what}, out_dir, None)
    anchor_gen = AnchorGenerator()
    evaluator = CocoEvaluator(ds.dataset, backend="auto")
    eval_s, extras_s = [], []
    for epoch in range(args.repeats):
        t0 = time.perf_counter()
        evaluator.reset()
        with torch.no_grad():
            for batch in loader:
                out = model(batch["images"])
                anchors, counts = anchor_gen(*batch["images"].shape[-2:])
                dets = decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, batch["image_sizes"],
                                         batch["scales"], score_thresh=args.score_thresh)
                for i, d in enumerate(dets.per_image(len(batch["image_ids"]))):
                    iid = int(batch["image_ids"][i])
                    evaluator.add(iid, detections_to_coco(d["boxes"], d["scores"], ds.category_map.to_category_ids(d["labels"]), iid))
        stats, _ = evaluator.evaluate()
        eval_s.append(time.perf_counter() - t0)
        with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": epoch, "step": epoch + 1, **stats}) + "\n")
        t0 = time.perf_counter()
        log_evaluation_extras(accelerator, out_dir, epoch, epoch + 1, ds.dataset, evaluator.results,
                              evaluator.coco_eval, args.val_images, sample_format=args.sample_format)
        extras_s.append(time.perf_counter() - t0)
        print(f"epoch {epoch}: evaluation {eval_s[-1]:.2f} s, extras {extras_s[-1]:.2f} s, AP50 {stats['AP50']:.4f}, "
              f"{len(evaluator.results)} detections", flush=True)
    accelerator.end_training()
    later = extras_s[1:] or extras_s
    summary = {"model": what, "image_size": image_size, "val_images": len(ds), "threads": torch.get_num_threads(),
               "evaluation_s": eval_s, "extras_s": extras_s, "extras_first_call_s": extras_s[0],
               "extras_median_later_s": statistics.median(later), "evaluation_median_s": statistics.median(eval_s),
               "extras_fraction_of_evaluation": statistics.median(later) / statistics.median(eval_s),
               "output_dir": out_dir}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
