"""Detections and suspected label errors written for the labelling tools users review them in: Label Studio, CVAT,
FiftyOne, and the YOLO and Pascal VOC files every tool imports.

One call per use: `write_prediction_files` (predict_retinanet.py --format) and `write_review_files`
(review_label_errors.py --format). Each format as its tool documents it:

  labelstudio  tasks JSON for Label Studio's import: `data.image` (the image's reference: `image_root_url` + its
               path below the source, URL-quoted), and a `predictions` entry (`model_version`, `score`, `result`)
               whose RectangleLabels results give `x`, `y`, `width`, `height` in percent of the image (top-left
               corner, `rotation` 0), `original_width` / `original_height` in pixels and each detection's `score`;
               beside it the labelling config (`label_config.xml`, whose `<Label category=...>` keeps the COCO ids
               through Label Studio's COCO export).
  cvat         CVAT for images 1.1: one annotations.xml, an <image id name width height> per image with a
               <box label xtl ytl xbr ybr> (pixels) per detection and its score as an <attribute name="score">.
  yolo         one `labels/<name>.txt` per image, a row `class cx cy w h` (normalised to 0..1; class = the model's
               label 0..K-1, its name on line class + 1 of `classes.txt`, darknet's / CVAT's YOLO 1.1 class list,
               and in `data.yaml`'s `names`, ultralytics' and Roboflow's, which supervision's `from_yolo` needs; no
               `train:` / `val:` there: the images are not in the folder), and with `save_conf` the score as a 6th
               column: ultralytics' `save_conf=True` convention of its predict (`Results.save_txt`), which
               ultralytics' label reader refuses and ours drops (supervision reads the box, the score left out):
               for review, not for training.
  voc          one `Annotations/<name>.xml` per image (<size>, an <object><name><bndbox> per detection: xmin / ymin
               1-based, the inverse of `detlib.data.voc`), `ImageSets/Main/predicted.txt` listing them, and the
               classes in `labelmap.txt` (CVAT's VOC export's).
  fiftyone     (review only; the library is optional) a FiftyOne dataset with the current boxes in `ground_truth`
               and the suggestions in `label_errors` (bounding_box [x, y, w, h] relative to the image), exported
               as FiftyOneDataset.

Boxes come in as COCO results / annotations: `bbox` [x, y, w, h] pixels of the image as shown (upright), the
image's `width` / `height` in the same pixels.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from xml.sax.saxutils import escape, quoteattr

from ..files import atomic_write, write_json

logger = logging.getLogger(__name__)

PREDICTION_FORMATS = ("coco", "labelstudio", "cvat", "yolo", "voc")
REVIEW_FORMATS = ("labelstudio", "cvat", "fiftyone")
# Label Studio's names in the labelling config we write: the image field of a task and the RectangleLabels tag.
LS_IMAGE, LS_LABELS = "image", "label"


def image_reference(file_name: str, image_root_url: str | None) -> str:
    """What a Label Studio task's `data.image` holds: `image_root_url` + the file's path below the source, its
    characters URL-quoted (`photos/a b.jpg` -> `<url>/photos/a%20b.jpg`); without a root URL the path as it is."""
    path = file_name.replace(os.sep, "/")
    if not image_root_url:
        return path
    return image_root_url.rstrip("/") + "/" + urllib.parse.quote(path)


def percent_box(bbox, width: int, height: int) -> dict:
    """COCO xywh pixels -> Label Studio's value: x, y (top-left), width, height in percent of the image."""
    x, y, w, h = (float(v) for v in bbox)
    return {"x": 100.0 * x / width, "y": 100.0 * y / height, "width": 100.0 * w / width,
            "height": 100.0 * h / height, "rotation": 0}


def labelstudio_region(bbox, label: str, width: int, height: int, region_id: str, score: float | None = None,
                       meta: str | None = None) -> dict:
    """One RectangleLabels result of a Label Studio task (`bbox` xywh pixels; see `percent_box`)."""
    r = {"id": region_id, "from_name": LS_LABELS, "to_name": LS_IMAGE, "type": "rectanglelabels",
         "original_width": int(width), "original_height": int(height), "image_rotation": 0,
         "value": {**percent_box(bbox, width, height), "rectanglelabels": [label]}}
    if score is not None:
        r["score"] = float(score)
    if meta:
        r["meta"] = {"text": [meta]}
    return r


