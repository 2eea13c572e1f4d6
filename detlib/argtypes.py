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
