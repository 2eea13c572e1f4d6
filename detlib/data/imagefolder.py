"""ImageFolder data: the folder scan (classes, usable images, a cache of the decode check) and the data set.

Layout (torchvision `ImageFolder`): `root/<class name>/**/<image>`. Class names are the sorted names of the
sub-folders of `root`; class index i is the i-th name. Hidden entries (names starting with "." such as
`.ipynb_checkpoints`, `.DS_Store`, macOS `._cat.1.jpg`, and `__MACOSX`) are never classes nor samples.
Files without an image extension (`Thumbs.db`, `desc.txt`) are left out and counted.

Real folders hold damaged files (0 bytes, truncated downloads, text saved as .jpg) and images in every colour
mode (grayscale, CMYK, RGBA, palette). `scan_image_folder` checks every file once at start, in parallel
threads (PIL decodes without holding the GIL), and leaves out the ones that cannot be decoded, with a count
and the first paths; the data set converts every image to RGB. The result of the check is cached by
(path, size, mtime), so the other processes of a distributed run and a resumed run do not decode everything
again.

We keep our own scan rather than torchvision's `ImageFolder`: it skips hidden entries and undecodable files
with a report, survives symlink loops, and caches the decode check.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..files import file_key, read_json_cache, write_json
from ..logtext import LIST_ITEMS, short_list
from .images import check_image_file, load_rgb, load_skipping_unreadable
from .seeds import sample_rng
from .options import VERIFY_MODES  # beside the flags, where --help reads it without torch

logger = logging.getLogger(__name__)

# IMG_EXTENSIONS is torchvision's list (lower case, .webp included); the check is case-insensitive.
JUNK_FOLDERS = ("__MACOSX",)  # written by macOS zip tools next to the real folders


def is_hidden(name: str) -> bool:
    """True for names that are never classes nor samples: dot-files/folders and `__MACOSX`."""
    return name.startswith(".") or name in JUNK_FOLDERS


def find_classes(root: str) -> tuple[list[str], dict[str, int], list[str]]:
    """Class folders of an ImageFolder root.

    Returns:
        (classes sorted by name, {class name: index}, hidden entries of `root` that were left out).
    Raises:
        FileNotFoundError: `root` is not a folder (names it).
        ValueError: `root` has no (non-hidden) sub-folder, with what it holds instead.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image folder not found: {root}")
    entries = sorted(os.scandir(root), key=lambda e: e.name)
    hidden = [e.name for e in entries if is_hidden(e.name)]
    classes = [e.name for e in entries if e.is_dir() and not is_hidden(e.name)]
    if not classes:
        raise ValueError(f"{root} has no class folders: expected {root}/<class>/<image> (ImageFolder layout); "
                         f"it holds {[e.name for e in entries][:10]}")
    return classes, {c: i for i, c in enumerate(classes)}, hidden


def check_split_classes(train_classes: list[str], val_classes: list[str], train_root: str, val_root: str) -> None:
    """Raise ValueError naming the differences when train and val would map classes to different indices."""
    if list(train_classes) == list(val_classes):
        return
    only_train = sorted(set(train_classes) - set(val_classes))
    only_val = sorted(set(val_classes) - set(train_classes))
    short = len(train_classes) + len(val_classes) <= 2 * LIST_ITEMS
    lists = (f" (train classes {train_classes}, val classes {val_classes})" if short
             else f" ({len(train_classes)} train classes, {len(val_classes)} val classes)")
    raise ValueError(f"class folders differ between {train_root} and {val_root}, so a label index would mean "
                     f"different classes: only in train {_names(only_train)}, only in val {_names(only_val)}" + lists)


def _names(names: list[str]) -> str:
    """A list of names for a message: as Python writes it when short, else cut (detlib.logtext)."""
    return str(names) if len(names) <= LIST_ITEMS else f"[{short_list(names)}]"


@dataclass
class FolderScan:
    """What `scan_image_folder` found.

    samples: (path, class index) of every usable image, sorted by class then path.
    skipped: (path, reason) of image-named files that cannot be decoded ("empty file", "truncated", ...).
    ignored: files left out without a check (hidden files, names without an image extension).
    hidden: hidden entries of the root (never classes).
    revisited: folders reached a second time through a symlink (a loop, or a second link), not listed again.
    """

    root: str
    classes: list[str]
    class_to_idx: dict[str, int]
    samples: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    revisited: list[str] = field(default_factory=list)

    def class_counts(self) -> list[int]:
        counts = Counter(t for _, t in self.samples)
        return [counts.get(i, 0) for i in range(len(self.classes))]


def _list_files(root: str, classes: list[str]) -> tuple[list[tuple[str, int]], list[str], list[str]]:
    candidates, ignored, revisited = [], [], []
    for idx, cls in enumerate(classes):
        # os.walk follows a symlink loop until the path is too long, listing every file again on each turn.
        seen: set[tuple[int, int]] = set()
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls), followlinks=True):
            try:
                st = os.stat(dirpath)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                revisited.append(dirpath)
                dirnames[:] = []
                continue
            seen.add((st.st_dev, st.st_ino))
            ignored.extend(os.path.join(dirpath, d) for d in dirnames if is_hidden(d))
            dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))  # os.walk does not descend into them
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                if is_hidden(name) or not name.lower().endswith(IMG_EXTENSIONS):
                    ignored.append(path)
                else:
                    candidates.append((path, idx))
    return candidates, ignored, revisited