def labelstudio_config(category_ids: list[int], names: dict[int, str], header: str | None = None) -> str:
    """The labelling config of the tasks we write: an Image `image` and RectangleLabels `label` with one Label per
    class, its COCO id as `category` (Label Studio's COCO export, and label-studio-converter, keep it). `header`: a
    task field shown above the image (`$name`)."""
    lines = ["<View>"]
    if header:
        lines.append(f'  <Header value="${header}"/>')
    lines.append(f'  <Image name="{LS_IMAGE}" value="${LS_IMAGE}"/>')
    lines.append(f'  <RectangleLabels name="{LS_LABELS}" toName="{LS_IMAGE}">')
    lines += [f"    <Label value={quoteattr(names[c])} category=\"{c}\"/>" for c in category_ids]
    lines += ["  </RectangleLabels>", "</View>", ""]
    return "\n".join(lines)


def labelstudio_prediction_tasks(images: list[dict], results: list[dict], names: dict[int, str],
                                 image_root_url: str | None, model_version: str) -> list[dict]:
    """Label Studio tasks, one per image, each with one `predictions` entry holding its detections (module
    docstring); the prediction's `score` is its detections' mean (what Label Studio sorts tasks by; 0 with none)."""
    by_image = _by_image(results)
    tasks = []
    for im in images:
        dets = by_image.get(im["image_id"], [])
        result = [labelstudio_region(r["bbox"], names.get(r["category_id"], str(r["category_id"])), im["width"],
                                     im["height"], f"d{k}", r["score"]) for k, r in enumerate(dets)]
        score = sum(r["score"] for r in dets) / len(dets) if dets else 0.0
        tasks.append({"data": {LS_IMAGE: image_reference(im["file_name"], image_root_url),
                               "image_id": im["image_id"]},
                      "predictions": [{"model_version": model_version, "score": float(score), "result": result}]})
    return tasks


def cvat_xml(images: list[dict], boxes: list[dict], category_ids: list[int], names: dict[int, str],
             attributes: dict[str, str]) -> str:
    """CVAT for images 1.1 annotations.xml.

    Args:
        images: {"image_id", "file_name", "width", "height"} (pixels), in the order written (<image id> 0..N-1).
        boxes: {"image_id", "category_id", "bbox" xywh pixels, "attributes": {name: value}, "source": "manual" |
            "auto"}; each becomes a <box label xtl ytl xbr ybr> (pixels) with an <attribute> per entry.
        attributes: the attributes every label declares in <meta>: {name: CVAT input type ("number", "text")}.
    """
    by_image = _by_image(boxes)
    out = ['<?xml version="1.0" encoding="utf-8"?>', "<annotations>", "  <version>1.1</version>", "  <meta>",
           "    <task>", f"      <size>{len(images)}</size>", "      <mode>annotation</mode>", "      <labels>"]
    for c in category_ids:
        out += ["        <label>", f"          <name>{escape(names[c])}</name>", "          <type>rectangle</type>",
                "          <attributes>"]
        for a, kind in attributes.items():
            values = "0\n1\n0.001" if kind == "number" else ""  # a number's min, max and step
            out += ["            <attribute>", f"              <name>{a}</name>", "              <mutable>False</mutable>",
                    f"              <input_type>{kind}</input_type>", "              <default_value></default_value>",
                    f"              <values>{values}</values>", "            </attribute>"]
        out += ["          </attributes>", "        </label>"]
    out += ["      </labels>", "    </task>", "  </meta>"]
    for k, im in enumerate(images):
        out.append(f"  <image id=\"{k}\" name={quoteattr(im['file_name'].replace(os.sep, '/'))} "
                   f"width=\"{int(im['width'])}\" height=\"{int(im['height'])}\">")
        for b in by_image.get(im["image_id"], []):
            x, y, w, h = (float(v) for v in b["bbox"])
            out.append(f"    <box label={quoteattr(names.get(b['category_id'], str(b['category_id'])))} "
                       f"source=\"{b.get('source', 'manual')}\" occluded=\"0\" xtl=\"{x:.2f}\" ytl=\"{y:.2f}\" "
                       f"xbr=\"{x + w:.2f}\" ybr=\"{y + h:.2f}\" z_order=\"0\">")
            out += [f"      <attribute name=\"{a}\">{escape(str(v))}</attribute>"
                    for a, v in b.get("attributes", {}).items()]
            out.append("    </box>")
        out.append("  </image>")
    out += ["</annotations>", ""]
    return "\n".join(out)


