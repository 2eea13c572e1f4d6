"""The data check both training scripts run at start and `scripts/check_dataset.py` runs alone: the report
and what the COCO and ImageFolder checks share.

Real data sets come from CVAT, Label Studio, Roboflow, LabelMe converters, hand-written scripts and zip files,
and do not always say what a loader assumes. Each fault found is one `Finding` of a kind and a level:

kinds   structure (required keys and types), ids (image / annotation ids, file names), boxes, images (the
        files), categories (also train against val; class folders).
levels  error    the run cannot be right: it stops at start with the report.
        repair   done in memory, counted and logged (numeric strings parsed, polygon -> bbox, annotation ids
                 renumbered, a box clipped, an annotation or image left out). `strict=True` makes them errors.
        warning  the run is right but probably not what was meant (unused categories, train / val overlap).

The checks themselves: `detlib.datacheck.coco` (COCO json and its image files), `detlib.datacheck.imagefolder` (ImageFolder).
Image files are checked by their header only (size, EXIF orientation), in worker processes; results are
cached by (path, size, mtime) so the other processes of a run and the next run do not read them again.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable

from PIL import Image

from ..files import file_key, read_json_cache, write_json
from ..logtext import short_middle
from .orientation import exif_orientation

logger = logging.getLogger(__name__)

LEVELS = ("error", "repair", "warning")
KINDS = ("structure", "ids", "boxes", "images", "categories")
# PIL's own decompression-bomb threshold; a data set with larger images raises it with --max_image_pixels.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
MAX_EXAMPLES = 5
# Above this many images the header pass runs in worker processes with a progress bar.
PARALLEL_MIN_IMAGES = 500
# Strong class imbalance: the class in the most training images is in this many times the images of the rarest, or more
# (classes without an image have a finding of their own). A model trained on it may never predict the rarest classes.
IMBALANCE_RATIO = 10


@dataclass
class Finding:
    """One kind of fault: `count` occurrences, the first `MAX_EXAMPLES` offending ids / paths in `examples`."""

    level: str
    kind: str
    split: str
    message: str
    count: int
    examples: list = field(default_factory=list)

    def line(self) -> str:
        # each example cut in its middle (`short_middle`): the line stays readable whatever the data root's length;
        # data_report.json keeps them whole
        ex = f"; e.g. {', '.join(map(short_middle, self.examples))}" if self.examples else ""
        more = " ..." if self.count > len(self.examples) and self.examples else ""
        return f"{self.split:<6} {self.kind:<10} {self.message} [{self.count}]{ex}{more}"


class DataReport:
    """Findings of one or more checks, grouped by level and kind.

    Args:
        strict: turn every repair into an error (`--strict_data`).
    """

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.findings: list[Finding] = []
        self.summaries: dict[str, dict] = {}

    def add(self, level: str, kind: str, split: str, message: str, examples=(), count: int | None = None) -> None:
        """Record a finding unless `count` (default: the number of `examples`) is 0."""
        examples = list(examples)
        count = len(examples) if count is None else int(count)
        if count == 0:
            return
        if level == "repair" and self.strict:
            level, message = "error", message + " (an error under strict checking)"
        self.findings.append(Finding(level, kind, split, message, count, [_plain(e) for e in examples[:MAX_EXAMPLES]]))

    def of_level(self, level: str) -> list[Finding]:
        return [f for f in self.findings if f.level == level]

    @property
    def errors(self) -> list[Finding]:
        return self.of_level("error")

    @property
    def ok(self) -> bool:
        """True when nothing stops the run."""
        return not self.errors

    def format(self, title: str = "data check", notes: Iterable[str] = ()) -> str:
        """The report as text: one line per split summary, then findings by level and kind, then `notes` (what
        was done about it, e.g. a repaired file written), and last the verdict line
        "{title}: N errors, N repairs, N warnings"."""
        counts = Counter(f.level for f in self.findings)
        lines = [f"{title}:"]
        for split, s in self.summaries.items():
            lines.append(f"  {split}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
        for level in LEVELS:
            group = sorted(self.of_level(level), key=lambda f: (KINDS.index(f.kind) if f.kind in KINDS else 99))
            if group:
                lines.append(f"  {level}s:")
                lines.extend("    " + f.line() for f in group)
        lines.extend(f"  {n}" for n in notes)
        lines.append(f"{title}: {counts['error']} errors, {counts['repair']} repairs, {counts['warning']} warnings")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready: {"ok", "strict", "counts", "summaries", "findings": [Finding as dict]}."""
        return {"ok": self.ok, "strict": self.strict, "counts": {lv: len(self.of_level(lv)) for lv in LEVELS},
                "summaries": self.summaries, "findings": [asdict(f) for f in self.findings]}

    def write(self, path: str) -> None:
        """Write `to_dict()` as json (atomically: a reader never sees half a report)."""
        write_json(self.to_dict(), path, indent=1)


