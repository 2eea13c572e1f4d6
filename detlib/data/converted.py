"""What the Pascal VOC and YOLO readers (`detlib.data.voc`, `detlib.data.yolo`) share: the one rule by which
their text files are read (`read_text`), the image ids of a converted split, and the COCO-format dict it becomes.
The rules of the conversion: `detlib.data.formats`.
"""

from __future__ import annotations

import codecs


def read_text(path: str) -> str:
    """A text file as every reader of `voc` and `yolo` takes it (data.yaml, label files, classes.txt, image lists,
    split lists, class lists), whatever wrote it: UTF-8 with or without a BOM (Windows Notepad writes one), UTF-16
    with its BOM (Notepad's "Unicode"). Lines are then split by `str.splitlines` (LF, CRLF or CR) and rows by
    `str.split` (spaces or tabs). VOC xml goes to its parser as bytes, which honours a BOM itself.

    Raises:
        OSError: the file cannot be read; UnicodeDecodeError: it is neither.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return data.decode("utf-16")
    return data.decode("utf-8-sig")


def read_lines(path: str) -> list[str]:
    """The non-blank lines of a text file (`read_text`), stripped."""
    return [line.strip() for line in read_text(path).splitlines() if line.strip()]


def stem_ids(stems: list[str]) -> tuple[list[int], bool]:
    """Integer ids for the images of a split: their stems when all are distinct integers, else 1..N."""
    if stems and all(s.isdigit() for s in stems) and len({int(s) for s in stems}) == len(stems):
        return [int(s) for s in stems], True
    return list(range(1, len(stems) + 1)), False


def coco_dict(images: list[dict], annotations: list[dict], categories: list[dict], description: str) -> dict:
    """A converted split as a COCO-format dict, its annotations numbered 1..N in their order."""
    for i, a in enumerate(annotations, 1):
        a["id"] = i
    return {"info": {"description": description}, "licenses": [], "images": images, "annotations": annotations,
            "categories": categories}

