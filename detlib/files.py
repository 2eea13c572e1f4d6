"""Files written whole or not at all, the one reader of JSON files (`read_json`), and the JSON caches of per-file
checks.

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


class JsonFileError(ValueError):
    """A file that is not JSON; the message is one line naming it, `reason` the parser's error (type: text)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path} is not JSON ({reason})")
        self.path, self.reason = path, reason


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


def read_json(path: str):
    """The JSON value in the file `path`. The file is read as bytes, so UTF-8 with or without a BOM, UTF-16 and UTF-32
    all parse. A caller that has its own error for the user (a weights file, a results file) catches these two.

    Raises:
        OSError: the file cannot be opened: FileNotFoundError when there is none, IsADirectoryError, PermissionError;
            Python's message, one line naming the file ("[Errno 2] No such file or directory: 'PATH'").
        JsonFileError (a ValueError): the file is not JSON: bad syntax, bytes that are not text, or nesting past the
            recursion limit; one line naming the file ("PATH is not JSON (JSONDecodeError: Expecting value: line 1
            column 1 (char 0))").
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise JsonFileError(path, f"{type(e).__name__}: {e}") from None


def read_json_cache(path: str | None) -> dict:
    """The dict a `write_json` cache holds; {} when there is none, or it is damaged (a cache only saves work)."""
    if not path or not os.path.isfile(path):
        return {}
    try:
        cache = read_json(path)
    except (OSError, JsonFileError):
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
