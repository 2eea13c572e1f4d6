r"""Train and evaluate RetinaNet (ResNet-50 + FPN by default, any timm backbone) with HuggingFace Accelerate.

Built-in synthetic data, CPU (no download; the defaults switch to a small model and image size):
    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/train_retinanet.py

COCO 2017 on 4 GPUs x 15 images, the default recipe (AdamW 1e-4, plateau schedule, 600 px longer side, 12 epochs), from
timm's resnet50.a1_in1k weights (README "Pretrained weights" says how to save the file):
    accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/train_retinanet.py --data_dir /data/coco \
        --backbone resnet50.a1_in1k --backbone_weights resnet50.a1_in1k.safetensors --output_dir outputs/r50_600

The SGD 1x recipe at 800 / 1333 (8 GPUs x 2 images; docs/recipes.md):
    accelerate launch --config_file accelerate_configs/8gpu.yaml scripts/train_retinanet.py --data_dir /data/coco \
        --backbone resnet50.a1_in1k --backbone_weights resnet50.a1_in1k.safetensors --image_size 800 --max_size 1333 \
        --per_device_batch_size 2 --optimizer sgd --lr 0.01 --lr_scheduler multistep --lr_steps 8 11 --warmup_steps 500 \
        --augmentation flip

Any COCO-format data set; a Pascal VOC or a YOLO (ultralytics) one by its root (the layout is detected;
detlib/data/formats.py says how they are read):
    ... scripts/train_retinanet.py --train_images DIR --train_annotations train.json --val_images DIR --val_annotations val.json
    ... scripts/train_retinanet.py --data_dir VOCdevkit/VOC2012      # Annotations/, JPEGImages/, ImageSets/Main/{train,val}.txt
    ... scripts/train_retinanet.py --data_dir datasets/my_yolo_set   # data.yaml with names, train: and val:

Small objects in large images: training on tiles cut at native resolution (docs/small_objects.md), here the built-in
small-object set (8-32 px shapes on 768-1280 px images):
    ... scripts/train_retinanet.py --builtin small_objects --train_tile 128

2 CPU processes (gloo DDP), resume, evaluation only:
    OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_retinanet.py ...
    ... scripts/train_retinanet.py --output_dir outputs/r50_600 --resume_from_checkpoint latest
    ... scripts/train_retinanet.py --data_dir /data/coco --evaluate_only outputs/r50_600/best

Torchvision's COCO weights (converted by scripts/convert_weights.py), evaluated as they are, or fine-tuned:
    ... scripts/train_retinanet.py --data_dir /data/coco --evaluate_only weights/tv_retinanet
    ... scripts/train_retinanet.py --train_images DIR --train_annotations 3class.json ... --init_from weights/tv_retinanet

Long runs (a checkpoint every 500 steps; SIGTERM / SIGUSR1 / Ctrl-C write one and exit 75; SLURM: slurm/):
    ... scripts/train_retinanet.py --data_dir /data/coco --checkpoint_steps 500 --resume_from_checkpoint latest

The same run again, from the config.yaml a run writes (flags given after it override it):
    ... scripts/train_retinanet.py --config outputs/r50_600/config.yaml --output_dir outputs/r50_600_again

Defaults that depend on the data (built-in: no --data_dir / --train_images / --val_images given) and the optimizer
(DATA_DEFAULTS in the script):
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
import time

from detlib.data import (AUGMENTATIONS, DEFAULT_MAX_IMAGE_PIXELS, add_format_flags, add_sampler_flags,
                         add_train_tile_flags, check_coco_for_training, data_dir_paths, loader_settings,
                         make_small_objects_coco, make_synthetic_coco, read_class_names, train_tile_conflict)
from detlib.argtypes import float_range, int_at_least, path
from detlib.engine import (RunStop, data_defaults_table, format_given, not_used_evaluating, parse_with_config,
                           resolve_data_defaults, run_argument_parser, show_data_defaults, stop, stop_together)
from detlib.files import write_json
from detlib.hub import add_hub_flags, check_push, local_weights, push_best
from detlib.retinanet import BOX_LOSSES, HEAD_NORMS
from detlib.schedules import step_scheduler
from detlib.tiling import add_tile_flags, tile_flag_error, tile_settings, tiled_loader
from detlib.lazy import no_grad
from detlib.weights import (WeightsFileError, load_model_weights, load_state_dict_file, model_config_file,
                            read_model_config, require_model_keys, weights_path)

logger = logging.getLogger("train_retinanet")

# Defaults that depend on the data, {flag: (built-in data, real data)}: the full recipe for real data, a CPU-sized one
# for the built-in set, from scratch on 2 CPU cores in minutes (docs/recipes.md run log; trials in issue 17): 6 epochs
# of 75 steps reach val AP50 0.94. In the trials the GroupNorm heads (BUILTIN_HEAD_NORM) reached AP50 0.93 in 375
# steps, the paper's heads (no norm) 0.70 in 750; batch 8 gives twice the steps of 16 for 1.1-1.3x the time per image;
# AdamW 3e-3 learned far slower than 1e-3; flips are enough (the AP on training images equals the val AP: no
# overfitting for crops to hold off). SGD's 0.01 is the COCO 1x recipe's LR for 16 images per step (8 GPUs x 2;
# docs/recipes.md recipe table).
DATA_DEFAULTS = {
    "backbone": ("resnet18", "resnet50"),
    "image_size": (128, 600),
    "fpn_channels": (64, 256),
    "augmentation": ("flip", "flip_crop_translate"),
    "epochs": (6, 12),
    "per_device_batch_size": (8, 15),
    "lr": {"adamw": (1e-3, 1e-4), "sgd": (0.01, 0.01)},
    "weight_decay": {"adamw": (0.01, 0.01), "sgd": (1e-4, 1e-4)},  # AdamW's is torch's default
    # the AdamW recipe's clip 0.1; SGD trains unclipped as in torchvision's and detectron2's recipes (a norm of 0.1 would
    # scale down every SGD step: gradient norms start at 0.15-0.26 on a small model)
    "max_grad_norm": {"adamw": (0.1, 0.1), "sgd": (0.0, 0.0)},
    "lr_scheduler": ("cosine", "plateau"),
    "warmup_steps": (100, 500),
    # a folder each, so a real-data run after a built-in one is not refused as "a folder of another run"
    "output_dir": ("outputs/retinanet_builtin", "outputs/retinanet"),
    # the built-in run keeps what a resume needs (one checkpoint: 0.14 GB), a long real run one to fall back on
    "checkpoint_total_limit": (1, 2),
}
__doc__ += data_defaults_table(DATA_DEFAULTS)  # the one table, in the docstring and so in --help
# The built-in run's heads: GroupNorm (torchvision's v2 head), which learns the shapes several times faster from
# scratch than the paper's head (no norm); not a flag here: an --init_from / --evaluate_only model keeps its own.
BUILTIN_HEAD_NORM = "gn"
# What the built-in run with these defaults gives (docs/recipes.md run log), for its start line and its stop line.
BUILTIN_RUN = {"shapes": "with the defaults about 3.5 min on 2 CPU cores, about 1 min on a GPU, to val AP50 above 0.9",
               "small_objects": "with --train_tile 128 --tile 128 --epochs 3 about 5 min on 2 CPU cores to tiled val AP50 0.11 (docs/small_objects.md)"}
# This script's defaults of the run machinery's flags (detlib.engine.flags).
RUN_DEFAULTS = {"project": "detlib-retinanet", "eval_interval": 5,
                "per_device_eval_batch_size": 8, "log_interval": 20, "checkpoint_total_limit": None}  # None: DATA_DEFAULTS
# What a resume cannot change: the model and its classes, the optimizer and schedule with their settings (their state
# brings them back), the loss normaliser's state, the samples per step and the data position (process count, batch,
# accumulation, the sampler that sets an epoch's draws), fp16's GradScaler.
FIXED_ON_RESUME = ("backbone", "fpn_channels", "head_norm", "num_classes", "freeze_at", "backbone_bn", "optimizer", "lr",
                   "weight_decay", "wd_norm", "momentum", "lr_scheduler", "plateau_patience", "loss_normalizer",
                   "num_processes", "per_device_batch_size", "gradient_accumulation_steps", "mixed_precision",
                   "sampler", "repeat_threshold", "anchor_sizes", "builtin", "train_tile", "tile_min_visible", "empty_tile_rate")
# The built-in sets (detlib.data.builtin) and the anchors of the small-object one: its 8-32 px objects would get one
# low-IoU match each from the 32-512 px defaults.
BUILTIN_SETS = {"shapes": make_synthetic_coco, "small_objects": make_small_objects_coco}
SMALL_OBJECT_ANCHORS = [8, 16, 32, 64, 128]
WARMUP_START = 0.001  # the warm-up's first LR factor: Detectron's 1/1000
# What main writes to config.yaml beside the flags; --config reads them as a record and does not apply them.
RECORD_KEYS = ("num_classes", "resize_mode", "data_train_images", "data_train_annotations", "data_val_images",
               "data_val_annotations", "not_used")


def build_parser() -> argparse.ArgumentParser:
    p, groups = run_argument_parser(__doc__, **RUN_DEFAULTS)  # --config, epochs, batch, checkpoints, logging
    g = groups["data"]
    add_format_flags(g)  # --data_dir of a COCO, VOC or YOLO set and its splits (detlib.data.formats)
    g.add_argument("--train_images", type=path, help="image folder of any COCO-format training set (default: none)")
    g.add_argument("--train_annotations", type=path, help="COCO json of the training set (default: none)")
    g.add_argument("--val_images", type=path, help="image folder of the validation set (default: none)")
    g.add_argument("--val_annotations", type=path, help="COCO json of the validation set (default: none)")
    g.add_argument("--image_size", type=int_at_least(32), help="longer image side in pixels; with --max_size, the "
                   "shorter side")
    g.add_argument("--max_size", type=int_at_least(32), help="resize the shorter side to --image_size, the longer to at "
                   "most this (800 / 1333 is the standard COCO setting; default: none, the longer side is --image_size)")
    g.add_argument("--train_scales", type=int_at_least(32), nargs="+", help="multi-scale training: each training image "
                   "is resized to one of these sizes (the shorter side with --max_size, e.g. 640 672 704 736 768 800 "
                   "with --max_size 1333 as detectron2's 1x); evaluation uses --image_size (default: none, --image_size only)")
    g.add_argument("--augmentation", choices=AUGMENTATIONS, help="training augmentation (detlib.data.transforms): none, "
                   "flip, or flip plus random crop and translation")
    g.add_argument("--builtin", default="shapes", choices=BUILTIN_SETS, help="the built-in set trained on without data "
                   "flags: shapes (128 px images) or small_objects (8-32 px objects on 768-1280 px images; anchors of "
                   "8-128 px; train it with --train_tile) (default: %(default)s)")
    add_train_tile_flags(g)  # --train_tile SIZE and its tiles' rules (detlib.data.train_tiles)
    g.add_argument("--include_crowd", action="store_true", help="train on iscrowd boxes instead of ignoring their anchors")
    g.add_argument("--aspect_grouping", action=argparse.BooleanOptionalAction, default=True,
                   help="training batches of only landscape or only portrait images (default: on)")
    add_sampler_flags(g, "repeat_factor")  # --sampler, --repeat_threshold (detlib.data.balanced)
    g.add_argument("--filter_empty", action=argparse.BooleanOptionalAction, default=True,
                   help="leave out training images with no usable box, as torchvision and detectron2 do (default: on)")
    g.add_argument("--skip_image_check", action="store_true", help="check the json only, not the image files' headers")
    g.add_argument("--max_image_pixels", type=int_at_least(0), default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="images with more pixels stop the run at start (PIL's decompression-bomb limit); raise it "
                        "for genuine large images (0: no limit)")
    g.add_argument("--strict_data", action="store_true", help="data repairs (parsed strings, renumbered ids, dropped "
                   "boxes, ...) stop the run like errors")

    g = groups["model"]
    g.add_argument("--backbone", help="timm model name")
    g.add_argument("--backbone_weights", type=path, help="local backbone weights: .safetensors or torch state dict (default: none, "
                   "from scratch)")
    g.add_argument("--backbone_weights_ema", action=argparse.BooleanOptionalAction, default=True,
                   help="from a training checkpoint with an EMA copy (timm's train.py: state_dict_ema), take it, as "
                        "timm's load_checkpoint does; --no-backbone_weights_ema: its raw state_dict (the load line "
                        "says which)")
    g.add_argument("--pretrained_backbone", action="store_true", help="timm's own pretrained download (online)")
    g.add_argument("--init_from", type=path, help="start from a detector's weights (a converted torchvision model or one of ours: "
                   "a run folder, best/, last/ or a weights file): every tensor whose name and shape fit; the class "
                   "output is re-initialised when the class count differs. Its model_config.json's backbone, width, "
                   "P6 input, anchors and resize are used unless --backbone / --fpn_channels / --image_size say otherwise "
                   "(default: none)")
    g.add_argument("--categories_by_name", action="store_true", help="--evaluate_only / --init_from a model whose "
                   "category ids name other classes than this data set's: match the classes by name (default: refused)")
    g.add_argument("--freeze_at", type=int, choices=range(6), metavar="{0..5}", help="freeze what the backbone computes "
                   "before stride 4 (1: the stem), 8 (2: the stem and first stage, detectron2's FREEZE_AT 2), 16 (3), "
                   "32 (4), or all of it (5), on every timm family; frozen parts' BatchNorm is frozen too (default: 2 "
                   "with pretrained weights, 0 from scratch)")
    g.add_argument("--backbone_bn", default="auto", choices=["auto", "frozen", "train"],
                   help="backbone BatchNorm: frozen (the standard setting with pretrained weights), train, or "
                        "auto = frozen when pretrained weights are loaded, trained when training from scratch "
                        "(default: %(default)s)")
    g.add_argument("--fpn_channels", type=int_at_least(1), help="FPN and head width")
    g.add_argument("--anchor_sizes", type=float_range(0, lo_open=True), nargs=5, metavar="PX", help="base anchor "
                   "size of P3..P7 in px, times 2^0, 2^(1/3), 2^(2/3) (default: 32 64 128 256 512; 8 16 32 64 128 on "
                   "--builtin small_objects; or the --init_from model's)")
    g.add_argument("--head_norm", choices=HEAD_NORMS, help="norm of the heads' hidden convs: none (the paper) or gn, "
                   "GroupNorm(32) after each conv, which then has no bias (torchvision's v2 RetinaNet; needs "
                   "--fpn_channels divisible by 32) (default: none; gn on the built-in data; or the --init_from / "
                   "--evaluate_only model's)")
    g.add_argument("--sync_bn", action="store_true", help="SyncBatchNorm for trainable BN layers (multi-GPU)")
    g.add_argument("--channels_last", action="store_true", help="channels_last memory format for the model (for a GPU "
                   "with bf16 / fp16; on a 2-core CPU it made the train step 1.1x slower: docs/benchmarks.md)")

    g = groups["optimization"]
    g.add_argument("--lr", type=float_range(0), help="peak learning rate; scale it with the batch (SGD's 0.01 is the "
                   "COCO 1x recipe's for 16 images per step)")
    g.add_argument("--weight_decay", type=float_range(0), help="weight decay, not on norm weights and biases "
                   "unless --wd_norm")
    g.add_argument("--wd_norm", action="store_true", help="weight decay on norm weights and biases too")
    g.add_argument("--lr_scheduler", choices=["plateau", "multistep", "cosine", "constant"],
                   help="plateau: 10x lower when the epoch's mean loss stops falling; multistep: 10x lower at "
                        "--lr_steps; cosine: down to 0; constant")
    g.add_argument("--plateau_patience", type=int_at_least(0), default=3, help="plateau: epochs without a lower mean "
                   "training loss tolerated before the LR drops 10x")
    g.add_argument("--lr_steps", type=int_at_least(1), nargs="+", default=[8, 11], help="multistep: epochs where the LR drops 10x")
    g.add_argument("--warmup_steps", type=int_at_least(0), help="optimizer steps of linear warm-up from "
                   "0.001x to the LR, for multistep, cosine and constant (plateau has none)")
    g.add_argument("--box_loss", default="l1", choices=BOX_LOSSES, help="regression loss of the box deltas")
    g.add_argument("--loss_normalizer", default="batch", choices=["batch", "ema"],
                   help="divide the losses by the step's positive anchors (every micro-batch and process: one batch), "
                        "or by their running average over steps (detectron2; steadier at 2 images per GPU) (default: "
                        "%(default)s)")

    g = groups["evaluation"]
    g.add_argument("--score_thresh", type=float_range(0, 1), default=0.05, help="lowest score kept in the evaluation")
    g.add_argument("--nms_thresh", type=float_range(0, 1, lo_open=True), default=0.5, help="IoU of class-wise NMS")
    g.add_argument("--detections_per_image", type=int_at_least(1), default=100, help="detections kept per image")
    add_tile_flags(g)  # tiled evaluation (detlib.tiling): each val image cut at its native size, boxes merged
    g.add_argument("--coco_eval_backend", default="auto", choices=["auto", "hotcoco", "pycocotools", "faster"],
                   help="COCOeval implementation: hotcoco (the 12 stats equal pycocotools' to the bit, at 0.02 of its "
                        "time), pycocotools, faster-coco-eval; auto: the first installed of these")
    g.add_argument("--area_ranges", type=float_range(0), nargs="+", metavar="PX", help="edges of the small / medium / "
                   "large size ranges of APs..ARl in px of the box side, sqrt(area), not px^2 of the area "
                   "(pycocotools' areaRng 0 1024 9216 is 0 32 96 here): 3 or 4 increasing numbers, e.g. 0 16 32 96 for "
                   "tiny objects (default: COCO's 0 32 96)")
    g.add_argument("--eval_bootstrap", type=int_at_least(0), default=100, help="image resamples of the 95%% intervals "
                   "of AP and AP50 in each evaluation (0: none; the cost grows with the val set: 36 s at 5,000 images)")
    g.add_argument("--num_log_images", type=int_at_least(0), default=16,
                   help="val images drawn with their detections at every evaluation, the same ones each time, under "
                        "OUTPUT_DIR/samples/ and to the trackers (default: %(default)s)")
    add_hub_flags(groups["checkpointing"])  # --push_to_hub of best/ at the end (detlib.hub)
    show_data_defaults(p, DATA_DEFAULTS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The flags of `argv` (default: sys.argv[1:]) over those of --config; data-dependent ones stay None (main)."""
    p = build_parser()
    args = parse_with_config(p, argv, RECORD_KEYS)
    if args.builtin != "shapes" and args.output_dir is None and not (args.data_dir or args.train_images or args.val_images):
        args.output_dir = f"outputs/retinanet_{args.builtin}"  # not the shapes run's folder
    if train_tile_conflict(args):
        p.error(train_tile_conflict(args))
    if tile_flag_error(args):
        p.error(tile_flag_error(args))
    if args.max_size is not None and args.image_size is not None and args.max_size < args.image_size:
        p.error(f"--max_size {args.max_size} is smaller than --image_size {args.image_size} (the shorter side)")
    return args