def scan_image_folder(root: str, class_to_idx: dict[str, int] | None = None, verify: str = "full",
                      num_threads: int | None = None, cache_file: str | None = None) -> FolderScan:
    """List the images of an ImageFolder root and leave out the ones that cannot be decoded.

    Args:
        root: `root/<class>/**/<image>`.
        class_to_idx: the mapping to use (the training set's); by default the root's own. Raises ValueError
            when the root's class folders differ from it.
        verify: "full" decodes every pixel (finds truncated files), "header" reads headers only (finds empty
            and non-image files, fast), "none" lists files without opening them.
        num_threads: parallel checks (default: CPU count).
        cache_file: JSON file remembering each checked file's result by (size, mtime).
    Returns:
        FolderScan.
    Raises:
        FileNotFoundError, ValueError: see `find_classes` and `check_split_classes`.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    classes, own_map, hidden = find_classes(root)
    if class_to_idx is not None:
        expected = sorted(class_to_idx, key=class_to_idx.get)
        check_split_classes(expected, classes, "the training set", root)
    scan = FolderScan(root=root, classes=classes, class_to_idx=own_map, hidden=hidden)
    candidates, scan.ignored, scan.revisited = _list_files(root, classes)
    if verify == "none":
        scan.samples = candidates
        return scan

    cache = read_json_cache(cache_file)

    def key_of(path: str) -> str:
        key = file_key(path)
        if key is None:
            raise FileNotFoundError(path)  # gone since the scan: reported missing below
        return f"{verify}|{key}"

    def check(path: str) -> tuple[str | None, str | None]:
        try:
            key = key_of(path)
        except OSError:
            return None, "missing"
        if key in cache:
            return key, cache[key]
        return key, check_image_file(path, full_decode=verify == "full")

    threads = num_threads or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(check, [p for p, _ in candidates]))
    new_cache = {}
    for (path, target), (key, reason) in zip(candidates, results):
        if key is not None:
            new_cache[key] = reason
        if reason is None:
            scan.samples.append((path, target))
        else:
            scan.skipped.append((path, reason))
    if cache_file and new_cache.keys() - cache.keys():
        cache.update(new_cache)
        write_json(cache, cache_file)
    return scan


class ImageFolderDataset(torch.utils.data.Dataset):
    """The usable images of a `FolderScan`, as RGB tensors.

    Item: {"image": float32 [3, S, S] (after `transform`; uint8 [3, H, W] without one),
           "label": int, the class index, "index": int, the position in `samples`}.
    A key past the last image is a repeated draw of image key % N (`ClassBalancedSampler`), with its own augmentation.
    With `seed`, a sample's random transform is a function of (seed, epoch, key) alone (`sample_rng`; the epoch:
    `set_epoch`), so a run resumed mid-epoch sees the crops and flips the uninterrupted run saw.
    A file that fails to decode although the scan passed it (changed on disk, or `verify="none"`) is logged;
    in training the next image is used instead, in evaluation a black image keeps the sample count exact.
    """

    def __init__(self, scan: FolderScan, transform=None, train: bool = True, seed: int | None = None):
        self.samples = scan.samples
        self.classes = scan.classes
        self.class_to_idx = scan.class_to_idx
        self.transform = transform
        self.train, self.seed, self.epoch = train, seed, 0
        if not self.samples:
            raise ValueError(f"no usable image in {scan.root}")

    def __len__(self) -> int:
        return len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's augmentation stream (with `seed`). DataLoader workers must be re-created
        each epoch to see it (`persistent_workers=False`)."""
        self.epoch = int(epoch)

    def _load(self, index: int, copy: int = 0) -> dict:
        path, label = self.samples[index]
        img, truncated = load_rgb(path)
        if truncated:
            logger.warning("image %s is truncated; its missing part is decoded as grey", path)
        if self.transform is not None:
            with sample_rng(self.seed, self.epoch, index + copy * len(self)):
                image = self.transform(img)
        else:
            image = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)
        return {"image": image, "label": label, "index": index}

    def __getitem__(self, key: int) -> dict:
        copy, index = divmod(key, len(self))
        return load_skipping_unreadable(lambda i: self._load(i, copy), index, len(self), self.train, self._unreadable)

    def _unreadable(self, index: int, error: Exception) -> dict:
        logger.warning("unreadable image, evaluated as a black image: %s", error)
        return self._load_black(index)

    def _load_black(self, index: int) -> dict:
        black = Image.new("RGB", (64, 64))
        image = self.transform(black) if self.transform is not None else torch.zeros((3, 64, 64), dtype=torch.uint8)
        return {"image": image, "label": self.samples[index][1], "index": index}
