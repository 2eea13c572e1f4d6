"""Deployment of an exported RetinaNet beyond the ONNX file: the OpenVINO IR (fp32, fp16), INT8 models (ONNX Runtime
static quantisation, NNCF post-training quantisation), a runner that executes any of them on the evaluation's
batches, and the AP check each export is held to.

One concept per module: `formats` (ONNX -> OpenVINO IR, INT8 quantisation, calibration inputs), `runner` (an
exported file as one object called on a batch of images, and PyTorch's own as the same kind of object), `ap_check`
(each runner's COCO AP on a labelled set beside PyTorch's, and the verdict on the drop).
The runtimes (onnxruntime, openvino, nncf) are the `deploy` extra, imported inside the functions that need them.
"""

from ..lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "ap_check": ("ap_of_runners", "ap_verdict"),
    "formats": ("DEPLOY_FORMATS", "QUANTISED", "calibration_line", "missing_packages", "write_formats"),
    "runner": ("ExportRunner", "TorchRunner", "is_exported_model", "metadata_path"),
})
