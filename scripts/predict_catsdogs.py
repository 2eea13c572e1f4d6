r"""Classify images with a trained classifier (scripts/train_catsdogs.py): top-k classes with probabilities.

A folder (recursively), a file or a glob, on the CPU or a GPU:
    python scripts/predict_catsdogs.py --weights outputs/catsdogs/best --source photos/ --output_dir outputs/predict_cd

Top-3, and a copy of every image into a folder named after its predicted class:
    python scripts/predict_catsdogs.py --weights outputs/catsdogs --source "photos/**/*.jpg" --output_dir out \
        --topk 3 --copy_to_class_folders

A video (PyAV: pip install av), frame by frame (predictions.json / .csv get one row per frame, with frame and time):
    python scripts/predict_catsdogs.py --weights outputs/catsdogs/best --source clip.mp4 --output_dir out

Several processes (each takes its share of the batches; results merged, no image twice):
    OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/predict_catsdogs.py --weights ... --source ...

Writes OUT/predictions.csv (file, class_1, prob_1, ..., class_k, prob_k), OUT/predictions.json (the same as
a list of {"file_name", "topk": [{"class", "prob"}, ...]}; a video's frames add "frame" from 0 and "time" in
seconds, and the csv two columns of them), OUT/skipped.txt (only when a file was skipped: unreadable and unsupported
files), with --copy_to_class_folders OUT/by_class/<class>/<file>, and a last line naming predictions.csv with the
images per predicted class.
Preprocessing is the evaluation's (shorter side to image_size / 0.875, centre crop), at the training size.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import logging
import os
import shutil
from collections import Counter

from tqdm import tqdm  # not tqdm.auto: its asyncio bar calls iter() on a DataLoader as it is made (workers twice)

from detlib.data import INSTALL_HINT, av_available, video_frames
from detlib.engine import int_at_least, stop
from detlib.files import atomic_write, write_json
from detlib.inference import (earlier_outputs, list_media_files, load_classifier, output_names, predict_videos,
                              prediction_parser, run_prediction, shard_batches, start_prediction, stop_if_signalled,
                              write_skipped)
from detlib.lazy import no_grad

logger = logging.getLogger("predict_catsdogs")


def build_parser() -> argparse.ArgumentParser:
    p, groups = prediction_parser(__doc__, batch_size=64)
    g = groups["data"]
    g.add_argument("--source", required=True, help="an image or video file, a folder (recursive: its images and "
                   "videos) or a glob pattern")
    g.add_argument("--image_size", type=int_at_least(16), help="default None: the training size from model_config.json")
    g = groups["output"]
    g.add_argument("--topk", type=int_at_least(1), help="classes per image (default: 5, at most the number of classes)")
    g.add_argument("--copy_to_class_folders", action="store_true", help="copy each image to OUT/by_class/<top-1 class>/")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def write_outputs(args, paths: list[str], root: str, classes: list[str], k: int, shards: list,
                  unsupported: list[str] = ()) -> dict:
    """predictions.csv / .json, skipped.txt and the summary line from every process's share (main process)."""
    merged: dict[int, list[tuple[str, float]]] = {}
    frames: dict[int, list[dict]] = {}
    skipped = []
    for part, fail, video_part, video_fail in shards:
        merged.update(part)
        frames.update(video_part)
        skipped += [f"{paths[i]} (unreadable)" for i in fail] + list(video_fail.values())
    names = {i: os.path.relpath(paths[i], root) for i in merged}
    rows = [{"file_name": names[i], "topk": [{"class": c, "prob": p} for c, p in merged[i]]} for i in sorted(merged)]
    rows += [r for v in sorted(frames) for r in frames[v]]
    with atomic_write(os.path.join(args.output_dir, "predictions.csv"), newline="") as f:
        w = csv.writer(f)
        w.writerow(["file"] + [c for j in range(1, k + 1) for c in (f"class_{j}", f"prob_{j}")]
                   + (["frame", "time"] if frames else []))
        for r in rows:
            w.writerow([r["file_name"]] + [v for t in r["topk"] for v in (t["class"], f"{t['prob']:.6f}")]
                       + ([r.get("frame", ""), r.get("time", "")] if frames else []))
    write_json(rows, os.path.join(args.output_dir, "predictions.json"))
    write_skipped(args.output_dir, sorted(skipped) + list(unsupported))
    top1 = Counter(r["topk"][0]["class"] for r in rows)
    logger.info("wrote %s and .json: %d images%s classified: %s", os.path.join(args.output_dir, "predictions.csv"),
                len(merged), f" and {sum(map(len, frames.values()))} video frames" if frames else "",
                ", ".join(f"{c} {top1[c]}" for c in classes if top1[c]) or "none")
    return merged


