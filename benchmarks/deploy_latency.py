"""CPU latency of the deployment formats against PyTorch eager, measured in one process: PyTorch fp32 (and bf16 where
the CPU has avx512_bf16 / AMX), ONNX Runtime fp32 / INT8, OpenVINO fp32 / INT8, at batch 1 and 8.

    python benchmarks/deploy_latency.py --model builtin --weights outputs/retinanet_builtin/best \
        --ap_json outputs/retinanet_builtin/export/retinanet.ap.json --out benchmarks/results_deploy.json
    python benchmarks/deploy_latency.py --model r50 --batch 1 --out benchmarks/results_deploy.json
    python benchmarks/deploy_latency.py --model r50 --batch 8 --out benchmarks/results_deploy.json
    python benchmarks/deploy_latency.py --table benchmarks/results_deploy.json   # the markdown table

What is timed: the network (backbone, FPN, heads: images -> cls_logits, box_deltas), the same graph
`export_retinanet.py --decode outside` writes, here with a batch dimension of 1 or 8. The decoding (top-k, NMS)
costs the same whatever ran the network and is left out. Each runtime gets the same threads (--threads, default
every core) and the same real images (the COCO subset's, resized to the canvas); the median of --repeats runs after
a warm-up run. The INT8 graphs are made by `detlib.deploy.write_formats` (the export's own code), calibrated on
--calibration_batches batches of real images. `--model r50`: a ResNet-50 RetinaNet (80 classes, 256-channel FPN) at
640 px, randomly initialised (latency does not depend on the weights; it has no AP). `--model builtin`: trained
weights at their own size; AP beside each comes from the export's FILE.ap.json (--ap_json, the whole val set),
PyTorch bf16's is measured here on the same set.
Each invocation merges its rows into --out (one entry per model and batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python benchmarks/deploy_latency.py`
    sys.path.insert(0, REPO)

RUNTIMES = ("pytorch", "pytorch_bf16", "onnx", "onnx_int8", "openvino", "openvino_int8")


def cpu_has_bf16() -> bool:
    """The CPU's flags (lscpu) name native bf16 arithmetic: avx512_bf16 or AMX."""
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def real_images(canvas: int, count: int):
    """[count, 3, canvas, canvas] float32 0..255: the COCO subset's images, resized with padding as the export's input."""
    import numpy as np
    import torch

    from detlib.data.images import load_rgb
    from detlib.retinanet.export import prepare_input
    from devtools.peers import COCO_IMAGES

    files = sorted(os.path.join(COCO_IMAGES, f) for f in os.listdir(COCO_IMAGES))[:count]
    return torch.cat([prepare_input(torch.from_numpy(np.asarray(load_rgb(f)[0]).copy()).permute(2, 0, 1), canvas, None,
                                    canvas)["images"] for f in files])


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def build_model(args):
    """(model in eval mode, canvas px, model_config)."""
    from detlib.inference import load_retinanet, retinanet_input_size
    from detlib.retinanet import build_retinanet_from_config, canvas_size

    if args.model == "builtin":
        model, config, _ = load_retinanet(args.weights)
        image_size, max_size = retinanet_input_size(config, args.weights)
        return model, canvas_size(image_size, max_size), config
    config = {"num_classes": 80, "backbone": "resnet50", "fpn_channels": 256, "mean": [0.485, 0.456, 0.406],
              "std": [0.229, 0.224, 0.225], "image_size": 640, "max_size": None}
    return build_retinanet_from_config(config).eval(), 640, config


