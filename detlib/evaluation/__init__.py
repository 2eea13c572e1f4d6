"""What an evaluation computes and shows: COCO evaluation across processes, per-class AP, PR curves, the
confusion matrix and best-F1 thresholds, their plots, drawn samples, and model cards.

`coco` (the 12 stats, every image counted once), `metrics` (per-class numbers and their plots), `drawing`
(detections drawn on images), `report` (what an evaluation writes to the run folder and the trackers),
`model_card` (the README.md of a weights folder).
"""

from .coco import STAT_NAMES, CocoEvaluator, detections_to_coco
from .drawing import boxes_from_coco, class_color, draw_detections, drawing_scale, save_image, upright_image_and_boxes
from .metrics import best_f1_thresholds, format_best_f1, per_class_ap, per_class_without_detections
from .model_card import classifier_card, command_line, detector_card, write_card
from .report import log_classification_extras, log_evaluation_extras, record_evaluation

__all__ = [
    "STAT_NAMES", "CocoEvaluator", "detections_to_coco", "boxes_from_coco", "class_color", "draw_detections", "drawing_scale",
    "save_image", "upright_image_and_boxes", "best_f1_thresholds", "format_best_f1", "per_class_ap",
    "per_class_without_detections", "classifier_card", "command_line", "detector_card", "write_card",
    "log_classification_extras", "log_evaluation_extras", "record_evaluation"
]
