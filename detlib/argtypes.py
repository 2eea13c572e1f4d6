"""argparse types that refuse values that cannot work (`--epochs 0`, `--lr -1`: one argparse line at start, exit 2)
and that make a path flag's existing file absolute. Shared by the scripts' parsers and the flags that the feature
modules add to them (`detlib.engine.flags`, `detlib.data.options`, `detlib.data.formats`).
"""

from __future__ import annotations

import argparse
import math
import os


def path(text: str) -> str:
    """argparse type of a flag naming a file or folder: an existing one as an absolute path (read from the folder the
    command runs in); anything else as typed (a Hub repo id, a list of names, a path that a later check names)."""
    return os.path.abspath(text) if os.path.exists(text) else text


def int_at_least(lo: int):
    """argparse type: an integer >= `lo`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text}")
        return value
    parse.__name__ = f"integer >= {lo}"
    return parse


def float_range(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False):
    """argparse type: a finite number in [lo, hi] (the ends left out with `lo_open` / `hi_open`)."""
    def parse(text: str) -> float:
        value = float(text)
        if (not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo)
                or (hi_open and value == hi)):
            raise argparse.ArgumentTypeError(f"must be a number {'>' if lo_open else '>='} {lo}"
                                             + (f" and {'<' if hi_open else '<='} {hi}" if hi != math.inf else "")
                                             + f", got {text}")
        return value
    parse.__name__ = "number"
    return parse


def duration_seconds(text: str) -> int:
    """Seconds of a duration written [D-]HH:MM:SS (SLURM's --time form; HH may exceed 23). Raises ValueError."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or ("-" in text and not days.isdigit()):
        raise ValueError(f"must be HH:MM:SS or D-HH:MM:SS, got {text}")
    h, m, s = map(int, parts)
    if m > 59 or s > 59:
        raise ValueError(f"minutes and seconds must be below 60, got {text}")
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


def time_limit(text: str) -> str:
    """argparse type of --time_limit: a positive `duration_seconds` text, kept as typed (config.yaml shows it so)."""
    try:
        seconds = duration_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be longer than 0, got {text}")
    return text.strip()