def bf16_ap(args, model, config) -> float | None:
    """PyTorch bf16's COCO AP on the run's val set (the export's AP check, a bf16 runner in it)."""
    import torch

    from detlib.deploy import TorchRunner, ap_of_runners
    from detlib.inference import retinanet_input_size
    from detlib.retinanet import AnchorGenerator
    from detlib.weights import run_config_of

    cfg, _ = run_config_of(args.weights)
    if not cfg.get("data_val_annotations"):
        return None
    fp32 = TorchRunner(model, AnchorGenerator())

    def bf16(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fp32(batch)

    image_size, max_size = retinanet_input_size(config, args.weights)
    ap = ap_of_runners({"bf16": bf16}, cfg["data_val_annotations"], cfg["data_val_images"], image_size, max_size,
                       config["category_ids"])
    return ap["bf16"]["AP"]


def measure(args) -> dict:
    import torch

    from detlib.deploy import write_formats
    from detlib.deploy.runner import open_session
    from detlib.retinanet import ExportableRetinaNet

    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    model, canvas, config = build_model(args)
    bf16 = cpu_has_bf16()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for batch in args.batch:
            images = real_images(canvas, batch * (args.calibration_batches + 1))
            x, calibration = images[:batch], [{"images": images[i:i + batch].numpy()}
                                              for i in range(batch, len(images), batch)]
            onnx_path = os.path.join(tmp, f"b{batch}.onnx")
            torch.onnx.export(ExportableRetinaNet(model, canvas, decode=False).eval(), (x,), onnx_path, dynamo=True,
                              input_names=["images"], output_names=["cls_logits", "box_deltas"], external_data=False)
            paths = {"onnx": onnx_path, **write_formats(onnx_path, ["openvino", "onnx_int8", "openvino_int8"], calibration)}
            seconds = {"pytorch": timed(lambda: model(x), args.repeats)}
            if bf16:
                def run_bf16():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        model(x)
                seconds["pytorch_bf16"] = timed(run_bf16, args.repeats)
            for name in ("onnx", "onnx_int8", "openvino", "openvino_int8"):
                session, arrays = open_session(paths[name], threads), [x.numpy()]
                seconds[name] = timed(lambda: session(arrays), args.repeats)
            rows[f"{args.model} b{batch}"] = {
                "model": args.model, "canvas": canvas, "batch": batch, "threads": threads,
                "ms_per_image": {k: round(1000 * v / batch, 2) for k, v in seconds.items()},
                "speedup_vs_pytorch": {k: round(seconds["pytorch"] / v, 2) for k, v in seconds.items()}}
            print(json.dumps(rows[f"{args.model} b{batch}"]), flush=True)
    if args.model == "builtin":
        ap = {}
        if args.ap_json:
            with open(args.ap_json) as f:
                ap = {k: v["AP"] for k, v in json.load(f)["ap"].items()}
        if bf16:
            ap["pytorch_bf16"] = bf16_ap(args, model, config)
        for row in rows.values():
            row["ap"] = ap
    return rows


def table(path: str) -> str:
    """The markdown table of a results file: per model and batch, ms per image and speed-up over PyTorch eager fp32."""
    with open(path) as f:
        results = json.load(f)
    names = {"pytorch": "PyTorch eager fp32", "pytorch_bf16": "PyTorch eager bf16", "onnx": "ONNX Runtime fp32",
             "onnx_int8": "ONNX Runtime INT8", "openvino": "OpenVINO fp32", "openvino_int8": "OpenVINO INT8"}
    keys = sorted(results, key=lambda k: (results[k]["model"] != "builtin", results[k]["batch"]))
    head = " | ".join(f"{results[k]['model']} {results[k]['canvas']} px, batch {results[k]['batch']}" for k in keys)
    lines = [f"| runtime | {head} | AP (built-in) |", "|---" * (len(keys) + 2) + "|"]
    ap = next((results[k].get("ap") for k in keys if results[k].get("ap")), {}) or {}
    for name, label in names.items():
        cells = []
        for k in keys:
            r = results[k]
            ms = r["ms_per_image"].get(name)
            cells.append("n/a" if ms is None else f"{ms:g} ms ({r['speedup_vs_pytorch'][name]:.2f}x)")
        lines.append(f"| {label} | {' | '.join(cells)} | {ap.get(name, 'n/a') if ap.get(name) is not None else 'n/a'} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from detlib.engine.flags import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", choices=["builtin", "r50"], default="builtin", help="the built-in run's model, or a "
                   "randomly initialised ResNet-50 RetinaNet at 640 px (latency only)")
    p.add_argument("--weights", help="--model builtin: the trained run (best/) (default: none, needed with builtin)")
    p.add_argument("--ap_json", help="--model builtin: export_retinanet.py's FILE.ap.json of these weights (default: "
                   "no AP column)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes measured")
    p.add_argument("--threads", type=int, help="threads of every runtime (default: every core)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (the median is kept)")
    p.add_argument("--calibration_batches", type=int, default=2, help="INT8 calibration batches")
    p.add_argument("--out", help="results json: this run's rows are merged into it (default: print only)")
    p.add_argument("--table", help="print the markdown table of a results json and stop (default: measure)")
    return p

def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return
    if args.model == "builtin" and not args.weights:
        p.error("--model builtin needs --weights")
    rows = measure(args)
    if args.out:
        old = json.load(open(args.out)) if os.path.isfile(args.out) else {}
        with open(args.out, "w") as f:
            json.dump({**old, **rows}, f, indent=1)


if __name__ == "__main__":
    main()
