r"""Export a trained RetinaNet to ONNX (and / or a torch.export program) and check it against PyTorch.

ONNX with the decoding (top-k, NMS) inside, checked on 3 val images of the run (from its config.yaml):
    python scripts/export_retinanet.py --weights outputs/r50_600/best --output outputs/r50_600/retinanet.onnx

Raw head outputs only (decode outside, e.g. with detlib.retinanet.decode.decode_detections), plus a torch.export program:
    python scripts/export_retinanet.py --weights outputs/r50_600 --output model.onnx --decode outside --format both

Parity images from elsewhere (a folder, a glob, a file, or a COCO json with its image folder):
    python scripts/export_retinanet.py --weights RUN --output model.onnx --check_source val.json --check_images val2017/

OpenVINO (fp32, fp16) and INT8 (ONNX Runtime static quantisation, NNCF), calibrated on 32 val images (pip install -e
'.[export,deploy]'); each export's COCO AP on the labelled check set is written beside PyTorch's (FILE.ap.json), and
one that falls more than --max_ap_drop (1 AP point) below it exits 1 with both numbers and what to try:
    python scripts/export_retinanet.py --weights outputs/r50_600/best --output export/retinanet.onnx \
        --format openvino onnx_int8 openvino_int8 --calibration_images 64

The graph takes one image padded to a square canvas (the training size rounded up to a multiple of 32; with
--decode outside the ONNX graph takes any batch and padded size); see
detlib/retinanet/export.py for its inputs and outputs, and docs/predict_export.md for running it with onnxruntime. Beside
FILE.onnx it writes FILE.json (canvas, sizes, class ids and names, thresholds, input / output names) and
FILE.parity.json (the check's numbers). The check fails loudly (exit 1) when an image's detections differ
beyond the tolerance: labels not identical, a box more than --box_atol px off or a score more than --score_atol.
Detections whose scores tie within --score_atol (an early model's, all near the prior) may come in another order or,
at a cut-off, be another of the tied candidates: those are paired by score when the export's is one PyTorch's head
outputs give. The verdict says how many detections were compared, and a check that compared none (both find nothing
above --score_thresh) is no pass: exit 1, with what to do.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import warnings

import numpy as np

from detlib.deploy import DEPLOY_FORMATS
from detlib.engine import HelpFormatter, float_range, int_at_least, stop
from detlib.inference import list_image_files, load_retinanet, retinanet_input_size
from detlib.lazy import no_grad
from detlib.weights import weights_path

logger = logging.getLogger("export_retinanet")
FORMATS = ("onnx", "pt2", "both", *DEPLOY_FORMATS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--weights", required=True, help="a run folder, best/, last/, a checkpoint folder or a model.safetensors")
    g.add_argument("--image_size", type=int_at_least(32), help="resize size (default: the training size from "
                   "model_config.json)")
    g.add_argument("--max_size", type=int_at_least(32), help="longest side with --image_size as the shorter one "
                   "(default: model_config.json's)")
    g = p.add_argument_group("export")
    g.add_argument("--output", required=True, help="FILE.onnx (a .pt2 program goes beside it with --format pt2/both)")
    g.add_argument("--format", nargs="+", default=["onnx"], choices=FORMATS, metavar="FORMAT",
                   help="one or more of: onnx: FILE.onnx; pt2: a torch.export program FILE.pt2; both: onnx and pt2; "
                   "openvino: the OpenVINO IR FILE.xml (fp32) and FILE.fp16.xml; onnx_int8: FILE.int8.onnx (ONNX "
                   "Runtime static quantisation); openvino_int8: FILE.int8.xml (NNCF); each of the last three writes "
                   "FILE.onnx too (their source)")
    g.add_argument("--decode", default="inside", choices=["inside", "outside"],
                   help="inside: the graph returns boxes / scores / labels; outside: the raw head outputs")
    g.add_argument("--opset", type=int_at_least(7), default=18, help="ONNX opset version (the exporter may keep its own: said in one line)")
    g.add_argument("--score_thresh", type=float_range(0, 1), default=0.05,
                   help="lowest score the graph keeps (decode inside; as in the evaluation)")
    g.add_argument("--nms_thresh", type=float_range(0, 1, lo_open=True), default=0.5,
                   help="IoU of the graph's class-wise NMS (decode inside)")
    g.add_argument("--detections_per_image", type=int_at_least(1), default=100,
                   help="detections the graph returns at most (decode inside)")
    g = p.add_argument_group("quantisation and AP check")
    g.add_argument("--calibration_images", type=int_at_least(1), default=32,
                   help="images of the check source (the run's val set) the INT8 formats calibrate their ranges on")
    g.add_argument("--float_head", action="store_true", help="INT8 formats: keep the heads' last convolutions in float")
    g.add_argument("--max_ap_drop", type=float, default=1.0, help="largest drop of an export's COCO AP below PyTorch's, "
                   "in AP points on the labelled check set (more: exit 1)")
    g = p.add_argument_group("parity check")
    g.add_argument("--check_source", help="images for the check (default: the run's val set, from its config.yaml)")
    g.add_argument("--check_images", help="image folder of a COCO-json --check_source (default: the json's folder)")
    g.add_argument("--num_check_images", type=int_at_least(1), default=3,
                   help="images the export is compared with PyTorch on")
    g.add_argument("--box_atol", type=float_range(0), default=0.01, help="largest box coordinate difference allowed, pixels")
    g.add_argument("--score_atol", type=float_range(0), default=1e-5, help="largest score difference allowed")
    g.add_argument("--logit_atol", type=float_range(0), default=1e-3, help="decode outside: largest head output difference")
    g = p.add_argument_group("logging")
    g.add_argument("--verbose", action="store_true", help="also the INFO lines of the libraries (the ONNX exporter's)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_size is not None and args.image_size is not None and args.max_size < args.image_size:
        p.error(f"--max_size {args.max_size} is smaller than --image_size {args.image_size} (the shorter side)")
    written = output_files(args)
    for i, (kind, path) in enumerate(written.items()):
        for other, earlier in list(written.items())[:i]:
            if os.path.abspath(path) == os.path.abspath(earlier):
                p.error(f"--output {args.output}: the {kind} file would be {path}, the {other} file too (one would "
                        "replace the other); name it FILE.onnx")
    return args


def output_files(args) -> dict[str, str]:
    """{kind: path} of every file the export writes: FILE.onnx as --output, FILE.pt2, the deployment formats'
    (`detlib.deploy.formats.output_paths`), FILE.json, FILE.parity.json, FILE.ap.json."""
    from detlib.deploy import DEPLOY_FORMATS
    from detlib.deploy.formats import output_paths as deploy_paths

    stem = os.path.splitext(args.output)[0]
    formats = set(args.format)
    files = {"onnx": args.output} if formats & {"onnx", "both", *DEPLOY_FORMATS} else {}
    if formats & {"pt2", "both"}:
        files["pt2"] = stem + ".pt2"
    files.update(deploy_paths(args.output, formats))
    return {**files, "metadata": stem + ".json", "parity": stem + ".parity.json", "ap": stem + ".ap.json"}


def ignored_flags(args, defaults: dict) -> list[str]:
    """One line per flag given that this export does not use (said, not silently dropped)."""
    from detlib.deploy import QUANTISED

    changed = {k for k, v in defaults.items() if getattr(args, k, v) != v}
    quantised = set(args.format) & set(QUANTISED)
    unused = {"opset": args.format == ["pt2"] and "--format pt2 writes no ONNX graph",
              "calibration_images": not quantised and "no INT8 format (onnx_int8, openvino_int8) asked for",
              "float_head": not quantised and "no INT8 format (onnx_int8, openvino_int8) asked for",
              "logit_atol": args.decode == "inside" and "--decode inside compares detections (--box_atol, --score_atol)",
              "box_atol": args.decode == "outside" and "--decode outside compares the raw head outputs (--logit_atol)",
              "score_atol": args.decode == "outside" and "--decode outside compares the raw head outputs (--logit_atol)"}
    out = [f"--{k} {getattr(args, k)} is not used: {why}" for k, why in unused.items() if why and k in changed]
    if args.check_images and not (args.check_source and args.check_source.lower().endswith(".json")):
        out.append(f"--check_images {args.check_images} is not used: it is the image folder of a COCO-json --check_source")
    return out


def run_config(weights: str) -> dict:
    """The `config.yaml` of the run `weights` come from (their folder or up to two above: RUN/best/,
    RUN/checkpoints/epoch_0003/); {} when there is none or it does not parse (its val set is the default check)."""
    import yaml

    from detlib.weights import weights_path

    try:
        folder = os.path.dirname(os.path.abspath(weights_path(weights)))
    except FileNotFoundError:
        return {}
    for f in (os.path.join(folder, *[".."] * up, "config.yaml") for up in range(3)):
        if os.path.isfile(f):
            try:
                with open(f) as fh:
                    cfg = yaml.safe_load(fh)
            except (OSError, yaml.YAMLError):
                return {}
            return cfg if isinstance(cfg, dict) else {}
    return {}


def check_source(args) -> tuple[str | None, str | None]:
    """(the check images' source, the image folder of a COCO json source): --check_source, else the run's val set."""
    if args.check_source:
        return args.check_source, args.check_images
    cfg = run_config(args.weights)
    return cfg.get("data_val_annotations"), cfg.get("data_val_images")


def check_image_paths(args, count: int) -> list[str]:
    """The first `count` readable images of the check source (sorted by name / image id)."""
    from detlib.data import IMAGE_ERRORS, load_rgb
    from detlib.files import read_json

    source, image_dir = check_source(args)
    if count == 0 or not source:
        return []
    if source.lower().endswith(".json") and os.path.isfile(source):
        images = sorted(read_json(source)["images"], key=lambda im: im["id"])
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
        if len(readable) == count:
            break
    return readable


def compare(ref: tuple, got: tuple, args, candidates=None) -> dict:
    """Differences between the PyTorch reference and an export on one image (see `compare_detections`), with
    `num_compared`: the detections (decode inside) or head output values (outside) the verdict rests on."""
    from detlib.retinanet import compare_detections

    if args.decode == "outside":  # raw head outputs
        ref, got = [np.asarray(r) for r in ref], [np.asarray(g) for g in got]
        return {"max_abs_cls_logits": float(np.abs(ref[0] - got[0]).max()), "max_abs_box_deltas": float(np.abs(ref[1] - got[1]).max()),
                "num_compared": int(ref[0].size + ref[1].size)}
    d = compare_detections(ref, got, box_atol=args.box_atol, score_atol=args.score_atol, candidates=candidates,
                           score_thresh=args.score_thresh)
    return {**d, "num_compared": d["num_paired"] + d["num_tie_paired"]}


def passes(d: dict, args) -> bool:
    if "max_abs_cls_logits" in d:
        return d["max_abs_cls_logits"] <= args.logit_atol and d["max_abs_box_deltas"] <= args.logit_atol
    return d["labels_equal"] and d["max_abs_box_px"] <= args.box_atol and d["max_abs_score"] <= args.score_atol


def verdict(report: list[dict], args) -> tuple[str, str]:
    """("pass" | "fail" | "no verdict", the line that says what was compared)."""
    n_images = len({r["image"] for r in report})
    compared = sum(r["num_compared"] for r in report)
    failed = [f"{r['format']} {r['image']}" for r in report if not r["pass"]]
    if args.decode == "outside":
        worst = max(max(r["max_abs_cls_logits"], r["max_abs_box_deltas"]) for r in report)
        what = (f"raw head outputs compared on {n_images} images ({compared} values of cls_logits and box_deltas), "
                f"largest difference {worst:.3g} (tolerance {args.logit_atol:g})")
    else:
        ties = sum(r["num_tie_paired"] for r in report)
        what = (f"{compared} detections compared on {n_images} images ({compared - ties} paired within {args.box_atol:g} "
                f"px and score {args.score_atol:g}, {ties} paired by scores tied within {args.score_atol:g}, each one "
                f"PyTorch's head outputs give)")
    if failed:
        return "fail", f"{what}; beyond the tolerance on {', '.join(failed[:4])}{' ...' if len(failed) > 4 else ''}"
    if compared == 0:
        return "no verdict", (f"0 detections compared on {n_images} images: PyTorch and the export find none above "
                              f"--score_thresh {args.score_thresh:g} (an early model?), so nothing shows they agree; check "
                              "with --score_thresh 0, or --decode outside (the raw head outputs)")
    return "pass", what


# What --format onnx needs beyond requirements.txt: the exporter (torch.onnx's dynamo path uses onnxscript), the
# opset check (onnx) and the parity run (onnxruntime); pyproject's `export` extra installs them.
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")


def missing_onnx_packages() -> list[str]:
    """The ONNX_PACKAGES that are not installed (checked without importing them)."""
    return [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]


def hold_to_ap(args, files: dict, reference, image_size: int, max_size: int | None, category_ids: list[int],
               calibrated: int | None = None):
    """FILE.ap.json: the COCO AP of each model file (not the .pt2) beside PyTorch's on the check set when it is a
    COCO json, with the images the INT8 formats were calibrated on (`calibrated`: the number used, None without
    INT8); exit 1 when one fell more than --max_ap_drop below it. Returns the APs (None: no labelled set)."""
    from detlib.deploy import ExportRunner, QUANTISED, ap_of_runners, ap_verdict

    source, image_dir = check_source(args)
    stem = os.path.splitext(args.output)[0]
    if not (source and source.lower().endswith(".json") and os.path.isfile(source)):
        if set(args.format) & set(QUANTISED):
            logger.error("no AP check: the check source %s is not a COCO json with labels, and an INT8 model is only "
                         "written as a success once its AP is measured: give --check_source val.json", source)
            sys.exit(1)
        logger.warning("no AP check: the check source %s has no labels (a COCO json has)", source)
        return None
    runners = {"pytorch": reference, **{k: ExportRunner(p) for k, p in files.items() if k != "pt2"}}
    ap = ap_of_runners(runners, source, image_dir or os.path.dirname(source), image_size, max_size, category_ids)
    lines, failed = ap_verdict(ap, args.max_ap_drop)
    with open(stem + ".ap.json", "w") as f:
        json.dump({"source": source, "max_ap_drop": args.max_ap_drop, "ap": ap, "pass": not failed,
                   "calibration_images": calibrated,
                   "calibration_images_asked": args.calibration_images if set(args.format) & set(QUANTISED) else None,
                   "float_head": args.float_head}, f, indent=1)
    for line in lines:
        logger.info("AP on %d images of %s: %s", ap["pytorch"]["num_images"], os.path.basename(source), line)
    if failed:
        for line in failed:
            logger.error("AP check failed: %s", line)
        logger.error("the exported files are written but did not pass (%s.ap.json)", stem)
        sys.exit(1)
    return ap


def main(argv=None):
    return export(parse_args(argv))  # --help and a bad flag are answered before torch is imported


@no_grad
def export(args):
    import torch

    from detlib.data import PAD_VALUE, load_rgb
    from detlib.deploy import (DEPLOY_FORMATS, ExportRunner, QUANTISED, TorchRunner, calibration_line, missing_packages,
                               write_formats)
    from detlib.engine import setup_console_logging
    from detlib.retinanet import (AnchorGenerator, ExportableRetinaNet, canvas_size, decode_detections,
                                  head_candidates, prepare_input)
    from detlib.retinanet.export import dynamic_image_shapes

    setup_console_logging(args.verbose)
    wanted = output_files(args)
    if "onnx" in wanted and (missing := missing_onnx_packages() + missing_packages(args.format)):
        extras = "export,deploy" if set(args.format) & set(DEPLOY_FORMATS) else "export"
        stop(f"--format {' '.join(args.format)} needs {', '.join(missing)} (not installed): pip install -e "
             f"'.[{extras}]' (or -r requirements-dev.txt); --format pt2 needs nothing more", 1)
    try:
        model, config, category_map = load_retinanet(args.weights)
        image_size, max_size = retinanet_input_size(config, args.weights, args.image_size, args.max_size)
    except (FileNotFoundError, RuntimeError, KeyError) as e:
        stop(str(e), 1)
    # the exported graph has detlib's anchors and resize built in; a converted torchvision model's would differ
    foreign = [k for k in ("resize_mode", "anchor_offset", "anchor_sizes") if k in config
               and config[k] not in (None, "antialias")]
    if foreign:
        stop(f"{args.weights}: exporting a model with torchvision's settings ({', '.join(foreign)} in "
             "model_config.json) is not supported yet; evaluate or predict it with the scripts", 1)
    parser = build_parser()
    for line in ignored_flags(args, {k: parser.get_default(k) for k in vars(args)}):  # flags it does not use
        logger.warning("%s", line)
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
        if "onnx" in wanted:
            # decoding outside: any batch and padded size, so a runner feeds the evaluation's batches as they are
            outside = args.decode == "outside"
            torch.onnx.export(wrapped, (example[0].repeat(2, 1, 1, 1),) if outside else example, args.output,
                              input_names=inputs, output_names=outputs, opset_version=args.opset, dynamo=True,
                              dynamic_shapes=(dynamic_image_shapes(),) if outside else None, verbose=False,
                              external_data=False)  # one self-contained file (models under 2 GB)
            files["onnx"] = args.output
            import onnx

            written = max((o.version for o in onnx.load(args.output, load_external_data=False).opset_import
                           if o.domain in ("", "ai.onnx")), default=None)
            if written != args.opset:  # the exporter keeps its own opset when it cannot convert to the one asked for
                logger.warning("--opset %d could not be honoured: the exporter wrote opset %s (its version conversion "
                               "does not reach %d; the graph works with runtimes that support %s)", args.opset, written,
                               args.opset, written)
        if "pt2" in wanted:
            program = torch.export.export(wrapped, example)
            torch.export.save(program, stem + ".pt2")
            files["pt2"] = stem + ".pt2"
    meta = {**config, "canvas": canvas, "image_size": image_size, "max_size": max_size, "decode": args.decode,
            "opset": written if "onnx" in files else None,
            "inputs": inputs, "outputs": outputs, "pad_value": list(PAD_VALUE),
            "category_ids": category_map.category_ids, "category_names": category_map.names,
            "score_thresh": args.score_thresh, "nms_thresh": args.nms_thresh,
            "detections_per_image": args.detections_per_image, "weights": weights_path(args.weights)}
    with open(stem + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    calibrated = None
    if deploy := [f for f in args.format if f in DEPLOY_FORMATS]:  # from FILE.onnx; INT8 calibrated on real images
        calibration = [{k: v.numpy() for k, v in prepare_input(torch.from_numpy(np.asarray(load_rgb(p)[0]).copy()).permute(
            2, 0, 1), image_size, max_size, canvas).items() if k in inputs} for p in check_image_paths(args, args.calibration_images)]
        if not calibration and set(deploy) & set(QUANTISED):
            stop("the INT8 formats calibrate on real images: give --check_source (no val set in the run's "
                 "config.yaml)", 1)
        if set(deploy) & set(QUANTISED):  # the images really used, not the number asked for, said and recorded
            calibrated = len(calibration)
            logger.log(logging.WARNING if len(calibration) < args.calibration_images else logging.INFO, "%s",
                       calibration_line(len(calibration), args.calibration_images, check_source(args)[0]))
        files.update(write_formats(args.output, deploy, calibration, args.float_head))
    logger.info("wrote %s (canvas %dx%d, decoding %s) and %s.json", ", ".join(files.values()), canvas, canvas, args.decode, stem)

    # ---- parity: PyTorch (detlib's own decoding) against each export, on real images
    paths = check_image_paths(args, args.num_check_images)
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
    if "openvino" in files:
        runners["openvino"] = ExportRunner(files["openvino"]).raw
    anchors, counts = AnchorGenerator()(canvas, canvas)
    report = []
    for path in paths:
        pil, _ = load_rgb(path)
        x = prepare_input(torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1), image_size, max_size, canvas)
        out = model(x["images"])
        candidates = None
        if args.decode == "inside":
            d = decode_detections(out["cls_logits"], out["box_deltas"], anchors, counts, x["image_size"][None],
                                  x["scale"][None], score_thresh=args.score_thresh, nms_thresh=args.nms_thresh,
                                  max_detections=args.detections_per_image)
            ref = (d.boxes.numpy(), d.scores.numpy(), d.labels.numpy())
            # what PyTorch could return for this image: detections tied in score are checked against it
            candidates = head_candidates(out["cls_logits"], out["box_deltas"], anchors, x["image_size"], x["scale"])
        else:
            ref = (out["cls_logits"].numpy(), out["box_deltas"].numpy())
        for name, run in runners.items():
            diff = {"image": os.path.basename(path), "format": name, **compare(ref, run(x), args, candidates)}
            diff["pass"] = passes(diff, args)
            report.append(diff)
            logger.info("parity %s %s: %s", name, diff["image"], json.dumps({k: v for k, v in diff.items() if k not in ("image", "format")}))
    tolerance = ({"logits": args.logit_atol} if args.decode == "outside" else {"box_px": args.box_atol, "score": args.score_atol})
    outcome, line = verdict(report, args)
    with open(stem + ".parity.json", "w") as f:
        json.dump({"tolerance": tolerance, "images": report, "num_compared": sum(r["num_compared"] for r in report),
                   "verdict": outcome, "summary": line, "pass": outcome == "pass"}, f, indent=1)
    if outcome == "fail":
        logger.error("parity: export differs from PyTorch beyond the tolerance: %s; see %s.parity.json", line, stem)
        sys.exit(1)
    if outcome == "no verdict":
        logger.error("parity: no verdict: %s (the exported files are written; %s.parity.json)", line, stem)
        sys.exit(1)
    logger.info("parity on %d images: pass: %s", len(paths), line)

    # ---- AP: every exported model file evaluated on the labelled check set beside PyTorch
    ap = hold_to_ap(args, files, TorchRunner(model, AnchorGenerator(), args.score_thresh, args.nms_thresh,
                                             args.detections_per_image), image_size, max_size, category_map.category_ids,
                    calibrated)
    return {"files": files, "parity": report, "ap": ap}


if __name__ == "__main__":
    main()
