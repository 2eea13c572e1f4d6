"""detlib.files: a file is written whole or not at all; a JSON file that cannot be read is one line naming it;
caches survive damage."""

import json
import os

import pytest

from detlib.files import JsonFileError, atomic_write, file_key, read_json, read_json_cache, write_json


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "report.json"
    write_json({"a": 1}, str(path))
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(RuntimeError):
        with atomic_write(str(path)) as f:
            f.write('{"a": 2, "half')
            raise RuntimeError("disk full")
    assert json.loads(path.read_text()) == {"a": 1}  # the old file, whole
    assert sorted(os.listdir(path.parent)) == ["report.json"]  # no temporary left behind


def test_the_temporary_keeps_the_extension_and_names_the_process(tmp_path):
    path = str(tmp_path / "plot.png")
    with atomic_write(path, "wb") as f:
        assert f.name.endswith(f".{os.getpid()}.tmp.png")
        f.write(b"png")
    assert open(path, "rb").read() == b"png"


def test_read_json_names_the_file_it_cannot_read(tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_json(str(path))
    for text, reason in (('{"k": [1, 2', "JSONDecodeError"), ("[" * 100_000, "RecursionError")):
        path.write_text(text)
        with pytest.raises(JsonFileError) as e:
            read_json(str(path))
        assert str(e.value).startswith(f"{path} is not JSON ({reason}: ") and "\n" not in str(e.value)
        assert e.value.reason.startswith(reason) and isinstance(e.value, ValueError)
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"k": "\u00e9"}).encode())  # a BOM, as Windows Notepad writes
    assert read_json(str(path)) == {"k": "\u00e9"}


def test_a_damaged_or_foreign_cache_reads_as_empty(tmp_path):
    path = tmp_path / "cache.json"
    assert read_json_cache(str(path)) == {} and read_json_cache(None) == {}
    path.write_text('{"k": [1, 2')  # cut short by a kill
    assert read_json_cache(str(path)) == {}
    path.write_text("[1, 2]")
    assert read_json_cache(str(path)) == {}
    write_json({"k": [1, 2]}, str(path))
    assert read_json_cache(str(path)) == {"k": [1, 2]}


def test_file_key_changes_with_the_content(tmp_path):
    path = tmp_path / "a.jpg"
    assert file_key(str(path)) is None
    path.write_bytes(b"1")
    first = file_key(str(path))
    path.write_bytes(b"12")
    assert first.startswith(str(path)) and file_key(str(path)) != first
