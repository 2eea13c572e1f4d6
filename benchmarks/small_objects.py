"""Small objects in large images: a model trained on tiles, evaluated whole-image vs tiled (issue 40).

The built-in small-object set (`--builtin small_objects`: 8-32 px shapes on 768-1280 px images, 20 training and 8 val
images) and a ResNet-18 RetinaNet trained on its 128 px tiles at native resolution (`--train_tile 128`, anchors of
8-128 px; the model's size, `--image_size`, stays the built-in 128 px). Then the val images, three ways:
  whole         resized whole to the model's 128 px (what detlib did before tiles): the objects shrink 6-10x, to 1-5 px;
  tiled         cut into 128 px tiles overlapping by --tile_overlap, each at native resolution, merged across tiles
                (`--tile 128`, detlib.tiling);
  whole_native  the whole image at its own size, not resized (the model is convolutional: the same scale as its tiles;
                memory grows with the image, which tiling bounds).
Reported: AP, AP50, APs (COCO, small = area < 32^2: every object here), from `train_retinanet.py --evaluate_only` for
whole and tiled (the script's own path) and in-process for all three; images per second of each in-process (model,
decoding and merge; the images decoded beforehand; median of 3 passes over the val set, 1 process, --threads).

    python benchmarks/small_objects.py --output_dir outputs/bench_small_objects               # train, then measure
    python benchmarks/small_objects.py --weights outputs/bench_small_objects/train/last --output_dir outputs/b2

Writes OUTPUT_DIR/results.json (and the runs' folders) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
SCRIPT = os.path.join(REPO, "scripts", "train_retinanet.py")
TILE = 128


def run_script(args: list[str], log: str) -> float | None:
    """Run train_retinanet.py with `args` (output to `log`); returns its wall time in s, None when the script has no
    such flag (--tile before tiled evaluation). Raises SystemExit on another failure."""
    t = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, SCRIPT, *args], stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if code == 2 and "unrecognized arguments" in open(log).read():
        return None
    if code:
        raise SystemExit(f"train_retinanet.py {' '.join(args)} exited {code}; see {log}")
    return time.perf_counter() - t


def last_stats(output_dir: str) -> dict:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        line = [json.loads(x) for x in f if '"AP"' in x][-1]
    return {k: round(line[k], 4) for k in ("AP", "AP50", "APs", "AR100")}


def in_process(weights: str, overlap: float, threads: int) -> dict:
    """AP / AP50 / APs (pycocotools) and images per second of whole, tiled and whole_native on the val images."""
    import numpy as np
    import torch
    from PIL import Image
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from detlib.boxes import box_xyxy_to_xywh
    from detlib.data import EvaluationCollate, build_transform, make_small_objects_coco
    from detlib.inference import load_retinanet
    from detlib.retinanet import anchor_generator_from_config, decode_detections
    from detlib.tiling import _window_item, detect_tiled, window_transform

    torch.set_num_threads(threads)
    model, config, category_map = load_retinanet(weights)
    anchor_gen = anchor_generator_from_config(config)
    transform = build_transform(config["image_size"], "none", config.get("max_size"))
    paths = make_small_objects_coco()
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(paths["val_annotations"])
    images = [(im["id"], torch.from_numpy(np.array(Image.open(os.path.join(paths["val_images"], im["file_name"]))
                                                   .convert("RGB"))).permute(2, 0, 1).contiguous())
              for im in sorted(gt.dataset["images"], key=lambda im: im["id"])]

    @torch.no_grad()
    def decode(batch):
        out = model(batch["images"])
        anchors, counts = anchor_gen(*batch["images"].shape[-2:])
        return decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, batch["image_sizes"],
                                 batch["scales"], max_detections=100).per_image(len(batch["image_ids"]))

    modes = {"whole": lambda image: decode(EvaluationCollate()([_window_item(image, transform, 0)]))[0],
             "tiled": lambda image: detect_tiled(decode, image, window_transform(config, TILE, config["image_size"])[0],
                                                 TILE, overlap, 8, max_detections=100),  # --tile's scale rule
             "whole_native": lambda image: decode(EvaluationCollate()([_window_item(image, None, 0)]))[0]}
    results = {}
    for name, detect in modes.items():
        times, found = [], {}
        for _ in range(3):
            t = time.perf_counter()
            found = {image_id: detect(image) for image_id, image in images}
            times.append(time.perf_counter() - t)
        dets = [{"image_id": i, "category_id": category_map.category_ids[int(c)], "bbox": b, "score": float(s)}
                for i, d in found.items()
                for b, s, c in zip(box_xyxy_to_xywh(d["boxes"]).tolist(), d["scores"], d["labels"])]
        with contextlib.redirect_stdout(io.StringIO()):
            e = COCOeval(gt, gt.loadRes(dets), "bbox") if dets else None
            if e:
                e.evaluate(), e.accumulate(), e.summarize()
        stats = e.stats if e else [0.0] * 12
        results[name] = {"AP": round(float(stats[0]), 4), "AP50": round(float(stats[1]), 4),
                         "APs": round(float(stats[3]), 4), "images_per_s": round(len(images) / statistics.median(times), 3)}
        print(name, results[name], flush=True)
    return results


def build_parser() -> argparse.ArgumentParser:
    from detlib.engine.flags import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--output_dir", default="outputs/bench_small_objects", help="where the runs and results.json go")
    p.add_argument("--weights", help="a model trained on small_objects (default: none, train one here)")
    p.add_argument("--epochs", type=int, default=3, help="epochs of the training run")
    p.add_argument("--tile_overlap", type=float, default=0.25, help="the tiled evaluation's overlap")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-process timing")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    common = ["--builtin", "small_objects", "--report_to", "none", "--num_log_images", "0", "--eval_bootstrap", "0"]
    record = {"setup": f"--builtin small_objects, --train_tile {TILE}, evaluated on its 8 val images; CPU, "
                       f"{args.threads} torch threads in-process"}
    weights = args.weights
    if not weights:
        seconds = run_script(common + ["--train_tile", str(TILE), "--epochs", str(args.epochs), "--eval_interval",
                                       str(args.epochs), "--output_dir", os.path.join(out, "train"),
                                       "--overwrite_output_dir"], os.path.join(out, "train.log"))
        weights = os.path.join(out, "train", "last")
        record["training"] = {"command": f"train_retinanet.py {' '.join(common)} --train_tile {TILE} --epochs "
                                         f"{args.epochs}", "seconds": round(seconds, 1)}
    record["weights"] = weights
    script = {}
    for name, extra in (("whole", []), ("tiled", ["--tile", str(TILE), "--tile_overlap", str(args.tile_overlap)])):
        folder = os.path.join(out, f"eval_{name}")
        seconds = run_script(common + ["--evaluate_only", weights, "--output_dir", folder, "--overwrite_output_dir",
                                       *extra], os.path.join(out, f"eval_{name}.log"))
        script[name] = (None if seconds is None else  # None: this checkout's script cannot evaluate tiled
                        {**last_stats(os.path.join(folder, "evaluate_only")), "seconds": round(seconds, 1)})
        print("--evaluate_only", name, script[name], flush=True)
    record["evaluate_only"] = script
    record["in_process"] = in_process(weights, args.tile_overlap, args.threads)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("\n| evaluation | AP | AP50 | APs | images/s |\n|---|---|---|---|---|")
    for name, r in record["in_process"].items():
        print(f"| {name} | {r['AP']:.3f} | {r['AP50']:.3f} | {r['APs']:.3f} | {r['images_per_s']:.2f} |")
    print("wrote", os.path.join(out, "results.json"))


if __name__ == "__main__":
    main()