def yolo_rows(dets: list[dict], width: int, height: int, label_of: dict[int, int], save_conf: bool = False) -> str:
    """The YOLO label file of one image: `class cx cy w h` normalised to 0..1 (6 decimals, as ultralytics writes
    them), `class` = `label_of[category_id]`; with `save_conf` the score as a 6th column (ultralytics' save_conf)."""
    lines = []
    for r in dets:
        x, y, w, h = (float(v) for v in r["bbox"])
        row = [(x + w / 2) / width, (y + h / 2) / height, w / width, h / height] + ([r["score"]] if save_conf else [])
        lines.append(" ".join([str(label_of[r["category_id"]])] + [f"{v:.6f}" for v in row]))
    return "".join(line + "\n" for line in lines)


def yolo_data_yaml(class_names: list[str]) -> str:
    """The `data.yaml` of a YOLO labels folder: `nc` and `names` {label: name} (ultralytics' form, which its
    trainer, Roboflow's import and supervision's `DetectionDataset.from_yolo` read), without `train:` / `val:` (the
    images are elsewhere: a comment says to add them)."""
    import yaml

    return ("# the classes of labels/*.txt; to train on them add `path:` and `train:` / `val:` naming the images\n"
            + yaml.safe_dump({"nc": len(class_names), "names": dict(enumerate(class_names))}, sort_keys=False,
                             allow_unicode=True))


def voc_xml(im: dict, dets: list[dict], names: dict[int, str]) -> str:
    """The Pascal VOC xml of one image: <size> and an <object> per detection with <bndbox> xmin = x + 1,
    ymin = y + 1, xmax = x + w, ymax = y + h (VOC's 1-based inclusive pixel indices: `detlib.data.voc` reads it back
    to `bbox`), to 2 decimals."""
    out = ["<annotation>", "  <folder>JPEGImages</folder>",
           f"  <filename>{escape(os.path.basename(im['file_name']))}</filename>",
           f"  <size><width>{int(im['width'])}</width><height>{int(im['height'])}</height><depth>3</depth></size>"]
    for r in dets:
        x, y, w, h = (float(v) for v in r["bbox"])
        out += ["  <object>", f"    <name>{escape(names.get(r['category_id'], str(r['category_id'])))}</name>",
                "    <pose>Unspecified</pose>", "    <truncated>0</truncated>", "    <difficult>0</difficult>",
                f"    <bndbox><xmin>{x + 1:.2f}</xmin><ymin>{y + 1:.2f}</ymin><xmax>{x + w:.2f}</xmax>"
                f"<ymax>{y + h:.2f}</ymax></bndbox>", "  </object>"]
    out += ["</annotation>", ""]
    return "\n".join(out)


