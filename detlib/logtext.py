"""Log lines that stay short whatever the data's size: class lists, per-class counts and per-class tables.

A line of the console or train.log must not grow with the number of classes or images (300 classes once made
one evaluation line of 277,322 characters). What grows goes to a file (the evaluation's per-class json / csv,
config.yaml, data_report.json); the log gets a count, the extremes and the file's path. Class names are cut to
`NAME_CHARS` characters in the log (never in files).
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Iterable, Sequence

NAME_CHARS = 40  # of a class name in a log line
EXAMPLE_CHARS = 80  # of an example (a path, an id) in a data check line: five of them fit a line of any data root
LIST_ITEMS = 8  # items of a list written out in a log line
EXTREMES = 3  # worst / best classes named in a summary
COUNT_ITEMS = 10  # classes whose image counts are all written out


def short_name(name, limit: int = NAME_CHARS) -> str:
    """`name` as text, cut to `limit` characters (an ellipsis marks the cut)."""
    text = str(name)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def short_middle(text, limit: int = EXAMPLE_CHARS) -> str:
    """`text` cut to `limit` characters in its middle, an ellipsis marking the cut: a long path keeps its start and
    its file name ("/data/very/long/…/cats/0001.jpg")."""
    text = str(text)
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head] + "…" + text[len(text) - (limit - head - 1):]


def short_list(items: Iterable, limit: int = LIST_ITEMS) -> str:
    """"a, b, c" for up to `limit` items; "a, b, ... (300 in all)" beyond (names cut by `short_name`)."""
    items = list(items)
    shown = ", ".join(short_name(i) for i in items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items)} in all)"


def class_counts(classes: Sequence[str], counts: Sequence[int], limit: int = COUNT_ITEMS) -> str:
    """Images per class: "cat 6, dog 0" for up to `limit` classes; beyond, the range and the classes with the
    fewest and the most images: "1 to 4 images each; fewest: a 1, b 1, c 1; most: x 4, y 4, z 3"."""
    pairs = list(zip(classes, counts))
    if len(pairs) <= limit:
        return ", ".join(f"{short_name(c)} {n}" for c, n in pairs)
    ranked = sorted(pairs, key=lambda p: (p[1], str(p[0])))
    fewest = ", ".join(f"{short_name(c)} {n}" for c, n in ranked[:EXTREMES])
    most = ", ".join(f"{short_name(c)} {n}" for c, n in sorted(pairs, key=lambda p: (-p[1], str(p[0])))[:EXTREMES])
    return f"{ranked[0][1]} to {ranked[-1][1]} images each; fewest: {fewest}; most: {most}"


def shorten_lists(obj, limit: int = 20):
    """A copy of a config-like dict for the log: every list longer than `limit` becomes its first items and a
    note of its length (the file beside keeps the whole list)."""
    if isinstance(obj, dict):
        return {k: shorten_lists(v, limit) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and len(obj) > limit:
        return [*obj[:LIST_ITEMS], f"({len(obj)} items in all)"]
    return obj


def close_names(name: str, names: list[str], n: int = 5) -> list[str]:
    """Up to `n` of `names` close to a misspelt `name` (a timm model name, a flag): difflib's close matches, else
    the names that share `name`'s longest prefix (3+ characters), closest first (`resnet_does_not_exist` ->
    resnet...), else none."""
    hits = difflib.get_close_matches(name, names, n=n)
    if hits:
        return hits
    low = name.lower()
    k = max((len(os.path.commonprefix([low, m.lower()])) for m in names), default=0)
    if k < 3:
        return []
    ratio = lambda m: difflib.SequenceMatcher(None, low, m.lower()).ratio()  # noqa: E731
    return sorted((m for m in names if m.lower().startswith(low[:k])), key=lambda m: (-ratio(m), m))[:n]


def escape_unencodable() -> None:
    """Every console stream writes a character its encoding lacks as an escape (`\\u732b`) instead of raising: a
    console that is not UTF-8 (Windows' cp1252, PYTHONIOENCODING=ascii, LANG=C) still gets every line, from the log
    handlers, print and tqdm alike (all write to sys.stdout / sys.stderr). The files we write are UTF-8."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
