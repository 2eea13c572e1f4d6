"""The built-in data sets, generated deterministically, so both scripts run with no download.

Detection (`make_synthetic_coco`, used by train_retinanet.py): images show 2-5 filled shapes (circle, square,
triangle: 3 classes) in random colours on textured backgrounds (smooth colour gradient + noise + random lines
as distractors). Written as JPEG files plus COCO-format json, the same path a real data set takes through the code:

    root/images/{train,val}_000000.jpg
    root/annotations/instances_{train,val}.json

`make_small_objects_coco` (`--builtin small_objects`): the same shapes, 8-32 px, on images of 768-1280 px a side,
for training and evaluating on tiles (detlib.data.train_tiles).

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

from ..files import cache_writes, read_json, write_json

logger = logging.getLogger(__name__)

SHAPES_CATEGORIES = [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}, {"id": 3, "name": "triangle"}]
SHAPES_VERSION = 2  # 2: 128 px, objects 24-64 px, 2-5 per image, none hidden (1: 160 px, 20-64 px, 1-4)
MIN_OBJECTS, MAX_OBJECTS = 2, 5  # shapes per image (fewer where no free place is found)
SMALL_OBJECTS_VERSION = 1
SMALL_OBJECTS_SIDES = (768, 1024, 1280)  # image sides in px
SMALL_OBJECTS_AREA = 25_000  # px^2 of image per object on average: at most 98 objects an image, under COCO's 100 detections
STRIPES_CLASSES = ("horizontal", "vertical")
STRIPES_VERSION = 2


CACHE_REMEDY = "set DETLIB_CACHE to a writable folder (or pass a data set)"


def cache_root() -> str:
    """Where the built-in data sets are generated (absolute): `$DETLIB_CACHE`, else `~/.cache/detlib`."""
    return os.path.abspath(os.environ.get("DETLIB_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "detlib")))


def _background(rng: np.random.RandomState, size: int, width: int | None = None) -> np.ndarray:
    """A `size` (height) x `width` (default: `size`) colour gradient plus noise, [H, W, 3] uint8."""
    h, w = size, width or size
    c0, c1 = rng.randint(0, 256, 3), rng.randint(0, 256, 3)
    t = np.linspace(0, 1, w)[None, :, None] if rng.rand() < 0.5 else np.linspace(0, 1, h)[:, None, None]
    img = c0 * (1 - t) + c1 * t + rng.normal(0, 18, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def _draw_shape(draw: ImageDraw.ImageDraw, rng: np.random.RandomState, x: int, y: int, s: int) -> int:
    """Draw a random class's shape (0 circle, 1 square, 2 triangle) filling the box (x, y, x + s, y + s) in a random
    colour; returns the class."""
    cls = int(rng.randint(0, 3))
    colour = tuple(int(v) for v in rng.randint(0, 256, 3))
    if cls == 0:
        draw.ellipse([x, y, x + s - 1, y + s - 1], fill=colour)
    elif cls == 1:
        draw.rectangle([x, y, x + s - 1, y + s - 1], fill=colour)
    else:
        draw.polygon([(x + s / 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=colour)
    return cls


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
        anns.append((_draw_shape(draw, rng, x, y, s), [float(x), float(y), float(s), float(s)]))
    return img, anns


def _draw_small_objects_image(rng: np.random.RandomState, min_obj: int, max_obj: int):
    """A large image (sides of 768, 1024 or 1280 px) with one small shape per SMALL_OBJECTS_AREA px^2 on average
    (sides `min_obj`..`max_obj` px, apart as in `_draw_image`) and 0-15 thin distractor lines."""
    h, w = (int(rng.choice(SMALL_OBJECTS_SIDES)) for _ in range(2))
    img = Image.fromarray(_background(rng, h, w))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(0, 16)):
        pts = [(int(rng.randint(0, w)), int(rng.randint(0, h))) for _ in range(2)]
        draw.line(pts, fill=tuple(int(v) for v in rng.randint(0, 256, 3)), width=int(rng.randint(1, 3)))
    anns, placed = [], []
    for _ in range(rng.randint(h * w // (2 * SMALL_OBJECTS_AREA), 3 * h * w // (2 * SMALL_OBJECTS_AREA))):
        s = int(rng.randint(min_obj, max_obj + 1))
        x, y = int(rng.randint(0, w - s)), int(rng.randint(0, h - s))
        if any(_overlap((x, y, x + s, y + s), p) >= 0.3 for p in placed):
            continue
        placed.append((x, y, x + s, y + s))
        anns.append((_draw_shape(draw, rng, x, y, s), [float(x), float(y), float(s), float(s)]))
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
    if _cached(root, params, paths):
        return paths
    logger.info("generating the built-in synthetic shapes data set in %s", root)
    return _write_coco_set(root, params, paths, {"train": (num_train, seed), "val": (num_val, seed + 1)},
                           lambda rng: _draw_image(rng, image_size, min_object, max_object), "detlib synthetic shapes")


def make_small_objects_coco(root: str | None = None, num_train: int = 20, num_val: int = 8, min_object: int = 8,
                            max_object: int = 32, seed: int = 0) -> dict[str, str]:
    """Generate (or reuse) the built-in small-object set (`--builtin small_objects`; default root:
    cache_root()/small_objects_v1): the shapes of the default set, `min_object` to `max_object` px, about 42 to a
    1024 x 1024 image, on large images (sides of 768, 1024 or 1280 px, `_draw_small_objects_image`). Resized whole
    to a model's 128 px input they are 1-5 px wide: the set shows what tiling (`--train_tile`, `--tile`) is for.

    Returns:
        {"train_images", "train_annotations", "val_images", "val_annotations"}: paths in the COCO layout.
    """
    root = root or os.path.join(cache_root(), f"small_objects_v{SMALL_OBJECTS_VERSION}")
    params = {"version": SMALL_OBJECTS_VERSION, "num_train": num_train, "num_val": num_val, "min_object": min_object,
              "max_object": max_object, "seed": seed}
    paths = {"train_images": os.path.join(root, "images"), "val_images": os.path.join(root, "images"),
             "train_annotations": os.path.join(root, "annotations", "instances_train.json"),
             "val_annotations": os.path.join(root, "annotations", "instances_val.json")}
    if _cached(root, params, paths):
        return paths
    logger.info("generating the built-in small-object data set in %s", root)
    return _write_coco_set(root, params, paths, {"train": (num_train, seed), "val": (num_val, seed + 1)},
                           lambda rng: _draw_small_objects_image(rng, min_object, max_object), "detlib small objects")


def _cached(root: str, params: dict, paths: dict[str, str]) -> bool:
    """Whether root/generator.json says `params` made the set and its `paths` are all there."""
    marker = os.path.join(root, "generator.json")
    if not os.path.isfile(marker):
        return False
    return read_json(marker) == params and all(os.path.exists(p) for p in paths.values())


def _write_coco_set(root: str, params: dict, paths: dict[str, str], splits: dict[str, tuple[int, int]], draw,
                    description: str) -> dict[str, str]:
    """Draw `splits` ({split: (count, seed)}) with `draw(rng) -> (PIL image, [(class, xywh)])` as JPEG files and
    COCO jsons at `paths`, then write `params` as root/generator.json (the cache's marker). Returns `paths`."""
    with cache_writes(root, "built-in data's cache", CACHE_REMEDY):
        os.makedirs(paths["train_images"], exist_ok=True)
        os.makedirs(os.path.dirname(paths["train_annotations"]), exist_ok=True)
        ann_id = 1
        for split, (count, split_seed) in splits.items():
            rng = np.random.RandomState(split_seed)
            images, annotations = [], []
            for i in range(count):
                img, anns = draw(rng)
                name = f"{split}_{i:06d}.jpg"
                img.save(os.path.join(paths[f"{split}_images"], name), quality=90)
                image_id = i + 1 + (0 if split == "train" else 1_000_000)
                images.append({"id": image_id, "file_name": name, "width": img.width, "height": img.height})
                for cls, bbox in anns:
                    annotations.append({"id": ann_id, "image_id": image_id, "category_id": SHAPES_CATEGORIES[cls]["id"],
                                        "bbox": bbox, "area": bbox[2] * bbox[3], "iscrowd": 0})
                    ann_id += 1
            data = {"info": {"description": description, "version": params["version"]}, "licenses": [],
                    "images": images, "annotations": annotations, "categories": SHAPES_CATEGORIES}
            write_json(data, paths[f"{split}_annotations"])
        with open(os.path.join(root, "generator.json"), "w") as f:
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
    if os.path.isfile(marker) and read_json(marker) == params:
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
