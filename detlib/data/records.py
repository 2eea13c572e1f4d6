"""Per-image training records in a few flat numpy arrays instead of one Python dict per image.

A DataLoader worker is a fork of the training process. Reading a Python object in a fork writes its reference
count, so every page of a list of 118k dicts (COCO train: ~860k boxes) is copied into every worker of every
process, a few hundred MiB each ("copy-on-read"; detectron2 serialises its records into one buffer for this
reason). Numpy arrays hold no per-element objects: workers read them without copying a page.

`CompactRecords` keeps, for N images and T boxes:
    ids [N] int64, sizes [N, 2] int32 (H, W),
    offsets [N + 1] int64 (boxes of image i: rows offsets[i]:offsets[i + 1]),
    boxes [T, 4] float32 xyxy pixels, labels [T] int64, iscrowd [T] bool,
    paths: one uint8 buffer of the UTF-8 paths, with path_offsets [N + 1] int64.
Indexing returns the dict a list of records would hold (`id`, `path`, `size`, `boxes`, `labels`, `iscrowd`), with
array views: nothing is copied.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


class CompactRecords:
    """A read-only sequence of image records stored as flat arrays (see the module docstring).

    Args:
        records: dicts with `id` (int), `path` (str), `size` ((H, W)), `boxes` ([n, 4] float32), `labels` ([n]
            int64) and `iscrowd` ([n] bool).
    """

    def __init__(self, records: Sequence[dict]):
        n = len(records)
        counts = np.fromiter((len(r["labels"]) for r in records), dtype=np.int64, count=n)
        self.offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        self.ids = np.fromiter((r["id"] for r in records), dtype=np.int64, count=n)
        self.sizes = np.asarray([r["size"] for r in records], dtype=np.int32).reshape(n, 2)
        self.boxes = (np.concatenate([r["boxes"] for r in records]) if n else np.zeros((0, 4))).astype(np.float32).reshape(-1, 4)
        self.labels = (np.concatenate([r["labels"] for r in records]) if n else np.zeros(0)).astype(np.int64)
        self.iscrowd = (np.concatenate([r["iscrowd"] for r in records]) if n else np.zeros(0)).astype(bool)
        encoded = [r["path"].encode("utf-8") for r in records]
        self.path_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(p) for p in encoded], out=self.path_offsets[1:])
        self.paths = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        a, b = self.offsets[index], self.offsets[index + 1]
        p, q = self.path_offsets[index], self.path_offsets[index + 1]
        return {"id": int(self.ids[index]), "path": self.paths[p:q].tobytes().decode("utf-8"),
                "size": (int(self.sizes[index, 0]), int(self.sizes[index, 1])), "boxes": self.boxes[a:b],
                "labels": self.labels[a:b], "iscrowd": self.iscrowd[a:b]}

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))
