"""Review a run's suspected label errors in a labelling tool: the top entries of RUN_DIR/label_errors.json (the
final evaluation's, ranked by the confidence that the label is wrong) as review tasks for Label Studio, CVAT or
FiftyOne, one task per image, each showing the image's current boxes and the suggested correction of every entry
on it (wrong_class, badly_placed, missing_box) with its confidence. The reviewer keeps the right box of each pair
and deletes the other; the tool's export is then the corrected annotation of those images (docs/predict_export.md,
"Fixing labels with Label Studio / CVAT / FiftyOne").

    python scripts/review_label_errors.py outputs/retinanet_builtin --format labelstudio --top 50 \
        --image_root_url "/data/local-files/?d=shapes"
    python scripts/review_label_errors.py outputs/retinanet_builtin --format cvat --top 50
    python scripts/review_label_errors.py outputs/retinanet_builtin --format fiftyone --top 50   # pip install fiftyone

The annotations and images are the run's val set (its config.yaml: a COCO json, a VOC or YOLO set, the built-in
data), read and checked as the run's evaluation read them, so the entries' image and annotation ids name the same
images and boxes; `--annotations` / `--images` name a COCO json and its folder instead (a data set that moved).
Writes OUT/<format>/ (OUT: --output_dir, default RUN_DIR/review): Label Studio's tasks.json and label_config.xml,
CVAT's annotations.xml (CVAT for images 1.1), FiftyOne's dataset folder (FiftyOneDataset, the images linked, not
copied). Exit 0 when written; 1 with one line naming the file or flag otherwise.
"""

from __future__ import annotations

import argparse
import os

from detlib.engine import HelpFormatter, int_at_least

# detlib.evaluation.annotation_formats.REVIEW_FORMATS, written out so that --help imports no torch
REVIEW_FORMATS = ("labelstudio", "cvat", "fiftyone")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("run_dir", help="a training run's folder (its label_errors.json and config.yaml)")
    p.add_argument("--format", choices=REVIEW_FORMATS, required=True, help="the tool the tasks are for")
    p.add_argument("--top", type=int_at_least(1), default=100, help="the entries reviewed, best-ranked first (several "
                   "on one image make one task)")
    p.add_argument("--output_dir", help="where OUT/<format>/ is written (default: RUN_DIR/review)")
    p.add_argument("--image_root_url", help="--format labelstudio: the URL the tasks name each image by, followed by "
                   "its file_name (default: none, the file_name alone)")
    p.add_argument("--annotations", help="the COCO json of the evaluated images (default: the run's val set, from its "
                   "config.yaml)")
    p.add_argument("--images", help="the image folder of --annotations (default: the run's)")
    return p


def val_set(args) -> tuple[dict, str]:
    """(the normalised COCO dict of the run's evaluated images, their folder): `--annotations`, else the run's val
    set from config.yaml (COCO json, VOC or YOLO set), read and checked (json part) as the run read it.
    Raises:
        FileNotFoundError: no config.yaml, or a file it names is gone (say --annotations / --images).
        ValueError: the data check finds errors."""
    import yaml

    from detlib.data.formats import read_data_dir_splits
    from detlib.data.voc import read_class_names
    from detlib.datacheck import DataReport, check_coco

    if args.annotations:
        annotations, images, fmt, cfg = args.annotations, args.images, "coco", {}
    else:
        path = os.path.join(args.run_dir, "config.yaml")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: is {args.run_dir} a training run's folder? (or give "
                                    "--annotations and --images)")
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
        annotations, images = cfg.get("data_val_annotations"), args.images or cfg.get("data_val_images")
        fmt = cfg.get("data_format") or "coco"
    if not annotations or not os.path.exists(annotations):
        raise FileNotFoundError(f"the run's val annotations {annotations} are not there (give --annotations and "
                                "--images)")
    if not images or not os.path.isdir(images):
        raise FileNotFoundError(f"image folder {images} not found (give --images)")
    report = DataReport()
    source = annotations
    if fmt != "coco":  # the run's VOC / YOLO split, converted as its data check converted it
        class_names = cfg.get("class_names")
        names = read_class_names(class_names) if isinstance(class_names, str) else class_names
        annotations = read_data_dir_splits({"format": fmt, "val_annotations": annotations, "val_images": images},
                                           {"train": None, "val": cfg.get("val_set")}, report=report, progress=False,
                                           class_names=names)["val"]
    check = check_coco(annotations, None, split="val", report=report, check_images=False, source=source)
    if check.dataset is None or not report.ok:
        raise ValueError(f"{source}: {report.format()}")
    return check.dataset, images


def main(argv=None) -> list[str]:
    args = build_parser().parse_args(argv)
    from detlib.engine import stop
    from detlib.evaluation.annotation_formats import write_review_files
    from detlib.evaluation.label_errors import LABEL_ERRORS_FILE, load_label_errors
    from detlib.files import JsonFileError

    path = os.path.join(args.run_dir, LABEL_ERRORS_FILE)
    try:
        errors = load_label_errors(path)
    except FileNotFoundError:
        stop(f"{path} not found: a run writes it at its final evaluation (scripts/evaluate_predictions.py --plots DIR "
             "writes one for a predictions file)", 1)
    except (JsonFileError, KeyError, TypeError) as e:
        stop(f"{path} is not a label_errors.json ({e})", 1)
    try:
        dataset, image_dir = val_set(args)
    except (FileNotFoundError, ValueError) as e:
        stop(str(e), 1)
    # the entries name the json's own image ids (original_id where the check renumbered one)
    images = [{"id": im.get("original_id", im["id"]), "file_name": im["file_name"],
               "path": os.path.join(image_dir, im["file_name"]), "width": im["width"], "height": im["height"]}
              for im in dataset["images"]]
    key = {im["id"]: im.get("original_id", im["id"]) for im in dataset["images"]}
    annotations = [dict(a, image_id=key[a["image_id"]]) for a in dataset["annotations"] if not a.get("iscrowd")]
    category_ids = [c["id"] for c in dataset["categories"]]
    names = {c["id"]: c["name"] for c in dataset["categories"]}
    out = args.output_dir or os.path.join(args.run_dir, "review")
    try:
        written = write_review_files(args.format, out, images, annotations, errors, category_ids, names, top=args.top,
                                     image_root_url=args.image_root_url)
    except ImportError as e:
        stop(str(e), 1)
    except (ValueError, KeyError) as e:
        stop(f"{path}: {e}", 1)
    reviewed = min(args.top, len(errors))
    tasks = len({e["image_id"] for e in sorted(errors, key=lambda e: e["rank"])[:args.top]})
    likely = sum(e["confidence"] >= 0.5 for e in sorted(errors, key=lambda e: e["rank"])[:args.top])
    print(f"wrote {', '.join(written)}: {tasks} tasks (images) for the top {reviewed} of the {len(errors)} entries of "
          f"{path} ({likely} with confidence >= 0.5)")
    return written


if __name__ == "__main__":
    main()