def resolve_data(args) -> dict[str, str]:
    """The four data paths, from --data_dir, the explicit flags, or the built-in synthetic set. Sets
    `args.data_format` (detected from --data_dir when not given; "coco" otherwise): for VOC and YOLO the
    annotation paths are the split lists / the yaml, converted by build_dataloaders."""
    explicit = [args.train_images, args.train_annotations, args.val_images, args.val_annotations]
    if args.data_dir:
        found = data_dir_paths(args.data_dir, args.data_format, args.train_set, args.val_set,
                               need_train=not args.evaluate_only)
        args.data_format = found.pop("format")
        return found
    if args.data_format not in (None, "coco"):
        raise ValueError(f"--data_format {args.data_format} reads a data set root: give it as --data_dir")
    args.data_format = "coco"
    if any(explicit):
        if args.evaluate_only and args.val_images and args.val_annotations:
            return {"train_images": None, "train_annotations": None, "val_images": args.val_images, "val_annotations": args.val_annotations}
        if not all(explicit):
            raise ValueError("give all four of --train_images --train_annotations --val_images --val_annotations "
                             "(or --data_dir)")
        return dict(zip(["train_images", "train_annotations", "val_images", "val_annotations"], explicit))
    return BUILTIN_SETS[args.builtin]()


def build_dataloaders(args, paths: dict[str, str]):
    """The training and validation data sets and loaders (unprepared), on the json files as the data check
    repaired them (it stops the run on errors; report in output_dir/data_report.json). The val loader holds this
    process's batches already (`EvaluationBatchSampler`): it is not to be passed to `accelerator.prepare`."""
    import torch

    from detlib.data import (CocoDetection, EvaluationBatchSampler, EvaluationCollate, GroupedBatchSampler,
                             TrainingTiles, aspect_groups, build_transform, collate_detection, evaluation_shapes,
                             training_sampler)
    from detlib.labels import evaluated_classes

    from accelerate import PartialState

    train_json, val_json = check_coco_for_training(paths, args.output_dir, check_images=not args.skip_image_check,
                                                   max_image_pixels=args.max_image_pixels or None,
                                                   strict=args.strict_data, is_main=PartialState().is_main_process,
                                                   data_format=args.data_format,
                                                   splits={"train": args.train_set, "val": args.val_set},
                                                   class_names=read_class_names(args.class_names) if args.class_names
                                                   else None,
                                                   include_crowd=args.include_crowd,
                                                   max_detections=args.detections_per_image)
    train_ds = None
    if paths.get("train_annotations"):
        train_ds = CocoDetection(paths["train_images"], train_json,
                                 build_transform(args.train_scales or args.image_size, args.augmentation, args.max_size,
                                                 args.resize_mode), include_crowd=args.include_crowd,
                                 seed=args.seed, max_image_pixels=args.max_image_pixels or None, filter_empty=args.filter_empty)
        if train_ds.num_target_boxes() == 0:
            raise ValueError(f"{paths['train_annotations']}: no usable (non-crowd, non-degenerate) box in the whole "
                             "training set; nothing to learn from (use --include_crowd to train on crowd boxes)")
        if args.train_tile:  # the items are the tiles of the images, at native resolution
            train_ds = TrainingTiles(train_ds, args.train_tile, args.tile_min_visible, args.empty_tile_rate,
                                     args.augmentation, args.resize_mode)
    # The model's classes: train's (val's categories were checked against them: same id, same name; val may list
    # only those it uses), or those of the evaluated checkpoint.
    category_map = train_ds.category_map if train_ds is not None else None
    saved = read_model_config(args.evaluate_only) if args.evaluate_only else None
    if category_map is None and saved and saved.get("category_ids"):  # the json's ids must mean the model's classes
        category_map = evaluated_classes(saved, val_json, args.categories_by_name, args.evaluate_only,
                                         paths["val_annotations"])
    val_ds = CocoDetection(paths["val_images"], val_json, build_transform(args.image_size, "none", args.max_size, args.resize_mode),
                           include_crowd=args.include_crowd, train=False, max_image_pixels=args.max_image_pixels or None,
                           category_map=category_map)
    side = args.train_tile or max(args.train_scales or [args.image_size])
    bytes_per_batch = (3 * side * (args.max_size or side) * args.per_device_batch_size
                       * (4 if args.resize_mode == "torchvision" else 1))  # float32 images in torchvision's resize
    # Workers are not persistent: each epoch's workers get a fresh copy of the data set with its epoch set
    # (the augmentation stream, see CocoDetection.set_epoch).
    common = loader_settings(args.num_workers, bytes_per_batch)
    common["collate_fn"] = collate_detection
    train_loader = None
    if train_ds is not None:
        drop_last = len(train_ds) >= args.per_device_batch_size
        # --sampler repeat_factor: images of rare classes drawn more often (None: shuffled by the loader)
        sampler = training_sampler(args.sampler, [r["labels"][~r["iscrowd"]] for r in train_ds.records],
                                   train_ds.category_map.names, args.seed, args.output_dir,
                                   PartialState().is_main_process, args.repeat_threshold)
        if args.aspect_grouping:  # landscape and portrait images in separate batches: less padding
            batches = GroupedBatchSampler(aspect_groups([r["size"] for r in train_ds.records]), args.per_device_batch_size,
                                          seed=args.seed, drop_last=drop_last, sampler=sampler)
            train_loader = torch.utils.data.DataLoader(train_ds, batch_sampler=batches, **common)
        else:
            train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.per_device_batch_size,
                                                       shuffle=sampler is None, sampler=sampler, drop_last=drop_last,
                                                       **common)
    # batches of val images of one padded shape, each image on one process: an image's detections are those of the
    # image alone, so the 12 stats are the same on any process count and eval batch size (docs/evaluation.md)
    process = PartialState()
    shapes = evaluation_shapes([r["size"] for r in val_ds.records], args.image_size, args.max_size, args.resize_mode)
    common["collate_fn"] = EvaluationCollate()
    val_loader = torch.utils.data.DataLoader(val_ds, batch_sampler=EvaluationBatchSampler(
        shapes, args.per_device_eval_batch_size, process.num_processes, process.process_index), **common)
    if args.tile:  # each val image whole on one process at its native size, its tiles in eval batches
        val_loader = tiled_loader(val_ds, process.num_processes, process.process_index,
                                  **{k: v for k, v in common.items() if k != "collate_fn"})
    return train_ds, val_ds, train_loader, val_loader


