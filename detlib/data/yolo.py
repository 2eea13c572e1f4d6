"""YOLO (ultralytics) sets read as COCO-format dicts (`read_yolo_split`): the data yaml, where each image's label
file is, the label rows, and the class ids that look written from 1 (`yolo_shifted_ids`).

Layout: ROOT/data.yaml with `names` (a list, or {index: name}) and `train:` / `val:` (an image folder, searched
recursively, a .txt list of image paths, or a list of them; relative to the yaml's `path:`, else to the yaml's
folder); one `class cx cy w h` row per box, normalised to 0..1 (a polygon row `class x1 y1 x2 y2 ...` gives its
extent), in each image's label file (`yolo_label_files`, the rule below). The rules YOLO shares with VOC (text files,
sizes, `_source`, image ids) are in `detlib.data.formats`; YOLO's own:

* YOLO classes keep their index as the category id (0..K-1), named by `names`. A row whose class id is not one
  of them stops the run (an error naming `label file:line`, as ultralytics refuses the label). A set whose rows
  use class 1 but never class 0 looks written from 1: when a row also has class K (one past `names`) that is
  an error saying so; when every id is inside `names`, a warning (class 0 may simply be unused). A LabelImg
  `classes.txt` beside the label files that orders the classes otherwise than `names` is an error too.
* YOLO label files (`yolo_label_files`): the image's path with its last `/images/` made `/labels/` and the
  extension `.txt` (ultralytics' `img2label_paths`), else the `.txt` beside the image (darknet's, CVAT's YOLO 1.1
  and LabelImg's layout). labels/ wins where both exist. A label file read beside its image and one that a
  labels/ file replaces are warnings, and a split where no image has either says where it looked: an image
  never becomes background without a word.
* YOLO image lists (`train: train.txt`, ultralytics' coco.yaml form): one image path a line, absolute or relative to
  the list's folder (ultralytics replaces a leading `./` by it), else to the set's root (`path:`); the split's
  `file_name`s are relative to the list's folder (`_yolo_folder`). A path found in neither is a repair naming the
  list, the line and the folders looked in.

Faults are findings in the data check's report (`detlib.datacheck.report`), listed in YOLO_FINDINGS; an image
without a label file has no boxes (a background image, counted), a label file without an image is warned about.
"""

from __future__ import annotations

import math
import os
from collections import Counter

from ..datacheck.orientation import shown_size
from ..datacheck.report import DataReport, Findings, read_image_headers
from .converted import coco_dict, read_lines, read_text, stem_ids

# File name extensions read as images in a YOLO image folder (ultralytics' IMG_FORMATS, lower case).
YOLO_IMAGE_EXTENSIONS = (".bmp", ".dng", ".jpeg", ".jpg", ".mpo", ".png", ".tif", ".tiff", ".webp", ".pfm", ".heic")
YOLO_YAML_NAMES = ("data.yaml", "dataset.yaml", "data.yml")
# A YOLO box whose corners lie further outside 0..1 than this is not normalised (pixels?) and is dropped; a
# little outside is rounding, clipped by the data check.
YOLO_OUTSIDE_TOLERANCE = 0.01
# Corners outside 0..1 by no more than this are the rounding of a label file's decimals: clamped without a finding.
YOLO_ROUNDING = 1e-4
YOLO_FINDINGS = {
    "no_image": ("repair", "images", "images listed that do not exist: left out"),
    "twice": ("repair", "ids", "images listed twice: kept once"),
    "bad_row": ("repair", "boxes", "label rows that are not `class cx cy w h` numbers (or a polygon): dropped"),
    "bad_class": ("error", "categories", "label rows whose class id is not one of names (0..{last}): no class of "
                  "the model is theirs (fix the id, or the names)"),
    "not_normalised": ("repair", "boxes", "label rows with coordinates outside 0..1 (pixels instead of normalised?): "
                       "dropped"),
    "duplicate_row": ("repair", "boxes", "duplicate label rows: kept once"),
    "unreadable_label": ("repair", "images", "label files that cannot be read as text: the image left out"),
    "orphan_label": ("warning", "images", "label files without an image: not used"),
    "beside": ("warning", "images", "label files beside their images, not under labels/: read (ultralytics reads only "
               "labels/)"),
    "shadowed": ("warning", "images", "label files beside their images that the image's labels/ file replaces: not used"),
    "classes_txt": ("error", "categories", "classes.txt files (LabelImg's class list, whose order the label rows' ids "
                    "follow) that name the classes in another order than `names`: make `names` that list"),
}


