r"""Check a data set before training: the same checks and report as the training scripts run at start.

COCO-format detection data (json + image folder), optionally with its val set (categories checked against train):
    python scripts/check_dataset.py --annotations train.json --images DIR
    python scripts/check_dataset.py --annotations train.json --images DIR --val_annotations val.json --val_images DIR
Write the repaired json (numbers parsed, ids made valid, boxes derived / clipped / dropped as the report says):
    python scripts/check_dataset.py --annotations train.json --images DIR --write_fixed train_fixed.json

A data set root, COCO, Pascal VOC or YOLO (the layout detected: detlib/data/formats.py; train and val splits checked,
VOC and YOLO read as COCO: detlib/data/voc.py, detlib/data/yolo.py), and its splits as COCO json files:
    python scripts/check_dataset.py --data_dir VOCdevkit/VOC2012
    python scripts/check_dataset.py --data_dir datasets/my_yolo_set --write_fixed train.json --write_fixed_val val.json

An ImageFolder (class sub-folders), optionally with its val folder:
    python scripts/check_dataset.py --image_folder data/train --val_image_folder data/val

Prints the report (errors, repairs, warnings by kind, with counts and the first offending ids / files) and exits
with status 1 when there are errors (2 for a missing file or folder), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from detlib.data.formats import FORMATS, data_dir_paths, read_data_dir_splits  # noqa: E402
from detlib.data.voc import read_class_names  # noqa: E402
from detlib.datacheck.coco import check_coco, check_learnable, check_train_val  # noqa: E402
from detlib.datacheck.report import DEFAULT_MAX_IMAGE_PIXELS, DataReport  # noqa: E402
from detlib.engine.flags import ArgumentParser, HelpFormatter, int_at_least  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)  # escapes what the console cannot write
    g = p.add_argument_group("COCO-format data")
    g.add_argument("--annotations", metavar="FILE", help="COCO json (the training set when --val_annotations is given; "
                   "default: none, give it or --image_folder)")
    g.add_argument("--images", metavar="DIR", help="folder of the images' file_name (default: none; needed to check "
                   "the image files)")
    g.add_argument("--val_annotations", metavar="FILE", help="COCO json of the validation set, checked against "
                   "--annotations (default: none)")
    g.add_argument("--val_images", metavar="DIR", help="default: --images")
    g.add_argument("--data_dir", metavar="ROOT", help="a data set root instead: COCO (annotations/instances_{set}.json), "
                   "VOC (Annotations/, JPEGImages/, ImageSets/Main/{set}.txt) or YOLO (data.yaml); its train and val "
                   "splits are checked (default: none)")
    g.add_argument("--data_format", choices=FORMATS, help="the layout of --data_dir (default: detected)")
    g.add_argument("--train_set", help="--data_dir's training split (default train2017 for COCO, train for VOC / YOLO)")
    g.add_argument("--val_set", help="--data_dir's validation split (default val2017 for COCO, val for VOC / YOLO)")
    g.add_argument("--class_names", help="Pascal VOC: the classes in label order, a file of one name a line or names "
                   "separated by commas (default: every name the xml files use, near-identical spellings merged)")
    g.add_argument("--write_fixed", metavar="OUT", help="write the repaired --annotations json (--data_dir: its training "
                   "split as COCO json) here (not on errors; default: not written)")
    g.add_argument("--write_fixed_val", metavar="OUT", help="write the repaired --val_annotations json (--data_dir: its "
                   "val split) here (default: not written)")
    g.add_argument("--skip_image_check", action="store_true", help="check the json only, not the image files")
    g.add_argument("--max_image_pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="images with more pixels are errors (PIL's decompression-bomb limit; 0: no limit)")
    g.add_argument("--num_workers", type=int, help="processes reading image headers (default: CPU count, at most 8)")
    g.add_argument("--detections_per_image", type=int_at_least(1), default=100, help="the model's detections per image "
                   "(train_retinanet.py's flag): val images with more boxes are named")
    g = p.add_argument_group("ImageFolder data")
    g.add_argument("--image_folder", metavar="DIR", help="ImageFolder root: DIR/<class>/<image> (default: none, give "
                   "it or --annotations)")
    g.add_argument("--val_image_folder", metavar="DIR", help="validation ImageFolder with the same class folders "
                   "(default: none)")
    g.add_argument("--verify", default="header", choices=["full", "header", "none"],
                   help="full decode (finds truncated files), header only, or no file check")
    g = p.add_argument_group("both")
    g.add_argument("--strict", action="store_true", help="repairs count as errors")
    g.add_argument("--report_json", metavar="OUT", help="also write the report as json, as data_report.json (default: "
                   "not written)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if sum(map(bool, (args.annotations, args.data_dir, args.image_folder))) != 1:
        p.error("give --annotations (COCO json), --data_dir (a COCO, VOC or YOLO root) or --image_folder (ImageFolder)")
    if args.annotations and not args.images and not args.skip_image_check:
        p.error("--images DIR is needed to check the image files (or pass --skip_image_check)")
    # each output file its own, never an input: the repaired val json must not replace the train one, nor the original
    files = [(f"--{k}", v) for k in ("annotations", "val_annotations", "write_fixed", "write_fixed_val", "report_json")
             if (v := getattr(args, k))]
    for i, (flag, path) in enumerate(files):
        for other, earlier in files[:i]:
            if os.path.realpath(path) == os.path.realpath(earlier) and flag.startswith(("--write", "--report")):
                p.error(f"{flag} {path} is the file of {other} too: one would replace the other; give each its own file")
    return args


def write_fixed(dataset: dict, path: str) -> None:
    """The normalised json, without the loader's private keys (leading underscore)."""
    out = dict(dataset)
    out["images"] = [{k: v for k, v in im.items() if not k.startswith("_")} for im in dataset["images"]]
    with open(path, "w") as f:
        json.dump(out, f)


