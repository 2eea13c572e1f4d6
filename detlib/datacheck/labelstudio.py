"""Label Studio's JSON exports read as a COCO dict, so the data check, training and evaluation take them as they take
a COCO json (`detlib.datacheck.coco.check_coco` calls `labelstudio_to_coco` on a json that is a list of tasks).

Label Studio exports a project as (its "Export" dialog):

  JSON      the tasks as stored: [{"id", "data": {"image": ...}, "annotations": [{"result": [...], "was_cancelled",
            "created_at", ...}], "predictions": [...]}]; each RectangleLabels result {"original_width",
            "original_height", "value": {"x", "y", "width", "height", "rotation", "rectanglelabels": [name]}}.
  JSON-min  one flat object per task: {"id", "image": ..., "<from_name>": [{"x", "y", "width", "height",
            "rotation", "rectanglelabels": [name], "original_width", "original_height"}], "annotator", ...}.

`x`, `y` are the top-left corner and `width`, `height` the size, all in percent of the image (0..100);
`original_width` / `original_height` the image's size in pixels. `rotation` (degrees, clockwise about the top-left
corner, as Label Studio draws it) turns the box: a rotated box is read as its axis-aligned hull in pixels (the
smallest xyxy box holding its four corners), a repair the report names (`--strict_data` refuses it instead).

Rules: a task's latest annotation that was not cancelled is its labels (by `updated_at`, else `created_at`, else its
order; a task with several is named); predictions are never labels; results that are not rectangles (polygons,
keypoints, choices) are left out and counted. Classes are the label names used, sorted, numbered 1..K (Label Studio's
own COCO export numbers them 0..K-1 in the same order). Image ids are the task ids. The image reference
(`data.image`) is kept as `file_name`; `detlib.datacheck.coco_images.tool_file_name` finds its file on disk
(Label Studio's `/data/upload/<project>/<hash>-<name>` and `/data/local-files/?d=<path>`).
"""

from __future__ import annotations

import math

from .coco_fields import int_id, number
from .report import DataReport, Findings

LABELSTUDIO_FINDINGS = {
    "rotated": ("repair", "boxes", "Label Studio boxes with a rotation: read as their axis-aligned hull (the smallest "
                "box holding the rotated one)"),
    "not_box": ("repair", "boxes", "Label Studio results that are not rectangles (polygons, keypoints, choices): left "
                "out"),
    "bad_value": ("repair", "boxes", "Label Studio rectangles without 4 finite numbers x, y, width, height or the "
                  "image's original_width / original_height: left out"),
    "several": ("repair", "structure", "Label Studio tasks with several annotations: the latest one not cancelled "
                "is read"),
    "cancelled": ("repair", "structure", "Label Studio tasks whose annotations were all cancelled (skipped): read "
                  "as images without boxes"),
}
# The task fields of a JSON-min export that are not a control tag's results.
JSON_MIN_FIELDS = ("id", "annotator", "annotation_id", "created_at", "updated_at", "lead_time", "agreement")


def is_labelstudio_export(data) -> bool:
    """A json value that is a Label Studio export (JSON or JSON-min): a list of task objects (a COCO json is an
    object)."""
    return isinstance(data, list) and all(isinstance(t, dict) for t in data) and bool(data)


def rotated_hull(x: float, y: float, w: float, h: float, degrees: float) -> tuple[float, float, float, float]:
    """The axis-aligned hull [x1, y1, x2, y2] (pixels) of a box whose top-left corner is (x, y), size (w, h) pixels,
    turned by `degrees` clockwise about that corner (Label Studio's rotation; y points down)."""
    t = math.radians(degrees)
    c, s = math.cos(t), math.sin(t)
    xs = [x, x + w * c, x + w * c - h * s, x - h * s]
    ys = [y, y + w * s, y + w * s + h * c, y + h * c]
    return min(xs), min(ys), max(xs), max(ys)


