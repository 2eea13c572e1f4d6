"""Data: reading images, box-aware transforms, the COCO-format data set and its collate, per-image records,
aspect-ratio grouping, the ImageFolder data set, VOC / YOLO read as COCO, video frames, and the built-in sets.

`images` (files to RGB, damaged files survived), `transforms` (augmentation, resizing, the input conventions),
`coco` (the detection data set, the batch), `records` (compact per-image arrays), `sampler` (aspect grouping, the
evaluation's batches of one padded shape), `balanced` (class-balanced sampling of a skewed training set),
`imagefolder` (the classification data set), `seeds` (a training sample's random draws, a function of (seed, epoch,
key)), `loaders` (the DataLoader set-up: workers that end with their training process, the /dev/shm check),
`formats` (the layout of a data folder, COCO, VOC or YOLO, its splits, and the data check of it), `voc` and `yolo`
(each layout's splits read as COCO dicts), `converted` (the text-file rule and the COCO dict both readers share),
`video` (PyAV frames), `builtin` (the synthetic sets both scripts train on without data), `train_tiles` (the tiles of
a training set as its items: --train_tile), `options` (the flags of the samplers and of --train_tile, the choices
of --augmentation and --verify_images, light for --help).
"""

from ..datacheck.report import DEFAULT_MAX_IMAGE_PIXELS  # light: PIL only
from ..lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "balanced": ("ClassBalancedSampler", "RepeatFactorSampler", "log_class_frequencies", "repeat_factors",
                 "training_sampler"),
    "builtin": ("make_small_objects_coco", "make_synthetic_coco", "make_synthetic_image_folder"),
    "coco": ("PAD_VALUE", "CocoDetection", "EvaluationCollate", "collate_detection", "evaluation_shapes"),
    "formats": ("FORMATS", "add_format_flags", "check_coco_for_training", "data_dir_paths", "read_data_dir_splits"),
    "imagefolder": ("ImageFolderDataset", "scan_image_folder"),
    "loaders": ("loader_settings", "worker_loader_kwargs"),
    "images": ("IMAGE_ERRORS", "load_rgb"),
    "options": ("AUGMENTATIONS", "VERIFY_MODES", "add_sampler_flags", "add_train_tile_flags", "train_tile_conflict"),
    "sampler": ("EvaluationBatchSampler", "GroupedBatchSampler", "aspect_groups"),
    "train_tiles": ("TrainingTiles",),
    "transforms": ("INPUT_DIVISIBILITY", "build_transform"),
    "voc": ("read_class_names",),
    "video": ("INSTALL_HINT", "VideoWriter", "av_available", "video_frames", "video_info"),
})
__all__ += ["DEFAULT_MAX_IMAGE_PIXELS"]
