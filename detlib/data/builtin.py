"""The built-in data sets, generated deterministically, so both scripts run with no download.

Detection (`make_synthetic_coco`, used by train_retinanet.py): images show 2-5 filled shapes (circle, square,
triangle: 3 classes) in random colours on textured backgrounds (smooth colour gradient + noise + random lines
as distractors). Written as JPEG files plus COCO-format json, the same path a real data set takes through the code:

    root/images/{train,val}_000000.jpg
    root/annotations/instances_{train,val}.json

Classification (`make_synthetic_image_folder`, used by train_catsdogs.py): a 2-class ImageFolder,
horizontal vs vertical stripes:

    root/{train,val}/{horizontal,vertical}/<class>_00000.jpg

Generation is seeded, so the same arguments give the same files on every machine; a folder that already
holds a matching `generator.json` is reused (the cache). Both live under `cache_root()`, each in a folder
named with its generator's version, so a changed generator never reuses old files. A cache that is there is only
read (a read-only home with the sets in it works); one that cannot be written is one line (`detlib.files.cache_writes`).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
from PIL import Image, ImageDraw

from ..files import cache_writes, write_json

logger = logging.getLogger(__name__)

SHAPES_CATEGORIES = [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}, {"id": 3, "name": "triangle"}]
SHAPES_VERSION = 2  # 2: 128 px, objects 24-64 px, 2-5 per image, none hidden (1: 160 px, 20-64 px, 1-4)
MIN_OBJECTS, MAX_OBJECTS = 2, 5  # shapes per image (fewer where no free place is found)
STRIPES_CLASSES = ("horizontal", "vertical")
STRIPES_VERSION = 2


CACHE_REMEDY = "set DETLIB_CACHE to a writable folder (or pass a data set)"


def cache_root() -> str:
    """Where the built-in data sets are generated (absolute): `$DETLIB_CACHE`, else `~/.cache/detlib`."""
    return os.path.abspath(os.environ.get("DETLIB_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "detlib")))


def _background(rng: np.random.RandomState, size: int) -> np.ndarray:
    c0, c1 = rng.randint(0, 256, 3), rng.randint(0, 256, 3)
    t = np.linspace(0, 1, size)[None, :, None] if rng.rand() < 0.5 else np.linspace(0, 1, size)[:, None, None]
    img = c0 * (1 - t) + c1 * t + rng.normal(0, 18, (size, size, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def _draw_image(rng: np.random.RandomState, size: int, min_obj: int, max_obj: int):
    img = Image.fromarray(_background(rng, size))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(0, 4)):  # distractor lines: not objects
        pts = [tuple(int(v) for v in rng.randint(0, size, 2)) for _ in range(2)]
        draw.line(pts, fill=tuple(int(v) for v in rng.randint(0, 256, 3)), width=int(rng.randint(1, 4)))
    anns, placed = [], []
    for _ in range(rng.randint(MIN_OBJECTS, MAX_OBJECTS + 1)):
        for _attempt in range(20):
            s = int(rng.randint(min_obj, max_obj + 1))
            x, y = int(rng.randint(0, size - s)), int(rng.randint(0, size - s))
            # keep objects apart enough that each stays visible: a new shape (drawn on top) covers at most 30 % of
            # the box of any earlier one, also of a small one it would contain (whose IoU with it is small)
            if all(_overlap((x, y, x + s, y + s), p) < 0.3 for p in placed):
                break
        else:
            continue
        placed.append((x, y, x + s, y + s))
        cls = int(rng.randint(0, 3))
        colour = tuple(int(v) for v in rng.randint(0, 256, 3))
        if cls == 0:
            draw.ellipse([x, y, x + s - 1, y + s - 1], fill=colour)
        elif cls == 1:
            draw.rectangle([x, y, x + s - 1, y + s - 1], fill=colour)
        else:
            draw.polygon([(x + s / 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=colour)
        anns.append((cls, [float(x), float(y), float(s), float(s)]))
    return img, anns


def _overlap(a, b) -> float:
    """Intersection of boxes `a` and `b` (xyxy) over the area of the smaller one."""
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return ix * iy / smaller if smaller > 0 else 0.0


def make_synthetic_coco(root: str | None = None, num_train: int = 600, num_val: int = 100, image_size: int = 128,
                        min_object: int = 24, max_object: int = 64, seed: int = 0) -> dict[str, str]:
    """Generate (or reuse) the synthetic shapes detection data set (default root: cache_root()/synthetic_shapes_v2).

    The defaults are the built-in set of train_retinanet.py: square images of `image_size` px, objects with sides
    of `min_object` to `max_object` px, which the default anchors (32-512 px, detlib.retinanet.anchors) match at IoU >= 0.5.

    Returns:
        {"train_images", "train_annotations", "val_images", "val_annotations"}: paths in the COCO layout.
    """
    root = root or os.path.join(cache_root(), f"synthetic_shapes_v{SHAPES_VERSION}")
    params = {"version": SHAPES_VERSION, "num_train": num_train, "num_val": num_val, "image_size": image_size,
              "min_object": min_object, "max_object": max_object, "seed": seed}
    paths = {"train_images": os.path.join(root, "images"), "val_images": os.path.join(root, "images"),
             "train_annotations": os.path.join(root, "annotations", "instances_train.json"),
             "val_annotations": os.path.join(root, "annotations", "instances_val.json")}
    marker = os.path.join(root, "generator.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == params and all(os.path.exists(p) for p in paths.values()):
                return paths
    logger.info("generating the built-in synthetic shapes data set in %s", root)
    with cache_writes(root, "built-in data's cache", CACHE_REMEDY):
        os.makedirs(paths["train_images"], exist_ok=True)
        os.makedirs(os.path.dirname(paths["train_annotations"]), exist_ok=True)
        ann_id = 1
        for split, count, split_seed in (("train", num_train, seed), ("val", num_val, seed + 1)):
            rng = np.random.RandomState(split_seed)
            images, annotations = [], []
            for i in range(count):
                img, anns = _draw_image(rng, image_size, min_object, max_object)
                name = f"{split}_{i:06d}.jpg"
                img.save(os.path.join(paths[f"{split}_images"], name), quality=90)
                image_id = i + 1 + (0 if split == "train" else 1_000_000)
                images.append({"id": image_id, "file_name": name, "width": image_size, "height": image_size})
                for cls, bbox in anns:
                    annotations.append({"id": ann_id, "image_id": image_id, "category_id": SHAPES_CATEGORIES[cls]["id"],
                                        "bbox": bbox, "area": bbox[2] * bbox[3], "iscrowd": 0})
                    ann_id += 1
            data = {"info": {"description": "detlib synthetic shapes", "version": SHAPES_VERSION}, "licenses": [],
                    "images": images, "annotations": annotations, "categories": SHAPES_CATEGORIES}
            write_json(data, paths[f"{split}_annotations"])
        with open(marker, "w") as f:
            json.dump(params, f)
    return paths


# ---- classification: horizontal vs vertical stripes

def _draw_stripes_image(rng: np.random.RandomState, size: int, cls: int) -> Image.Image:
    """Stripes of random period, phase, contrast and colours, horizontal (class 0) or vertical (class 1), under
    pixel noise and a random filled shape that both classes share (so no single colour or blob tells them apart)."""
    period = rng.uniform(size / 10, size / 3)
    wave = 0.5 + 0.5 * np.sin(2 * np.pi * np.arange(size) / period + rng.uniform(0, 2 * np.pi))
    wave = wave[:, None] if cls == 0 else wave[None, :]  # rows (horizontal stripes) or columns
    c0, c1 = rng.randint(0, 256, 3), rng.randint(0, 256, 3)
    img = c0 * (1 - wave[..., None]) + c1 * wave[..., None] + rng.normal(0, 20, (size, size, 3))
    img = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    s = int(rng.randint(size // 5, size // 2))
    x, y = int(rng.randint(0, size - s)), int(rng.randint(0, size - s))
    colour = tuple(int(v) for v in rng.randint(0, 256, 3))
    (draw.ellipse if rng.rand() < 0.5 else draw.rectangle)([x, y, x + s - 1, y + s - 1], fill=colour)
    return img


def make_synthetic_image_folder(root: str | None = None, num_train: int = 200, num_val: int = 50,
                                image_size: int = 64, seed: int = 0) -> dict[str, str]:
    """Generate (or reuse) a 2-class ImageFolder: horizontal vs vertical stripes (see `_draw_stripes_image`);
    default root: cache_root()/synthetic_imagefolder_v2.

    `num_train` / `num_val` images per class, JPEG, seeded (the same files on every machine); a folder whose
    `generator.json` matches the arguments is reused.
    Returns:
        {"train_dir": root/train, "val_dir": root/val}.
    """
    root = root or os.path.join(cache_root(), f"synthetic_imagefolder_v{STRIPES_VERSION}")
    params = {"version": STRIPES_VERSION, "num_train": num_train, "num_val": num_val, "image_size": image_size,
              "seed": seed}
    dirs = {"train_dir": os.path.join(root, "train"), "val_dir": os.path.join(root, "val")}
    marker = os.path.join(root, "generator.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == params:
                return dirs
    logger.info("generating the built-in stripes image folder (horizontal vs vertical) in %s", root)
    with cache_writes(root, "built-in data's cache", CACHE_REMEDY):
        for split, count, split_seed in (("train", num_train, seed), ("val", num_val, seed + 1)):
            rng = np.random.RandomState(split_seed)
            for cls, name in enumerate(STRIPES_CLASSES):
                folder = os.path.join(root, split, name)
                os.makedirs(folder, exist_ok=True)
                for i in range(count):
                    _draw_stripes_image(rng, image_size, cls).save(os.path.join(folder, f"{name}_{i:05d}.jpg"), quality=90)
        with open(marker, "w") as f:
            json.dump(params, f)
    return dirs