def not_used_flags(args) -> list[str]:
    """The flags whose values this run ignores (its scheduler's or optimizer's are others), for config.yaml."""
    unused = {"momentum": args.optimizer != "sgd", "plateau_patience": args.lr_scheduler != "plateau",
              "lr_steps": args.lr_scheduler != "multistep", "warmup_steps": args.lr_scheduler == "plateau"}
    return [k for k, v in unused.items() if v] + [k for k in ("tile_overlap", "tile_full") if not args.tile]


def resolve_model(args, given: set[str], synthetic: bool) -> tuple[dict | None, dict, list[str]]:
    """How the model is built and sees images, before any work: ours by default; an --evaluate_only or --init_from
    model's own (its model_config.json: a converted torchvision model's P6 from P5, anchors and resize; its size
    unless --image_size is given; a key the model needs and the file lacks stops in one line naming it and its flag).
    Returns (that model config or None, the settings every checkpoint of this run records, notes: a line each).
    Stops in one line on flags or files that cannot work."""
    from detlib.evaluation import area_ranges_from_edges
    from detlib.retinanet import ANCHOR_CONFIG_KEYS, check_backbone, check_head_norm

    flag, source = ("--evaluate_only", args.evaluate_only) if args.evaluate_only else ("--init_from", args.init_from)
    try:  # a Hub repo id is fetched now (from the cache when offline), before any work
        local_weights(source) if source else None
    except FileNotFoundError as e:
        stop(f"{flag} {source}: {e}", code=1)
    try:  # a wrong path stops here, before the data check
        saved = read_model_config(source) if source and weights_path(source) else None
    except (FileNotFoundError, WeightsFileError) as e:
        stop(f"{flag}: {e}", code=1)
    if args.push_to_hub and args.evaluate_only:
        stop("--push_to_hub uploads a training run's best/: not with --evaluate_only")
    notes = []
    settings = {"p6_input": "c5", "head_norm": BUILTIN_HEAD_NORM if synthetic and not source else "none",
                "resize_mode": "antialias"}
    if saved:
        try:  # what rebuilds the evaluated model and its size, unless given: never filled in from elsewhere
            require_model_keys(saved, source, {k: f"--{k}" for k in ("backbone", "fpn_channels", "image_size")
                                               if args.evaluate_only and k not in given})
        except WeightsFileError as e:
            stop(f"{flag}: {e}", code=1)
        settings.update({k: saved[k] for k in (*settings, *ANCHOR_CONFIG_KEYS) if saved.get(k) is not None})
        for k in ("backbone", "fpn_channels"):
            if k in saved and (args.evaluate_only or k not in given):
                if k in given and getattr(args, k) != saved[k]:
                    notes.append(f"--{k} {getattr(args, k)} is not used: --evaluate_only rebuilds the model its "
                                 f"model_config.json describes ({k} {saved[k]})")
                setattr(args, k, saved[k])
        if "image_size" not in given and "image_size" in saved:  # --init_from's size, when it has one
            args.image_size = saved["image_size"]
            args.max_size = args.max_size if "max_size" in given else saved.get("max_size")
    if args.evaluate_only and saved is None:
        notes.append(f"no model_config.json beside {weights_path(source)}: the model is built from the flags and "
                     f"defaults ({args.backbone}, fpn_channels {args.fpn_channels}, {args.image_size} px)")
    if args.evaluate_only:
        notes += not_used_evaluating(args, ("backbone_weights", "pretrained_backbone", "init_from"))
    settings["head_norm"] = args.head_norm or settings["head_norm"]  # given: over the saved model's
    if not args.evaluate_only and (args.anchor_sizes or (synthetic and args.builtin == "small_objects" and not source)):
        settings["anchor_sizes"] = args.anchor_sizes or SMALL_OBJECT_ANCHORS  # given: over the --init_from model's
    sizes = (args.max_size,) if args.max_size else (args.image_size, *(args.train_scales or ()))  # the longest sides
    try:  # of training's and evaluation's inputs
        check_head_norm(settings["head_norm"], args.fpn_channels, max(sizes))
    except ValueError as e:
        stop(str(e))
    try:
        check_backbone(args.backbone, image_sizes=sizes)
    except ValueError as e:
        stop(f"--backbone: {e}" if "backbone" in given and not args.evaluate_only else
             f"backbone {args.backbone!r} (from {source or 'the default'}): {e}")
    if args.backbone_weights and not args.evaluate_only and not os.path.isfile(args.backbone_weights):
        stop(f"weights file not found: {args.backbone_weights} (--backbone_weights)", code=1)
    try:
        area_ranges_from_edges(args.area_ranges) if args.area_ranges else None
    except ValueError as e:
        stop(f"--area_ranges: {e}")
    args.resize_mode = settings["resize_mode"]  # read by build_dataloaders
    # the scale its tiled evaluations run windows at (detlib.tiling.window_transform): this run's tiles, or the
    # evaluated model's
    settings["train_tile"] = (saved or {}).get("train_tile") if args.evaluate_only else args.train_tile
    return saved, settings, [n for n in notes if n]