class Findings:
    """The examples a pass of a check collects, one list per finding of its table, added to a report at the end.

    A pass states what it can find once, as a table {key: (level, kind, message)} in report order; while it
    runs it appends offending ids / items to `found[key]`.

    Args:
        table: {key: (level, kind, message)}; a message may hold `{name}` fields, filled by `add_to`.
    """

    def __init__(self, table: dict[str, tuple[str, str, str]]):
        self.table = table
        self.examples: dict[str, list] = {key: [] for key in table}

    def __getitem__(self, key: str) -> list:
        return self.examples[key]

    def add_to(self, report: DataReport, split: str, **fields) -> None:
        """Add every finding with examples to `report`, in the table's order; `fields` fill the messages."""
        for key, (level, kind, message) in self.table.items():
            if self.examples[key]:
                report.add(level, kind, split, message.format(**fields) if fields else message, self.examples[key])


class DataCheckError(ValueError):
    """The data check found errors; `report` holds them."""

    def __init__(self, message: str, report: DataReport):
        super().__init__(message)
        self.report = report


def check_balance(report: DataReport, split: str, images_per_class: dict[str, int], remedy: str) -> None:
    """Warn in `report` when the class in the most images is in at least IMBALANCE_RATIO times the images of the rarest
    (`images_per_class`: class -> images that hold it; classes without one are left out), naming the rare classes
    (in at most 1 / IMBALANCE_RATIO of the most frequent's images) and `remedy`, the option that balances them."""
    present = {c: n for c, n in images_per_class.items() if n > 0}
    if len(present) < 2 or max(present.values()) < IMBALANCE_RATIO * min(present.values()):
        return
    most = max(present, key=present.get)
    rare = sorted((n, c) for c, n in present.items() if n * IMBALANCE_RATIO <= present[most])
    report.add("warning", "categories", split, f"strong class imbalance: {most} is in {present[most]} images, "
               f"{present[most] / rare[0][0]:.0f}x the rarest class ({IMBALANCE_RATIO}x or more); the model may never "
               f"predict the classes listed: train with {remedy}",
               [f"{c} ({n} image{'s' * (n != 1)})" for n, c in rare])


def _plain(v):
    return v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)


# ---- the image files: header only, in worker processes


def read_image_header(path: str) -> tuple[str, int, int, int]:
    """(status, width, height, EXIF orientation) of an image file from its header, without decoding pixels.

    status: "ok", "missing", "empty file" or "unreadable: <reason>"; width / height of the stored pixels
    (0 unless ok); orientation 1..8 (EXIF tag 0x0112, 1 when absent).
    """
    try:
        if os.path.getsize(path) == 0:
            return "empty file", 0, 0, 1
    except OSError:
        return "missing", 0, 0, 1
    # The size limit is ours to judge (see check_coco), so PIL must not refuse to open a large file here.
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(path) as im:
            w, h = im.size
            orientation = exif_orientation(im)
    except Exception as e:  # PIL raises many types for non-images
        return f"unreadable: {type(e).__name__}: {e}"[:200], 0, 0, 1
    return "ok", int(w), int(h), orientation


def read_image_headers(paths: list[str], num_workers: int | None = None, progress: bool = True,
                       cache_file: str | None = None) -> list[tuple[str, int, int, int]]:
    """`read_image_header` of every path, in worker processes for big sets, with a tqdm bar when `progress`.

    Results are cached in `cache_file` (json) by (path, size, mtime): a second process or run reads the cache.
    """
    cache = read_json_cache(cache_file)
    keys = [file_key(p) for p in paths]
    todo = [i for i, k in enumerate(keys) if k is None or k not in cache]
    results: list = [tuple(cache[k]) if k is not None and k in cache else None for k in keys]
    todo_paths = [paths[i] for i in todo]
    workers = num_workers if num_workers is not None else min(8, os.cpu_count() or 1)
    limit = Image.MAX_IMAGE_PIXELS  # read_image_header lifts it; the process's own setting comes back after
    if len(todo_paths) >= PARALLEL_MIN_IMAGES and workers > 1:
        import multiprocessing as mp

        from tqdm.auto import tqdm

        # fork: workers start at once; they only read files and return small tuples.
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(workers) as pool:
            it = pool.imap(read_image_header, todo_paths, chunksize=64)
            new = list(tqdm(it, total=len(todo_paths), desc="image headers", disable=not progress, leave=False))
    else:
        new = [read_image_header(p) for p in todo_paths]
    for i, r in zip(todo, new):
        results[i] = r
    Image.MAX_IMAGE_PIXELS = limit
    if cache_file and todo:
        for i in todo:
            if keys[i] is not None:
                cache[keys[i]] = list(results[i])
        write_json(cache, cache_file)
    return results


def publish_report(report: DataReport, output_dir: str | None, is_main: bool = True, log: logging.Logger = logger,
                   title: str = "data check") -> None:
    """Write `output_dir/data_report.json` and log the report as one block (main process); raise on errors.

    Every process calls it with the same report, so every process stops together.
    Raises:
        DataCheckError (a ValueError): the report has errors; the message points at the report.
    """
    path = os.path.join(output_dir, "data_report.json") if output_dir else None
    if is_main:
        if path:
            report.write(path)
        level = logging.ERROR if report.errors else logging.WARNING if report.findings else logging.INFO
        log.log(level, "%s", report.format(title))
    if report.errors:
        where = f" (full report: {path})" if path else ""
        lines = "\n".join("  " + f.line() for f in report.errors)
        raise DataCheckError(f"the data check found {len(report.errors)} kinds of error{where}:\n{lines}", report)
