"""Files written whole or not at all, and the JSON caches of per-file checks.

A file a reader may open while it is written (a report, a plot, a weights file, a cache two processes share)
is written under a temporary name in the same folder and renamed over the final name once complete
(`os.replace` is atomic on one file system): a reader, a killed run or a full disk never leaves half a file
under the final name. The temporary name carries the process id, so two processes writing one file at once
each rename a whole file of their own. A checkpoint is a folder and follows the same rule on its own
(`detlib.engine.checkpoints`).

A cache a run writes outside its --output_dir (the built-in data, a tracker's folders) that cannot be written is
one line naming the cache, its folder, the OS's reason and the variable that moves it (`cache_writes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator


class CacheNotWritable(OSError):
    """A cache outside the run folder cannot be written; the message is one line."""


@contextlib.contextmanager
def cache_writes(folder: str, what: str, remedy: str) -> Iterator[None]:
    """The block writes the cache `what` in `folder` (made here): any OSError in it (permission, a read-only file
    system, a full disk) becomes CacheNotWritable("the `what` cannot be written at `folder` (reason); `remedy`")."""
    try:
        os.makedirs(folder, exist_ok=True)
        yield
    except CacheNotWritable:
        raise
    except OSError as e:
        raise CacheNotWritable(f"the {what} cannot be written at {folder} ({e.strerror or e}); {remedy}") from None


def check_cache(folder: str, what: str, remedy: str) -> None:
    """Raise CacheNotWritable (`cache_writes`) unless a file can be written in `folder` (made here): for a cache a
    library writes later, checked before the run's work."""
    with cache_writes(folder, what, remedy), tempfile.TemporaryFile(dir=folder):
        pass


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """The temporary path to write `path` through: renamed to `path` when the block ends without an exception,
    removed when it raises (the old `path`, if any, is kept). The folder is created. The temporary name keeps
    `path`'s extension, for writers that choose the format by it (matplotlib's savefig)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    stem, ext = os.path.splitext(path)
    tmp = f"{stem}.{os.getpid()}.tmp{ext}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", **open_kwargs) -> Iterator:
    """`open(path, mode)` for writing, made atomic by `atomic_path`."""
    with atomic_path(path) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f


def write_json(obj, path: str, **dump_kwargs) -> str:
    """Write `obj` as json to `path` atomically (`json.dump` keyword arguments pass through); returns `path`."""
    with atomic_write(path) as f:
        json.dump(obj, f, **dump_kwargs)
    return path


def read_json_cache(path: str | None) -> dict:
    """The dict a `write_json` cache holds; {} when there is none, or it is damaged (a cache only saves work)."""
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def file_key(path: str) -> str | None:
    """A cache key of a file's content as cheap to get as a stat: "abspath|size|mtime_ns"; None when the file
    cannot be stat'ed. A changed or replaced file gets a new key."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"


def write_failure(error: BaseException, path: str, needed_bytes: int | None = None) -> str:
    """Why writing `path` failed, in one line: the OS's (or the writer's) error and the space free where it was
    written, beside `needed_bytes` (what was being written) when known; "no space left on device" when less is free."""
    existing = os.path.abspath(path)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    text = " ".join(str(error).split())[:200] or type(error).__name__
    full = "no space left on device: " if needed_bytes and free < needed_bytes else ""
    needed = f", ~{needed_bytes / 2**20:.1f} MiB needed" if needed_bytes else ""
    return f"{full}{type(error).__name__}: {text} ({free / 2**20:.1f} MiB free in {existing}{needed})"


def readable_as_umask_allows(path: str) -> None:
    """The mode the run's other files get (0644 under umask 022): safetensors writes through a private temporary
    file and leaves 0600, which a teammate or a serving job of another user cannot read. Best effort."""
    if os.path.isfile(path):
        umask = os.umask(0)
        os.umask(umask)
        with contextlib.suppress(OSError):
            os.chmod(path, 0o666 & ~umask)