def build_model(args, settings: dict, saved: dict | None, category_map: CategoryMap, train_annotations: str | None):
    """The RetinaNet of this run and its anchor generator: with --evaluate_only's weights loaded (strictly), or every
    tensor of --init_from's that fits (a class output of another class count re-initialised; the same classes under
    other ids matched by name with --categories_by_name). Returns (model, anchor generator, the weights file
    evaluated or None). Raises RunStop (one line) on weights that do not fit."""
    from detlib.labels import CategoryMap, model_classes_in_data
    from detlib.retinanet import (RetinaNet, anchor_generator_from_config, load_matching_weights, loaded_weights_line,
                                  reorder_class_outputs)

    pretrained = bool(args.backbone_weights or args.pretrained_backbone or args.init_from)
    if args.freeze_at is None:
        args.freeze_at = 2 if pretrained and not args.evaluate_only else 0
    if not pretrained and not args.evaluate_only and (args.data_dir or args.train_images):
        logger.warning("backbone from scratch on real data (no --backbone_weights): expect an AP near 0 for many epochs "
                       "on a small set; pretrained weights: README 'Pretrained weights', docs/backbones.md")
    if args.backbone_bn == "auto" and not pretrained and not args.evaluate_only:
        logger.info("backbone from scratch (no --backbone_weights): its BatchNorm is trained, not frozen")
    anchor_gen = anchor_generator_from_config({**settings, "num_classes": len(category_map)})
    # the saved model's input normalisation (a converted or trained detector's), else the backbone's own
    normalisation = {k: saved[k] for k in ("mean", "std") if saved and saved.get("backbone") == args.backbone and k in saved}
    if args.evaluate_only and saved and len(normalisation) < 2:
        raise RunStop(f"{model_config_file(args.evaluate_only)} lacks \"mean\" and \"std\" (the input normalisation, "
                      "per RGB channel on a 0-1 scale, as timm's pretrained_cfg gives it): add them from the backbone's tag")
    try:
        model = RetinaNet(len(category_map), args.backbone, fpn_channels=args.fpn_channels,
                          pretrained_backbone=args.pretrained_backbone and not args.evaluate_only,
                          backbone_weights=None if args.evaluate_only else args.backbone_weights,
                          backbone_weights_ema=args.backbone_weights_ema,
                          freeze_backbone_bn=args.backbone_bn == "frozen" or (args.backbone_bn == "auto" and pretrained),
                          freeze_at=args.freeze_at, p6_input=settings["p6_input"], head_norm=settings["head_norm"],
                          num_anchors=anchor_gen.num_anchors_per_location, **normalisation)
        if args.evaluate_only:
            return model, anchor_gen, load_model_weights(model, args.evaluate_only)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # weights that do not fit, an offline download
        raise RunStop(str(e)) from None
    if not args.init_from:
        return model, anchor_gen, None
    try:
        init_file = weights_path(args.init_from)
        loaded = load_matching_weights(model, load_state_dict_file(init_file))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        raise RunStop(f"--init_from: {e}") from None
    if not loaded["loaded"]:
        raise RunStop(f"--init_from: no tensor of {init_file} fits this model ({args.backbone}, fpn_channels "
                      f"{args.fpn_channels})")
    if not loaded["reinitialised"] and saved and saved.get("category_names"):  # its class output is kept
        try:
            _, source_class = model_classes_in_data(CategoryMap(saved["category_ids"], saved["category_names"]),
                                                    category_map, args.categories_by_name, init_file, train_annotations)
        except ValueError as e:
            raise RunStop(f"--init_from: {e}") from None
        if args.categories_by_name:
            reorder_class_outputs(model, source_class)
    logger.info("--init_from %s: %s", init_file, loaded_weights_line(loaded, len(category_map)))
    return model, anchor_gen, None


