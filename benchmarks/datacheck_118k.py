"""Time the json part of the COCO data check (`detlib.datacheck.coco.check_coco`) on a COCO-2017-train-sized file.

Generates (once, seeded) a boxes-only COCO json with 118,287 images and about 860,000 annotations (COCO
train2017's counts; 80 categories with COCO's non-contiguous ids), then times, on one core:
reading the json (`json.load`), and checking + normalising it without the image files.

    OMP_NUM_THREADS=1 python benchmarks/datacheck_118k.py            # goal: check under 10 s
    python benchmarks/datacheck_118k.py --repeats 3 --json /tmp/coco118k.json

Prints one json line: images, annotations, load_s, check_s (median of the repeats), total_s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from detlib.datacheck.coco import check_coco  # noqa: E402
from detlib.engine.flags import HelpFormatter  # noqa: E402

COCO_CATEGORY_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]


def generate(path: str, num_images: int = 118_287, num_annotations: int = 860_001, seed: int = 0) -> None:
    """A boxes-only COCO json of that size: 640x480 images, random boxes inside them, ids 1..N."""
    rng = np.random.RandomState(seed)
    images = [{"id": i, "file_name": f"{i:012d}.jpg", "width": 640, "height": 480} for i in range(1, num_images + 1)]
    image_ids = rng.randint(1, num_images + 1, num_annotations)
    # inside the image (x + w <= 600 < 640, y + h <= 450 < 480): the common case, nothing to repair
    xy = (rng.uniform(0, 1, (num_annotations, 2)) * [300, 200]).round(2)
    wh = (rng.uniform(0, 1, (num_annotations, 2)) * [298, 248] + 2).round(2)
    cats = rng.choice(COCO_CATEGORY_IDS, num_annotations)
    annotations = [{"id": k + 1, "image_id": int(image_ids[k]), "category_id": int(cats[k]),
                    "bbox": [float(xy[k, 0]), float(xy[k, 1]), float(wh[k, 0]), float(wh[k, 1])],
                    "area": float(round(wh[k, 0] * wh[k, 1], 2)), "iscrowd": 0} for k in range(num_annotations)]
    data = {"info": {}, "licenses": [], "images": images, "annotations": annotations,
            "categories": [{"id": c, "name": f"class_{c}", "supercategory": "thing"} for c in COCO_CATEGORY_IDS]}
    with open(path, "w") as f:
        json.dump(data, f)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "detlib_coco118k.json"),
                   help="where the generated file is kept (reused when present)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the medians are reported")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not os.path.isfile(args.json):
        t = time.perf_counter()
        generate(args.json)
        print(f"generated {args.json} ({os.path.getsize(args.json) / 1e6:.0f} MB) in {time.perf_counter() - t:.1f} s",
              file=sys.stderr)
    loads, checks = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with open(args.json, "rb") as f:
            data = json.load(f)
        t1 = time.perf_counter()
        result = check_coco(data, split="train", check_images=False)
        t2 = time.perf_counter()
        loads.append(t1 - t0)
        checks.append(t2 - t1)
        assert result.report.ok, result.report.format()
        del data, result
    out = {"images": 118_287, "annotations": 860_001, "load_s": round(statistics.median(loads), 2),
           "check_s": round(statistics.median(checks), 2),
           "total_s": round(statistics.median(loads) + statistics.median(checks), 2), "repeats": args.repeats}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
