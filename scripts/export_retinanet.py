r"""Export a trained RetinaNet to ONNX (and / or a torch.export program) and check it against PyTorch.

ONNX with the decoding (top-k, NMS) inside, checked on 3 val images of the run (from its config.yaml):
    python scripts/export_retinanet.py --weights outputs/r50_600/best --output outputs/r50_600/retinanet.onnx

Raw head outputs only (decode outside, e.g. with detlib.decode.decode_detections), plus a torch.export program:
    python scripts/export_retinanet.py --weights outputs/r50_600 --output model.onnx --decode outside --format both

Parity images from elsewhere (a folder, a glob, a file, or a COCO json with its image folder):
    python scripts/export_retinanet.py --weights RUN --output model.onnx --check_source val.json --check_images val2017/

The graph takes one image padded to a square canvas (the training size rounded up to a multiple of 32); see
detlib/export.py for its inputs and outputs, and README "Export" for running it with onnxruntime. Beside
FILE.onnx it writes FILE.json (canvas, sizes, class ids and names, thresholds, input / output names) and
FILE.parity.json (the check's numbers). The check fails loudly (exit 1) when an image's detections differ
beyond the tolerance: labels not identical, a box more than --box_atol px off or a score more than --score_atol.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

import numpy as np
import torch
import yaml

from detlib.anchors import AnchorGenerator
from detlib.data import PAD_VALUE
from detlib.decode import decode_detections
from detlib.export import ExportableRetinaNet, canvas_size, compare_detections, prepare_input
from detlib.flags import HelpFormatter, float_range, int_at_least
from detlib.images import IMAGE_ERRORS, load_rgb
from detlib.inference import list_image_files, load_retinanet
from detlib.runtime import setup_console_logging
from detlib.weights import weights_path

logger = logging.getLogger("export_retinanet")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--weights", required=True, help="a run folder, best/, last/, a checkpoint folder or a model.safetensors")
    g.add_argument("--image_size", type=int_at_least(32), help="resize size (default: the training size from "
                   "model_config.json)")
    g.add_argument("--max_size", type=int_at_least(32), help="longest side with --image_size as the shorter one "
                   "(default: model_config.json's)")
    g = p.add_argument_group("export")
    g.add_argument("--output", required=True, help="FILE.onnx (a .pt2 program goes beside it with --format pt2/both)")
    g.add_argument("--format", default="onnx", choices=["onnx", "pt2", "both"],
                   help="onnx: FILE.onnx; pt2: a torch.export program FILE.pt2; both")
    g.add_argument("--decode", default="inside", choices=["inside", "outside"],
                   help="inside: the graph returns boxes / scores / labels; outside: the raw head outputs")
    g.add_argument("--opset", type=int_at_least(18), default=18, help="ONNX opset version")
    g.add_argument("--score_thresh", type=float_range(0, 1), default=0.05,
                   help="lowest score the graph keeps (decode inside; as in the evaluation)")
    g.add_argument("--nms_thresh", type=float_range(0, 1, lo_open=True), default=0.5,
                   help="IoU of the graph's class-wise NMS (decode inside)")
    g.add_argument("--detections_per_image", type=int_at_least(1), default=100,
                   help="detections the graph returns at most (decode inside)")
    g = p.add_argument_group("parity check")
    g.add_argument("--check_source", help="images for the check (default: the run's val set, from its config.yaml)")
    g.add_argument("--check_images", help="image folder of a COCO-json --check_source (default: the json's folder)")
    g.add_argument("--num_check_images", type=int_at_least(0), default=3,
                   help="images the export is compared with PyTorch on (0: no check)")
    g.add_argument("--box_atol", type=float_range(0), default=0.01, help="largest box coordinate difference allowed, pixels")
    g.add_argument("--score_atol", type=float_range(0), default=1e-5, help="largest score difference allowed")
    g.add_argument("--logit_atol", type=float_range(0), default=1e-3, help="decode outside: largest head output difference")
    g = p.add_argument_group("logging")
    g.add_argument("--verbose", action="store_true", help="also the INFO lines of the libraries (the ONNX exporter's)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run_config(weights: str) -> dict:
    """config.yaml of the run the weights come from (the weights' folder or up to two levels above), or {}."""
    folder = os.path.dirname(os.path.abspath(weights_path(weights)))
    for _ in range(3):
        f = os.path.join(folder, "config.yaml")
        if os.path.isfile(f):
            with open(f) as fh:
                return yaml.safe_load(fh) or {}
        folder = os.path.dirname(folder)
    return {}


def check_image_paths(args) -> list[str]:
    """The first --num_check_images readable images of the check source (sorted by name / image id)."""
    source, image_dir = args.check_source, args.check_images
    if args.num_check_images == 0:
        return []
    if not source:
        cfg = run_config(args.weights)
        source, image_dir = cfg.get("data_val_annotations"), cfg.get("data_val_images")
        if not source:
            return []
    if source.lower().endswith(".json") and os.path.isfile(source):
        with open(source) as f:
            images = sorted(json.load(f)["images"], key=lambda im: im["id"])
        paths = [os.path.join(image_dir or os.path.dirname(source), im["file_name"]) for im in images]
    else:
        paths = list_image_files(source)[1]
    readable = []
    for p in paths:
        try:
            load_rgb(p)
        except IMAGE_ERRORS:
            continue
        readable.append(p)
        if len(readable) == args.num_check_images:
            break
    return readable


def compare(ref: tuple, got: tuple, args) -> dict:
    """Differences between the PyTorch reference and an export on one image (see `compare_detections`: a
    detection tied with the cap or the threshold within --score_atol may be another one)."""
    if args.decode == "outside":  # raw head outputs
        ref, got = [np.asarray(r) for r in ref], [np.asarray(g) for g in got]
        return {"max_abs_cls_logits": float(np.abs(ref[0] - got[0]).max()), "max_abs_box_deltas": float(np.abs(ref[1] - got[1]).max())}
    return compare_detections(ref, got, args.detections_per_image, args.score_thresh, args.score_atol)


def passes(d: dict, args) -> bool:
    if "max_abs_cls_logits" in d:
        return d["max_abs_cls_logits"] <= args.logit_atol and d["max_abs_box_deltas"] <= args.logit_atol
    return d["labels_equal"] and d["max_abs_box_px"] <= args.box_atol and d["max_abs_score"] <= args.score_atol


@torch.no_grad()
def main(argv=None):
    args = parse_args(argv)
    setup_console_logging(args.verbose)
    try:
        model, config, category_map = load_retinanet(args.weights)
    except (FileNotFoundError, RuntimeError, KeyError) as e:
        raise SystemExit(f"error: {e}") from None
    # the exported graph has detlib's anchors and resize built in; a converted torchvision model's would differ
    foreign = [k for k in ("resize_mode", "anchor_offset", "anchor_sizes") if k in config
               and config[k] not in (None, "antialias")]
    if foreign:
        raise SystemExit(f"error: {args.weights}: exporting a model with torchvision's settings ({', '.join(foreign)} in "
                         "model_config.json) is not supported yet; evaluate or predict it with the scripts")
    image_size = args.image_size or config.get("image_size") or 600
    max_size = args.max_size if args.image_size or args.max_size else config.get("max_size")
    canvas = canvas_size(image_size, max_size)
    wrapped = ExportableRetinaNet(model, canvas, decode=args.decode == "inside", score_thresh=args.score_thresh,
                                  nms_thresh=args.nms_thresh, max_detections=args.detections_per_image).eval()
    inputs = ["images", "image_size", "scale"] if args.decode == "inside" else ["images"]
    outputs = ["boxes", "scores", "labels"] if args.decode == "inside" else ["cls_logits", "box_deltas"]
    example = prepare_input(torch.zeros((3, canvas, canvas), dtype=torch.uint8), image_size, max_size, canvas)
    example = tuple(example[k] for k in inputs)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    stem = os.path.splitext(args.output)[0]
    files = {}
    with warnings.catch_warnings():
        if not args.verbose:  # the exporters' notes on traced shapes and deprecations are not actionable here
            warnings.simplefilter("ignore")
        if args.format in ("onnx", "both"):
            torch.onnx.export(wrapped, example, args.output, input_names=inputs, output_names=outputs,
                              opset_version=args.opset, dynamo=True, verbose=False,
                              external_data=False)  # one self-contained file (models under 2 GB)
            files["onnx"] = args.output
        if args.format in ("pt2", "both"):
            program = torch.export.export(wrapped, example)
            torch.export.save(program, stem + ".pt2")
            files["pt2"] = stem + ".pt2"
    meta = {**config, "canvas": canvas, "image_size": image_size, "max_size": max_size, "decode": args.decode,
            "inputs": inputs, "outputs": outputs, "pad_value": list(PAD_VALUE),
            "category_ids": category_map.category_ids, "category_names": category_map.names,
            "score_thresh": args.score_thresh, "nms_thresh": args.nms_thresh,
            "detections_per_image": args.detections_per_image, "weights": weights_path(args.weights)}
    with open(stem + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    logger.info("wrote %s (canvas %dx%d, decoding %s) and %s.json", ", ".join(files.values()), canvas, canvas, args.decode, stem)

    # ---- parity: PyTorch (detlib's own decoding) against each export, on real images
    paths = check_image_paths(args)
    if not paths:
        logger.warning("no parity check: %s", "--num_check_images 0" if args.num_check_images == 0 else
                       "no --check_source and no val set in the run's config.yaml")
        return {"files": files, "parity": None}
    runners = {}
    if "onnx" in files:
        import onnxruntime as ort

        session = ort.InferenceSession(files["onnx"], providers=["CPUExecutionProvider"])
        runners["onnx"] = lambda x: session.run(None, {k: x[k].numpy() for k in inputs})
    if "pt2" in files:
        loaded = torch.export.load(files["pt2"]).module()
        runners["pt2"] = lambda x: [t.numpy() for t in loaded(*(x[k] for k in inputs))]
    anchors, counts = AnchorGenerator()(canvas, canvas)
    report, ok = [], True
    for path in paths:
        pil, _ = load_rgb(path)
        x = prepare_input(torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1), image_size, max_size, canvas)
        out = model(x["images"])
        if args.decode == "inside":
            d = decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, x["image_size"][None],
                                  x["scale"][None], score_thresh=args.score_thresh, nms_thresh=args.nms_thresh,
                                  max_detections=args.detections_per_image)
            ref = (d.boxes.numpy(), d.scores.numpy(), d.labels.numpy())
        else:
            ref = (out["cls_logits"].numpy(), out["box_deltas"].numpy())
        for name, run in runners.items():
            diff = {"image": os.path.basename(path), "format": name, **compare(ref, run(x), args)}
            diff["pass"] = passes(diff, args)
            ok &= diff["pass"]
            report.append(diff)
            logger.info("parity %s %s: %s", name, diff["image"], json.dumps({k: v for k, v in diff.items() if k not in ("image", "format")}))
    tolerance = ({"logits": args.logit_atol} if args.decode == "outside" else {"box_px": args.box_atol, "score": args.score_atol})
    with open(stem + ".parity.json", "w") as f:
        json.dump({"tolerance": tolerance, "images": report, "pass": ok}, f, indent=1)
    if not ok:
        logger.error("export differs from PyTorch beyond the tolerance %s; see %s.parity.json", tolerance, stem)
        sys.exit(1)
    logger.info("parity on %d images: pass (tolerance %s)", len(paths), tolerance)
    return {"files": files, "parity": report}


if __name__ == "__main__":
    main()
