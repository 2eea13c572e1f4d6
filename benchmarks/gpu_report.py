"""The GPU check's one table (markdown, for README and docs/benchmarks.md as it is), from what
`benchmarks/gpu_check.sh` leaves in its results folder:

    gpu_results.json            benchmarks/gpu_throughput.py
    overfit_fp32.json, overfit_fp32_seed1.json, overfit_bf16.json     benchmarks/overfit_coco8.py --json_out
    train_run/metrics.jsonl, train_run/train.log                       the short train_retinanet.py run
    train_run_start.json                                               {"time": the launch's wall time}

    python3 benchmarks/gpu_report.py RESULTS_DIR                     # prints the table
    python3 benchmarks/gpu_report.py RESULTS_DIR --update TABLE_MD   # prints the rows measured since the last
                                                                     # call, rewrites TABLE_MD (gpu_check.sh)

A measurement that is missing (skipped past its deadline, failed, out of memory) is a dash with the reason. The
published figures beside the rows are the issue's: MLPerf Training's RetinaNet (a heavier ResNeXt50-FPN at
800 x 800 on OpenImages, with every optimisation of its submitters) and detectron2's R50 RetinaNet 1x.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys

MLPERF = ("MLPerf Training RetinaNet (ResNeXt50-FPN, 800x800, OpenImages, every trick): 119-121 img/s per A100, "
          "277-290 per H100, 300-315 per H200")
DETECTRON2 = {"fp32": "detectron2 R50 RetinaNet 1x: 7.0 img/s per 2080 Ti (fp32)",
              "fp16": "detectron2 R50 RetinaNet 1x: 8.1 img/s per 2080 Ti (fp16)"}
# overfit-8 AP of bf16 counts as equal to fp32's when it differs by no more than the fp32 seed-to-seed spread
# or this much, whichever is larger (200 steps on 8 images: the last evaluation moves by a few hundredths)
MIN_NOISE = 0.02


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_yaml(path: str) -> dict:
    try:
        import yaml

        with open(path) as f:
            return yaml.safe_load(f) or {}
    except (OSError, ValueError, ImportError):
        return {}


def rate(r: dict | None) -> str:
    if not r:
        return "- (not run)"
    if "images_per_s" not in r:
        return f"- ({r.get('error', 'no result')[:60]})"
    return f"{r['images_per_s']:.1f} img/s"


def ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or "images_per_s" not in a or "images_per_s" not in b:
        return "-"
    return f"{a['images_per_s'] / b['images_per_s']:.2f}x"


def gib(r: dict | None) -> str:
    return f"{r['peak_memory_gib']:.1f} GiB" if r and r.get("peak_memory_gib") is not None else "-"


def train_run_line(folder: str) -> tuple[str, str]:
    """(img/s and steps, notes) of the short train_retinanet.py run."""
    metrics = os.path.join(folder, "metrics.jsonl")
    rows = []
    if os.path.isfile(metrics):
        for line in open(metrics):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    train = [r for r in rows if "images_per_s" in r]
    if not train:
        return "- (no train line)", "see train_run/train.log"
    rates = [r["images_per_s"] for r in train[1:]] or [train[0]["images_per_s"]]  # the first holds the compile
    evals = [r for r in rows if "AP" in r]
    notes = [f"{train[-1]['step']} steps, last loss {train[-1]['loss']:.3f}"]
    start = read_json(os.path.join(os.path.dirname(os.path.abspath(folder)), "train_run_start.json"))
    if start and "time" in train[0]:  # gpu_check.sh writes the launch's wall time: the compile shows here
        notes.append(f"first logged step (step {train[0]['step']}) {train[0]['time'] - start['time']:.0f} s after the launch")
    if evals:
        notes.append(f"AP {evals[-1]['AP']:.3f}" + (f", ema_AP {evals[-1]['ema_AP']:.3f}" if "ema_AP" in evals[-1] else ""))
    log = open(os.path.join(folder, "train.log")).read() if os.path.isfile(os.path.join(folder, "train.log")) else ""
    m = re.search(r"torch\.compile: (\d+) graph", log)
    if m:
        notes.append(f"{m.group(1)} compiled graph(s)")
    if train[-1].get("peak_memory_gib") is not None:
        notes.append(f"peak {train[-1]['peak_memory_gib']:.1f} GiB")
    return f"{statistics.median(rates):.1f} img/s (median of the log intervals after the first)", "; ".join(notes)


def table_parts(folder: str) -> tuple[str, list[str], str]:
    """(the heading line, the table's rows, the line of skipped stages) from what the check left in `folder`."""
    g = read_json(os.path.join(folder, "gpu_results.json")) or {}
    train = g.get("train", {})
    sizes = list(train) or ["800x1333", "800x800"]
    head = (f"GPU check on {g.get('device', '?')} (torch {g.get('torch', '?')}), batch {g.get('batch_size', '?')} per step, "
            f"{g.get('steps', '?')} timed steps after the warm-up, images: {g.get('data', '?')}"
            + ("; QUICK MODE on the CPU, tiny sizes: a check of the script, not a measurement" if g.get("quick") else ""))
    rows = ["| measurement | detlib | torchvision, same weights | detlib / torchvision | detlib peak memory | beside it |",
            "|---|---|---|---|---|---|"]
    for size in sizes:
        square = size.split("x")[0] == size.split("x")[1]
        for dname in ("fp32", "bf16", "fp16"):
            ours = train.get(size, {}).get("detlib", {}).get(dname)
            peer = train.get(size, {}).get("torchvision", {}).get(dname)
            ref = MLPERF if square and dname == "bf16" else ("" if square else DETECTRON2.get(dname, ""))
            rows.append(f"| train {size}, {dname} | {rate(ours)} | {rate(peer)} | {ratio(ours, peer)} | {gib(ours)} | {ref} |")
    square = next((s for s in sizes if s.split("x")[0] == s.split("x")[1]), None)
    eager = train.get(square, {}).get("detlib", {}).get("bf16") if square else None
    nchw = g.get("detlib_nchw_bf16")
    rows.append(f"| channels_last: detlib {square} bf16 in NCHW | {rate(nchw)} | - | channels_last / NCHW "
                f"{ratio(eager, nchw)} | {gib(nchw)} | |")
    for size, r in (g.get("compiled_bf16") or {}).items():
        base = train.get(size, {}).get("detlib", {}).get("bf16")
        rows.append(f"| torch.compile ({r.get('backend', '?')}): detlib {size} bf16 | {rate(r)} | - | compiled / eager "
                    f"{ratio(r, base)} | {gib(r)} | compile + warm-up {r.get('warmup_s', 0):.0f} s; "
                    f"{r.get('graphs', '?')} graph(s) so far |")
    if not g.get("compiled_bf16"):
        rows.append("| torch.compile: detlib bf16 | - (not run) | - | - | - | |")
    loader = g.get("loader")
    feed = f"{loader['images_per_s'] / eager['images_per_s']:.1f}x the eager bf16 {square} rate" \
        if loader and eager and "images_per_s" in eager else ""
    rows.append(f"| data loader, {loader['workers'] if loader else '?'} workers, {(loader or {}).get('size', '800/1333')} "
                f"flip_crop_translate + collate | "
                f"{rate(loader)} | - | - | - | {feed} |")
    syncs = g.get("syncs_per_train_step_bf16", "- (not run)")
    rows.append(f"| host-device syncs in one detlib train step (bf16) | {'- (CUDA only)' if syncs is None else syncs} "
                "| - | - | - | |")
    fits = {k: read_json(os.path.join(folder, f"overfit_{k}.json")) for k in ("fp32", "fp32_seed1", "bf16")}
    if fits["fp32"] and fits["bf16"]:
        diff = fits["bf16"]["AP"] - fits["fp32"]["AP"]
        noise = max(MIN_NOISE, abs(fits["fp32_seed1"]["AP"] - fits["fp32"]["AP"]) if fits["fp32_seed1"] else 0.0)
        verdict = "equal within noise" if abs(diff) <= noise else "NOT equal within noise"
        seed1 = f", fp32 seed 1 {fits['fp32_seed1']['AP']:.3f}" if fits["fp32_seed1"] else ""
        rows.append(f"| overfit 8 images (ResNet-18, {fits['fp32']['image_size']} px, {fits['fp32']['steps']} steps, "
                    f"train_retinanet.py): AP | fp32 {fits['fp32']['AP']:.3f}{seed1}, bf16 {fits['bf16']['AP']:.3f} | - | "
                    f"bf16 - fp32 = {diff:+.3f} | - | {verdict} (noise {noise:.3f}); {fits['fp32']['data']} |")
    else:
        rows.append("| overfit 8 images, AP fp32 vs bf16 | - (not run) | - | - | - | |")
    run_rate, notes = train_run_line(os.path.join(folder, "train_run"))
    cfg = read_yaml(os.path.join(folder, "train_run", "config.yaml"))
    precision = {"no": "fp32"}.get(cfg.get("mixed_precision"), cfg.get("mixed_precision", "?"))
    flags = (f"{precision}, --compile ({cfg.get('compile_backend', '?')}), --model_ema "
             f"{cfg.get('model_ema', '?')}, {cfg.get('image_size', '?')} px, batch {cfg.get('per_device_batch_size', '?')}")
    rows.append(f"| train_retinanet.py, built-in data: {flags} | {run_rate} | - | - | - | {notes} |")
    skipped = g.get("skipped") or []
    tail = f"Skipped past the deadline: {', '.join(skipped)}." if skipped else ""
    return head, rows, tail


def table(folder: str) -> str:
    head, rows, tail = table_parts(folder)
    return head + "\n\n" + "\n".join(rows) + ("\n\n" + tail if tail else "")


def update(folder: str, table_path: str | None = None) -> list[str]:
    """Print each row measured since the last call (the device call's output is what survives a kill) and rewrite
    `table_path` with the whole table. Rows already printed are kept in `folder`/rows_printed.json; a row
    still waiting for its measurement ("not run", "no train line") is not printed.

    Returns:
        the rows printed by this call."""
    state_path = os.path.join(folder, "rows_printed.json")
    printed = read_json(state_path) or []
    head, rows, tail = table_parts(folder)
    new = [r for r in rows[2:] if r not in printed and "(not run)" not in r and "(no train line)" not in r]
    for r in new:
        print(r, flush=True)
    with open(state_path, "w") as f:
        json.dump(printed + new, f)
    if table_path:
        with open(table_path, "w") as f:
            f.write(table(folder) + "\n")
    return new


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 3) or not os.path.isdir(argv[0]) or (len(argv) == 3 and argv[1] != "--update"):
        print("usage: python3 benchmarks/gpu_report.py RESULTS_DIR [--update TABLE_MD]", file=sys.stderr)
        return 2
    if len(argv) == 3:
        update(argv[0], argv[2])
    else:
        print(table(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
