"""Memory of the training data set at COCO train scale, records as Python dicts vs flat arrays (detlib.data.records).

    python benchmarks/dataset_memory.py [--images 118287]

Generates a boxes-only COCO json of 118,287 images and 860,001 boxes (benchmarks/datacheck_118k.py) and a
folder of symbolic links to one small JPEG (the data set only checks that each file exists). For each variant, in
a fresh process: the resident memory the data set adds (RSS after building it, json freed, minus before), then
a forked child, standing in for one DataLoader worker, reads every record once; its private dirty memory grows
by what copy-on-read duplicated.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from detlib.engine.flags import HelpFormatter  # noqa: E402  (no torch: the measured child imports what it measures)


def _kib(field: str, path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def dict_records(records) -> list[dict]:
    """The peer of `detlib.data.records.CompactRecords`: one Python dict per image with its own small arrays, as the
    data set held its records before (`CocoDetection._index` builds them so)."""
    return [{**r, "boxes": r["boxes"].copy(), "labels": r["labels"].copy(), "iscrowd": r["iscrowd"].copy()}
            for r in records]


def measure(json_path: str, image_dir: str, compact: bool) -> dict:
    """`compact`: the data set as detlib builds it (flat arrays, the json dropped); else its peer, the records as a
    list of dicts (`dict_records`) beside the json dict."""
    from detlib.data.coco import CocoDetection

    gc.collect()
    before = _kib("VmRSS:", "/proc/self/status")
    ds = CocoDetection(image_dir, json_path, train=compact)  # an evaluation set keeps the json, as the peer did
    if not compact:
        ds.records = dict_records(ds.records)
    gc.collect()
    after = _kib("VmRSS:", "/proc/self/status")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "worker": read every record, as __getitem__ does over an epoch
        os.close(r)
        start = _kib("Private_Dirty:", "/proc/self/smaps_rollup")
        total = 0.0
        for rec in ds.records:
            total += float(rec["boxes"].sum()) + len(rec["path"]) + rec["size"][0]
        grown = _kib("Private_Dirty:", "/proc/self/smaps_rollup") - start
        os.write(w, json.dumps({"worker_kib": grown}).encode())
        os._exit(0)
    os.close(w)
    worker = json.loads(os.read(r, 1 << 16))
    os.waitpid(pid, 0)
    return {"images": len(ds), "dataset_mib": (after - before) / 1024, "worker_mib": worker["worker_kib"] / 1024}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--images", type=int, default=118_287, help="images in the generated json (COCO train2017's count)")
    p.add_argument("--variant", choices=["dicts", "arrays"], help=argparse.SUPPRESS)  # one measurement (child)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--image_dir", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.variant:
        print(json.dumps(measure(args.json, args.image_dir, compact=args.variant == "arrays")))
        return
    from datacheck_118k import generate
    from PIL import Image

    root = tempfile.mkdtemp(prefix="detlib_mem_")
    json_path = os.path.join(root, "train.json")
    generate(json_path, num_images=args.images, num_annotations=int(args.images * 860_001 / 118_287))
    image_dir = os.path.join(root, "images")
    os.makedirs(image_dir)
    one = os.path.join(root, "one.jpg")
    Image.new("RGB", (64, 48)).save(one)
    for i in range(1, args.images + 1):
        os.symlink(one, os.path.join(image_dir, f"{i:012d}.jpg"))
    for variant in ("dicts", "arrays"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--json", json_path, "--image_dir", image_dir],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        m = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{variant:6s}: {m['images']} images; the data set holds {m['dataset_mib']:.0f} MiB of resident memory; "
              f"one worker copies {m['worker_mib']:.0f} MiB by reading every record once")


if __name__ == "__main__":
    main()