def write_prediction_files(fmt: str, output_dir: str, images: list[dict], results: list[dict],
                           category_ids: list[int], names: dict[int, str], *, image_root_url: str | None = None,
                           model_version: str = "detlib", save_conf: bool = False) -> list[str]:
    """The detections in a labelling tool's format (module docstring), under `output_dir/<fmt>/`.

    Args:
        fmt: one of PREDICTION_FORMATS other than "coco" (predictions.json is the script's own).
        images: {"image_id", "file_name" (the path below the source), "out_name" (the stem per-image files take,
            unique: `detlib.inference.output_names`), "width", "height" (pixels of the image as shown)}.
        results: COCO results (`image_id`, `category_id`, `bbox` xywh pixels, `score`).
        category_ids: the model's classes in label order (YOLO's class = the index here); names: {id: name}.
    Returns:
        the paths written.
    Raises:
        ValueError: an unknown `fmt`.
    """
    folder = os.path.join(output_dir, fmt)
    by_image = _by_image(results)
    written = []
    if fmt == "labelstudio":
        tasks = labelstudio_prediction_tasks(images, results, names, image_root_url, model_version)
        written.append(write_json(tasks, os.path.join(folder, "tasks.json"), indent=1))
        written.append(_write_text(os.path.join(folder, "label_config.xml"), labelstudio_config(category_ids, names)))
    elif fmt == "cvat":
        boxes = [{**r, "source": "auto", "attributes": {"score": f"{r['score']:.6f}"}} for r in results]
        written.append(_write_text(os.path.join(folder, "annotations.xml"),
                                   cvat_xml(images, boxes, category_ids, names, {"score": "number"})))
    elif fmt == "yolo":
        label_of = {c: k for k, c in enumerate(category_ids)}
        for im in images:
            written.append(_write_text(os.path.join(folder, "labels", im["out_name"] + ".txt"),
                                       yolo_rows(by_image.get(im["image_id"], []), im["width"], im["height"],
                                                 label_of, save_conf)))
        written.append(_write_text(os.path.join(folder, "classes.txt"), "".join(names[c] + "\n" for c in category_ids)))
        written.append(_write_text(os.path.join(folder, "data.yaml"), yolo_data_yaml([names[c] for c in category_ids])))
    elif fmt == "voc":
        for im in images:
            written.append(_write_text(os.path.join(folder, "Annotations", im["out_name"] + ".xml"),
                                       voc_xml(im, by_image.get(im["image_id"], []), names)))
        written.append(_write_text(os.path.join(folder, "ImageSets", "Main", "predicted.txt"),
                                   "".join(im["out_name"] + "\n" for im in images)))
        # the class list of CVAT's VOC export (datumaro's labelmap.txt: name:color:parts:actions), so readers that
        # assume VOC's 20 classes take ours
        written.append(_write_text(os.path.join(folder, "labelmap.txt"), "# label:color_rgb:parts:actions\n"
                                   + "".join(f"{names[c]}:::\n" for c in category_ids)))
    else:
        raise ValueError(f"unknown prediction format {fmt!r} (one of {', '.join(PREDICTION_FORMATS)})")
    return written


# ---- suspected label errors as review tasks (review_label_errors.py)

def error_note(e: dict) -> str:
    """One line saying what a label_errors.json entry suspects, with its rank and confidence."""
    what = {"wrong_class": f"box {e['annotation_id']} '{e['category']}' looks like '{e['suggested_category']}'",
            "badly_placed": f"box {e['annotation_id']} '{e['category']}' misplaced (IoU {e['iou']:.2f})",
            "missing_box": f"unannotated '{e['suggested_category']}'"}[e["type"]]
    return f"#{e['rank']} {e['type']}: {what} (confidence {e['confidence']:.2f})"


def review_images(errors: list[dict], top: int) -> list[tuple[int, list[dict]]]:
    """The images of the `top` entries of a ranked label-errors list, each with its entries among them:
    [(image id, entries by rank)], the image of the best-ranked entry first."""
    out: dict[int, list[dict]] = {}
    for e in sorted(errors, key=lambda e: e["rank"])[:top]:
        out.setdefault(e["image_id"], []).append(e)
    return list(out.items())


def review_boxes(annotations: list[dict], entries: list[dict], ids_of: dict[str, int]) -> list[dict]:
    """The boxes a reviewer sees on one image: every current annotation (`review` "current", `annotation_id`) and a
    suggestion per entry (`review` its `error_note`, `confidence`, at the detection's box with its class). A
    reviewer keeps the right one of each pair and deletes the other (or keeps a missing box's suggestion): what
    is left is the image's corrected annotation. `ids_of`: {class name: category id}."""
    boxes = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "source": "manual",
              "region": f"ann{a['id']}", "attributes": {"review": "current", "annotation_id": str(a["id"])}}
             for a in annotations]
    for e in entries:
        boxes.append({"image_id": e["image_id"],
                      "category_id": ids_of[e["suggested_category"]], "bbox": e["suggested_bbox"], "source": "auto",
                      "region": f"err{e['rank']}", "confidence": e["confidence"],
                      "attributes": {"review": error_note(e), "annotation_id": ""}})
    return boxes


