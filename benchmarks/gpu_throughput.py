"""Training throughput on one GPU: detlib's R50-FPN RetinaNet against torchvision's with the same weights, and the
data loader that has to feed it. Run by `benchmarks/gpu_check.sh`; alone:

    python benchmarks/gpu_throughput.py                  # one CUDA GPU, <= --deadline_s (250 s)
    python benchmarks/gpu_throughput.py --quick          # the same stages on the CPU, tiny sizes (about a minute)

Measured in one process, each after warm-up steps (cuDNN's autotuner off, as in the scripts), `--steps` timed steps:
* train images/s and peak memory at 800 x 1333 and at 800 x 800 (both padded to multiples of 32, as the
  collate pads), batch `--batch_size`, in fp32 (PyTorch's defaults: TF32 convolutions, fp32 matmuls), bf16
  (autocast) and fp16 (autocast + GradScaler); detlib in channels_last with its frozen BatchNorm folded,
  torchvision as it comes, both training every backbone stage, SGD;
* at 800 x 800 bf16: detlib in NCHW (what channels_last gives), the host-device syncs of one step;
* the data loader: images/s of the training pipeline (decode, 800 / 1333 resize, flip_crop_translate, collate)
  with `--num_workers` workers (16: the H200 machine's cores);
* detlib under torch.compile (`--compile_backend`, dynamic shapes as `--compile` runs them): 800 x 800 bf16, then
  800 x 1333 bf16 on the same compiled model (its second graph), each with its compile + warm-up time; last,
  since it is the longest stage.
A stage that would end past `--deadline_s` is skipped and says so. `--out` (gpu_results.json) is rewritten after every stage, so a
run stopped by its time limit keeps what it measured; `benchmarks/gpu_report.py` turns it into the table.
Images: the shared COCO subset when it is there (`DETLIB_COCO_SUBSET`, or ../shared/data/coco_subset), else the
built-in synthetic set (the throughput depends on the image size, not its content).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kit import COCO_IMAGES, COCO_TRAIN_JSON, Kit, build_model_pair, peer_input_size, real_batch  # noqa: E402

from detlib.engine.flags import HelpFormatter  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized run that checks the script works")
    p.add_argument("--batch_size", type=int, help="images per step (default: 16; 1 with --quick)")
    p.add_argument("--steps", type=int, help="timed steps per measurement (default: 10; 1 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed steps before each measurement (default: 2; 0 with --quick)")
    p.add_argument("--num_workers", type=int, help="data loader workers (default: min(16, cores); 2 with --quick)")
    p.add_argument("--compile_backend", help="torch.compile backend (default: inductor; eager with --quick: dynamo "
                   "alone, inductor's CPU compile of R50 takes minutes on 2 cores)")
    p.add_argument("--deadline_s", type=float, default=250.0,
                   help="a stage that would end after this (by its expected time on an H200) is skipped")
    p.add_argument("--stages", default="eager,channels_last,loader,compiled",
                   help="comma-separated stages to run: eager, channels_last, loader, compiled (gpu_check.sh runs the "
                        "compiled one in a process of its own, with its own limit)")
    p.add_argument("--append", action="store_true", help="add to the results already in --out instead of starting anew")
    p.add_argument("--table", help="after every stage, print the table rows measured since the last print and "
                   "rewrite this markdown file with the whole table (benchmarks/gpu_report.py's update; default: neither)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", os.path.dirname(os.path.abspath(__file__))),
                                                 "gpu_results.json"), help="where the results are written ($OUT when set)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    q = args.quick
    args.batch_size = args.batch_size or (1 if q else 16)
    args.steps = args.steps or (1 if q else 10)
    args.warmup = args.warmup if args.warmup is not None else (0 if q else 2)
    args.num_workers = args.num_workers if args.num_workers is not None else (2 if q else min(16, os.cpu_count() or 1))
    args.compile_backend = args.compile_backend or ("eager" if q else "inductor")
    # (name, (height, width)): the COCO 1x training size and MLPerf's square one; tiny stand-ins with --quick
    args.sizes = [("800x1333", (800, 1333)), ("800x800", (800, 800))] if not q else [("64x96", (64, 96)), ("64x64", (64, 64))]
    args.stages = set(args.stages.split(","))
    unknown = args.stages - {"eager", "channels_last", "loader", "compiled"}
    if unknown:
        build_parser().error(f"--stages: unknown {sorted(unknown)}")
    return args


def data_paths() -> dict:
    """The COCO-format set the batches and the loader read: the shared subset, else the built-in synthetic set."""
    if os.path.isfile(COCO_TRAIN_JSON):
        return {"images": COCO_IMAGES, "annotations": COCO_TRAIN_JSON, "source": "COCO subset (shared data)"}
    from detlib.data.builtin import make_synthetic_coco

    paths = make_synthetic_coco()
    return {"images": paths["train_images"], "annotations": paths["train_annotations"],
            "source": "built-in synthetic shapes (no COCO subset on this machine)"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_rate(kit: Kit, batch: dict, dtype, steps: int, warmup: int, model=None) -> dict:
    """Train images/s over `steps` steps after `warmup` ones, the peak memory of the timed steps, the time of the
    warm-up (which holds a compilation). An out-of-memory is a result ({"error": "out of memory"})."""
    scaler = torch.amp.GradScaler(kit.device.type, enabled=dtype == torch.float16)
    B = len(batch["images"]) if "images" in batch else len(batch["tv_images"])
    try:
        t0 = time.perf_counter()
        for _ in range(warmup):
            kit.train_step(batch, dtype, scaler, model)
        sync(kit.device)
        warm = time.perf_counter() - t0
        if kit.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            kit.train_step(batch, dtype, scaler, model)
        sync(kit.device)
        dt = time.perf_counter() - t0
    except torch.OutOfMemoryError:
        kit.optimizer.zero_grad(set_to_none=True)
        if kit.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"batch": B, "error": "out of memory"}
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if kit.device.type == "cuda" else None
    return {"batch": B, "images_per_s": B * steps / dt, "step_s": dt / steps, "peak_memory_gib": peak,
            "warmup_s": warm}


def count_syncs(kit: Kit, batch: dict) -> int | None:
    """Host-device synchronisations in one bf16 training step (CUDA only)."""
    if kit.device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            kit.train_step(batch, torch.bfloat16)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(kit.device)
    return sum("synchroniz" in str(w.message) for w in caught)


def loader_rate(args, paths: dict, seconds: float) -> dict:
    """Images/s of the training DataLoader (`--num_workers` workers) over the set, repeated, for about `seconds`
    after its first batch (worker start-up excluded)."""
    from detlib.data.coco import CocoDetection, collate_detection
    from detlib.data.transforms import build_transform

    size, max_size = (800, 1333) if not args.quick else (64, 96)
    ds = CocoDetection(paths["images"], paths["annotations"], build_transform(size, "flip_crop_translate", max_size))
    repeated = torch.utils.data.Subset(ds, [i % len(ds) for i in range(max(len(ds), 4096))])
    loader = torch.utils.data.DataLoader(repeated, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         num_workers=args.num_workers, collate_fn=collate_detection,
                                         pin_memory=torch.cuda.is_available(), persistent_workers=False)
    it = iter(loader)
    next(it)
    n, t0 = 0, time.perf_counter()
    for batch in it:
        n += len(batch["images"])
        if time.perf_counter() - t0 > seconds:
            break
    dt = time.perf_counter() - t0
    del it
    return {"images_per_s": n / dt, "images": n, "workers": args.num_workers, "batch": args.batch_size,
            "size": f"{size}/{max_size}",
            "setting": f"CocoDetection + build_transform({size}, 'flip_crop_translate', max_size {max_size}) + "
                       f"collate_detection, {args.num_workers} workers, {paths['source']}"}


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        sys.exit("no CUDA device: run with --quick to test the script on the CPU")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    paths = data_paths()
    print(f"device: {name}, torch {torch.__version__}, batch {args.batch_size}, images: {paths['source']}", flush=True)
    results = {"device": name, "torch": torch.__version__, "quick": args.quick, "batch_size": args.batch_size,
               "steps": args.steps, "cpu_count": os.cpu_count(), "data": paths["source"], "train": {}, "skipped": []}
    if args.append and os.path.isfile(args.out):
        with open(args.out) as f:
            results = {**results, **json.load(f)}

    def save():  # after every stage, so a run stopped by its time limit keeps what it measured
        results["total_s"] = time.perf_counter() - t_start
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        if args.table:
            import gpu_report

            gpu_report.update(os.path.dirname(os.path.abspath(args.out)), args.table)

    def due(stage: str, need_s: float) -> bool:
        """True when the stage, expected to take `need_s` (on an H200; nothing with --quick), ends before the deadline."""
        if time.perf_counter() - t_start + (0 if args.quick else need_s) <= args.deadline_s:
            return True
        results["skipped"].append(stage)
        print(f"{stage}: skipped (it would end past --deadline_s {args.deadline_s:.0f} s)", flush=True)
        return False

    data = {"images": paths["images"], "annotations": paths["annotations"]}
    ours, peer, _ = build_model_pair(64, 1, **data)
    kits = {"detlib": Kit(ours, device, channels_last=True), "torchvision": Kit(peer, device)}
    batches = {}
    for size_name, (h, w) in args.sizes:
        base = real_batch((h, w), min(args.batch_size, 8), **data)
        batches[size_name] = {k: kit.batch(base, args.batch_size) for k, kit in kits.items()}
    # cuDNN's autotuner off, as the training scripts leave it: their aspect-ratio batches change shape from step to
    # step, and on an H200 the autotuning of one (shape, dtype) took 19-28 s of warm-up in the first GPU check
    torch.backends.cudnn.benchmark = False

    # 1. eager training: bf16 at both sizes first (the square one, MLPerf's, first), then fp32, then fp16
    order = [(d, size) for d in ("bf16", "fp32", "fp16") for size in sorted(args.sizes, key=lambda s: s[1][0] != s[1][1])]
    for dname, (size_name, (h, w)) in order if "eager" in args.stages else []:
        peer_input_size(peer, h, w)
        for kit_name, kit in kits.items():
            stage = f"train {size_name} {dname} {kit_name}"
            if not due(stage, 10):
                continue
            r = train_rate(kit, batches[size_name][kit_name], DTYPES[dname], args.steps, args.warmup)
            results["train"].setdefault(size_name, {}).setdefault(kit_name, {})[dname] = r
            print(f"{stage}: {r.get('images_per_s', 0):.1f} images/s, peak {r.get('peak_memory_gib') or 0:.1f} GiB "
                  f"{r.get('error', '')} ({time.perf_counter() - t_start:.0f} s)", flush=True)
            save()

    # 2. channels_last: detlib in NCHW at the square size, bf16; the syncs of one step
    square = next(n for n, (h, w) in args.sizes if h == w)
    if "channels_last" in args.stages and due("channels_last", 10):
        # a copy of the same model in the default memory format (Kit converts only to channels_last)
        ours_nchw = Kit(copy.deepcopy(ours).to(memory_format=torch.contiguous_format), device, channels_last=False)
        r = train_rate(ours_nchw, ours_nchw.batch(real_batch(dict(args.sizes)[square], min(args.batch_size, 8), **data),
                                                  args.batch_size), torch.bfloat16, args.steps, args.warmup)
        results["detlib_nchw_bf16"] = {"size": square, **r}
        del ours_nchw
        print(f"detlib NCHW {square} bf16: {r.get('images_per_s', 0):.1f} images/s", flush=True)
        results["syncs_per_train_step_bf16"] = count_syncs(kits["detlib"], batches[square]["detlib"])
        save()

    # 3. the data loader
    if "loader" in args.stages and due("loader", 30):
        results["loader"] = loader_rate(args, paths, 5.0 if args.quick else 20.0)
        print(f"data loader: {results['loader']['images_per_s']:.1f} images/s with {args.num_workers} workers", flush=True)
        save()

    # 4. torch.compile, as --compile runs it (dynamic shapes after the first recompile)
    compiled = None
    for size_name in [square] + [n for n, _ in args.sizes if n != square] if "compiled" in args.stages else []:
        stage = f"compiled {size_name} bf16"
        if not due(stage, 100):  # inductor's compile of the forward and backward graphs, then the timed steps
            continue
        try:
            if compiled is None:
                compiled = torch.compile(kits["detlib"].model, backend=args.compile_backend)
            # at least one untimed step: the compilation
            r = train_rate(kits["detlib"], batches[size_name]["detlib"], torch.bfloat16, args.steps,
                           max(1, args.warmup), compiled)
        except Exception as e:  # a failure is a finding, not a reason to lose the other numbers
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
        from torch._dynamo.utils import counters

        r.update(backend=args.compile_backend, graphs=counters["stats"].get("unique_graphs", 0))
        results.setdefault("compiled_bf16", {})[size_name] = r
        print(f"{stage}: {r.get('images_per_s', 0):.1f} images/s (compile + warm-up {r.get('warmup_s', 0):.0f} s, "
              f"{r['graphs']} graph(s)) {r.get('error', '')}", flush=True)
        save()

    save()
    print(f"written {args.out} ({results['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
