r"""Detect objects in images with a trained RetinaNet: drawn images, COCO-format predictions, a summary.

A folder of photos (recursively), on the CPU or a GPU:
    python scripts/predict_retinanet.py --weights outputs/r50_600 --source photos/ --output_dir outputs/predict

One file, a glob, per-image json, a higher score threshold:
    python scripts/predict_retinanet.py --weights outputs/r50_600/best --source img.jpg --output_dir out
    python scripts/predict_retinanet.py --weights outputs/r50_600/last/model.safetensors --source "data/**/*.png" \
        --output_dir out --save_json_per_image --score_thresh 0.3

A COCO json (the results carry its image ids; equal to what --evaluate_only writes for the same weights,
--image_size and --batch_size = its --per_device_eval_batch_size):
    python scripts/predict_retinanet.py --weights outputs/r50_600/best --source /data/coco/annotations/instances_val2017.json \
        --images /data/coco/val2017 --output_dir out

A labelled Pascal VOC or YOLO set (its val split by default; results carry its image ids, as --evaluate_only's):
    python scripts/predict_retinanet.py --weights outputs/voc/best --source VOCdevkit/VOC2012 --data_format voc --output_dir out
    python scripts/predict_retinanet.py --weights outputs/yolo/best --source datasets/my_set/data.yaml --split val --output_dir out

Small objects in large images (aerial, slides): tiles of 512 px cut at native resolution, each at the scale the model
was trained at (not resized for a model trained with --train_tile, else resized to its size), boxes merged across
tiles (docs/predict_export.md, "Tiled prediction"); --tile_full adds the whole image:
    python scripts/predict_retinanet.py --weights outputs/r50_600/best --source aerial/ --output_dir out --tile 512 \
        --tile_overlap 0.2

A video (PyAV: pip install av), frame by frame, as the same frames saved as images would be:
    python scripts/predict_retinanet.py --weights outputs/r50_600/best --source clip.mp4 --output_dir out --save_json_per_image

An exported model (scripts/export_retinanet.py: ONNX Runtime for .onnx, OpenVINO for .xml; FILE.json beside it):
    python scripts/predict_retinanet.py --weights outputs/r50_600/export/retinanet.int8.xml --source photos/ --output_dir out

For a labelling tool (docs/predict_export.md, "Fixing labels with Label Studio / CVAT / FiftyOne"): Label Studio
tasks with predictions, CVAT for images 1.1 XML, YOLO txt or Pascal VOC xml under OUT/<format>/, beside predictions.json:
    python scripts/predict_retinanet.py --weights outputs/r50_600/best --source photos/ --output_dir out --format labelstudio \
        --image_root_url "/data/local-files/?d=photos"

Several processes (each takes its share of the batches; results merged, no image twice):
    accelerate launch --config_file accelerate_configs/2gpu.yaml scripts/predict_retinanet.py --weights ... --source ...

Writes OUT/predictions.json (COCO results: image_id, category_id, bbox [x, y, w, h] pixels of the original
image, score; plus file_name when the source is not a COCO json), OUT/images/<name>.jpg with the detections
scoring >= --draw_thresh drawn (an image of at most 256 px enlarged 2-4x so its labels stay legible), OUT/json/<name>.json with --save_json_per_image, OUT/skipped.txt (only when
something was skipped) listing unreadable images and unsupported files, and a last line naming predictions.json with the
detections per class. A video gives
OUT/videos/<name>.mp4 (drawn), its frames' results in predictions.json (with file_name, frame from 0, time in
seconds, image_id = the frame) and with --save_json_per_image OUT/json/<name>.json (a list: one image json per
frame, with frame and time). <name> is the input's path below the source
without its extension; inputs that would share one (a.jpg, a.png) keep the whole name (a.jpg.jpg, a.png.jpg),
so no input's files replace another's.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
from collections import Counter

from PIL import Image
from tqdm import tqdm  # not tqdm.auto: its asyncio bar calls iter() on a DataLoader as it is made (workers twice)

from detlib.data import (INSTALL_HINT, VideoWriter, av_available, data_dir_paths, read_data_dir_splits, video_frames,
                         worker_loader_kwargs)
from detlib.data.voc import read_class_names
from detlib.datacheck import DataReport, check_coco
from detlib.engine import float_range, int_at_least, stop
from detlib.files import write_json
from detlib.inference import (earlier_outputs, image_size_as_shown, input_shapes, list_media_files, load_retinanet, output_names,
                              prediction_parser, predict_videos, retinanet_input_size, run_prediction,
                              start_prediction, stop_if_signalled, write_skipped)
from detlib.tiling import add_tile_flags, collate_images, tile_flag_error, tile_flag_notes, tile_settings, tiled_loader
from detlib.lazy import no_grad
from detlib.weights import WeightsFileError, weights_path

logger = logging.getLogger("predict_retinanet")
# --format: detlib.evaluation.annotation_formats.PREDICTION_FORMATS, written out so that --help imports no torch
PREDICTION_FORMATS = ("coco", "labelstudio", "cvat", "yolo", "voc")
# OUT/<folder>/<name>: the files written per input (never read as inputs, see list_image_files)
PER_INPUT_FOLDERS = ("images", "json", "videos")


def build_parser() -> argparse.ArgumentParser:
    # 8 images per forward pass: the training script's --per_device_eval_batch_size
    p, groups = prediction_parser(__doc__, batch_size=8)
    g = groups["data"]
    g.add_argument("--source", required=True, help="an image or video file, a folder (recursive: its images and "
                   "videos), a glob pattern, a COCO json, or a VOC / YOLO root (--data_format)")
    g.add_argument("--images", help="image folder of a COCO-json source (default: none; needed with a json --source)")
    g.add_argument("--data_format", choices=["voc", "yolo"], help="--source is the root of a labelled VOC or YOLO set "
                   "(a data.yaml source is read as YOLO without it): its --split is predicted, as a COCO json would be "
                   "(default: none, an image source)")
    g.add_argument("--split", default="val", help="the split of a VOC / YOLO source (VOC: ImageSets/Main/<split>.txt, "
                   "YOLO: the yaml key)")
    g.add_argument("--class_names", help="a VOC source's classes in id order: a file with one name a line, or the names "
                   "separated by commas (default: none, the names its xml files use, sorted; give the training run's list "
                   "if it had one)")
    g.add_argument("--categories_by_name", action="store_true", help="a COCO-json source whose category ids name other "
                   "classes than the model's: match the classes by name and write the json's ids (default: such a "
                   "json is refused)")
    g.add_argument("--image_size", type=int_at_least(32), help="resize size (default None: the training run's, from model_config.json)")
    g.add_argument("--max_size", type=int_at_least(32), help="default None: from model_config.json")

    g = p.add_argument_group("detection")
    g.add_argument("--score_thresh", type=score_threshold, default=0.05, help="lowest score kept (default: 0.05, the "
                   "evaluation's), or best_f1: per class, the threshold that maximised F1 in the training run's evaluation "
                   "of these weights (score_thresholds.json beside them; classes without one take the pooled one)")
    g.add_argument("--nms_thresh", type=float_range(0, 1, lo_open=True), default=0.5, help="IoU of class-wise NMS")
    g.add_argument("--detections_per_image", type=int_at_least(1), default=100, help="detections kept per image (with "
                   "--tile: per tile, and per image after the merge)")
    add_tile_flags(g)

    g = groups["output"]
    g.add_argument("--draw_thresh", type=float_range(0, 1), help="lowest score drawn on OUT/images (default: 0.3; with "
                   "--score_thresh best_f1 every detection kept)")
    g.add_argument("--no_images", action="store_true", help="do not write the drawn images")
    g.add_argument("--save_json_per_image", action="store_true", help="also OUT/json/<name>.json per image")
    g.add_argument("--format", choices=PREDICTION_FORMATS, default="coco", help="also write the detections of the "
                   "images for a labelling tool, under OUT/<format>/: Label Studio tasks with predictions (tasks.json, "
                   "label_config.xml), CVAT for images 1.1 (annotations.xml), YOLO (labels/<name>.txt, classes.txt, "
                   "data.yaml) or Pascal VOC (Annotations/<name>.xml) (default: coco, predictions.json alone)")
    g.add_argument("--image_root_url", help="--format labelstudio: the URL the tasks name each image by, followed by "
                   "its path below the source (e.g. /data/local-files/?d=photos or https://host/bucket) (default: "
                   "none, the path alone)")
    g.add_argument("--save_conf", action="store_true", help="--format yolo: the score as a 6th column (ultralytics' "
                   "save_conf; YOLO label readers do not take it)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if tile_flag_error(args):
        p.error(tile_flag_error(args))
    return args


def score_threshold(text: str):
    """argparse type of --score_thresh: a number in [0, 1], or "best_f1"."""
    return text if text == "best_f1" else float_range(0, 1)(text)


score_threshold.__name__ = "number or best_f1"


def class_thresholds(args, category_map) -> torch.Tensor:
    """[K] float32: the lowest score kept for each of the model's classes (label order): --score_thresh, or with
    best_f1 the thresholds of score_thresholds.json beside the weights (the pooled one for classes without their
    own). Raises FileNotFoundError / WeightsFileError (one line) when best_f1 has no file to read."""
    import torch

    from detlib.evaluation import read_score_thresholds

    if args.score_thresh != "best_f1":
        return torch.full((len(category_map),), float(args.score_thresh))
    per_class, pooled, path = read_score_thresholds(args.weights)
    values = [per_class.get(c, pooled) for c in category_map.category_ids]
    logger.info("--score_thresh best_f1 from %s: %d classes their own (%.3f .. %.3f), %d the pooled %.3f", path,
                sum(c in per_class for c in category_map.category_ids), min(values), max(values),
                sum(c not in per_class for c in category_map.category_ids), pooled)
    return torch.tensor(values, dtype=torch.float32)


def build_dataset(args, transform):
    """(data set, names relative to the source root, COCO image ids or None, EXIF turn on (a labelled source: by the
    data's rule, docs/data_check.md), skipped files)."""
    from detlib.data import CocoDetection
    from detlib.data.images import DetectionImageFiles

    if args.data_format or (args.source.lower().endswith((".yaml", ".yml")) and os.path.isfile(args.source)):
        dataset, image_dir = labelled_split(args)
        ds = CocoDetection(image_dir, dataset, transform, train=False)
        ds.videos = []
        names = [os.path.relpath(r["path"], image_dir) for r in ds.records]
        return ds, names, [r["id"] for r in ds.records], True, list(ds.missing_images)
    if args.source.lower().endswith(".json") and os.path.isfile(args.source):
        if not args.images:
            stop("a COCO-json --source needs --images DIR (its image folder)", 1)
        # The evaluation's own data set: same order (by image id), same decoding, same sizes.
        ds = CocoDetection(args.images, args.source, transform, train=False)
        ds.videos = []
        names = [os.path.relpath(r["path"], args.images) for r in ds.records]
        return ds, names, [r["id"] for r in ds.records], True, list(ds.missing_images)
    root, paths, videos, skipped = list_media_files(args.source, exclude=tuple(os.path.join(args.output_dir, f)
                                                                                for f in PER_INPUT_FOLDERS))
    if videos and not av_available():
        if not paths:
            raise ValueError(f"{args.source}: {len(videos)} video(s) ({os.path.basename(videos[0])} ...) and no image: "
                             f"reading videos needs PyAV: {INSTALL_HINT}")
        logger.warning("%d videos left out: reading videos needs PyAV (%s)", len(videos), INSTALL_HINT)
        skipped, videos = skipped + [f"{v} (a video: {INSTALL_HINT} to predict it)" for v in videos], []
    if skipped and not paths and not videos:
        raise ValueError(f"{args.source}: nothing to predict: {skipped[0]}")
    ds = DetectionImageFiles(paths, transform, exif_transpose=not args.no_exif_transpose)
    ds.videos = [(v, os.path.relpath(v, root)) for v in videos]
    return ds, [os.path.relpath(p, root) for p in paths], None, not args.no_exif_transpose, skipped


def labelled_split(args) -> tuple[dict, str]:
    """(the normalised COCO dict, its image folder) of a VOC / YOLO source's --split (`detlib.data.formats`), checked as
    the training script checks it (json part; a YOLO set's image sizes come from the files).
    Raises:
        FileNotFoundError, ValueError: the layout's files are missing, or the check finds errors (the report)."""
    paths = data_dir_paths(args.source, args.data_format, None, args.split, need_train=False)
    report = DataReport()
    class_names = read_class_names(args.class_names) if args.class_names else None
    dataset = read_data_dir_splits(paths, {"train": None, "val": args.split}, report=report, progress=False,
                                   class_names=class_names)["val"]
    check = check_coco(dataset, None, split="val", report=report, check_images=False, source=paths["val_annotations"])
    if not report.ok:
        raise ValueError(f"{args.source}: {report.format()}")
    return check.dataset, paths["val_images"]


def write_outputs(args, ds, shards: list, skipped: list[str], names: dict[int, str]) -> list[dict]:
    """predictions.json (the images', by input index, then the videos' frame by frame), skipped.txt and the summary
    line (main process). `shards`: (per image, failed images, per video, failed videos) of each part."""
    merged: dict[int, list[dict]] = {}
    videos: dict[int, list[dict]] = {}
    failed: list[int] = []
    failed_videos: dict[int, str] = {}
    for part, fail, video_part, video_fail in shards:
        merged.update(part)
        videos.update(video_part)
        failed += fail
        failed_videos.update(video_fail)
    # in input order: each process lists only its own batches and videos (dealt round-robin)
    skipped = (skipped + [ds_path(ds, k) + " (unreadable)" for k in sorted(failed)]
               + [failed_videos[v] for v in sorted(failed_videos)])
    results = [r for k in sorted(merged) for r in merged[k]] + [r for k in sorted(videos) for r in videos[k]]
    write_json(results, os.path.join(args.output_dir, "predictions.json"))
    if args.format != "coco":  # the images' detections for a labelling tool, beside predictions.json
        from detlib.evaluation.annotation_formats import write_prediction_files

        tool_files = write_prediction_files(args.format, args.output_dir, tool_images(ds, sorted(merged)),
                                            [r for k in sorted(merged) for r in merged[k]], list(names), names,
                                            image_root_url=args.image_root_url, model_version=args.weights,
                                            save_conf=args.save_conf)
        logger.info("wrote %d %s file(s) in %s%s", len(tool_files), args.format, os.path.join(args.output_dir,
                    args.format), f" (the {len(videos)} videos' frames are in predictions.json only)" if videos else "")
    write_skipped(args.output_dir, skipped)
    per_class = Counter(names.get(r["category_id"], r["category_id"]) for r in results)
    frames = len({(r["file_name"], r["frame"]) for k in videos for r in videos[k]})
    if not args.no_images:  # the json keeps every detection >= --score_thresh (what AP needs), the pictures fewer
        logger.info("%d detections drawn in %s (score >= %g, --draw_thresh)", sum(r["score"] >= args.draw_thresh
                                                                                for r in results),
                    os.path.join(args.output_dir, "images"), args.draw_thresh)
    logger.info("wrote %s: %d images%s, %d detections with score >= %s: %s",  # the last line names the result
                os.path.join(args.output_dir, "predictions.json"), len(merged),
                f" and {len(videos)} videos ({frames} frames with detections)" if videos else "", len(results),
                args.score_thresh if args.score_thresh == "best_f1" else f"{args.score_thresh:g}",
                ", ".join(f"{k} {v}" for k, v in per_class.most_common()) or "none")
    return results


def tool_images(ds, indices: list[int]) -> list[dict]:
    """The predicted images as `write_prediction_files` takes them: image id, path below the source, output stem,
    and size in pixels as predicted (a labelled source's as evaluated, an image file's header as shown)."""
    from detlib.data import CocoDetection

    rel_names, out_names, coco_ids, exif_applied = ds.inputs
    out = []
    for k in indices:
        h, w = ds.records[k]["size"] if isinstance(ds, CocoDetection) else image_size_as_shown(ds.paths[k],
                                                                                               exif_applied)[::-1]
        out.append({"image_id": k if coco_ids is None else coco_ids[k], "file_name": rel_names[k],
                    "out_name": out_names[k], "width": w, "height": h})
    return out


def ignored_flags(args, coco_source: bool) -> list[str]:
    """One line per flag given that this run does not use (so it is said, not silently dropped)."""
    out = []
    if args.images and not coco_source:
        out.append(f"--images {args.images} is not used: it is the image folder of a COCO-json --source, and --source "
                   f"{args.source} is not one")
    if args.no_exif_transpose and (coco_source or args.data_format or args.source.lower().endswith((".yaml", ".yml"))):
        out.append("--no_exif_transpose changes nothing here: a labelled source is turned by the data's EXIF rule "
                   "(its boxes refer to the image as shown unless its json gives the stored size; docs/data_check.md)")
    if args.class_names and not (args.data_format or args.source.lower().endswith((".yaml", ".yml"))):
        out.append(f"--class_names {args.class_names} is not used: it is the class list of a VOC --source (--data_format "
                   "voc), and --source is not one")
    if args.no_images and args.draw_thresh is not None:
        out.append(f"--draw_thresh {args.draw_thresh} is not used: --no_images draws nothing")
    return out + tile_flag_notes(args)


def predict_video(args, path: str, name: str, out_name: str, detect, transform, names: dict[int, str],
                  quiet: bool) -> tuple[list[dict], str | None]:
    """A video's detections frame by frame: OUT/videos/<out_name>.mp4 with the detections >= --draw_thresh drawn,
    OUT/json/<out_name>.json (--save_json_per_image: one entry per frame, an image's json with `frame` and `time`).
    Returns (the COCO results of every frame, each with `file_name`, `frame` (from 0), `time` (seconds) and
    `image_id` = the frame index; None, or why the file was not read to its end: `VideoFrames.problem()`).
    Raises ValueError when the file yields no frame (then nothing is written for it)."""
    import torch

    from detlib.data import EvaluationCollate
    from detlib.data.images import detection_item
    from detlib.evaluation import boxes_from_coco, class_color, draw_detections

    frames = video_frames(path)
    writer = None if args.no_images else VideoWriter(os.path.join(args.output_dir, "videos", out_name + ".mp4"),
                                                     frames.fps)
    results, per_frame = [], []
    bar = tqdm(total=frames.declared, desc=f"video {name}", unit="frame", disable=quiet, leave=False)
    stream, collate = iter(frames), collate_images if args.tile else EvaluationCollate()  # frames share one shape
    try:
        while chunk := list(itertools.islice(stream, args.batch_size)):
            stop_if_signalled()
            batch = collate([detection_item(rgb, None if args.tile else transform, i) for i, _, rgb in chunk])
            for (i, t, rgb), res in zip(chunk, detect(batch)):
                for r in res:
                    r.update(file_name=name, frame=i, time=t)
                results += res
                per_frame.append({"file_name": name, "image_id": i, "frame": i, "time": t,
                                  "detections": [per_image_detection(r, names) for r in res]})
                if writer is not None:
                    shown = [r for r in res if r["score"] >= args.draw_thresh]
                    drawn = draw_detections(torch.from_numpy(rgb).permute(2, 0, 1), boxes_from_coco([r["bbox"] for r in shown]),
                                            [f"{names.get(r['category_id'], r['category_id'])} {r['score']:.2f}" for r in shown],
                                            [class_color(r["category_id"]) for r in shown])
                    writer.write(drawn.permute(1, 2, 0).numpy())
            bar.update(len(chunk))
    finally:
        bar.close()
        if writer is not None:
            writer.close()  # no frame: nothing was opened, no file
    problem = frames.problem()
    if not per_frame:
        raise ValueError(f"{path}: {problem}")
    if args.save_json_per_image:
        write_json(per_frame, os.path.join(args.output_dir, "json", out_name + ".json"), indent=1)
    logger.info("video %s: %d%s frames (%.1f fps), %d detections%s", name, len(per_frame),
                f" of {frames.declared}" if problem and frames.declared else "", frames.fps, len(results),
                "" if writer is None else f", drawn into {os.path.join(args.output_dir, 'videos', out_name + '.mp4')}")
    return results, problem


def per_image_detection(r: dict, names: dict[int, str]) -> dict:
    """A detection as the per-image json writes it."""
    return {"category_id": r["category_id"], "category_name": names.get(r["category_id"], str(r["category_id"])),
            "score": r["score"], "bbox": r["bbox"]}


def ds_path(ds, index: int) -> str:
    from detlib.data import CocoDetection

    return ds.records[index]["path"] if isinstance(ds, CocoDetection) else ds.paths[index]


def write_image_outputs(args, path: str, image_id: int, name: str, res: list[dict], exif_applied: bool,
                        names: dict[int, str], size: tuple[int, int] | None = None, out_name: str | None = None) -> None:
    """OUT/images/<out_name>.jpg (detections >= --draw_thresh on the upright image) and, with --save_json_per_image,
    OUT/json/<out_name>.json; written by the process that predicted the image. `out_name`: the input's own in
    `output_names` (default: `name` without its extension)."""
    from detlib.evaluation import (boxes_from_coco, class_color, draw_detections, drawing_scale, save_image,
                                   upright_image_and_boxes)

    stem = out_name or os.path.splitext(name)[0]
    if not args.no_images:
        shown = [r for r in res if r["score"] >= args.draw_thresh]
        image, boxes = upright_image_and_boxes(path, boxes_from_coco([r["bbox"] for r in shown]), exif_applied, size)
        labels = [f"{names.get(r['category_id'], r['category_id'])} {r['score']:.2f}" for r in shown]
        drawn = draw_detections(image, boxes, labels, [class_color(r["category_id"]) for r in shown],
                                scale=drawing_scale(*image.shape[-2:]))  # a thumbnail enlarged: legible labels
        save_image(drawn, os.path.join(args.output_dir, "images", stem + ".jpg"))
    if args.save_json_per_image:
        dets = [per_image_detection(r, names) for r in res]
        write_json({"file_name": name, "image_id": image_id, "detections": dets},
                   os.path.join(args.output_dir, "json", stem + ".json"), indent=1)


def main(argv=None):
    return predict(parse_args(argv))  # --help and a bad flag are answered before torch is imported


@no_grad
def predict(args):
    import torch
    from accelerate.utils import gather_object

    from detlib.data import CocoDetection, EvaluationBatchSampler, EvaluationCollate, build_transform, evaluation_shapes
    from detlib.deploy import ExportRunner, is_exported_model
    from detlib.evaluation import detect, detect_images
    from detlib.labels import CategoryMap, model_classes_in_data
    from detlib.retinanet import anchor_generator_from_config

    accelerator = start_prediction(args)  # CPU or GPU, any number of processes; OUTPUT_DIR/predict.log

    # ---- model (rebuilt from model_config.json, class names included)
    runner = None  # an export_retinanet.py file (FILE.onnx, FILE.xml ...): its runtime runs it, FILE.json describes it
    try:
        if is_exported_model(args.weights):
            runner = ExportRunner(args.weights, nms_thresh=args.nms_thresh, max_detections=args.detections_per_image)
            model, config = None, runner.meta
            category_map = CategoryMap(config["category_ids"], config["category_names"])
        else:
            model, config, category_map = load_retinanet(args.weights)
        image_size, max_size = retinanet_input_size(config, args.weights, args.image_size, args.max_size)
    except (FileNotFoundError, RuntimeError, KeyError) as e:
        stop(str(e), 1)
    if runner is not None and (refusal := runner.size_refusal(image_size, max_size)):  # at start, not at a batch
        stop(refusal, 1)
    logger.info("loaded %s (%s, fpn_channels %d, %d classes)", weights_path(args.weights), config["backbone"],
                config["fpn_channels"], len(category_map))
    coco_source = args.source.lower().endswith(".json") and os.path.isfile(args.source)
    notes = ignored_flags(args, coco_source)  # flags this run cannot honour: one line each
    if accelerator.is_main_process:
        for line in filter(None, notes):
            logger.warning("%s", line)
    if runner is None:
        model.to(accelerator.device)
    anchor_gen = anchor_generator_from_config(config)  # a converted model's anchor convention, else ours
    names = dict(zip(category_map.category_ids, category_map.names))
    try:
        thresholds = class_thresholds(args, category_map)
    except (FileNotFoundError, WeightsFileError) as e:
        stop(f"--score_thresh best_f1: {e}", 1)
    # decoding keeps scores above its threshold (torchvision's >); a best-F1 threshold keeps its own score too (the
    # F1 was measured with it): decode just below the lowest, then each class keeps its scores >= its threshold
    decode_thresh = float(thresholds.min()) if args.score_thresh != "best_f1" else float(
        torch.nextafter(thresholds.min(), torch.tensor(-1.0)))
    if runner is not None:
        runner.score_thresh = decode_thresh
        if line := runner.differs(decode_thresh, args.nms_thresh, args.detections_per_image):
            logger.warning("%s", line)
    if args.draw_thresh is None:
        args.draw_thresh = 0.0 if args.score_thresh == "best_f1" else 0.3

    # ---- data: the evaluation transform; this process's share of the batches
    try:
        ds, rel_names, coco_ids, exif_applied, skipped = build_dataset(args, build_transform(image_size, "none", max_size,
                                                                                     config.get("resize_mode", "antialias")))
    except (FileNotFoundError, ValueError) as e:
        stop(str(e), 1)
    # A json's category ids must mean the model's classes: matched by id and name (or by name, with the flag).
    to_output_id = category_map.to_category_ids(torch.arange(len(category_map)))  # label -> id written; -1: left out
    if isinstance(ds, CocoDetection) and "category_names" in config:
        try:
            ids, _ = model_classes_in_data(category_map, ds.category_map, args.categories_by_name,
                                           weights_path(args.weights), args.source)
        except ValueError as e:
            stop(str(e), 1)
        to_output_id = torch.tensor([-1 if i is None else i for i in ids])
        names = {i: n for i, n in zip(ids, category_map.names) if i is not None}
    elif "category_names" not in config:
        if isinstance(ds, CocoDetection) and ds.category_map.category_ids == category_map.category_ids:
            names = dict(zip(ds.category_map.category_ids, ds.category_map.names))
        elif accelerator.is_main_process:
            logger.warning("model_config.json has no category_names: classes are named by their category ids")
    # one per input: a.jpg, a.png, a.jpeg and a.mp4 never write over each other
    all_names = output_names(rel_names + [name for _, name in ds.videos])
    out_names, video_out_names = all_names[:len(rel_names)], all_names[len(rel_names):]
    ds.inputs = (rel_names, out_names, coco_ids, exif_applied)  # what --format's files name each image by
    if accelerator.is_main_process and not (args.no_images and not args.save_json_per_image):
        renamed = [(n, o) for n, o in zip(rel_names + [name for _, name in ds.videos], all_names)
                   if o != os.path.splitext(n)[0]]
        if renamed:
            logger.info("%d inputs share their name without extension with another: their outputs (<name>.jpg, "
                        "<name>.json) keep the whole name, e.g. %s", len(renamed),
                        ", ".join(f"{n} -> {o}" for n, o in renamed[:3]))
        held = earlier_outputs(args.output_dir, PER_INPUT_FOLDERS)
        if held:
            logger.warning("%s", held)
    # the evaluation's batches: images of one padded input shape, this process's share (EvaluationBatchSampler), so
    # that an image's detections are those of the image alone, as in the training script's evaluation
    resize_mode, workers = config.get("resize_mode", "antialias"), min(args.num_workers, os.cpu_count() or 1)
    if args.tile:  # each image whole on one process, at its native size, its tiles in batches of --batch_size
        Image.MAX_IMAGE_PIXELS = ds.max_image_pixels = None  # no decompression-bomb limit: tiling is for large images
        loader = tiled_loader(ds, accelerator.num_processes, accelerator.process_index, **worker_loader_kwargs(workers))
    else:
        shapes = (evaluation_shapes([r["size"] for r in ds.records], image_size, max_size, resize_mode)
                  if isinstance(ds, CocoDetection) else input_shapes(ds.paths, exif_applied, image_size, max_size,
                                                                     resize_mode))
        batches = EvaluationBatchSampler(shapes, args.batch_size, accelerator.num_processes, accelerator.process_index)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, collate_fn=EvaluationCollate(),
                                             **worker_loader_kwargs(workers))
    logger.info("%d images%s from %s at %d px (max %s)%s, %d process(es), batch size %d", len(ds),
                f" and {len(ds.videos)} videos" if ds.videos else "", args.source, image_size, max_size,
                f" in tiles of {args.tile} px overlapping {args.tile_overlap:g}" + " and whole" * args.tile_full
                if args.tile else "", accelerator.num_processes, args.batch_size)

    # ---- predict (detlib.evaluation.detect, as the training script's evaluation), each image's files written by
    # the process that predicted it
    index_of = {iid: k for k, iid in enumerate(coco_ids)} if coco_ids is not None else None  # image id -> input
    settings = (to_output_id, decode_thresh, args.nms_thresh, args.detections_per_image, thresholds)
    tiles = None
    if args.tile:  # the loader gives native images, cut in detect; windows at the scale the model was trained at
        sizes = [r["size"] for r in ds.records] if isinstance(ds, CocoDetection) else None  # a json's: windows counted
        tiles, line, mismatch = tile_settings({**config, "image_size": image_size, "max_size": max_size}, args.tile,
                                              args.tile_overlap, args.tile_full, args.batch_size, sizes,
                                              poll=stop_if_signalled)
        if accelerator.is_main_process:
            logger.info("%s", line)
            if mismatch:
                logger.warning("%s", mismatch)

    def write_image(image_id: int, res: list[dict]) -> None:
        k = image_id if index_of is None else index_of[image_id]
        for r in res if coco_ids is None else []:
            r["file_name"] = rel_names[k]
        size = ds.records[k]["size"] if isinstance(ds, CocoDetection) else None  # the json's, boxes refer to it
        write_image_outputs(args, ds_path(ds, k), image_id, rel_names[k], res, exif_applied, names, size,
                            out_name=out_names[k])

    if runner is not None:  # an exported model: its runtime runs and decodes each collated batch
        model, anchor_gen = runner, None
    found, failed = detect_images(model, anchor_gen, loader, accelerator, *settings, autocast=True,
                                  poll=stop_if_signalled, poll_every=1, on_image=write_image, desc="predict",
                                  tiles=tiles)

    # ---- videos, each on one process (video v on process v % n), frame by frame in batches of --batch_size
    def detect_frames(batch) -> list[list[dict]]:
        batch = {**batch, "device": accelerator.device} if tiles else {**batch, "images": batch["images"].to(accelerator.device)}
        return detect(model, anchor_gen, batch, *settings, accelerator.autocast, tiles)

    per_video, failed_videos = predict_videos(
        [path for path, _ in ds.videos], lambda v: predict_video(args, *ds.videos[v], video_out_names[v], detect_frames,
                                                                 ds.transform, names, not accelerator.is_local_main_process),
        accelerator.process_index, accelerator.num_processes)

    # ---- merge (the videos of every process) and write
    video_shards = gather_object([(per_video, failed_videos)])
    per_image = {(i if index_of is None else index_of[i]): res for i, res in found.items()}
    failed = [i if index_of is None else index_of[i] for i in failed]
    results = None
    if accelerator.is_main_process:
        results = write_outputs(args, ds, [(per_image, failed, {}, {})] + [({}, [], *v) for v in video_shards],
                                skipped, names)
    # a clean end of the process group: a rank that exits while another still tears down gloo can abort
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


if __name__ == "__main__":
    run_prediction(main)
