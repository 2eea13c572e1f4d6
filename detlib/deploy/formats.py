"""The deployment formats made from an exported FILE.onnx: the OpenVINO IR and the INT8 models.

    openvino       FILE.xml (+ .bin) fp32 and FILE.fp16.xml (weights stored in fp16, about half the size; the CPU
                   plugin computes in fp32), converted by `openvino.convert_model` from the ONNX graph
    onnx_int8      FILE.int8.onnx: ONNX Runtime static quantisation (QDQ, int8 weights per output channel, uint8
                   activations whose ranges are calibrated on real images)
    openvino_int8  FILE.int8.xml: NNCF post-training quantisation of the OpenVINO model, calibrated on the same images

Quantisation touches the convolutions only (the decoding, if inside, stays float). `float_head` keeps the two
last convolutions of the class and box heads in float: the scores and box deltas are then computed from int8
features but not rounded themselves (what to try when the AP drops).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re

DEPLOY_FORMATS = ("openvino", "onnx_int8", "openvino_int8")
QUANTISED = ("onnx_int8", "openvino_int8")
PACKAGES = {"openvino": ("openvino",), "onnx_int8": ("onnxruntime",), "openvino_int8": ("openvino", "nncf")}
# the heads' last convolutions (RetinaNet.cls_head.out / box_head.out), as the ONNX exporter names their nodes
HEAD_OUTPUT_NODES = ("cls_head.out", "box_head.out")


def missing_packages(formats) -> list[str]:
    """The packages `formats` need that are not installed (checked without importing them)."""
    need = sorted({p for f in formats for p in PACKAGES.get(f, ())})
    return [p for p in need if importlib.util.find_spec(p) is None]


def output_paths(onnx_path: str, formats) -> dict[str, str]:
    """{name: path} of the files `write_formats` writes for `formats` (name: openvino, openvino_fp16, onnx_int8,
    openvino_int8)."""
    stem = os.path.splitext(onnx_path)[0]
    paths = {"openvino": stem + ".xml", "openvino_fp16": stem + ".fp16.xml"} if "openvino" in formats else {}
    if "onnx_int8" in formats:
        paths["onnx_int8"] = stem + ".int8.onnx"
    if "openvino_int8" in formats:
        paths["openvino_int8"] = stem + ".int8.xml"
    return paths


def calibration_line(used: int, asked: int, source: str) -> str:
    """The line that says how many images the INT8 formats were calibrated on: `used`, the images really given to the
    quantisers (what FILE.ap.json records), never `asked` (--calibration_images) when the check `source` had fewer
    readable images; then it says so, and what gives more."""
    if used < asked:
        return (f"INT8 calibration on {used} images, not the {asked} of --calibration_images: the check source {source} "
                f"has {used} readable images (FILE.ap.json records {used}); for more, give a larger --check_source")
    return f"INT8 calibration on {used} images of {source}"


def head_nodes(onnx_path: str) -> list[str]:
    """Names of the ONNX nodes of the heads' last convolutions (`float_head`)."""
    import onnx

    graph = onnx.load(onnx_path, load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type == "Conv" and any(
        h.replace(".", "_") in n.name.replace(".", "_") or any(h in i for i in n.input) for h in HEAD_OUTPUT_NODES)]


def write_formats(onnx_path: str, formats, calibration: list[dict], float_head: bool = False) -> dict[str, str]:
    """Write the deployment formats of an exported FILE.onnx beside it.

    Args:
        onnx_path: the fp32 ONNX graph `export_retinanet.py` wrote.
        formats: any of DEPLOY_FORMATS.
        calibration: the quantisers' inputs, one dict per image {input name: np.ndarray} as the graph takes them
            (`prepare_input`); the more images, the better the activation ranges.
        float_head: keep the heads' last convolutions in float (quantised formats).
    Returns:
        {name: path} as `output_paths`.
    Raises:
        RuntimeError: a converter or quantiser failed (its message, one line).
    """
    paths = output_paths(onnx_path, formats)
    head = head_nodes(onnx_path) if float_head and set(formats) & set(QUANTISED) else []
    # the libraries' notes (ONNX Runtime's "consider pre-processing", NNCF's progress bars, torch's CUDA_HOME line
    # as nncf imports it) say nothing to act on here; their errors still show
    logging.disable(logging.WARNING)
    try:
        write_each(onnx_path, formats, paths, calibration, head)
    finally:
        logging.disable(logging.NOTSET)
    return paths


def write_each(onnx_path: str, formats, paths: dict, calibration: list[dict], head: list[str]) -> None:
    """`write_formats`'s work: each format converted (and quantised) from `onnx_path` to its path."""
    if "openvino" in formats or "openvino_int8" in formats:
        import openvino as ov

        ov_model = ov.convert_model(onnx_path)
        if "openvino" in formats:
            ov.save_model(ov_model, paths["openvino"], compress_to_fp16=False)
            ov.save_model(ov.convert_model(onnx_path), paths["openvino_fp16"], compress_to_fp16=True)
        if "openvino_int8" in formats:
            import nncf

            nncf.set_log_level(logging.ERROR)
            # OpenVINO names an ONNX node's op after it, a Conv with its bias split off as "NAME/WithoutBiases"
            ignored = nncf.IgnoredScope(patterns=[f"^{re.escape(n)}(/.*)?$" for n in head], validate=False) if head else None
            quantised = nncf.quantize(ov_model, nncf.Dataset(calibration, lambda x: x),
                                      subset_size=len(calibration), **({"ignored_scope": ignored} if ignored else {}))
            ov.save_model(quantised, paths["openvino_int8"], compress_to_fp16=False)
    if "onnx_int8" in formats:
        quantise_onnx(onnx_path, paths["onnx_int8"], calibration, head)


def quantise_onnx(onnx_path: str, out_path: str, calibration: list[dict], exclude: list[str]) -> None:
    """ONNX Runtime static quantisation: QDQ, int8 weights per channel, uint8 activations (MinMax on `calibration`),
    convolutions only; `exclude`: node names kept float."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(calibration)

        def get_next(self):
            return next(self.items, None)

    quantize_static(onnx_path, out_path, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["Conv"],
                    nodes_to_exclude=exclude)