def yolo_yaml_in(root: str) -> str | None:
    """The data yaml of a YOLO root (YOLO_YAML_NAMES), `root` itself when it is a yaml file, else None."""
    if os.path.isfile(root) and root.lower().endswith((".yaml", ".yml")):
        return root
    for name in YOLO_YAML_NAMES:
        if os.path.isfile(os.path.join(root, name)):
            return os.path.join(root, name)
    return None


def yolo_split_paths(root: str, name: str) -> tuple[str, str]:
    """(the image folder, the yaml) of the split `name` (a yaml key) of a YOLO root. Raises FileNotFoundError: no
    yaml, or a folder or list the key names is missing; ValueError: the yaml lacks `names` or the key."""
    yaml_path = yolo_yaml_in(root)
    if yaml_path is None:
        raise FileNotFoundError(f"no {' / '.join(YOLO_YAML_NAMES)} in {root}")
    cfg = read_yolo_yaml(yaml_path)
    return _yolo_folder(_yolo_image_entries(cfg, yaml_path, name)), yaml_path


def read_yolo_yaml(path: str) -> dict:
    """A YOLO data.yaml with `names` as {index: name} (a list becomes 0..K-1).

    Raises:
        ValueError: not yaml, no `names`, indices that are not 0..K-1, or an `nc` that disagrees with `names`.
    """
    import yaml

    try:
        cfg = yaml.safe_load(read_text(path))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not yaml ({type(e).__name__})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("names"), (list, dict)) or not cfg["names"]:
        raise ValueError(f"{path} has no `names` (the class names, a list or {{index: name}})")
    names = cfg["names"]
    names = dict(enumerate(names)) if isinstance(names, list) else names
    try:
        names = {int(k): str(v) for k, v in names.items()}
    except (TypeError, ValueError):
        raise ValueError(f"{path}: `names` keys must be class indices 0..K-1") from None
    if sorted(names) != list(range(len(names))):
        raise ValueError(f"{path}: `names` indices must be 0..{len(names) - 1}, got {sorted(names)[:10]}")
    if "nc" in cfg and cfg["nc"] != len(names):
        raise ValueError(f"{path}: nc: {cfg['nc']} but `names` lists {len(names)} classes")
    return {**cfg, "names": names}


def _yolo_base(cfg: dict, yaml_path: str) -> str:
    base = os.path.dirname(os.path.abspath(yaml_path))
    if cfg.get("path"):
        p = str(cfg["path"])
        cand = p if os.path.isabs(p) else os.path.join(base, p)
        if os.path.isdir(cand):
            return os.path.abspath(cand)
    return base


def _yolo_image_entries(cfg: dict, yaml_path: str, key: str) -> list[str]:
    if not cfg.get(key):
        raise ValueError(f"{yaml_path} has no `{key}:` (the {key} images: a folder, a .txt list, or a list of them)")
    base = _yolo_base(cfg, yaml_path)
    entries = cfg[key] if isinstance(cfg[key], list) else [cfg[key]]
    out = []
    for e in entries:
        p = str(e) if os.path.isabs(str(e)) else os.path.join(base, str(e))
        if not os.path.exists(p) and str(e).startswith("../") and os.path.exists(os.path.join(base, str(e)[3:])):
            # Roboflow's data.yaml says `train: ../train/images` beside train/: ultralytics' check_det_dataset
            # reads it without the ../ when the path with it is not there
            p = os.path.join(base, str(e)[3:])
        if not os.path.exists(p):
            raise FileNotFoundError(f"{yaml_path}: `{key}: {e}` not found ({p})")
        out.append(os.path.abspath(p))
    return out


