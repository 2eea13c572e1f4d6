"""The label-review loop of docs/predict_export.md ("Fixing labels with Label Studio / CVAT / FiftyOne") run end to
end on the built-in data, each step by the project's script as the docs' commands run it; only the reviewer is
simulated. In OUT (`--out`, a fresh folder):

1. the built-in set is generated into OUT/cache (DETLIB_CACHE); `--planted` errors go into a copy of its val json
   (`damage`, benchmarks/label_errors_precision.py: a third each class swapped, box dropped, box shifted by 40 %);
2. run 1, `accelerate launch ... scripts/train_retinanet.py`: the built-in train set, the planted copy as
   `--val_annotations` (the docs' retraining command). These flags make it a real-data run (ResNet-50, 600 px), so
   the built-in defaults (DATA_DEFAULTS, GroupNorm heads) are given as flags: the README's run, another val json;
3. `scripts/review_label_errors.py RUN1 --format labelstudio --top K` (the docs' --image_root_url);
4. the reviewer keeps in each task the boxes the clean json holds (same class, IoU >= 0.7, a clean box once) and
   deletes the rest; the tasks go out as Label Studio's JSON export (OUT/export.json);
5. `scripts/check_dataset.py --annotations OUT/export.json --images ... --write_fixed OUT/export_coco.json` reads
   it back; its boxes replace those of its images in the planted json (files and classes matched by name, as the
   docs say): OUT/val_fixed.json;
6. run 2: the same command, OUT/val_fixed.json as the val annotations;
7. per run: label_errors.json's entries (all; likely: confidence >= 0.5), those pointing at a planted error left in
   its labels (`damaged_box`), AP / AP50 on its val labels and on the clean ones (scripts/evaluate_predictions.py).
   Printed and written to --results.

    python benchmarks/label_review_loop.py     # two built-in runs of 6 epochs: ~10 min on 2 CPU cores

`--quick` trains 2 epochs a run (a check of the loop; the reported figures are the default's). The val labels do not
train the model: run 2 learns what run 1 learned; what changes is the labels its evaluation compares with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))
from label_errors_precision import damage, damaged_box  # noqa: E402  (benchmarks/, this script's folder)
from train_retinanet import BUILTIN_HEAD_NORM, DATA_DEFAULTS  # noqa: E402

from detlib.evaluation.label_errors import LIKELY_CONFIDENCE, _iou, _xyxy  # noqa: E402

KEEP_IOU = 0.7  # the reviewer keeps a box the clean labels hold at this IoU (same class)
LS_IMAGE_URL = "/data/local-files/?d=images"  # the docs' --image_root_url: Label Studio's local files
SIZE = ("original_width", "original_height") * 2  # a region's x, y, width, height: percent of these


def load(path: str):
    with open(path) as f:
        return json.load(f)


def dump(obj, path: str, **kw) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, **kw)


def run(cmd: list[str], env: dict) -> float:
    """Run a project command from the repository root (its output shown); returns its wall time in s."""
    print("$", " ".join(cmd), flush=True)
    t = time.time()
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return time.time() - t


def train_cmd(paths: dict, val_json: str, out: str, quick: bool) -> list[str]:
    """The README's built-in run on `val_json`: DATA_DEFAULTS' built-in column (AdamW) given as flags."""
    flags = []
    for k, v in DATA_DEFAULTS.items():
        v = v["adamw"] if isinstance(v, dict) else v
        if k != "output_dir":
            flags += [f"--{k}", str(2 if quick and k == "epochs" else v[0])]
    return ["accelerate", "launch", "--config_file", "accelerate_configs/cpu.yaml", "scripts/train_retinanet.py",
            "--train_images", paths["train_images"], "--train_annotations", paths["train_annotations"],
            "--val_images", paths["val_images"], "--val_annotations", val_json, "--head_norm", BUILTIN_HEAD_NORM,
            *flags, "--output_dir", out]


def matches(boxes: list[dict], clean: list[dict]) -> list[tuple[int, int]]:
    """One-to-one pairs (i of `boxes`, j of `clean`) of one class at IoU >= KEEP_IOU, best IoU first (COCO dicts:
    `bbox` xywh px, `category_id`)."""
    if not boxes or not clean:
        return []
    iou = _iou(_xyxy([b["bbox"] for b in boxes]), _xyxy([c["bbox"] for c in clean]))
    pairs = sorted(((iou[i, j], i, j) for i, b in enumerate(boxes) for j, c in enumerate(clean)
                    if b["category_id"] == c["category_id"] and iou[i, j] >= KEEP_IOU), reverse=True)
    used_i, used_j, out = set(), set(), []
    for _, i, j in pairs:
        if i not in used_i and j not in used_j:
            used_i.add(i), used_j.add(j), out.append((i, j))
    return out


def by_image(d: dict) -> dict[int, list[dict]]:
    """{image id: its annotations} of a COCO dict."""
    return {im["id"]: [a for a in d["annotations"] if a["image_id"] == im["id"]] for im in d["images"]}


def review(tasks: list[dict], clean: dict) -> list[dict]:
    """The simulated reviewer: review_label_errors.py's Label Studio tasks (its tasks.json) -> Label Studio's JSON
    export of them ([{"id", "data", "annotations": [{"result": the regions kept, ...}]}], what
    detlib.datacheck.labelstudio reads), each task's regions those the clean labels hold (`matches`)."""
    ids = {c["name"]: c["id"] for c in clean["categories"]}
    gt = by_image(clean)
    out = []
    for k, task in enumerate(tasks, 1):
        regions = task["annotations"][0]["result"]
        boxes = [{"bbox": [r["value"][f] * r[s] / 100 for f, s in zip(("x", "y", "width", "height"), SIZE)],
                  "category_id": ids[r["value"]["rectanglelabels"][0]]} for r in regions]  # percent -> px
        kept = sorted(i for i, _ in matches(boxes, gt[task["data"]["image_id"]]))
        stamp = "2025-01-01T10:00:00Z"  # Label Studio's ids and times: the task's id is its image id on reading
        out.append({"id": k, "data": task["data"], "predictions": [], "meta": {}, "created_at": stamp,
                    "annotations": [{"id": k, "completed_by": 1, "result": [regions[i] for i in kept], "task": k,
                                     "was_cancelled": False, "ground_truth": False, "created_at": stamp,
                                     "updated_at": stamp, "lead_time": 10.0}]})
    return out


