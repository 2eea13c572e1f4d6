"""The RetinaNet detector: anchors, box coding, the model (timm backbone, FPN, heads), anchor matching, the
focal and box losses, decoding to detections, export, and torchvision's weights.

One concept per module: `anchors` (where the anchors are, P3-P7), `box_coder` (boxes <-> regression targets),
`model` (backbone + FPN + heads), `matching` (anchors -> ground truth by IoU), `loss` (focal + box loss),
`decode` (head outputs -> detections), `export` (the self-contained ONNX / torch.export graph),
`torchvision_weights` (torchvision's COCO RetinaNet as ours), `options` (the choices of --box_loss and --head_norm,
light for --help).
"""

from ..lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "anchors": ("ANCHOR_CONFIG_KEYS", "AnchorGenerator", "anchor_generator_from_config"),
    "decode": ("decode_detections",),
    "export": ("ExportableRetinaNet", "canvas_size", "compare_detections", "head_candidates", "prepare_input"),
    "loss": ("EmaLossNormalizer", "StepLossNormalizer", "retinanet_loss"),
    "model": ("RetinaNet", "build_retinanet_from_config", "check_backbone", "check_head_norm", "load_matching_weights",
              "loaded_weights_line", "log_model_size", "reorder_class_outputs"),
    "options": ("BOX_LOSSES", "HEAD_NORMS"),
    "torchvision_weights": ("convert_torchvision_retinanet", "torchvision_coco_categories", "torchvision_model_config",
                            "torchvision_version"),
})