def build_scheduler(optimizer, args, steps_per_epoch: int, total_steps: int, done_steps: int = 0):
    """ReduceLROnPlateau (stepped per epoch on its mean loss, no warm-up; its state is checkpointed) or a per-step
    LambdaLR (`detlib.schedules.step_scheduler`), a function of the step alone: built after a resume at `done_steps`,
    it gives that step the LR of this run's schedule."""
    import torch

    if args.lr_scheduler == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.1,
                                                          patience=args.plateau_patience)
    return step_scheduler(optimizer, args.lr_scheduler, total_steps, args.warmup_steps,
                          [e * steps_per_epoch for e in args.lr_steps], WARMUP_START, done_steps)


def train_one_epoch(model, optimizer, scheduler, loader, anchor_gen, accelerator, state, guard, window, after_step, args,
                    normalizer) -> None:
    """Train from the run's position (`state`; a mid-epoch resume skips the batches it trained) to the end of the
    epoch or of the run. `guard`: whether to take each step, all-reduced (detlib.engine.StepGuard); `window`: the
    train line's means; `after_step(finite, lrs)`: the bookkeeping after each step (detlib.engine.step_done), true at
    the run's last step. Raises RunStop when the run diverges, Preempted on a stop signal or the time budget."""
    import torch

    from detlib.evaluation import write_train_batch
    from detlib.retinanet import retinanet_loss

    model.train()
    G = args.gradient_accumulation_steps
    done = state.step_in_epoch * G
    loader.set_epoch(state.epoch)  # the sampler's order; the data set's augmentation stream (detlib.data.seeds)
    if hasattr(loader.dataset, "set_epoch"):  # accelerate's set_epoch skips a data set whose sampler has one
        loader.dataset.set_epoch(state.epoch)
    for i, batch in enumerate(window.timed(accelerator.skip_first_batches(loader, done) if done else loader), done):
        if i % G == 0:  # a step's first micro-batch: its LRs, and the buffers a skipped step puts back
            lrs, step_losses, pos, seen = [g["lr"] for g in optimizer.param_groups], 0.0, 0.0, 0
            guard.snapshot(model)
        if i == state.global_step == 0 and accelerator.is_main_process:  # the run's first batch, as the model sees it
            write_train_batch(args.output_dir, batch["images"], loader.dataset.category_map.names, batch["labels"],
                              batch["boxes"])
        with accelerator.accumulate(model):
            images = batch["images"]
            if args.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            out = model(images)
            anchors, _ = anchor_gen(*images.shape[-2:], device=images.device)
            losses = retinanet_loss(out["cls_logits"], out["box_deltas"], anchors, batch["boxes"], batch["labels"],
                                    batch["crowd_boxes"], box_loss=args.box_loss, normalizer=normalizer)
            accelerator.backward(losses["loss"] * G)  # not accelerate's 1/G: the normaliser counts the whole window
            step_losses = step_losses + torch.stack([losses[k].detach() for k in ("loss", "cls_loss", "box_loss")])
            pos, seen = pos + losses["num_pos"], seen + len(batch["image_ids"])
            if not accelerator.sync_gradients:
                continue
            # the window's gradient and losses over the positive anchors of all its micro-batches and processes (a
            # partial last window: of its own micro-batches), as one batch of them would be
            step_losses = step_losses * normalizer.finish(model.parameters())
            window.add({"loss": step_losses[0], "cls_loss": step_losses[1], "box_loss": step_losses[2],
                        "pos_anchors_per_image": pos / seen}, seen)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
            finite = guard.check(step_losses[0], grad_norm, state.global_step + 1, lrs[0])  # alike on every rank
            if finite or accelerator.scaler is not None:  # fp16: the GradScaler skips a non-finite step itself
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.lr_scheduler != "plateau":  # per step; the plateau scheduler per epoch, in main
                scheduler.step()
        if after_step(finite, lrs):  # EMA, counters, train line, divergence, step checkpoint, stop poll
            return


