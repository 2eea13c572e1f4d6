"""The data check: the report (levels, counts, data_report.json) and the checks of a COCO json (fields, images,
annotations) and of an ImageFolder tree. It reads data; it never imports the data sets (detlib.data imports it).

`report` (the report and its levels), `coco` (one COCO json, or a train/val pair), `coco_fields`,
`coco_images`, `coco_annotations` (its parts), `imagefolder` (class folders).
"""

from .coco import check_coco, check_learnable, check_train_val
from .imagefolder import check_folder_scans, check_folders_for_training
from .report import DEFAULT_MAX_IMAGE_PIXELS, DataReport

__all__ = [
    "check_coco", "check_learnable", "check_train_val", "check_folder_scans", "check_folders_for_training",
    "DEFAULT_MAX_IMAGE_PIXELS", "DataReport"
]