def write_review_files(fmt: str, output_dir: str, images: list[dict], annotations: list[dict], errors: list[dict],
                       category_ids: list[int], names: dict[int, str], *, top: int = 100,
                       image_root_url: str | None = None) -> list[str]:
    """The `top` entries of a run's label_errors.json as review tasks, one per image (an image with several
    entries is one task), in the order of its best-ranked entry (`review_boxes` says what a task shows).

    Args:
        fmt: one of REVIEW_FORMATS.
        images: the annotation file's images {"id" (the id the entries name), "file_name", "path" (the file on
            disk), "width", "height"}; annotations: its annotations (COCO: `bbox` xywh pixels); names: {id: name}.
    Returns:
        the paths written (FiftyOne: the exported dataset's folder).
    Raises:
        ValueError: an unknown `fmt`, or an entry whose image is not in `images` (names the image id).
        ImportError: fiftyone without the library (one line: how to install it).
    """
    by_id = {im["id"]: im for im in images}
    anns = _by_image(annotations)
    ids_of = {names[c]: c for c in category_ids}
    tasks = []
    for iid, entries in review_images(errors, top):
        if iid not in by_id:
            raise ValueError(f"label_errors.json names image {iid}, which the annotation file does not have "
                             "(another data set than the run's?)")
        im = {**by_id[iid], "image_id": iid}
        tasks.append((im, entries, review_boxes(anns.get(iid, []), entries, ids_of)))
    folder = os.path.join(output_dir, fmt)
    if fmt == "labelstudio":
        out = []
        for im, entries, boxes in tasks:
            result = [labelstudio_region(b["bbox"], names[b["category_id"]], im["width"], im["height"], b["region"],
                                         b.get("confidence"), b["attributes"]["review"] if "confidence" in b else None)
                      for b in boxes]
            out.append({"data": {LS_IMAGE: image_reference(im["file_name"], image_root_url), "image_id": im["image_id"],
                                 "label_errors": "; ".join(error_note(e) for e in entries),
                                 "top_rank": entries[0]["rank"]},
                        "annotations": [{"result": result, "ground_truth": False}]})
        return [write_json(out, os.path.join(folder, "tasks.json"), indent=1),
                _write_text(os.path.join(folder, "label_config.xml"),
                            labelstudio_config(category_ids, names, header="label_errors"))]
    if fmt == "cvat":
        xml = cvat_xml([im for im, _, _ in tasks], [b for _, _, boxes in tasks for b in boxes], category_ids, names,
                       {"review": "text", "annotation_id": "text"})
        return [_write_text(os.path.join(folder, "annotations.xml"), xml)]
    if fmt == "fiftyone":
        return [fiftyone_review(folder, tasks, names)]
    raise ValueError(f"unknown review format {fmt!r} (one of {', '.join(REVIEW_FORMATS)})")


def fiftyone_review(folder: str, tasks: list, names: dict[int, str]) -> str:
    """The review tasks as a FiftyOne dataset (`ground_truth`: the current boxes, `label_errors`: the suggestions
    with their confidence and note; bounding_box [x, y, w, h] relative to the image), exported to `folder` as
    FiftyOneDataset (`fo.Dataset.from_dir(folder, dataset_type=fo.types.FiftyOneDataset)` loads it). Raises
    ImportError without fiftyone."""
    try:
        import fiftyone as fo
    except ImportError:
        raise ImportError("--format fiftyone needs the fiftyone library (pip install fiftyone; not a dependency of "
                          "detlib)") from None

    def detection(b: dict, im: dict):
        x, y, w, h = (float(v) for v in b["bbox"])
        return fo.Detection(label=names[b["category_id"]], bounding_box=[x / im["width"], y / im["height"],
                                                                        w / im["width"], h / im["height"]],
                            confidence=b.get("confidence"), note=b["attributes"]["review"],
                            annotation_id=b["attributes"]["annotation_id"])

    dataset = fo.Dataset()
    samples = []
    for im, entries, boxes in tasks:
        sample = fo.Sample(filepath=os.path.abspath(im["path"]), image_id=im["image_id"], top_rank=entries[0]["rank"],
                           tags=sorted({e["type"] for e in entries}))
        sample["ground_truth"] = fo.Detections(detections=[detection(b, im) for b in boxes if "confidence" not in b])
        sample["label_errors"] = fo.Detections(detections=[detection(b, im) for b in boxes if "confidence" in b])
        samples.append(sample)
    dataset.add_samples(samples)
    dataset.export(export_dir=folder, dataset_type=fo.types.FiftyOneDataset, export_media=False, overwrite=True)
    return folder


def _by_image(items: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in items:
        out.setdefault(r["image_id"], []).append(r)
    return out


def _write_text(path: str, text: str) -> str:
    with atomic_write(path) as f:
        f.write(text)
    return path
