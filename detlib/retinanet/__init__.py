"""The RetinaNet detector: anchors, box coding, the model (timm backbone, FPN, heads), anchor matching, the
focal and box losses, decoding to detections, export, and torchvision's weights.

One concept per module: `anchors` (where the anchors are, P3-P7), `box_coder` (boxes <-> regression targets),
`model` (backbone + FPN + heads), `matching` (anchors -> ground truth by IoU), `loss` (focal + box loss),
`decode` (head outputs -> detections), `export` (the self-contained ONNX / torch.export graph),
`torchvision_weights` (torchvision's COCO RetinaNet as ours).
"""

from .anchors import ANCHOR_CONFIG_KEYS, AnchorGenerator, anchor_generator_from_config
from .decode import decode_detections
from .export import ExportableRetinaNet, canvas_size, compare_detections, head_candidates, prepare_input
from .loss import BOX_LOSSES, EmaLossNormalizer, retinanet_loss
from .model import (HEAD_NORMS, RetinaNet, build_retinanet_from_config, check_backbone, load_matching_weights,
                    log_model_size, reorder_class_outputs)
from .torchvision_weights import (convert_torchvision_retinanet, torchvision_coco_categories, torchvision_model_config,
                                  torchvision_version)

__all__ = [
    "ANCHOR_CONFIG_KEYS", "AnchorGenerator", "anchor_generator_from_config", "decode_detections", "ExportableRetinaNet",
    "canvas_size", "compare_detections", "head_candidates", "prepare_input", "BOX_LOSSES", "EmaLossNormalizer",
    "retinanet_loss", "HEAD_NORMS", "RetinaNet", "build_retinanet_from_config", "check_backbone",
    "load_matching_weights", "log_model_size", "reorder_class_outputs", "convert_torchvision_retinanet", "torchvision_coco_categories",
    "torchvision_model_config", "torchvision_version"
]