@no_grad
def evaluate(model, loader, anchor_gen, evaluator: CocoEvaluator, category_map, accelerator, args, title: str = "",
             tiles: dict | None = None) -> dict:
    """Decode the validation shard of every process, gather, and (main process) run COCOeval and log its 12 stats
    under `title` (which weights, which epoch); returns them on every process (collective). Checks for preemption
    every 10 batches (raises Preempted). `tiles`: --tile's `detect_tiled` settings (`detlib.tiling.tile_settings`)."""
    # The bare model: DDP's forward can be collective, and the processes run unequal numbers of batches. Its buffers
    # are made rank 0's, as DDP's forward would make them (and as a checkpoint holds them): BatchNorm statistics that
    # each process updated on its own batches would otherwise differ between the processes' shares.
    import torch
    from accelerate.utils import broadcast_object_list

    from detlib.engine import stop_if_preempted
    from detlib.evaluation import detect_images

    model = accelerator.unwrap_model(model)
    if accelerator.num_processes > 1:
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)
    model.eval()
    evaluator.per_image, evaluator.failed = detect_images(
        model, anchor_gen, loader, accelerator, category_map.to_category_ids(torch.arange(len(category_map))),
        args.score_thresh, args.nms_thresh, args.detections_per_image,
        poll=lambda: stop_if_preempted(accelerator), tiles=tiles)  # --tile: native images, cut there
    result = [None]
    if accelerator.is_main_process:
        stats, summary = evaluator.evaluate()
        logger.info("%sCOCO evaluation on %d images:\n%s", title and f"{title}: ", evaluator.num_images, summary)
        result = [stats]
    broadcast_object_list(result)
    model.train()
    return result[0]


def evaluate_and_log(models: dict, val_loader, val_ds, evaluator, anchor_gen, accelerator, metrics, state, args,
                     image_dir: str, epoch: int | None, weights: str | None = None, final: bool = False,
                     tiles: dict | None = None) -> dict:
    """Evaluate `models` ({"": the weights trained or evaluated, "ema_": their EMA}) and log it: one metrics.jsonl
    line (the 12 stats, per-class AP, the best-F1 score thresholds; for the trained weights why the AP is what it
    is: the error breakdown, calibration and bootstrap intervals of `evaluation_diagnostics`; the EMA's stats
    beside as ema_*; evaluating only, the `weights` scored), the log's eval lines, then for the trained weights
    predictions_val.json, plots/ and samples/ (also to the trackers), with label_errors.json at the `final`
    evaluation. `epoch` counts from 1 (None: evaluating only); `tiles`: `evaluate`'s. Collective.
    Returns {prefix: its evaluation: epoch,
    step, the stats, per_class, best_f1}."""
    from detlib.evaluation import (STAT_NAMES, best_f1_thresholds, evaluation_diagnostics, format_best_f1,
                                   log_diagnostics_to_trackers, log_evaluation_extras, per_class_ap,
                                   per_class_without_detections)

    evaluations = {}
    for prefix, model in sorted(models.items(), reverse=True):  # the trained weights last: the evaluator keeps theirs
        title = (f"evaluation of {weights}" if weights else f"epoch {epoch}") + ", EMA weights" * bool(prefix)
        stats = evaluate(model, val_loader, anchor_gen, evaluator, val_ds.category_map, accelerator, args, title, tiles)
        per_class, best_f1 = {}, None
        if accelerator.is_main_process:  # nothing detected: 0 for every class with ground truth
            per_class = (per_class_ap(evaluator.coco_eval) if evaluator.coco_eval is not None
                         else per_class_without_detections(val_ds.dataset))
            best_f1 = best_f1_thresholds(val_ds.dataset, *evaluator.evaluated())
            logger.info("%s", format_best_f1(best_f1))
        evaluations[prefix] = {"epoch": epoch, "step": state.global_step, **stats, "per_class": per_class, "best_f1": {
            k: v for k, v in (best_f1 or {}).items() if k != "curves"}}
    diagnosed = {"metrics": {}}
    if accelerator.is_main_process:  # of the trained weights, whose detections the evaluator holds
        diagnosed = evaluation_diagnostics(evaluator, args.output_dir, epoch, args.eval_bootstrap, args.seed,
                                           label_errors=final or weights is not None)
        logger.info("%s", diagnosed["line"])
    line = {**evaluations[""], **diagnosed["metrics"],
            **{f"ema_{k}": v for k, v in evaluations.get("ema_", {}).items() if k in STAT_NAMES}}
    metrics.log({**line, **({"weights": os.path.abspath(weights)} if weights else {})}, step=state.global_step,
                tracker_epoch=epoch)
    if accelerator.is_main_process:
        log_diagnostics_to_trackers(accelerator, diagnosed, state.global_step)
        write_json(evaluator.results, os.path.join(args.output_dir, "predictions_val.json"))
        log_evaluation_extras(accelerator, args.output_dir, epoch, state.global_step, val_ds.dataset, evaluator.results,
                              evaluator.coco_eval, image_dir, num_log_images=args.num_log_images, seed=args.seed,
                              best_f1=best_f1)
    return evaluations