def _results(task: dict, found: Findings, where: str) -> list[dict]:
    """The label results of a task, as {"value" fields..., "original_width", "original_height", "type"}."""
    if "annotations" in task or "completions" in task:  # JSON
        anns = [a for a in task.get("annotations", task.get("completions")) or [] if isinstance(a, dict)]
        kept = [a for a in anns if not (a.get("was_cancelled") or a.get("skipped"))]
        if anns and not kept:
            found["cancelled"].append(where)
        if len(kept) > 1:
            found["several"].append(f"{where} ({len(kept)} annotations)")
        if not kept:
            return []
        latest = max(enumerate(kept), key=lambda ka: (str(ka[1].get("updated_at") or ka[1].get("created_at") or ""),
                                                      ka[0]))[1]
        out = []
        for r in latest.get("result") or []:
            if isinstance(r, dict) and isinstance(r.get("value"), dict):
                out.append({**r["value"], "type": r.get("type"), "original_width": r.get("original_width"),
                            "original_height": r.get("original_height")})
        return out
    out = []  # JSON-min: each control tag's results under its name
    for key, value in task.items():
        if key in JSON_MIN_FIELDS or not isinstance(value, list):
            continue
        out += [{**v, "type": None} for v in value if isinstance(v, dict)]
    return out


def labelstudio_to_coco(tasks: list, report: DataReport, split: str, source: str) -> dict:
    """A Label Studio JSON or JSON-min export (module docstring) as a COCO dict: images {"id" (the task's), "file_name"
    (its `data.image` / `image`), "width", "height" (original_width / original_height, None when no result gives them:
    the image file check fills them in)}, annotations {"bbox" [x, y, w, h] pixels, "category_id", "iscrowd": 0},
    categories 1..K by sorted name. Its findings (LABELSTUDIO_FINDINGS) are added to `report` under `split`."""
    found = Findings(LABELSTUDIO_FINDINGS)
    images, boxes = [], []
    for k, task in enumerate(tasks):
        tid = int_id(task.get("id"))
        iid = tid if tid is not None else k + 1
        where = f"task {task.get('id', k)}"
        data = task.get("data") if isinstance(task.get("data"), dict) else task
        ref = data.get("image") if isinstance(data.get("image"), str) else next(
            (v for v in data.values() if isinstance(v, str) and "/" in v), None)
        im = {"id": iid, "file_name": ref, "width": None, "height": None}
        images.append(im)
        for r in _results(task, found, where):
            labels = r.get("rectanglelabels") or (r.get("labels") if r.get("type") in (None, "labels") else None)
            if not labels or not {"x", "y", "width", "height"} <= set(r):
                found["not_box"].append(f"{where} ({r.get('type') or ', '.join(sorted(r)[:4])})")
                continue
            x, y, w, h, W, H = (number(r.get(f)) for f in ("x", "y", "width", "height", "original_width",
                                                             "original_height"))
            if None in (x, y, w, h, W, H) or W <= 0 or H <= 0:
                found["bad_value"].append(where)
                continue
            im["width"], im["height"] = int(round(W)), int(round(H))
            x1, y1, pw, ph = x * W / 100, y * H / 100, w * W / 100, h * H / 100
            x2, y2 = x1 + pw, y1 + ph
            rotation = number(r.get("rotation")) or 0.0
            if rotation % 360:
                x1, y1, x2, y2 = rotated_hull(x1, y1, pw, ph, rotation)
                found["rotated"].append(f"{where} ({labels[0]}, {rotation:g} degrees)")
            boxes.append({"image_id": iid, "name": str(labels[0]), "bbox": [x1, y1, x2 - x1, y2 - y1]})
    found.add_to(report, split)
    ids = {n: i for i, n in enumerate(sorted({b["name"] for b in boxes}), 1)}
    annotations = [{"id": i, "image_id": b["image_id"], "category_id": ids[b["name"]], "bbox": b["bbox"],
                    "area": b["bbox"][2] * b["bbox"][3], "iscrowd": 0} for i, b in enumerate(boxes, 1)]
    report.summaries[f"{split} (label studio)"] = {"file": source, "tasks": len(tasks), "boxes": len(boxes)}
    return {"info": {"description": f"converted from the Label Studio export {source}"}, "licenses": [],
            "images": images, "annotations": annotations,
            "categories": [{"id": i, "name": n} for n, i in ids.items()]}