def classify_video(path: str, name: str, model, transform, classes: list[str], k: int, batch_size: int, accelerator
                   ) -> tuple[list[dict], str | None]:
    """(one row per frame: {"file_name", "frame" (from 0), "time" (seconds), "topk"}, frames batched `batch_size` at a
    time in order; None, or why the file was not read to its end: `VideoFrames.problem()`). Raises ValueError when
    the file yields no frame."""
    import torch

    from PIL import Image

    out = []
    frames = video_frames(path)
    bar = tqdm(total=frames.declared, desc=f"video {name}", unit="frame", leave=False,
               disable=not accelerator.is_local_main_process)
    stream = iter(frames)
    while chunk := list(itertools.islice(stream, batch_size)):
        stop_if_signalled()
        images = torch.stack([transform(Image.fromarray(rgb)) for _, _, rgb in chunk]).to(accelerator.device)
        with accelerator.autocast():
            logits = model(images)
        prob, idx = logits.float().softmax(-1).topk(k, dim=-1)
        for (i, t, _), c, p in zip(chunk, idx.tolist(), prob.tolist()):
            out.append({"file_name": name, "frame": i, "time": t,
                        "topk": [{"class": classes[a], "prob": b} for a, b in zip(c, p)]})
        bar.update(len(chunk))
    bar.close()
    if not out:
        raise ValueError(f"{path}: {frames.problem()}")
    return out, frames.problem()


def main(argv=None):
    return predict(parse_args(argv))  # --help and a bad flag answer before torch is imported


@no_grad
def predict(args):
    import torch
    from accelerate.utils import gather_object

    from detlib.classification import classification_transform
    from detlib.data import worker_loader_kwargs
    from detlib.data.images import ClassificationImageFiles
    from detlib.weights import require_model_keys, weights_path

    accelerator = start_prediction(args)  # CPU or GPU, any number of processes; OUTPUT_DIR/predict.log
    notes: list[str] = []
    try:
        model, config = load_classifier(args.weights)
        if args.image_size is None:  # the training size, from model_config.json
            require_model_keys(config, args.weights, {"image_size": "--image_size with the size the model was trained at"})
        root, paths, videos, unsupported = list_media_files(args.source, exclude=(os.path.join(args.output_dir, "by_class"),))
        if videos and not av_available():
            if not paths:
                raise ValueError(f"{args.source}: {len(videos)} video(s) and no image: reading videos needs PyAV: "
                                 f"{INSTALL_HINT}")
            unsupported, videos = unsupported + [f"{v} (a video: {INSTALL_HINT} to predict it)" for v in videos], []
        if unsupported and not paths and not videos:
            raise ValueError(f"{args.source}: nothing to predict: {unsupported[0]}")
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        stop(str(e), 1)
    classes = config["classes"]
    image_size = args.image_size or config["image_size"]
    k = min(args.topk or 5, len(classes))
    if args.topk and k < args.topk:  # asked for more than there are: said, not silently cut
        notes.append(f"--topk {args.topk}: the model has {len(classes)} classes, so {k} per image")
    for note in filter(None, notes):
        if accelerator.is_main_process:
            logger.warning("%s", note)
    model.to(accelerator.device)
    logger.info("loaded %s (%s, classes %s); %d images from %s at %d px, %d process(es)", weights_path(args.weights),
                config["model"], classes, len(paths), args.source, image_size, accelerator.num_processes)

    # the copies' names: distinct ignoring case too (a.jpg and A.jpg are one file on some file systems)
    copy_names = output_names([os.path.relpath(p, root) for p in paths], keep_extension=True)
    if args.copy_to_class_folders and accelerator.is_main_process:
        held = earlier_outputs(args.output_dir, ("by_class",))
        if held:
            logger.warning("%s", held)
    ds = ClassificationImageFiles(paths, classification_transform(image_size, train=False), not args.no_exif_transpose)
    batches = shard_batches(len(ds), args.batch_size, accelerator.process_index, accelerator.num_processes)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=batches,
                                         **worker_loader_kwargs(min(args.num_workers, os.cpu_count() or 1)))
    rows: dict[int, list[tuple[str, float]]] = {}
    failed: list[int] = []
    for batch in tqdm(loader, desc="predict", disable=not accelerator.is_local_main_process):
        stop_if_signalled()
        with accelerator.autocast():
            logits = model(batch["image"].to(accelerator.device))
        prob, idx = logits.float().softmax(-1).topk(k, dim=-1)
        for i, index in enumerate(batch["index"].tolist()):
            if not bool(batch["valid"][i]):
                failed.append(index)
                continue
            rows[index] = [(classes[c], p) for c, p in zip(idx[i].tolist(), prob[i].tolist())]
            if args.copy_to_class_folders:
                dst = os.path.join(args.output_dir, "by_class", rows[index][0][0], copy_names[index])
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(paths[index], dst)

    per_video, failed_videos = predict_videos(  # each video on one process, frame by frame
        videos, lambda v: classify_video(videos[v], os.path.relpath(videos[v], root), model, ds.transform, classes, k,
                                         args.batch_size, accelerator),
        accelerator.process_index, accelerator.num_processes)

    shards = gather_object([(rows, failed, per_video, failed_videos)])
    merged = None
    if accelerator.is_main_process:
        merged = write_outputs(args, paths, root, classes, k, shards, unsupported)
    # a clean end of the process group: a rank that exits while another still tears down gloo can abort
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return merged


if __name__ == "__main__":
    run_prediction(main)
