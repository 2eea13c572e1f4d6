"""Training and inference throughput on one GPU: detlib's R50-FPN RetinaNet vs torchvision's, same weights.

Run by `benchmarks/gpu_check.sh` (which also runs `train_retinanet.py` for 200 steps); alone:

    python benchmarks/gpu_throughput.py                 # one CUDA GPU, about 5 minutes on an H200
    python benchmarks/gpu_throughput.py --quick         # CPU smoke test: 64 px, batch <= 2, 2 steps

For each kit: the largest per-device batch that fits at 800 x 800 (doubling until out of memory; the
search runs in bf16, and fp16 needs the same memory), then train images/s in bf16 and in fp16 (autocast;
fp16 with a GradScaler), peak memory, eval images/s (bf16, decoding included), and how many host-device
syncs one bf16 training step makes (`torch.cuda.set_sync_debug_mode("warn")`). detlib runs
channels_last with its frozen BatchNorm folded; torchvision as it comes. If time is left before
`--deadline_s`, detlib is also timed under `torch.compile`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kit import Kit, build_model_pair  # noqa: E402

from detlib.flags import HelpFormatter  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized run that checks the script works")
    p.add_argument("--image_size", type=int, help="square input side (default: 800; 64 with --quick)")
    p.add_argument("--batch_sizes", type=int, nargs="+", help="candidates, tried in order until one does not fit "
                   "(default: 8 16 32 64 128 256; 1 2 with --quick)")
    p.add_argument("--steps", type=int, help="timed steps per measurement (default: 10; 2 with --quick)")
    p.add_argument("--deadline_s", type=float, default=330.0, help="skip the optional torch.compile stage after this")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", os.path.dirname(os.path.abspath(__file__))),
                                                 "gpu_results.json"), help="where the results are written ($OUT when set)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.image_size = args.image_size or (64 if args.quick else 800)
    args.batch_sizes = args.batch_sizes or ([1, 2] if args.quick else [8, 16, 32, 64, 128, 256])
    args.steps = args.steps or (2 if args.quick else 10)
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def fits(kit: Kit, base: dict, B: int, dtype) -> bool:
    """Two training steps at batch B; False on out-of-memory (and the memory is given back)."""
    scaler = torch.amp.GradScaler(kit.device.type, enabled=dtype == torch.float16)
    try:
        batch = kit.batch(base, B)
        for _ in range(2):
            kit.train_step(batch, dtype, scaler)
        sync(kit.device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        kit.optimizer.zero_grad(set_to_none=True)
        batch = None
        if kit.device.type == "cuda":
            torch.cuda.empty_cache()


def train_throughput(kit: Kit, base: dict, B: int, dtype, steps: int, model=None) -> dict:
    """Train images/s at batch B after two warm-up steps, and the peak memory of the timed steps."""
    scaler = torch.amp.GradScaler(kit.device.type, enabled=dtype == torch.float16)
    batch = kit.batch(base, B)
    for _ in range(2):
        kit.train_step(batch, dtype, scaler, model)
    sync(kit.device)
    if kit.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        kit.train_step(batch, dtype, scaler, model)
    sync(kit.device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if kit.device.type == "cuda" else None
    return {"batch": B, "images_per_s": B * steps / dt, "step_s": dt / steps, "peak_memory_gib": peak}


def infer_throughput(kit: Kit, base: dict, B: int, dtype, steps: int) -> dict:
    """Eval images/s at batch B (forward + decoding) after one warm-up call, and detections per image."""
    kit.model.eval()
    batch = kit.batch(base, B)
    kit.infer(batch, dtype)
    sync(kit.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        n = kit.infer(batch, dtype)
    sync(kit.device)
    dt = time.perf_counter() - t0
    kit.model.train()
    return {"batch": B, "images_per_s": B * steps / dt, "detections_per_image": sum(n) / B}


def count_syncs(kit: Kit, base: dict, B: int) -> int | None:
    """Host-device synchronisations in one bf16 training step (CUDA only)."""
    if kit.device.type != "cuda":
        return None
    batch = kit.batch(base, B)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    kit.train_step(batch, torch.bfloat16, scaler)
    sync(kit.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            kit.train_step(batch, torch.bfloat16, scaler)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(kit.device)
    return sum("synchroniz" in str(w.message) for w in caught)


def measure_kit(name: str, kit: Kit, base: dict, args, t_start: float) -> dict | None:
    """The largest batch that fits (bf16), train images/s in bf16 and fp16, eval images/s, syncs per step;
    None when the first candidate batch does not fit."""
    best = None
    torch.backends.cudnn.benchmark = False  # no autotuning for every batch size the search tries
    for B in args.batch_sizes:
        if not fits(kit, base, B, torch.bfloat16):
            break
        best = B
    torch.backends.cudnn.benchmark = True  # the timed batch size is autotuned in its warm-up steps
    if best is None:
        print(f"{name}: batch {args.batch_sizes[0]} does not fit", flush=True)
        return None
    r = {"max_batch": best}
    for dname, dtype in DTYPES.items():
        t = r[f"train_{dname}"] = train_throughput(kit, base, best, dtype, args.steps)
        print(f"{name} train {dname}: batch {best}, {t['images_per_s']:.1f} images/s, peak {t['peak_memory_gib'] or 0:.1f} "
              f"GiB  ({time.perf_counter() - t_start:.0f} s)", flush=True)
    r["infer_bf16"] = infer_throughput(kit, base, best, torch.bfloat16, args.steps)
    r["syncs_per_train_step_bf16"] = count_syncs(kit, base, min(best, 8))
    print(f"{name} inference bf16: {r['infer_bf16']['images_per_s']:.1f} images/s; host-device syncs per "
          f"train step: {r['syncs_per_train_step_bf16']}  ({time.perf_counter() - t_start:.0f} s)", flush=True)
    return r


def measure_compiled(kit: Kit, base: dict, B: int, steps: int) -> dict:
    """Train images/s of `torch.compile(kit.model)` in bf16, with the compile + warm-up time; a failure is
    returned as {"error": ...} (a finding, not a reason to lose the other numbers)."""
    t0 = time.perf_counter()
    try:
        r = train_throughput(kit, base, B, torch.bfloat16, steps, model=torch.compile(kit.model))
        r["compile_and_warmup_s"] = time.perf_counter() - t0 - r["step_s"] * steps
        print(f"detlib train bf16 torch.compile: {r['images_per_s']:.1f} images/s "
              f"(compile + warm-up {r['compile_and_warmup_s']:.0f} s)", flush=True)
        return r
    except Exception as e:
        print(f"torch.compile failed: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def print_table(kits: dict) -> None:
    print("\n| kit | batch | train bf16 img/s | train fp16 img/s | peak GiB | eval bf16 img/s | syncs/step |")
    print("|---|---|---|---|---|---|---|")
    for kit_name, r in kits.items():
        peak = r["train_bf16"]["peak_memory_gib"]
        print(f"| {kit_name} | {r['max_batch']} | {r['train_bf16']['images_per_s']:.1f} | "
              f"{r['train_fp16']['images_per_s']:.1f} | {peak if peak is None else f'{peak:.1f}'} | "
              f"{r['infer_bf16']['images_per_s']:.1f} | {r['syncs_per_train_step_bf16']} |")
    if {"detlib", "torchvision"} <= set(kits):
        a, b = kits["detlib"], kits["torchvision"]
        for key in ("train_bf16", "train_fp16", "infer_bf16"):
            print(f"{key}: detlib / torchvision throughput = {a[key]['images_per_s'] / b[key]['images_per_s']:.2f}x")


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    elif not args.quick:
        sys.exit("no CUDA device: run with --quick to test the script on the CPU")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, {args.image_size} px", flush=True)

    ours, peer, base = build_model_pair(args.image_size, 2)
    kits = {"detlib": Kit(ours, device, channels_last=True), "torchvision": Kit(peer, device)}
    results = {"device": name, "image_size": args.image_size, "torch": torch.__version__, "kits": {}}

    def save():  # after every stage, so a run stopped by its time limit keeps what it measured
        results["total_s"] = time.perf_counter() - t_start
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    for kit_name, kit in kits.items():
        r = measure_kit(kit_name, kit, base, args, t_start)
        if r is not None:
            results["kits"][kit_name] = r
            save()

    if "detlib" in results["kits"] and time.perf_counter() - t_start < args.deadline_s:
        B = results["kits"]["detlib"]["max_batch"]
        results["kits"]["detlib"]["train_bf16_compiled"] = measure_compiled(kits["detlib"], base, B, args.steps)
        save()
    else:
        print("torch.compile stage skipped (past --deadline_s)", flush=True)

    print_table(results["kits"])
    save()
    print(f"written {args.out} ({results['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
