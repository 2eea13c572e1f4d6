"""VOC and YOLO data sets written from a COCO dict, for the tests of detlib.data.formats: the writers are the inverse
of the readers of detlib.data.voc and detlib.data.yolo (VOC's 1-based xmin / ymin, YOLO's normalised cx cy w h)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from xml.sax.saxutils import escape

import yaml

from conftest import COCO_SUBSET


def reference_coco(n_train: int = 6, n_val: int = 3, crowd: bool = False) -> tuple[dict, dict]:
    """(train, val) COCO dicts of the first images (by id) of the real subset, made so that a VOC or YOLO set
    written from them reads back into the same data: categories renumbered 1..K by sorted name over both
    splits (VOC's numbering), `area` = box area (VOC and YOLO have no segmentation), no crowd box unless `crowd`
    (YOLO has none; with `crowd` the first image of each split is one that has a crowd box), no annotation
    fields beyond those."""
    out = []
    for split, n in (("train", n_train), ("val", n_val)):
        d = json.loads((COCO_SUBSET / "annotations" / f"instances_{split}.json").read_text())
        crowded = {a["image_id"] for a in d["annotations"] if a["iscrowd"]} if crowd else set()
        images = sorted(d["images"], key=lambda im: (im["id"] not in crowded, im["id"]))[:n]  # a crowd one first
        ids = {im["id"] for im in images}
        anns = [a for a in d["annotations"] if a["image_id"] in ids and (crowd or not a["iscrowd"])]
        out.append((d["categories"], images, anns))
    used = {a["category_id"] for _, _, anns in out for a in anns}
    names = {c["id"]: c["name"] for c in out[0][0]}
    new_id = {cid: k for k, cid in enumerate(sorted(used, key=lambda c: names[c]), 1)}
    cats = [{"id": new_id[c], "name": names[c]} for c in sorted(used, key=lambda c: names[c])]
    result = []
    for _, images, anns in out:
        result.append({"info": {}, "licenses": [],
                       "images": [{k: im[k] for k in ("id", "file_name", "width", "height")} for im in images],
                       "annotations": [{"id": i, "image_id": a["image_id"], "category_id": new_id[a["category_id"]],
                                        "bbox": a["bbox"], "area": a["bbox"][2] * a["bbox"][3], "iscrowd": a["iscrowd"]}
                                       for i, a in enumerate(anns, 1)],
                       "categories": cats})
    return result[0], result[1]


def link_images(dataset: dict, folder: Path, image_dir: Path = COCO_SUBSET / "images") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for im in dataset["images"]:
        dst = folder / im["file_name"]
        if not dst.exists():
            os.symlink(image_dir / im["file_name"], dst)


def voc_xml(im: dict, anns: list[dict], names: dict[int, str], fmt: str = "{:.17g}") -> str:
    """The VOC xml of an image: xmin = x + 1, ymin = y + 1, xmax = x + w, ymax = y + h (1-based, inclusive)."""
    objects = []
    for a in anns:
        x, y, w, h = a["bbox"]
        box = [fmt.format(v) for v in (x + 1, y + 1, x + w, y + h)]
        objects.append(f"<object><name>{escape(names[a['category_id']])}</name><pose>Unspecified</pose>"
                       f"<truncated>{a.get('truncated', 0)}</truncated><difficult>{int(a.get('iscrowd', 0))}</difficult>"
                       f"<bndbox><xmin>{box[0]}</xmin><ymin>{box[1]}</ymin><xmax>{box[2]}</xmax><ymax>{box[3]}</ymax>"
                       "</bndbox></object>")
    return (f"<annotation><folder>JPEGImages</folder><filename>{escape(im['file_name'])}</filename><size>"
            f"<width>{im['width']}</width><height>{im['height']}</height><depth>3</depth></size>"
            + "".join(objects) + "</annotation>\n")


def write_voc(root: Path, splits: dict[str, dict], fmt: str = "{:.17g}") -> Path:
    """A VOC devkit folder from COCO dicts {split name: dict}: JPEGImages/ (links), Annotations/, ImageSets/Main/."""
    for split, d in splits.items():
        names = {c["id"]: c["name"] for c in d["categories"]}
        link_images(d, root / "JPEGImages")
        (root / "Annotations").mkdir(parents=True, exist_ok=True)
        (root / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
        ids = []
        for im in d["images"]:
            vid = os.path.splitext(im["file_name"])[0]
            ids.append(vid)
            anns = [a for a in d["annotations"] if a["image_id"] == im["id"]]
            (root / "Annotations" / f"{vid}.xml").write_text(voc_xml(im, anns, names, fmt))
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(i + "\n" for i in ids))
    return root


def yolo_rows(im: dict, anns: list[dict], index: dict[int, int], fmt: str = "{:.17g}") -> str:
    W, H = im["width"], im["height"]
    rows = []
    for a in anns:
        x, y, w, h = a["bbox"]
        rows.append(" ".join([str(index[a["category_id"]])] + [fmt.format(v) for v in
                                                                ((x + w / 2) / W, (y + h / 2) / H, w / W, h / H)]))
    return "".join(r + "\n" for r in rows)


def write_yolo(root: Path, splits: dict[str, dict], fmt: str = "{:.17g}") -> Path:
    """An ultralytics folder from COCO dicts {split name: dict}: images/<split>/ (links), labels/<split>/*.txt,
    data.yaml (`names` in category id order; class i = the i-th category)."""
    cats = sorted(next(iter(splits.values()))["categories"], key=lambda c: c["id"])
    index = {c["id"]: i for i, c in enumerate(cats)}
    for split, d in splits.items():
        link_images(d, root / "images" / split)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for im in d["images"]:
            anns = [a for a in d["annotations"] if a["image_id"] == im["id"]]
            if anns:  # an image without a label file has no boxes
                stem = os.path.splitext(im["file_name"])[0]
                (root / "labels" / split / f"{stem}.txt").write_text(yolo_rows(im, anns, index, fmt))
    cfg = {"path": ".", **{s: f"images/{s}" for s in splits}, "names": [c["name"] for c in cats]}
    (root / "data.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return root