def check_coco_files(args) -> tuple[DataReport, list[str]]:
    report = DataReport(args.strict)
    kw = dict(report=report, check_images=not args.skip_image_check, max_image_pixels=args.max_image_pixels or None,
              num_workers=args.num_workers, progress=sys.stderr.isatty())
    notes = []
    if args.data_dir:
        train, val, images = check_data_dir(args, report, kw)
        notes.append(f"{args.data_dir}: {args.data_format} data set; train images in {images['train']}, val images in "
                     f"{images['val']} (the file_names of the COCO json --write_fixed writes)")
    else:
        train = check_coco(args.annotations, args.images, split="train" if args.val_annotations else "data", **kw)
        val = None
        if args.val_annotations:
            val = check_coco(args.val_annotations, args.val_images or args.images, split="val", **kw)
            check_train_val(train, val, args.images, args.val_images or args.images)
    if val is not None:
        check_learnable(train, val, max_detections=args.detections_per_image)
    for check, out in ((train, args.write_fixed), (val, args.write_fixed_val)):
        if out and check is not None:
            if report.ok:
                write_fixed(check.dataset, out)
                notes.append(f"wrote the repaired json of {check.source} to {out}")
            else:
                notes.append(f"not written: {out} (fix the errors first)")
    return report, notes


def check_data_dir(args, report: DataReport, kw: dict):
    """The train and val splits of --data_dir (VOC and YOLO converted to COCO dicts first, their own faults in
    `report`), checked as the training script checks them. Returns (train CocoCheck, val CocoCheck, image folders)."""
    import tempfile

    paths = data_dir_paths(args.data_dir, args.data_format, args.train_set, args.val_set)
    args.data_format = paths.pop("format")
    with tempfile.TemporaryDirectory() as tmp:  # YOLO's sizes are read from the headers: once, for both passes
        cache = os.path.join(tmp, "image_header_cache.json")
        dicts = read_data_dir_splits({**paths, "format": args.data_format}, {"train": args.train_set, "val": args.val_set},
                                     report=report, progress=kw["progress"], cache_file=cache,
                                     class_names=read_class_names(args.class_names) if args.class_names else None)
        checks = [check_coco(dicts.get(s, paths[f"{s}_annotations"]), paths[f"{s}_images"], split=s,
                             source=paths[f"{s}_annotations"], cache_file=cache, **kw) for s in ("train", "val")]
    check_train_val(*checks, paths["train_images"], paths["val_images"])
    return checks[0], checks[1], {s: paths[f"{s}_images"] for s in ("train", "val")}


def check_folders(args) -> DataReport:
    from detlib.data.imagefolder import scan_image_folder
    from detlib.datacheck.imagefolder import check_folder_scans

    scans = {"train": scan_image_folder(args.image_folder, verify=args.verify)}
    if args.val_image_folder:
        scans["val"] = scan_image_folder(args.val_image_folder, verify=args.verify)
    return check_folder_scans(scans, strict=args.strict)[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    notes = []
    try:
        if args.annotations or args.data_dir:
            report, notes = check_coco_files(args)
        else:
            report = check_folders(args)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a data set root that does not say what its layout needs (a YOLO yaml without names)
        print(f"error: {e}", file=sys.stderr)
        return 1
    title = "image folder check" if args.image_folder else f"{(args.data_format or 'coco').upper()} data check"
    print(report.format(title, notes))
    if args.report_json:
        report.write(args.report_json)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
