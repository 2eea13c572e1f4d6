"""detlib against the kits a user would otherwise pick: torchvision's RetinaNet and pycocotools' COCOeval.

Every comparison runs in this one process on this machine: warm-up calls first, then rounds that call ours and
the peer back to back (the order flips each round, so a slow spell of a shared machine hits both), at least 5
after the warm-up for the model rows; the ratio ours / peer (lower is better) is the median of the rounds' paired
ratios, reported with their min-max and a 90 % interval (`paired_ratios`), so a change is told from noise.

    python benchmarks/run.py --quick                # fewer repeats: 6-15 min on 2 CPU cores, by their load
    python benchmarks/run.py                        # the full set (more repeats)
    python benchmarks/run.py --only assign_3000 coco_eval
    python benchmarks/run.py --quick --only compile model_ema   # ours compiled vs eager, with vs without EMA
    python benchmarks/run.py --threads 0            # torch's default threads (one per core) instead of 1

Writes `benchmarks/results.json` (`--out`): one object per benchmark (`train_step`, `inference`,
`assign_3000`, `coco_eval` with `ours_s`, `peer_s`, `ratio`; `data_pipeline` with
`images_per_s_per_worker`; `compile` and `model_ema`, ours against ours: the train step compiled vs eager, with
vs without the EMA update), plus the machine and the settings. `docs/benchmarks.md` explains each row.
The GPU figures come from `benchmarks/gpu_check.sh`, not from here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kit import NUM_CLASSES, Kit, build_model_pair  # noqa: E402  (kit puts the repository root on the path)
from devtools.peers import COCO_IMAGES, COCO_TRAIN_JSON, coco_eval_inputs, head_output_gap  # noqa: E402

from detlib.engine.flags import HelpFormatter  # noqa: E402
from detlib.evaluation.coco import STAT_NAMES, evaluate_coco  # noqa: E402
from detlib.retinanet.anchors import AnchorGenerator  # noqa: E402
from detlib.retinanet.matching import match_anchors  # noqa: E402

BENCHMARKS = ("train_step", "inference", "assign_3000", "coco_eval", "data_pipeline", "compile", "model_ema")
GOALS = {"train_step": 0.8, "inference": 0.7, "assign_3000": 1.0, "coco_eval": 0.05}  # coco_eval: issue 29
# The throughput the data loader must feed: the aim for one H200 (images/s).
GPU_IMAGES_PER_S = 100.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats (6-15 min on 2 CPU cores, by their load)")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks (default: all)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for both sides (0: torch's default, one per core). 1 by default: "
                        "on a machine shared with other jobs, OpenMP barriers make multi-thread timings swing 3-10x")
    p.add_argument("--image_size", type=int, default=512, help="train / inference input side in pixels")
    p.add_argument("--batch_size", type=int, default=2, help="images per train / inference step")
    p.add_argument("--coco_images", type=int, default=5000, help="images in the COCO evaluation benchmark")
    p.add_argument("--gpu_images_per_s", type=float, default=GPU_IMAGES_PER_S,
                   help="training throughput the data pipeline has to keep up with")
    p.add_argument("--compile_backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="torch.compile backend of the compile row")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.json"),
                   help="where the results are written")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def alternate(fns: dict, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Call every function `warmup` times, then `repeats` timed rounds, flipping the order each round.

    Returns:
        {name: [seconds of each timed call]}.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for r in range(repeats):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratios(ours: list[float], peer: list[float]) -> dict:
    """The ratio ours / peer of each round (the two calls of a round ran back to back, so a slow spell of a shared
    machine hits both) and its spread: {"ratio": the median, "ratio_min", "ratio_max", "ratio_p05", "ratio_p95" (a
    90 % interval of the rounds' ratios, `statistics.quantiles`' inclusive method), "pairs"}. A change of the median
    inside [ratio_min, ratio_max] is not told from noise."""
    ratios = [o / p for o, p in zip(ours, peer)]
    cuts = statistics.quantiles(ratios, n=20, method="inclusive") if len(ratios) > 1 else ratios * 19
    return {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_p05": cuts[0], "ratio_p95": cuts[-1], "pairs": len(ratios), "ratios": ratios}


def summarise(times: dict[str, list[float]], ours: str, peer: str, goal: float | None) -> dict:
    """Medians of each side's times, and the ratio as the median of the rounds' paired ratios with its spread
    (`paired_ratios`); `goal`: met when that median is at most it."""
    med = {name: statistics.median(t) for name, t in times.items()}
    out = {"ours_s": med[ours], "peer_s": med[peer], **paired_ratios(times[ours], times[peer])}
    if goal is not None:
        out.update(goal=goal, met=out["ratio"] <= goal)
    out["variants_median_s"] = med
    out["all_s"] = times
    return out


def peak_rss_gib(fn) -> tuple[object, float | None]:
    """Run fn(); return its result and the growth of the process's peak RSS during the call, in GiB.

    Resets the kernel's high-water mark first (`/proc/self/clear_refs`, Linux); None where unsupported.
    """
    def read(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        return None

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = read("VmRSS:")
    except OSError:
        return fn(), None
    result = fn()
    peak = read("VmHWM:")
    return result, (peak - base) / 2 ** 30 if peak and base else None


# ---------------------------------------------------------------- 1 + 2: train step and inference

def kit_variants(args, models, mode: str) -> dict[str, Kit]:
    """Fresh copies of both models as the scripts run them, NCHW (ours passes its inference input in channels_last
    on a CPU, `decode_batch`), and with the full run also each model converted to channels_last. `mode` is "train"
    or "eval"."""
    ours, peer, _ = models
    settings = {"ours": (ours, False), "peer": (peer, False)}
    if not args.quick:
        settings.update(ours_channels_last=(ours, True), peer_channels_last=(peer, True))
    kits = {name: Kit(copy.deepcopy(model), channels_last=cl) for name, (model, cl) in settings.items()}
    for kit in kits.values():
        kit.model.train(mode == "train")
    return kits


def bench_train_step(args, models) -> dict:
    """Forward + loss + backward + SGD step on the same batch, ours vs torchvision, both NCHW (the defaults)."""
    ours, peer, base = models
    kits = kit_variants(args, models, "train")
    batches = {name: kit.batch(base) for name, kit in kits.items()}
    times = alternate({name: (lambda k=kit, b=batches[name]: k.train_step(b)) for name, kit in kits.items()},
                      warmup=1, repeats=5 if args.quick else 9)
    out = summarise(times, "ours", "peer", GOALS["train_step"])
    out.update(setting=f"R50-FPN, {args.image_size}x{args.image_size} real COCO images, batch {args.batch_size}, fp32, "
                       "SGD; both NCHW (the training script's default), ours with folded frozen BN",
               head_logit_max_abs_diff=head_output_gap(ours, peer, base["images"]))
    return out


def bench_inference(args, models) -> dict:
    """Eval-mode forward + decoding to at most 100 detections per image, ours vs torchvision."""
    kits = kit_variants(args, models, "eval")
    batches = {name: kit.batch(models[2]) for name, kit in kits.items()}
    counts = {}

    def run(name):
        counts[name] = kits[name].infer(batches[name])

    times = alternate({name: (lambda n=name: run(n)) for name in kits}, warmup=1, repeats=5 if args.quick else 9)
    out = summarise(times, "ours", "peer", GOALS["inference"])
    out.update(setting=f"R50-FPN, {args.image_size}x{args.image_size}, batch {args.batch_size}, eval, score > 0.05, "
                       "top-1000 per level, NMS 0.5, 100 per image; models NCHW, ours through decode_batch (channels_last input "
                       "on a CPU)", detections_per_image=counts)
    return out


# ---------------------------------------------------------------- 6 + 7: --compile and --model_ema

def bench_compile(args, models) -> dict:
    """Our train step (NCHW, fp32) under torch.compile (`--compile_backend`) against the same model
    eager, same parameters and optimizer; the first compiled call (compilation) is timed on its own."""
    ours, _, base = models
    kit = Kit(copy.deepcopy(ours))
    kit.model.train()
    compiled = torch.compile(kit.model, backend=args.compile_backend)
    batch = kit.batch(base)
    t0 = time.perf_counter()
    kit.train_step(batch, model=compiled)
    first_call = time.perf_counter() - t0
    times = alternate({"compiled": lambda: kit.train_step(batch, model=compiled), "eager": lambda: kit.train_step(batch)},
                      warmup=1, repeats=5 if args.quick else 9)
    out = summarise(times, "compiled", "eager", None)
    out.update(setting=f"ours R50-FPN, {args.image_size}x{args.image_size}, batch {args.batch_size}, fp32, NCHW: "
                       f"torch.compile(backend={args.compile_backend!r}) vs eager", first_call_s=first_call)
    return out


def bench_model_ema(args, models) -> dict:
    """Our train step with and without the `--model_ema` update after it (timm's ModelEmaV3, foreach lerp over
    every parameter and buffer), and the update alone."""
    from timm.utils import ModelEmaV3

    ours, _, base = models
    kit = Kit(copy.deepcopy(ours))
    kit.model.train()
    ema = ModelEmaV3(kit.model, decay=0.9998, use_warmup=True, warmup_power=0.75)
    batch = kit.batch(base)
    times = alternate({"with_ema": lambda: kit.train_step(batch, ema=ema), "plain": lambda: kit.train_step(batch)},
                      warmup=1, repeats=5 if args.quick else 9)
    out = summarise(times, "with_ema", "plain", None)
    updates = alternate({"update": lambda: ema.update(kit.model, step=1000)}, warmup=2, repeats=20)["update"]
    out.update(setting=f"ours R50-FPN, {args.image_size}x{args.image_size}, batch {args.batch_size}, fp32, NCHW: "
                       "train step + ModelEmaV3.update vs train step",
               ema_update_s=statistics.median(updates),
               ema_update_fraction_of_step=statistics.median(updates) / out["peer_s"],
               ema_parameters=sum(t.numel() for t in ema.module.state_dict().values()))
    return out


# ---------------------------------------------------------------- 3: assignment with 3,000 boxes

def bench_assign(args) -> dict:
    """One 800 x 800 image with 3,000 boxes of 8 px (case B29): ours (chunked) vs box_iou + Matcher."""
    from torchvision.models.detection._utils import Matcher
    from torchvision.ops import box_iou

    gen = torch.Generator().manual_seed(0)
    anchors, _ = AnchorGenerator()(800, 800)
    corner = torch.rand(3000, 2, generator=gen) * (800 - 8)
    gt = torch.cat([corner, corner + 8], dim=1)
    labels = torch.randint(0, NUM_CLASSES, (3000,), generator=gen)
    matcher = Matcher(0.5, 0.4, allow_low_quality_matches=True)

    def ours():
        return match_anchors(anchors, gt[None], labels[None])[0]

    def peer():
        return matcher(box_iou(gt, anchors))

    chunked, ours_mem = peak_rss_gib(ours)
    reference, peer_mem = peak_rss_gib(peer)
    unchunked, unchunked_mem = peak_rss_gib(lambda: match_anchors(anchors, gt[None], labels[None], max_elements=1 << 40)[0])
    times = alternate({"ours": ours, "peer": peer}, warmup=1, repeats=5 if args.quick else 7)
    out = summarise(times, "ours", "peer", GOALS["assign_3000"])
    out.update(setting=f"{anchors.shape[0]} anchors x 3000 gt boxes of 8 px, fg 0.5 / bg 0.4, low-quality matches",
               same_as_unchunked=bool(torch.equal(chunked, unchunked)),
               same_as_torchvision=bool(torch.equal(chunked, reference)),
               peak_rss_growth_gib={"ours_chunked": ours_mem, "ours_unchunked": unchunked_mem, "peer": peer_mem},
               positives=int((chunked >= 0).sum()))
    return out


# ---------------------------------------------------------------- 4: COCO evaluation

def pycocotools_stats(gt: dict, results: list[dict]) -> list[float]:
    """Plain pycocotools, as a user would call it."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = gt
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes([dict(r) for r in results])  # loadRes writes into the dicts
        ev = COCOeval(coco_gt, coco_dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return [float(s) for s in ev.stats]


def bench_coco_eval(args) -> dict:
    """`evaluate_coco(backend="hotcoco")` (the "auto" backend) vs pycocotools' COCOeval on N images x 100 detections."""
    n = args.coco_images
    gt, results = coco_eval_inputs(n, 100)
    warm_gt, warm_results = coco_eval_inputs(20, 100, seed=1)
    stats = {}

    def ours():
        by_name, _ = evaluate_coco(gt, results, backend="hotcoco")
        stats["ours"] = [by_name[k] for k in STAT_NAMES]

    def peer():
        stats["peer"] = pycocotools_stats(gt, results)

    evaluate_coco(warm_gt, warm_results, backend="hotcoco")  # warm-up: imports, first allocations
    pycocotools_stats(warm_gt, warm_results)
    times = alternate({"ours": ours, "peer": peer}, warmup=0, repeats=2 if args.quick else 3)
    out = summarise(times, "ours", "peer", GOALS["coco_eval"])
    diff = max(abs(a - b) for a, b in zip(stats["ours"], stats["peer"]))
    out.update(setting=f"{n} images (copies of the subset's 130), {len(results)} detections, bbox",
               max_abs_stat_diff=diff, stats_identical=diff <= 1e-6, stats=dict(zip(STAT_NAMES, stats["peer"])))
    return out


# ---------------------------------------------------------------- 5: data pipeline

def bench_data_pipeline(args) -> dict:
    """Images per second of one loader worker: decode + COCO training transform at 600 px + collate."""
    from detlib.data.coco import CocoDetection, collate_detection
    from detlib.data.transforms import build_transform

    ds = CocoDetection(COCO_IMAGES, COCO_TRAIN_JSON, build_transform(600, "flip_crop_translate"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a DataLoader worker runs with one thread
    try:
        for i in range(4):  # warm-up
            ds[i]
        rates = []
        for _ in range(1 if args.quick else 3):
            t0 = time.perf_counter()
            for start in range(0, len(ds), args.batch_size):
                collate_detection([ds[i] for i in range(start, min(len(ds), start + args.batch_size))])
            rates.append(len(ds) / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(threads)
    rate = statistics.median(rates)
    return {"images_per_s_per_worker": rate, "all_images_per_s": rates, "images": len(ds),
            "gpu_images_per_s": args.gpu_images_per_s,
            "workers_to_keep_up": math.ceil(args.gpu_images_per_s / rate),
            "setting": "CocoDetection(instances_train.json) + build_transform(600, 'flip_crop_translate') + "
                       f"collate_detection, batch {args.batch_size}, 1 thread, real JPEGs"}


# ---------------------------------------------------------------- report

def machine_info() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_at_start": list(os.getloadavg()), "cuda": torch.cuda.is_available()}


def spread(r: dict) -> str:
    """"0.912 (0.880-0.951, 5 pairs)": the median paired ratio, its min-max over the rounds."""
    return f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}, {r['pairs']} pairs)"


def table(results: dict) -> str:
    rows = ["| benchmark | ours | peer | ratio ours/peer: median of the paired rounds (min-max) | goal | met |",
            "|---|---|---|---|---|---|"]
    for name in BENCHMARKS:
        r = results.get(name)
        if r is None:
            continue
        if name == "data_pipeline":
            rows.append(f"| data_pipeline | {r['images_per_s_per_worker']:.1f} images/s per worker | - | - | "
                        f"{r['workers_to_keep_up']} worker(s) feed {r['gpu_images_per_s']:.0f} images/s | - |")
            continue
        if name == "compile":
            rows.append(f"| compile ({results['args'].get('compile_backend', 'inductor')}) vs eager, train step | "
                        f"{r['ours_s']:.3f} s compiled | {r['peer_s']:.3f} s eager | {r['ratio']:.3f} | - | "
                        f"first call {r['first_call_s']:.0f} s |")
            continue
        if name == "model_ema":
            rows.append(f"| model_ema: train step + EMA update vs without | {r['ours_s']:.3f} s | {r['peer_s']:.3f} s | "
                        f"{r['ratio']:.3f} | - | update alone {r['ema_update_s'] * 1000:.1f} ms = "
                        f"{100 * r['ema_update_fraction_of_step']:.1f} % of a step |")
            continue
        rows.append(f"| {name} | {r['ours_s']:.3f} s | {r['peer_s']:.3f} s | {spread(r)} | "
                    f"<= {r['goal']} | {'yes' if r['met'] else 'NO'} |")
    return "\n".join(rows)


def main(argv=None):
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    selected = args.only or BENCHMARKS
    results = {"machine": machine_info(), "mode": "quick" if args.quick else "full",
               "args": {k: v for k, v in vars(args).items() if k != "out"}}
    print(f"machine: {results['machine']}", flush=True)
    t_start = time.perf_counter()
    models = None
    for name in BENCHMARKS:
        if name not in selected:
            continue
        t0 = time.perf_counter()
        if name in ("train_step", "inference", "compile", "model_ema"):
            models = models or build_model_pair(args.image_size, args.batch_size)
            results[name] = {"train_step": bench_train_step, "inference": bench_inference, "compile": bench_compile,
                             "model_ema": bench_model_ema}[name](args, models)
        elif name == "assign_3000":
            results[name] = bench_assign(args)
        elif name == "coco_eval":
            results[name] = bench_coco_eval(args)
        else:
            results[name] = bench_data_pipeline(args)
        r = results[name]
        summary = (f"{r['images_per_s_per_worker']:.1f} images/s per worker" if name == "data_pipeline"
                   else f"ours {r['ours_s']:.3f} s, peer {r['peer_s']:.3f} s, ratio {spread(r)}")
        print(f"{name}: {summary} ({time.perf_counter() - t0:.0f} s)", flush=True)
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    results["total_s"] = time.perf_counter() - t_start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print()
    print(table(results))
    print(f"\n{results['total_s']:.0f} s in all; results written to {args.out}")
    return results


if __name__ == "__main__":
    main()
