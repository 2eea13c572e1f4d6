"""Data: reading images, box-aware transforms, the COCO-format data set and its collate, per-image records,
aspect-ratio grouping, the ImageFolder data set, VOC / YOLO read as COCO, video frames, and the built-in sets.

`images` (files to RGB, damaged files survived), `transforms` (augmentation, resizing, the input conventions),
`coco` (the detection data set, the batch), `records` (compact per-image arrays), `sampler` (aspect grouping, the
evaluation's batches of one padded shape), `imagefolder` (the classification data set), `loaders` (the DataLoader
set-up: workers that end with their training process, the /dev/shm check), `formats` (VOC / YOLO, and the data check
of a data folder in any format), `video` (PyAV frames), `builtin` (the synthetic sets both scripts train on without
data), `train_tiles` (the tiles of a training set as its items: --train_tile).
"""

from ..datacheck.report import DEFAULT_MAX_IMAGE_PIXELS
from .builtin import make_small_objects_coco, make_synthetic_coco, make_synthetic_image_folder
from .coco import PAD_VALUE, CocoDetection, EvaluationCollate, collate_detection, evaluation_shapes
from .formats import FORMATS, check_coco_for_training, data_dir_paths, read_class_names, read_data_dir_splits
from .imagefolder import VERIFY_MODES, ImageFolderDataset, scan_image_folder
from .loaders import loader_settings, stop_dataloader_workers, worker_loader_kwargs
from .images import IMAGE_ERRORS, load_rgb
from .sampler import EvaluationBatchSampler, GroupedBatchSampler, aspect_groups
from .train_tiles import TrainingTiles
from .transforms import AUGMENTATIONS, INPUT_DIVISIBILITY, build_transform
from .video import INSTALL_HINT, VideoWriter, av_available, video_frames, video_info

__all__ = [
    "loader_settings", "stop_dataloader_workers", "worker_loader_kwargs",
    "make_small_objects_coco", "make_synthetic_coco", "make_synthetic_image_folder", "PAD_VALUE", "CocoDetection", "collate_detection", "FORMATS",
    "check_coco_for_training", "data_dir_paths", "read_data_dir_splits", "VERIFY_MODES", "ImageFolderDataset",
    "scan_image_folder", "IMAGE_ERRORS", "load_rgb", "GroupedBatchSampler", "aspect_groups", "AUGMENTATIONS",
    "INPUT_DIVISIBILITY", "build_transform", "INSTALL_HINT", "VideoWriter", "av_available", "video_frames",
    "video_info", "DEFAULT_MAX_IMAGE_PIXELS", "EvaluationCollate", "evaluation_shapes",
    "EvaluationBatchSampler", "read_class_names", "TrainingTiles"
]