def merge(planted: dict, export: dict) -> dict:
    """`planted` with the images of `export` (check_dataset.py's COCO json of the Label Studio export) relabelled by
    it: files matched by name, classes by name (the export numbers its classes 1..K by sorted name)."""
    image_of = {im["file_name"]: im["id"] for im in planted["images"]}
    cat_of = {c["name"]: c["id"] for c in planted["categories"]}
    names = {c["id"]: c["name"] for c in export["categories"]}
    reviewed = {im["id"]: image_of[im["file_name"]] for im in export["images"]}
    anns = [a for a in planted["annotations"] if a["image_id"] not in reviewed.values()]
    next_id = max(a["id"] for a in planted["annotations"]) + 1  # the planted ids stay: damaged_box names them
    for k, a in enumerate(export["annotations"]):
        anns.append({**a, "id": next_id + k, "image_id": reviewed[a["image_id"]],
                     "category_id": cat_of[names[a["category_id"]]]})
    return {**planted, "annotations": anns}


def left(labels: dict, clean: dict, kinds: dict[int, str]) -> dict[int, str]:
    """The planted errors still in `labels`: {clean annotation id: kind}; a class / shift error whose box is gone
    (the reviewer deleted it without its right box) is a dropped box now."""
    have, ids = by_image(labels), {a["id"] for a in labels["annotations"]}
    out = {}
    for iid, gt in by_image(clean).items():
        found = {j for _, j in matches(have[iid], gt)}
        out.update({a["id"]: kinds.get(a["id"]) if a["id"] in ids and kinds.get(a["id"]) != "drop" else "drop"
                    for j, a in enumerate(gt) if j not in found})
    return out


def run_figures(run_dir: str, clean: dict, errors_left: dict[int, str], env: dict, clean_path: str) -> dict:
    """A run's label_errors.json entries (all / likely) and those pointing at a planted error left in its labels,
    with its final AP / AP50 on its val labels (metrics.jsonl) and on the clean labels."""
    errors = load(os.path.join(run_dir, "label_errors.json"))["errors"]
    hits = [(e, damaged_box(e, clean, errors_left)) for e in errors]
    evals = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "AP" in r]
    out = os.path.join(run_dir, "eval_clean.json")
    run([sys.executable, "scripts/evaluate_predictions.py", "--annotations", clean_path, "--predictions",
         os.path.join(run_dir, "predictions_val.json"), "--n_bootstrap", "0", "--out", out], env)
    on_clean = load(out)
    return {"entries": len(errors), "likely": sum(e["confidence"] >= LIKELY_CONFIDENCE for e in errors),
            "entries_at_planted": sum(a is not None for _, a in hits),
            "likely_at_planted": sum(a is not None and e["confidence"] >= LIKELY_CONFIDENCE for e, a in hits),
            "planted_found": len({a for _, a in hits if a is not None}),
            "planted_in_labels": len(errors_left), "AP": evals[-1]["AP"], "AP50": evals[-1]["AP50"],
            "AP_clean": on_clean["AP"], "AP50_clean": on_clean["AP50"]}


