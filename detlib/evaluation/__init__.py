"""What an evaluation computes and shows: COCO evaluation across processes, per-class AP, PR curves, the
confusion matrix and best-F1 thresholds, their plots, drawn samples, and model cards.

`coco` (the 12 stats, every image counted once, any area ranges), `detect` (a detector over batches to COCO results
gathered across processes: evaluation's and predict's), `metrics` (per-class numbers, best-F1 thresholds), `plots`
(their plots, and the training curves), `diagnostics` (why the AP is what it is: TIDE errors, calibration, bootstrap
intervals, run-vs-run comparison), `label_errors` (likely annotation errors, ranked), `results_file` (a COCO results
file matched to its ground truth: image ids, file names, coverage), `drawing` (detections drawn on images), `report`
(what an evaluation writes to the run folder and the trackers), `train_batch` (the first training batch drawn),
`model_card` (the README.md of a weights folder).
"""

from .coco import COCO_AREA_EDGES, COCO_AREA_RANGES, STAT_NAMES, CocoEvaluator, area_ranges_from_edges, detections_to_coco
from .detect import detect, detect_images
from .diagnostics import (bootstrap_interval, calibration, compare_evaluations, error_breakdown, format_diagnostics,
                          hotcoco_evaluation)
from .label_errors import count_label_errors, find_label_errors, write_label_errors
from .drawing import boxes_from_coco, class_color, draw_detections, drawing_scale, save_image, upright_image_and_boxes
from .metrics import (best_f1_thresholds, format_best_f1, per_class_ap, per_class_without_detections,
                      read_score_thresholds, write_score_thresholds)
from .model_card import card_dataset, classifier_card, command_line, detector_card, write_card
from .train_batch import write_train_batch
from .report import (evaluation_diagnostics, log_classification_extras, log_diagnostics_to_trackers,
                     log_evaluation_extras)

__all__ = [
    "STAT_NAMES", "CocoEvaluator", "detections_to_coco", "detect", "detect_images", "boxes_from_coco", "class_color", "draw_detections", "drawing_scale",
    "save_image", "upright_image_and_boxes", "best_f1_thresholds", "format_best_f1", "per_class_ap",
    "per_class_without_detections", "classifier_card", "command_line", "detector_card", "write_card",
    "log_classification_extras", "log_evaluation_extras", "read_score_thresholds", "write_score_thresholds", "COCO_AREA_EDGES", "COCO_AREA_RANGES",
    "area_ranges_from_edges", "bootstrap_interval", "calibration", "compare_evaluations", "error_breakdown",
    "format_diagnostics", "hotcoco_evaluation", "find_label_errors", "count_label_errors", "write_label_errors", "evaluation_diagnostics",
    "log_diagnostics_to_trackers", "write_train_batch"
]
