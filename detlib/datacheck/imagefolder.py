"""The ImageFolder part of the data check (see `detlib.datacheck.report` for the levels and the report).

`scan_image_folder` (detlib.data.imagefolder) lists and decodes the files; `check_folder_scans` then judges
what the scans found, across classes and across train / val:

- class folders: train and val must have the same class names (else the label indices differ: error, listing
  only the differing names); a class without a usable image is an error in train, a warning in val;
- strong class imbalance (`report.check_balance`: the largest class 10x the smallest or more): a warning naming
  `--sampler class_balanced`;
- a metric that cannot mean anything: train with one class (error: a classifier needs at least 2), val without
  a usable image (error: no accuracy), val with images of one class only (warning: always predicting it scores 1.0);
- hidden entries (`.ipynb_checkpoints`, `.DS_Store`, `__MACOSX`) are never classes: listed as a warning;
- unreadable files are left out (repair, with the reason);
- one file in two classes, either the same bytes (a copy) or the same path reached twice (a symlink), has two
  labels: it is left out of both (repair); the same file twice in one class is kept once (repair);
  byte-identical copies within a class are a warning (they weigh double);
- folders reached twice through symlinks (loops) are not followed again (warning);
- val files with the same bytes as train files: warning (val accuracy will be optimistic).

Byte comparison reads only files whose size equals another file's size, so a folder without duplicates
costs one `stat` per file.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter, defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING

from ..logtext import COUNT_ITEMS, class_counts
from .report import DataReport, check_balance, publish_report

if TYPE_CHECKING:  # the scans are made by the data side (detlib.data.imagefolder), which imports this check
    from ..data.imagefolder import FolderScan


def _digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "blake2b").hexdigest()
    except OSError:
        return None


def _same_bytes(paths: list[str]) -> dict[str, str]:
    """{path: content digest} for the paths whose size is shared with another path (others cannot be copies)."""
    by_size: dict[int, list[str]] = defaultdict(list)
    for p in paths:
        try:
            by_size[os.path.getsize(p)].append(p)
        except OSError:
            pass
    out = {}
    for group in by_size.values():
        if len(group) > 1:
            for p in group:
                d = _digest(p)
                if d is not None:
                    out[p] = d
    return out


def ignored_files(scan: FolderScan, shown: int = 3) -> str | int:
    """The summary's "ignored files": how many files the scan left out unchecked (hidden files, names without an
    image extension), with the first few, relative to the root; 0 when none."""
    if not scan.ignored:
        return 0
    first = ", ".join(os.path.relpath(p, scan.root) for p in scan.ignored[:shown])
    return f"{len(scan.ignored)} ({first}{', ...' if len(scan.ignored) > shown else ''})"


def check_folder_scans(scans: dict[str, FolderScan], report: DataReport | None = None,
                       strict: bool = False) -> tuple[dict[str, FolderScan], DataReport]:
    """Judge ImageFolder scans ("train" and / or "val") and leave out the files that carry two labels.

    Args:
        scans: split name -> `scan_image_folder(...)` result; "train" is the reference for "val".
        report: add to this report (default: a new one with `strict`).
    Returns:
        (the scans with conflicting and repeated samples left out, the report).
    """
    report = report if report is not None else DataReport(strict)
    out = {}
    for split, scan in scans.items():
        add = lambda level, msg, ex=(), count=None, s=split: report.add(level, "images", s, msg, ex, count)  # noqa: E731
        add("warning", "hidden entries of the root are not classes", scan.hidden)
        reasons = Counter(r.split(":")[0] for _, r in scan.skipped)
        add("repair", "image files that cannot be read: left out"
            + (f" ({', '.join(f'{n} {r}' for r, n in reasons.most_common())})" if reasons else ""),
            [f"{p} ({r})" for p, r in scan.skipped])
        add("warning", "folders reached again through a symlink (a loop or a second link): not followed again",
            scan.revisited)
        real = [os.path.realpath(p) for p, _ in scan.samples]
        digests = _same_bytes(list(dict.fromkeys(real)))
        labels_of: dict[str, set[int]] = defaultdict(set)
        for (p, t), r in zip(scan.samples, real):
            labels_of[digests.get(r, r)].add(t)
        conflict = {k for k, ts in labels_of.items() if len(ts) > 1}
        kept, seen, left_out, repeated = [], set(), [], []
        copies: dict[tuple[str, int], list[str]] = defaultdict(list)
        for (p, t), r in zip(scan.samples, real):
            key = digests.get(r, r)
            if key in conflict:
                left_out.append(f"{p} ({scan.classes[t]})")
                continue
            if r in seen:
                repeated.append(p)
                continue
            seen.add(r)
            copies[(key, t)].append(p)
            kept.append((p, t))
        add("repair", "files in two classes (the same bytes, or the same file reached twice through a symlink): "
            "left out of both", left_out)
        add("repair", "the same file reached twice in one class (through a symlink): kept once", repeated)
        add("warning", "byte-identical copies within a class (each copy weighs in training)",
            [", ".join(ps) for ps in copies.values() if len(ps) > 1])
        scan = replace(scan, samples=kept)
        counts = scan.class_counts()
        empty = [c for c, n in zip(scan.classes, counts) if n == 0]
        if split == "train":
            add("error", "classes without a usable image (a class needs training images)", empty)
            if len(scan.classes) < 2:  # softmax over one class: loss 0 and accuracy 1.0 whatever the weights
                report.add("error", "categories", split, "a classifier needs at least 2 classes (one class folder "
                           "cannot be wrong: loss 0, accuracy 1.0, nothing learned)", scan.classes)
            check_balance(report, split, dict(zip(scan.classes, counts)), "train_catsdogs.py --sampler class_balanced "
                          "(each class drawn equally often; docs/catsdogs.md)")
        else:
            add("warning", "classes without a usable image (their recall is reported as 0)", empty)
            with_images = [c for c, n in zip(scan.classes, counts) if n]
            if not kept:
                add("error", "no usable image: the accuracy cannot be computed", count=1)
            elif len(with_images) == 1 and len(scan.classes) > 1:
                add("warning", "images of one class only: a model that always predicts it scores accuracy 1.0, so "
                    "the accuracy (and best/) says little", with_images)
        report.summaries[split] = {"root": scan.root, "images": len(kept),
                                   "classes": class_counts(scan.classes, counts) if len(counts) <= COUNT_ITEMS
                                   else f"{len(counts)} ({class_counts(scan.classes, counts)})",
                                   "ignored files": ignored_files(scan)}
        out[split] = scan
    if "train" in out and "val" in out:
        train, val = out["train"], out["val"]
        if train.classes != val.classes:
            report.add("error", "categories", "val", "class folders differ between train and val, so a label index "
                       "would mean different classes", [f"only in train: {c}" for c in sorted(set(train.classes) - set(val.classes))]
                       + [f"only in val: {c}" for c in sorted(set(val.classes) - set(train.classes))])
        train_real = {os.path.realpath(p) for p, _ in train.samples}
        val_real = {os.path.realpath(p): p for p, _ in val.samples}
        digests = _same_bytes(list(train_real | set(val_real)))
        train_keys = {digests.get(r, r) for r in train_real}
        report.add("warning", "images", "val", "val files that are also in train (same bytes or same file): val "
                   "accuracy will be optimistic", [p for r, p in val_real.items() if digests.get(r, r) in train_keys])
    return out, report


def check_folders_for_training(scans: dict[str, FolderScan], output_dir: str | None, strict: bool = False,
                               is_main: bool = True) -> dict[str, FolderScan]:
    """The classification script's data check in one call: `check_folder_scans` + `publish_report`
    (`output_dir/data_report.json`, one log block; raises `DataCheckError` on errors)."""
    scans, report = check_folder_scans(scans, strict=strict)
    publish_report(report, output_dir, is_main, title="image folder check")
    return scans