def build_parser() -> argparse.ArgumentParser:
    from detlib.engine.flags import HelpFormatter  # the raw description, and each flag's default shown

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out", default="outputs/label_review_loop", help="the work folder (must not exist)")
    p.add_argument("--planted", type=int, default=18, help="label errors planted in the val json")
    p.add_argument("--top", type=int, default=50, help="review_label_errors.py --top (the docs' command)")
    p.add_argument("--seed", type=int, default=0, help="damage's seed")
    p.add_argument("--quick", action="store_true", help="2 epochs a run instead of 6: checks the loop, not its figures")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results_label_review_loop.json"),
                   help="the figures' JSON")
    return p


def main():
    args = build_parser().parse_args()
    out = os.path.abspath(args.out)
    if os.path.exists(out):
        sys.exit(f"{out} exists: the loop starts from a fresh folder (remove it or give another --out)")
    os.environ["DETLIB_CACHE"] = os.path.join(out, "cache")  # this process's data and the scripts'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))))
    from detlib.data.builtin import make_synthetic_coco

    paths = make_synthetic_coco()
    clean = load(paths["val_annotations"])
    planted, kinds = damage(clean, args.planted / len(clean["annotations"]), args.seed)
    files = {k: os.path.join(out, f"{k}.json") for k in ("val_planted", "export", "export_coco", "val_fixed")}
    dump(planted, files["val_planted"])
    times = {"run1": run(train_cmd(paths, files["val_planted"], f"{out}/run1", args.quick), env)}
    run([sys.executable, "scripts/review_label_errors.py", f"{out}/run1", "--format", "labelstudio", "--top",
         str(args.top), "--image_root_url", LS_IMAGE_URL], env)
    tasks = load(f"{out}/run1/review/labelstudio/tasks.json")
    dump(review(tasks, clean), files["export"])
    run([sys.executable, "scripts/check_dataset.py", "--annotations", files["export"], "--images",
         paths["val_images"], "--write_fixed", files["export_coco"]], env)
    fixed = merge(planted, load(files["export_coco"]))
    dump(fixed, files["val_fixed"])
    times["run2"] = run(train_cmd(paths, files["val_fixed"], f"{out}/run2", args.quick), env)

    left1, left2 = left(planted, clean, kinds), left(fixed, clean, kinds)
    fixed_ids, kind_names = set(left1) - set(left2), ("class", "shift", "drop")
    res = {"planted": len(kinds), "planted_by_kind": {k: list(kinds.values()).count(k) for k in kind_names},
           "val_images": len(clean["images"]), "val_boxes": len(clean["annotations"]), "top": args.top,
           "tasks": len(tasks), "fixed": len(fixed_ids), "fixed_by_kind": {k: sum(kinds[a] == k for a in fixed_ids)
                                                                            for k in kind_names},
           "quick": args.quick, "seed": args.seed, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
           "minutes": {k: round(v / 60, 1) for k, v in times.items()},
           "run1": run_figures(f"{out}/run1", clean, left1, env, paths["val_annotations"]),
           "run2": run_figures(f"{out}/run2", clean, left2, env, paths["val_annotations"])}
    # the val labels do not train the model: the same detections unless the thread count's float sums differ
    res["same_detections"] = load(f"{out}/run1/predictions_val.json") == load(f"{out}/run2/predictions_val.json")
    dump(res, args.results, indent=1)
    print(f"\n{res['planted']} errors planted {res['planted_by_kind']}; review of the top {args.top} entries: "
          f"{res['tasks']} tasks, {res['fixed']} fixed {res['fixed_by_kind']}")
    print("run | minutes | planted errors in its val labels | entries (likely) | at a planted error (likely) | "
          "planted found | AP / AP50 on its labels | on the clean labels")
    for r in ("run1", "run2"):
        f = res[r]
        print(f"{r} | {res['minutes'][r]} | {f['planted_in_labels']} | {f['entries']} ({f['likely']}) | "
              f"{f['entries_at_planted']} ({f['likely_at_planted']}) | {f['planted_found']} | "
              f"{f['AP']:.3f} / {f['AP50']:.3f} | {f['AP_clean']:.3f} / {f['AP50_clean']:.3f}")
    print(f"same detections in both runs: {res['same_detections']}; written {args.results}")


if __name__ == "__main__":
    main()
