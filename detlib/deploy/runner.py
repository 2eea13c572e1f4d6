"""An exported RetinaNet (FILE.onnx through ONNX Runtime, FILE.xml through OpenVINO) as one object called on a
batch of images, the way the evaluation and `scripts/predict_retinanet.py` call the PyTorch model plus its decoding.

A runner takes the evaluation's collated batch (`detlib.data.EvaluationCollate`) and returns each image's
detections. A graph without the decoding (`--decode outside`) takes the batch as it is (any batch and padded size)
and its raw head outputs are decoded by `decode_detections` with the caller's thresholds: PyTorch's detections to
float rounding. A graph with the decoding inside takes one image on its fixed square canvas
(`detlib.retinanet.export`): each image, already padded at the bottom / right with `PAD_VALUE`, is padded on to the
canvas and run alone, with the graph's own thresholds (FILE.json); where the evaluation pads an image to less than
the canvas (an image of another aspect ratio), the extra padding changes the features near its border and so can
change its detections (logged once; the AP check measures it).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from ..data.transforms import PAD_VALUE
from ..files import read_json
from ..retinanet.anchors import AnchorGenerator
from ..retinanet.decode import decode_detections
from ..retinanet.export import canvas_size

logger = logging.getLogger(__name__)

# FILE.onnx, FILE.xml and the variants `write_formats` names FILE.fp16.xml, FILE.int8.onnx, FILE.int8.xml all read FILE.json
EXPORTED_EXTENSIONS = (".onnx", ".xml")
VARIANT_SUFFIXES = (".fp16", ".int8")


def is_exported_model(path: str) -> bool:
    """True for a file `ExportRunner` runs (by its extension: .onnx, .xml)."""
    return str(path).lower().endswith(EXPORTED_EXTENSIONS) and os.path.isfile(path)


def metadata_path(model_path: str) -> str:
    """FILE.json of an exported model file: FILE.onnx, FILE.xml, FILE.fp16.xml, FILE.int8.onnx, FILE.int8.xml."""
    stem = os.path.splitext(model_path)[0]
    for suffix in VARIANT_SUFFIXES:
        if stem.endswith(suffix):
            return stem[: -len(suffix)] + ".json"
    return stem + ".json"


def open_session(path: str, threads: int | None = None):
    """A callable `inputs: list[np.ndarray] -> list[np.ndarray]` over the runtime the file's extension names.
    threads: the runtime's intra-op threads (None: its default, every core).
    Raises RuntimeError (one line) when the runtime is not installed."""
    import importlib.util

    runtime, extra = ("onnxruntime", "export") if path.lower().endswith(".onnx") else ("openvino", "deploy")
    if importlib.util.find_spec(runtime) is None:
        raise RuntimeError(f"running {path} needs {runtime} (not installed): pip install -e '.[{extra}]'")
    if path.lower().endswith(".onnx"):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        return lambda arrays: session.run(None, dict(zip(names, arrays)))
    import openvino as ov

    # f32 so that an fp32 IR runs in fp32 on a CPU the plugin would otherwise run in bf16 (AMX): a variant is what it says
    config = {"INFERENCE_PRECISION_HINT": "f32", **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
    compiled = ov.Core().compile_model(path, "CPU", config)
    request = compiled.create_infer_request()
    return lambda arrays: [np.asarray(v) for v in request.infer(arrays).values()]


class ExportRunner:
    """An exported model file run on batches of images.

    Args:
        path: FILE.onnx, FILE.xml, FILE.fp16.xml, FILE.int8.onnx or FILE.int8.xml, with FILE.json beside it.
        score_thresh, nms_thresh, max_detections: the decoding's (decode outside); default the export's FILE.json.
            A graph that decodes inside keeps its own (`meta`).
        threads: the runtime's threads (None: its default).
    Attributes:
        meta: FILE.json (the model_config keys, canvas, image_size, max_size, decode, category ids and names, the
            graph's thresholds).
    Raises:
        FileNotFoundError: no FILE.json beside the model (names both files).
    """

    def __init__(self, path: str, score_thresh: float | None = None, nms_thresh: float | None = None,
                 max_detections: int | None = None, threads: int | None = None):
        meta_file = metadata_path(path)
        if not os.path.isfile(meta_file):
            raise FileNotFoundError(f"{path}: no {meta_file} beside it (export_retinanet.py writes it with the model: "
                                    "canvas, sizes, classes); copy it with the model file")
        self.meta = read_json(meta_file)
        self.path, self.canvas, self.decode_inside = path, int(self.meta["canvas"]), self.meta["decode"] == "inside"
        self.score_thresh = self.meta["score_thresh"] if score_thresh is None else score_thresh
        self.nms_thresh = self.meta["nms_thresh"] if nms_thresh is None else nms_thresh
        self.max_detections = self.meta["detections_per_image"] if max_detections is None else max_detections
        self.warned = False
        self.session = open_session(path, threads)

    def size_refusal(self, image_size: int, max_size: int | None = None) -> str | None:
        """One line when images resized to `image_size` (`max_size`: the longer side's cap) cannot fit this graph's
        fixed canvas (decoding inside: the anchors of that canvas are constants in it), saying the export's size and
        how to predict or re-export; None when they fit, or the graph takes any size (decoding outside)."""
        need = canvas_size(image_size, max_size)
        if not self.decode_inside or need <= self.canvas:
            return None
        m = self.meta
        own = f"{m['image_size']} px" + (f" (longer side at most {m['max_size']})" if m.get("max_size") else "")
        asked = f"--image_size {image_size}" + (f" --max_size {max_size}" if max_size else "")
        return (f"{self.path} was exported for images of {own} on a fixed {self.canvas}x{self.canvas} canvas (decoding "
                f"inside): {asked} needs a {need}x{need} one; predict without --image_size (the export's "
                f"{m['image_size']}), or export again with {asked} (or with --decode outside, which takes any size)")

    def differs(self, score_thresh: float, nms_thresh: float, max_detections: int) -> str | None:
        """One line saying which of these a graph that decodes inside cannot honour (its own are built in), or None."""
        if not self.decode_inside:
            return None
        m, off = self.meta, []
        if score_thresh < m["score_thresh"]:
            off.append(f"score threshold {score_thresh:g} (it keeps scores above {m['score_thresh']:g})")
        if nms_thresh != m["nms_thresh"]:
            off.append(f"NMS IoU {nms_thresh:g} (its own: {m['nms_thresh']:g})")
        if max_detections != m["detections_per_image"]:
            off.append(f"{max_detections} detections per image (its own: {m['detections_per_image']})")
        return (f"{self.path} decodes inside its graph and cannot apply the {', '.join(off)}; export it again with "
                "those values, or with --decode outside") if off else None

    def raw(self, inputs: dict[str, torch.Tensor]) -> list[np.ndarray]:
        """The graph's outputs for `prepare_input`'s dict (one image on the canvas)."""
        return self.session([inputs[k].numpy() for k in self.meta["inputs"]])

    def __call__(self, batch: dict) -> list[dict[str, torch.Tensor]]:
        """Detections of each image of a collated batch.

        Args:
            batch: {"images": [B, 3, H, W] uint8 (or float32 0..255) padded with PAD_VALUE, H, W <= canvas;
                "image_sizes": [B, 2] (h, w) resized; "scales": [B, 2] (sy, sx)}, on the CPU.
        Returns:
            per image {"boxes": [N, 4] float32 xyxy pixels of the original image, "scores": [N] float32 decreasing,
            "labels": [N] int64 0..K-1}.
        Raises:
            ValueError: an image larger than the canvas (another --image_size than the export's).
        """
        images = batch["images"]
        if not self.decode_inside:  # the graph takes the batch as it is (`dynamic_image_shapes`): PyTorch's inputs
            cls_logits, box_deltas = (torch.from_numpy(np.asarray(o)).float() for o in self.session([images.float().numpy()]))
            anchors, counts = AnchorGenerator()(*images.shape[-2:])
            return decode_detections(cls_logits, box_deltas, anchors, counts, batch["image_sizes"], batch["scales"],
                                     score_thresh=self.score_thresh, nms_thresh=self.nms_thresh,
                                     max_detections=self.max_detections).per_image(images.shape[0])
        if max(images.shape[-2:]) > self.canvas:  # a caller that did not ask `size_refusal` first
            raise ValueError(f"input {tuple(images.shape[-2:])} does not fit the {self.canvas}x{self.canvas} canvas of "
                             f"{self.path}: predict at the export's size ({self.meta['image_size']})")
        if tuple(images.shape[-2:]) != (self.canvas, self.canvas) and not self.warned:
            self.warned = True  # once: each such image is padded further than PyTorch pads it
            logger.warning("%s decodes inside its graph, on a %dx%d canvas: an image padded to %dx%d by the evaluation "
                           "is padded on to the canvas, which changes the features near its bottom / right border, so "
                           "its detections can differ from PyTorch's; an export with --decode outside runs each batch "
                           "as PyTorch does", self.path, self.canvas, self.canvas, *images.shape[-2:])
        found = []
        for i in range(images.shape[0]):
            x = torch.tensor(PAD_VALUE, dtype=torch.float32).view(1, 3, 1, 1).repeat(1, 1, self.canvas, self.canvas)
            x[0, :, : images.shape[2], : images.shape[3]] = images[i].float()
            size, scale = batch["image_sizes"][i].float(), batch["scales"][i].float()
            boxes, scores, labels = (torch.from_numpy(np.asarray(o)) for o in self.raw({"images": x, "image_size": size,
                                                                                         "scale": scale}))
            found.append({"boxes": boxes.float(), "scores": scores.float(), "labels": labels.long()})
        return found


class TorchRunner:
    """The PyTorch model plus `decode_detections`, called as `ExportRunner` is: the reference of the AP check.

    Args:
        model: the RetinaNet in eval mode; anchor_gen: its `AnchorGenerator`; score_thresh, nms_thresh,
        max_detections: the decoding's.
    """

    def __init__(self, model: torch.nn.Module, anchor_gen, score_thresh: float = 0.05, nms_thresh: float = 0.5,
                 max_detections: int = 100):
        self.model, self.anchor_gen = model, anchor_gen
        self.score_thresh, self.nms_thresh, self.max_detections = score_thresh, nms_thresh, max_detections

    @torch.no_grad()
    def __call__(self, batch: dict) -> list[dict[str, torch.Tensor]]:
        """As `ExportRunner.__call__`; the batch is run as it is (padded to a multiple of 32, as the evaluation runs it)."""
        images = batch["images"].float()
        out = self.model(images)
        anchors, counts = self.anchor_gen(*images.shape[-2:])
        return decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, batch["image_sizes"],
                                 batch["scales"], score_thresh=self.score_thresh, nms_thresh=self.nms_thresh,
                                 max_detections=self.max_detections).per_image(images.shape[0])
