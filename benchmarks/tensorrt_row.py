"""The TensorRT row of benchmarks/gpu_check.sh: engines built by `trtexec` from the ONNX export (decoding outside: the
network, as benchmarks/deploy_latency.py times it) of a ResNet-50 RetinaNet at 640 px (80 classes, random init:
latency does not depend on the weights), fp16 and INT8, batch 1 and 8, beside PyTorch eager on the same GPU.

    python benchmarks/tensorrt_row.py --out $OUT/tensorrt.md

INT8 here is trtexec's own (`--int8` without a calibration cache: placeholder ranges), a latency figure only; an
INT8 engine to deploy is calibrated (or built from a QDQ graph) and held to its AP like the CPU formats. Where there
is no CUDA GPU or no trtexec (TensorRT) the row is skipped with one line and exit 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def skip_reason() -> str | None:
    """Why the row cannot run here (None: it can): checked before torch is imported."""
    if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0:
        return "no CUDA GPU (nvidia-smi finds none)"
    if shutil.which("trtexec") is None:
        return "no trtexec on PATH (TensorRT: the NVIDIA TensorRT container, or pip install tensorrt and its bin/)"
    return None


def trtexec_ms(onnx_path: str, precision: str) -> float:
    """Median GPU compute time per batch, ms, of the engine trtexec builds from `onnx_path` in `precision`."""
    out = subprocess.run(["trtexec", f"--onnx={onnx_path}", f"--{precision}", "--noDataTransfers", "--useCudaGraph",
                          "--duration=5"], capture_output=True, text=True, check=True).stdout
    return float(re.search(r"GPU Compute Time: .*?median = ([0-9.]+) ms", out).group(1))


def build_parser() -> argparse.ArgumentParser:
    from detlib.engine.flags import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out", help="markdown file for the rows (default: print only)")
    return p

def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if why := skip_reason():
        print(f"TensorRT row skipped: {why}")
        return
    import torch

    from detlib.retinanet import ExportableRetinaNet, build_retinanet_from_config

    config = {"num_classes": 80, "backbone": "resnet50", "fpn_channels": 256, "mean": [0.485, 0.456, 0.406],
              "std": [0.229, 0.224, 0.225]}
    model = build_retinanet_from_config(config).eval()
    rows = ["| TensorRT (R50 RetinaNet, 640 px) | batch 1 ms/image | batch 8 ms/image |", "|---|---|---|"]
    cells = {"PyTorch eager fp16": [], "TensorRT fp16": [], "TensorRT INT8": []}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for batch in (1, 8):
            x = torch.rand(batch, 3, 640, 640) * 255
            path = os.path.join(tmp, f"b{batch}.onnx")
            torch.onnx.export(ExportableRetinaNet(model, 640, decode=False).eval(), (x,), path, dynamo=True,
                              input_names=["images"], output_names=["cls_logits", "box_deltas"], external_data=False)
            gpu, xg = model.cuda().half(), x.cuda().half()
            for _ in range(5):
                gpu(xg)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                gpu(xg)
            torch.cuda.synchronize()
            cells["PyTorch eager fp16"].append(1000 * (time.perf_counter() - t) / 20 / batch)
            model = model.float().cpu()
            cells["TensorRT fp16"].append(trtexec_ms(path, "fp16") / batch)
            cells["TensorRT INT8"].append(trtexec_ms(path, "int8") / batch)
    base = cells["PyTorch eager fp16"]
    for name, ms in cells.items():
        rows.append(f"| {name} | " + " | ".join(f"{m:.2f} ({b / m:.2f}x)" for m, b in zip(ms, base)) + " |")
    text = "\n".join(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