def yolo_label_path(image_path: str) -> str:
    """The label file of an image under labels/: the last `/images/` of its path becomes `/labels/`, the extension
    `.txt` (ultralytics' `img2label_paths`)."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return os.path.splitext(sb.join(image_path.rsplit(sa, 1)))[0] + ".txt"


def yolo_label_files(image_path: str) -> tuple[str | None, str | None]:
    """(the label file read for an image, a label file beside it that is not read, or None): the labels/ file
    (`yolo_label_path`) when it exists, else the `.txt` beside the image (same folder and stem: darknet's, CVAT's
    YOLO 1.1 and LabelImg's layout). The one rule for where YOLO labels are (see the module docstring)."""
    under, beside = yolo_label_path(image_path), os.path.splitext(image_path)[0] + ".txt"
    if os.path.isfile(under):
        return under, beside if beside != under and os.path.isfile(beside) else None
    return (beside, None) if os.path.isfile(beside) else (None, None)


def _yolo_folder(entries: list[str]) -> str:
    """The image folder of a split's entries, which its images' `file_name`s are relative to: the folder of one
    entry (a list's own folder), or the folder that holds them all."""
    return os.path.commonpath([e if os.path.isdir(e) else os.path.dirname(e) for e in entries])


def _yolo_listed(line: str, listing: str, base: str) -> tuple[str | None, list[str]]:
    """(the image file a line of an image list names, or None; the folders it was looked for in). A relative line
    is relative to the list's folder (ultralytics replaces a leading `./` by it), else to the set's root `base`."""
    if os.path.isabs(line):
        return (line if os.path.isfile(line) else None), [os.path.dirname(line)]
    folders = list(dict.fromkeys([os.path.dirname(listing), base]))
    found = next((os.path.join(d, line) for d in folders if os.path.isfile(os.path.join(d, line))), None)
    return (os.path.abspath(found) if found else None), folders


def _yolo_images(entries: list[str], found: Findings, base: str) -> list[str]:
    """The image files of a split's entries (folders searched recursively, .txt lists read: `_yolo_listed`), sorted,
    unique; `base` the set's root."""
    files = []
    for e in entries:
        if os.path.isdir(e):
            for dirpath, dirnames, filenames in os.walk(e, followlinks=True):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                files += [os.path.join(dirpath, f) for f in filenames
                          if not f.startswith(".") and f.lower().endswith(YOLO_IMAGE_EXTENSIONS)]
        else:
            for line in read_lines(e):
                p, looked = _yolo_listed(line, e, base)
                if p is not None:
                    files.append(p)
                else:
                    found["no_image"].append(f"{os.path.basename(e)}: {line} (looked for in {' and '.join(looked)})")
    out, seen = [], set()
    for p in sorted(files):
        if p in seen:
            found["twice"].append(p)
        else:
            seen.add(p)
            out.append(p)
    return out


def read_yolo_split(yaml_path: str, key: str, *, report: DataReport, split: str, cache_file: str | None = None,
                    progress: bool = True, class_rows: Counter | None = None) -> dict:
    """The `key` split of a YOLO data set (its yaml) as a COCO dict (see `read_split`).

    Every image's size comes from its header (YOLO labels are normalised), read once and cached in `cache_file`,
    where the data check's image pass then finds it. Label files are named relative to the set's root (the
    yaml's `path:`), rows as `file:line` from 1.
    """
    cfg = read_yolo_yaml(yaml_path)
    names = cfg["names"]
    base = _yolo_base(cfg, yaml_path)
    entries = _yolo_image_entries(cfg, yaml_path, key)
    found = Findings(YOLO_FINDINGS)
    files = _yolo_images(entries, found, base)
    folder = _yolo_folder(entries)
    heads = read_image_headers(files, progress=progress, cache_file=cache_file)
    image_ids, _ = stem_ids([os.path.splitext(os.path.basename(p))[0] for p in files])
    class_rows = Counter() if class_rows is None else class_rows
    images, annotations = [], []
    background = labelled = 0
    label_dirs: set[str] = set()
    for path, iid, (status, fw, fh, orientation) in zip(files, image_ids, heads):
        # the boxes are normalised to the image as shown (ultralytics applies the EXIF turn, exif_size)
        sw, sh = shown_size((fw, fh), orientation)
        im = {"id": iid, "file_name": os.path.relpath(path, folder), "width": sw if status == "ok" else None,
              "height": sh if status == "ok" else None}
        label, unused = yolo_label_files(path)
        if label is not None:
            label_dirs.add(os.path.dirname(label))
        if unused:
            found["shadowed"].append(os.path.relpath(unused, base))
        rows = None
        if label is not None:
            labelled += 1
            if label != yolo_label_path(path):
                found["beside"].append(os.path.relpath(label, base))
            try:
                rows = [(n, line.split()) for n, line in enumerate(read_text(label).splitlines(), 1) if line.strip()]
            except (OSError, UnicodeDecodeError):
                found["unreadable_label"].append(os.path.relpath(label, base))
                continue
        images.append(im)
        if not rows:
            background += 1
            continue
        if status != "ok":
            continue  # the image check reports the file; its boxes go with it
        seen_rows = set()
        for n, row in rows:
            where = f"{os.path.relpath(label, base)}:{n}"
            box = _yolo_row(row, len(names), found, where, class_rows)
            if box is None:
                continue
            if tuple(row) in seen_rows:
                found["duplicate_row"].append(where)
                continue
            seen_rows.add(tuple(row))
            cls, cx, cy, w, h = box
            x1, y1, bw, bh = (cx - w / 2) * sw, (cy - h / 2) * sh, w * sw, h * sh
            # a box that ends at the border must not pass it by a float rounding (a "clipped" repair otherwise)
            bw = min(bw, sw - x1) if x1 + bw > sw and x1 + bw - sw < 1e-6 * sw else bw
            bh = min(bh, sh - y1) if y1 + bh > sh and y1 + bh - sh < 1e-6 * sh else bh
            annotations.append({"image_id": iid, "category_id": cls, "bbox": [x1, y1, bw, bh], "area": bw * bh,
                                "iscrowd": 0, "_source": where})
    found["orphan_label"].extend(_yolo_orphan_labels(entries, files))
    found["classes_txt"].extend(_yolo_classes_txt_conflicts(label_dirs, names, base))
    found.add_to(report, split, last=len(names) - 1)
    if files and not labelled:  # every image background: say where the labels were looked for
        report.add("warning", "images", split, "no image has a label file, so every image is background: looked for "
                   f"{os.path.relpath(yolo_label_path(files[0]), base)} and {os.path.relpath(os.path.splitext(files[0])[0], base)}"
                   ".txt (and the same for each image)", count=len(files))
    report.summaries[f"{split} (yolo)"] = {"yaml": yaml_path, "split": key, "images without a label file or rows "
                                           "(background)": background}
    categories = [{"id": k, "name": names[k]} for k in sorted(names)]
    return coco_dict(images, annotations, categories, f"converted from YOLO {yaml_path} ({key})")


def _yolo_row(row: list[str], num_classes: int, found: Findings, where: str, class_rows: Counter):
    """(class, cx, cy, w, h) normalised of a label row; None (with its finding) when it is dropped. Counts the row's
    class id into `class_rows` (out-of-range ones too)."""
    try:
        values = [float(v) for v in row]
    except ValueError:
        values = None
    if (values is None or len(values) < 5 or (len(values) > 5 and len(values) % 2 == 0)
            or not all(map(math.isfinite, values)) or not values[0].is_integer()):
        found["bad_row"].append(where)
        return None
    cls = int(values[0])
    class_rows[cls] += 1
    if not 0 <= cls < num_classes:
        found["bad_class"].append(f"{where} (class {cls})")
        return None
    if len(values) == 5:
        cx, cy, w, h = values[1:]
        x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
    else:  # a segment: its polygon's extent, as ultralytics' segments2boxes
        xs, ys = values[1::2], values[2::2]
        x1, y1, x2, y2 = min(xs), min(ys), max(xs), max(ys)
        cx, cy, w, h = (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1
    t = YOLO_OUTSIDE_TOLERANCE
    if min(x1, y1) < -t or max(x2, y2) > 1 + t:
        found["not_normalised"].append(where)
        return None
    if min(x1, y1) < 0 <= min(x1, y1) + YOLO_ROUNDING or 1 < max(x2, y2) <= 1 + YOLO_ROUNDING:
        # written with a few decimals, a box at the border overshoots it by the rounding: not a fault to report
        x1, y1, x2, y2 = max(x1, 0.0), max(y1, 0.0), min(x2, 1.0), min(y2, 1.0)
        cx, cy, w, h = (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1
    return cls, cx, cy, w, h


def _yolo_classes_txt_conflicts(label_dirs: set[str], names: dict[int, str], base: str) -> list[str]:
    """The classes.txt files in the folders labels were read from whose i-th name is not `names[i]` (for every i
    both have; LabelImg appends new classes at the end), each with its first difference."""
    out = []
    for folder in sorted(label_dirs):
        f = os.path.join(folder, "classes.txt")
        try:
            listed = read_lines(f)
        except (OSError, UnicodeDecodeError):
            continue
        diff = next((i for i, n in enumerate(listed[:len(names)]) if n != names[i]), None)
        if diff is not None:
            out.append(f"{os.path.relpath(f, base)}: class {diff} is {listed[diff]!r} there, {names[diff]!r} in names")
    return out


def _yolo_orphan_labels(entries: list[str], files: list[str]) -> list[str]:
    """Label files under the labels/ folder of a split's image folder that no image of the split has."""
    wanted = {yolo_label_path(p) for p in files}
    out = []
    for e in entries:
        if not os.path.isdir(e):
            continue
        labels = os.path.dirname(yolo_label_path(os.path.join(e, "x.jpg")))
        if os.path.abspath(labels) == os.path.abspath(e):
            continue  # labels beside the images: any other .txt there is no label of ours to judge
        for dirpath, _, filenames in os.walk(labels):
            out += [os.path.join(dirpath, f) for f in filenames
                    if f.endswith(".txt") and f != "classes.txt" and os.path.join(dirpath, f) not in wanted]
    return sorted(out)


def yolo_shifted_ids(class_rows: Counter, names: dict[int, str]) -> tuple[str, str, int] | None:
    """(level, message, rows) when the label rows' class ids look written from 1 instead of 0, else None.

    The rule: the rows use class 1 and never class 0. Then when a row has class K = len(names), one past the
    last name, the set is refused (an error: every box would train under the name of the class before its own,
    and the rows of class K have none); when every id is inside `names` it is said (a warning: class 0 may
    simply have no box).
    """
    if not class_rows or 0 in class_rows or min(class_rows) != 1:
        return None
    k, top = len(names), max(class_rows)
    if top == k:
        return ("error", f"class ids look written from 1, not 0: no label row has class 0 and {class_rows[k]} rows "
                f"have class {k}, one past names (0..{k - 1}); subtract 1 from every class id (ultralytics counts "
                "from 0)", class_rows[k])
    return ("warning", f"no label row has class 0 ({names[0]!r}) while rows of classes 1..{top} do: if the labels "
            "count from 1, every box trains under the name of the class before its own (then subtract 1 from every "
            "class id)", 1)

