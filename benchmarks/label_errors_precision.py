"""Precision and false alarms of the label-error list (`detlib.evaluation.label_errors`, issue 36 point 4).

A trained model's detections on a val set whose labels are right (the built-in set: right by construction) give:

- false alarms: every entry of the list on the val set as it is (none of them is a label error);
- precision and recall: on copies of the val set with `--fraction` of its boxes damaged (a third each: class swapped,
  box dropped, box shifted by 40 % of its size; `damage`, one copy per seed), the share of entries that point at a
  damaged box (its annotation id; for a dropped box a missing_box entry whose box overlaps it with IoU >= 0.5) and the
  share of damaged boxes some entry points at.

Each is given at several thresholds of the entry's `confidence` (the list's ranking) and, for comparison, of its raw
`score` (what the list counted before issue 36). The detections do not depend on the val labels, so one evaluation
serves every damaged copy.

    # the README's first command, then
    python benchmarks/label_errors_precision.py --predictions outputs/retinanet_builtin/predictions_val.json

Prints a table and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import random

from detlib.data.builtin import make_synthetic_coco
from detlib.evaluation.label_errors import _iou, _xyxy, find_label_errors

THRESHOLDS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def damage(gt: dict, frac: float = 0.05, seed: int = 0) -> tuple[dict, dict[int, str]]:
    """A copy of `gt` with `frac` of its non-crowd boxes damaged: {annotation id: "class" | "drop" | "shift"}."""
    rng = random.Random(seed)
    gt = copy.deepcopy(gt)
    boxes = [a for a in gt["annotations"] if not a.get("iscrowd", 0)]
    cats = sorted({a["category_id"] for a in boxes})
    kinds, dropped = {}, set()
    for j, a in enumerate(rng.sample(boxes, round(frac * len(boxes)))):
        kind = ("class", "drop", "shift")[j % 3]
        kinds[a["id"]] = kind
        if kind == "class":
            a["category_id"] = rng.choice([c for c in cats if c != a["category_id"]])
        elif kind == "drop":
            dropped.add(a["id"])
        else:
            x, y, w, h = a["bbox"]
            a["bbox"] = [x + rng.choice((-1, 1)) * 0.4 * w, y + rng.choice((-1, 1)) * 0.4 * h, w, h]
    gt["annotations"] = [a for a in gt["annotations"] if a["id"] not in dropped]
    return gt, kinds


def damaged_box(entry: dict, original: dict, kinds: dict[int, str]) -> int | None:
    """The annotation id of the damaged box `entry` points at, None when it points at none."""
    if entry["annotation_id"] in kinds and kinds[entry["annotation_id"]] != "drop":
        return entry["annotation_id"]
    if entry["type"] == "missing_box":
        by_id = {a["id"]: a for a in original["annotations"]}
        for aid, kind in kinds.items():
            a = by_id[aid]
            if kind == "drop" and a["image_id"] == entry["image_id"] and \
                    _iou(_xyxy([entry["suggested_bbox"]]), _xyxy([a["bbox"]]))[0, 0] >= 0.5:
                return aid
    return None


def measure(gt: dict, results: list[dict], seeds: int, frac: float, key: str) -> list[dict]:
    """Per threshold of entry[`key`]: false alarms on `gt`, precision and recall on its damaged copies."""
    clean = find_label_errors(gt, results)
    damaged = []
    for seed in range(seeds):
        copy_, kinds = damage(gt, frac, seed)
        entries = find_label_errors(copy_, results)
        damaged.append((kinds, [(e, damaged_box(e, gt, kinds)) for e in entries]))
    rows = []
    for t in THRESHOLDS:
        row = {"threshold": t, "false_alarms": sum(e[key] >= t for e in clean),
               "false_alarms_by_kind": {k: sum(e[key] >= t and e["type"] == k for e in clean)
                                        for k in ("wrong_class", "badly_placed", "missing_box")}}
        listed = hits = planted = found = 0
        found_by_kind = {"class": 0, "drop": 0, "shift": 0}
        planted_by_kind = dict.fromkeys(found_by_kind, 0)
        for kinds, pairs in damaged:
            above = [(e, aid) for e, aid in pairs if e[key] >= t]
            listed += len(above)
            hits += sum(aid is not None for _, aid in above)
            seen = {aid for _, aid in above if aid is not None}
            planted += len(kinds)
            found += len(seen)
            for aid, kind in kinds.items():
                planted_by_kind[kind] += 1
                found_by_kind[kind] += aid in seen
        row.update(precision=hits / listed if listed else None, recall=found / planted, listed=listed / seeds,
                   recall_by_kind={k: found_by_kind[k] / planted_by_kind[k] for k in found_by_kind})
        rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    from detlib.engine import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--predictions", required=True, help="a run's predictions_val.json (COCO results)")
    parser.add_argument("--annotations", default=None, help="its val json (default: the built-in set's)")
    parser.add_argument("--seeds", type=int, default=10, help="damaged copies of the val set")
    parser.add_argument("--fraction", type=float, default=0.05, help="share of the boxes damaged in each copy")
    parser.add_argument("--out", default=None, help="write the figures here (JSON) (default: printed only)")
    return parser


def main():
    args = build_parser().parse_args()
    with open(args.annotations or make_synthetic_coco()["val_annotations"]) as f:
        gt = json.load(f)
    with open(args.predictions) as f:
        results = json.load(f)
    out = {"images": len(gt["images"]), "boxes": len(gt["annotations"]), "seeds": args.seeds,
           "fraction": args.fraction, "by_confidence": measure(gt, results, args.seeds, args.fraction, "confidence"),
           "by_score": measure(gt, results, args.seeds, args.fraction, "score")}
    print(f"{out['images']} images, {out['boxes']} boxes; {args.seeds} damaged copies at {args.fraction:.0%}")
    for key in ("by_confidence", "by_score"):
        print(f"{key}: threshold, false alarms on the clean set (wrong_class/badly_placed/missing_box), "
              "entries per damaged copy, precision, recall (class/drop/shift)")
        for r in out[key]:
            fa = "/".join(str(v) for v in r["false_alarms_by_kind"].values())
            prec = "-" if r["precision"] is None else f"{r['precision']:.3f}"
            rec = "/".join(f"{v:.2f}" for v in r["recall_by_kind"].values())
            print(f"  >= {r['threshold']:.1f}: {r['false_alarms']:3d} ({fa}), {r['listed']:5.1f}, {prec}, "
                  f"{r['recall']:.3f} ({rec})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