def write_model_files(args, model_config: dict, card: dict, folder: str, name: str, evaluation: dict | None) -> None:
    """Beside the weights in `folder` (`output_dir/name/`, main process): the best-F1 score thresholds of `evaluation`
    (of exactly these weights, or None) and the model card (`card`: its dataset and command)."""
    from detlib.evaluation import detector_card, write_card, write_score_thresholds

    if evaluation and evaluation.get("best_f1"):
        write_score_thresholds(folder, evaluation["best_f1"], evaluation)
    where = args.push_to_hub if args.push_to_hub and name == "best" else folder
    write_card(detector_card(model_config, evaluation=evaluation, weights_name=name, where=where, **card), folder)


def main(argv=None):
    args = parse_args(argv)  # --help and a bad flag are answered before the imports below
    import torch
    from timm.optim import param_groups_weight_decay
    from timm.utils import ModelEmaV3

    from detlib.engine import (MetricsLog, Preempted, StepGuard, TrainState, TrainWindow, finish_run,
                               keep_best, log_plan, log_summary, make_accelerator, resume, run_length, running,
                               save_checkpoint, start_run, step_done, stop_early)
    from detlib.engine.signals import signal_received
    from detlib.evaluation import CocoEvaluator, STAT_NAMES, area_ranges_from_edges, card_dataset, command_line
    from detlib.retinanet import EmaLossNormalizer, StepLossNormalizer, log_model_size

    argv = sys.argv[1:] if argv is None else list(argv)  # the model cards' command
    given = args.given  # what the user chose (flags or --config)
    synthetic = not (args.data_dir or args.train_images or args.val_images)
    resolve_data_defaults(args, DATA_DEFAULTS, synthetic)
    saved, settings, notes = resolve_model(args, given, synthetic)
    if args.lr_scheduler == "plateau" and args.warmup_steps:  # config.yaml says what the run did: no warm-up
        notes += [f"--warmup_steps {args.warmup_steps} is not used: the plateau scheduler has no warm-up"] * (
            "warmup_steps" in given)
        args.warmup_steps = 0
    if args.evaluate_only:  # never over a training run's files
        args.output_dir = os.path.join(args.output_dir, "evaluate_only")
    accelerator = make_accelerator(args.mixed_precision, args.gradient_accumulation_steps, args.report_to, args.output_dir,
                                   args.seed, args.verbose, args.compile_backend if args.compile and not args.evaluate_only
                                   else None, args.compile_mode)
    state, t_start = TrainState(), time.time()
    with running(accelerator, args.output_dir, state, bool(args.evaluate_only), args.resume_from_checkpoint,
                 args.overwrite_output_dir, args.verbose, args.time_limit):
        for line in notes:
            logger.warning("%s", line)
        if args.push_to_hub:  # token, network and repo checked now, not after the training
            stop_together(accelerator, check_push(args.push_to_hub, args.hub_private) if accelerator.is_main_process
                          else None)
            logger.info("--push_to_hub %s: the Hub is reachable and the repo writable; best/ is uploaded at the end",
                        args.push_to_hub)
        stop_note = ""
        if synthetic and not args.evaluate_only:
            logger.info("no data given: training on the built-in synthetic %s data set (%s, %s heads, %d px, "
                        "fpn_channels %d, lr %g, %d epochs): %s; the model is only useful after the full run; pass "
                        "--data_dir for COCO", args.builtin, args.backbone, "GroupNorm" if settings["head_norm"] == "gn" else
                        "no-norm", args.image_size, args.fpn_channels, args.lr, args.epochs, BUILTIN_RUN[args.builtin])
            stop_note = (f"; the built-in run's model is only useful after all {args.epochs} epochs ({BUILTIN_RUN[args.builtin]}): "
                         "stopped early it detects the shapes poorly")

        # ---- data
        with accelerator.main_process_first():  # the synthetic set is generated once, by the main process
            try:
                paths = resolve_data(args)
                train_ds, val_ds, train_loader, val_loader = build_dataloaders(args, paths)
                error = None
            except (OSError, ValueError) as e:  # bad paths or data, a cache not writable: one line, no traceback
                error = str(e)
        stop_together(accelerator, error)  # out of main_process_first, whose barrier a lone exit would leave waiting
        category_map = val_ds.category_map

        # ---- model
        model_config = {"num_classes": len(category_map), "backbone": args.backbone, "fpn_channels": args.fpn_channels,
                        "image_size": args.image_size, "max_size": args.max_size,
                        "category_ids": category_map.category_ids, "category_names": category_map.names, **settings}
        model, anchor_gen, weights = build_model(args, settings, saved, category_map, paths.get("train_annotations"))
        model_config.update(mean=model.mean, std=model.std)
        if args.sync_bn and accelerator.num_processes > 1 and accelerator.device.type == "cuda":
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif args.sync_bn and accelerator.num_processes > 1:
            logger.warning("--sync_bn needs CUDA devices; ignored on %s", accelerator.device.type)
        if args.channels_last:
            model = model.to(memory_format=torch.channels_last)
        log_model_size(model, args.backbone, args.max_size or args.image_size, accelerator.is_main_process)
        config = {**vars(args), "num_processes": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
                  "synthetic_data": synthetic, "num_classes": len(category_map),
                  **{f"data_{k}": v for k, v in paths.items()}, "not_used": not_used_flags(args)}
        card = {"dataset": card_dataset(paths, args.data_format, args.data_dir, synthetic and args.builtin),
                "command": command_line("train_retinanet.py", argv)}
        metrics = MetricsLog(accelerator, args.output_dir)
        evaluator = CocoEvaluator(val_ds.dataset, args.coco_eval_backend,
                                  area_ranges=area_ranges_from_edges(args.area_ranges) if args.area_ranges else None)
        given_line = format_given(args, config)  # the flags the user set, for the config's log line
        tiles = None
        if args.tile:  # windows at the scale the model was trained at; their count known before the first one
            tiles, line, mismatch = tile_settings(model_config, args.tile, args.tile_overlap, args.tile_full,
                                                  args.per_device_eval_batch_size, [r["size"] for r in val_ds.records],
                                                  poll=signal_received)  # local: the image's windows stop,
            logger.info("tiled evaluation, %s", line)  # the next collective poll stops the run
            if mismatch:
                logger.warning("%s", mismatch)

        def evaluate(models: dict, epoch: int | None, final: bool = False) -> dict:
            return evaluate_and_log(models, val_loader, val_ds, evaluator, anchor_gen, accelerator, metrics, state, args,
                                    paths["val_images"], epoch, weights, final, tiles)

        if args.evaluate_only:
            model = accelerator.prepare(model)
            start_run(accelerator, state, config, given_line, args.output_dir, args.project, args.run_name, args.report_to)
            # a stop signal during it: `running`'s one line, exit 75 (nothing to checkpoint)
            return {k: v for k, v in evaluate({"": model}, None)[""].items() if k in STAT_NAMES}

        # ---- optimizer, schedule, resume
        # No weight decay on norm weights and biases (every 1-D parameter: timm, nanoGPT; detectron2's
        # WEIGHT_DECAY_NORM=0); --wd_norm decays them too. Frozen parameters are left out either way.
        params = ([p for p in model.parameters() if p.requires_grad] if args.wd_norm
                  else param_groups_weight_decay(model, args.weight_decay))
        optimizer = (torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay) if args.optimizer == "adamw"
                     else torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay))
        model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
        steps_per_epoch, total_steps = run_length(accelerator, train_loader, args.gradient_accumulation_steps,
                                                  args.epochs, args.max_steps)
        plateau = build_scheduler(optimizer, args, steps_per_epoch, total_steps) if args.lr_scheduler == "plateau" else None
        if plateau:  # its patience counter and best loss; the per-step schedules are a function of the step
            accelerator.register_for_checkpointing(plateau)
        ema_normalizer = EmaLossNormalizer() if args.loss_normalizer == "ema" else None
        if ema_normalizer:  # the same value on every process (fed the count over all of them), checkpointed
            accelerator.register_for_checkpointing(ema_normalizer)
        normalizer = StepLossNormalizer(lambda t: accelerator.reduce(t, reduction="sum"), accelerator.num_processes,
                                        ema_normalizer)
        ema = ModelEmaV3(accelerator.unwrap_model(model, keep_torch_compile=False), decay=args.model_ema,
                         use_warmup=args.model_ema_warmup, warmup_power=0.75) if args.model_ema else None
        resume(accelerator, args.output_dir, args.resume_from_checkpoint, state, config, model_config, FIXED_ON_RESUME,
               records=RECORD_KEYS, ema=ema)
        scheduler = plateau or build_scheduler(optimizer, args, steps_per_epoch, total_steps, state.global_step)
        bare = accelerator.unwrap_model(model, keep_torch_compile=False)  # evaluated uncompiled, saved without prefixes
        models = {"": bare if args.compile else model, **({"ema_": ema.module} if ema else {})}
        start_run(accelerator, state, config, given_line, args.output_dir, args.project, args.run_name, args.report_to,
                  checkpointed=list(models.values()))
        log_plan(state, args.epochs, total_steps, steps_per_epoch, args.per_device_batch_size * accelerator.num_processes
                 * args.gradient_accumulation_steps, optimizer.param_groups[0]["lr"], args.max_grad_norm)
        write_files = functools.partial(write_model_files, args, model_config, card)

        def checkpoint() -> str:  # everything a resume needs (a second call at the same state keeps the first)
            return save_checkpoint(accelerator, args.output_dir, state, list(models.values()), args.checkpoint_total_limit,
                                   config, model_config, ema.module if ema else None)

        def evaluate_and_keep_best(epoch: int, last: bool) -> dict:  # {"": the trained weights' evaluation, "ema_": ...}
            state.eval_pending = epoch  # a preemption's checkpoint says this evaluation is still to run
            # the run's final evaluation (label_errors.json): after the last epoch, or one that early stopping ends
            # the run with unless it brings a better best, which is known only after it
            final = last or 0 < args.early_stopping_patience <= state.evals_without_improvement + 1
            evaluations = evaluate(models, epoch, final)
            keep_best(accelerator, args.output_dir, "AP", evaluations, models, state, model_config, write_files)
            state.eval_pending = 0
            return evaluations

        # ---- train: the epoch's policy here, the step in train_one_epoch
        guard, window, evaluations = StepGuard(accelerator, args.max_nonfinite_steps), TrainWindow(accelerator), {}
        after_step = functools.partial(step_done, accelerator, state, guard=guard, window=window, metrics=metrics,
                                       steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                                       log_interval=args.log_interval, checkpoint_steps=args.checkpoint_steps,
                                       output_dir=args.output_dir, checkpoint=checkpoint, ema=ema, model=bare)
        start_step = state.global_step
        try:
            if state.eval_pending:  # an evaluation a preemption cut short runs first
                evaluations = evaluate_and_keep_best(state.eval_pending, state.global_step >= total_steps)
            for epoch in range(state.epoch, args.epochs):
                if state.global_step >= total_steps or stop_early(state, args.early_stopping_patience, "AP"):
                    break
                lr = optimizer.param_groups[0]["lr"]  # the plateau scheduler's line compares with it
                train_one_epoch(model, optimizer, scheduler, train_loader, anchor_gen, accelerator, state, guard, window,
                                after_step, args, normalizer)
                if state.step_in_epoch == steps_per_epoch:  # the epoch ran to its end (not the run's last step first)
                    mean_loss = state.end_epoch()  # the mean over all processes: the same on every rank
                    logger.info("epoch %d: mean loss %.4f, lr %.3g, %d skipped steps so far", epoch + 1, mean_loss,
                                optimizer.param_groups[0]["lr"], state.skipped_steps)
                    if plateau:
                        scheduler.step(mean_loss)
                        if optimizer.param_groups[0]["lr"] < lr:
                            logger.info("plateau: no lower mean loss in %d epoch(s), lr %.3g -> %.3g from epoch %d on",
                                        args.plateau_patience + 1, lr, optimizer.param_groups[0]["lr"], epoch + 2)
                last = state.global_step >= total_steps or epoch + 1 == args.epochs
                if (epoch + 1) % args.eval_interval == 0 or last:
                    evaluations = evaluate_and_keep_best(epoch + 1, last)
                if ((epoch + 1) % args.checkpoint_interval == 0 or last or stop_early(state, args.early_stopping_patience, "AP")
                        or args.checkpoint_steps and state.global_step % args.checkpoint_steps == 0):
                    checkpoint()
        except Preempted as p:
            raise p.stop(state, checkpoint(), stop_note) from None
        final = {p: e for p, e in evaluations.items() if e["step"] == state.global_step}  # of the weights at the end
        best = finish_run(accelerator, args.output_dir, "AP", models, final, state.global_step > start_step,
                          model_config, write_files)
    log_summary(args.output_dir, "AP", time.time() - t_start, state, best, final.get(""), window.images_seen,
                ema is not None, also=("AP50",))
    if args.push_to_hub and accelerator.is_main_process:
        push_best(args.output_dir, args.push_to_hub, args.hub_private, "train_retinanet")
    return {k: v for k, v in final[""].items() if k in STAT_NAMES} if "" in final else None


if __name__ == "__main__":
    main()
