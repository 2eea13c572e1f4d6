"""F cases of the runs (../shared/cases/README.md, "F cases"): F09, `--config` from another folder; F12, the resume
warning on paths spelt another way; F21, caches in an unwritable home; F22, a console that is not UTF-8; F25, a
process of a 2-process run killed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml

from conftest import write_coco, write_image
from helpers import load_script, make_tiny_folder, run_main

# Every flag of the training scripts that names a file or folder (read back by --config, compared on resume).
PATH_FLAGS = {
    "train_retinanet": {"config", "evaluate_only", "data_dir", "train_images", "train_annotations", "val_images",
                        "val_annotations", "class_names", "backbone_weights", "init_from"},
    "train_catsdogs": {"config", "evaluate_only", "train_dir", "val_dir", "weights"},
}
TINY_DETECTOR = ["--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "16", "--per_device_batch_size", "2",
                 "--per_device_eval_batch_size", "2", "--num_workers", "0", "--report_to", "none", "--eval_bootstrap",
                 "0", "--num_log_images", "0"]


# ---- F09: --config from another folder reads the same files

@pytest.mark.parametrize("script", sorted(PATH_FLAGS))
def test_case_f09_every_path_flag_is_recorded_absolute_and_a_missing_one_is_named_as_from_the_config(script, tmp_path,
                                                                                                     monkeypatch, capsys):
    """Each path flag given relative is parsed to the absolute path of what it names (so config.yaml records it and a
    --config re-run from another folder reads the same file); --output_dir is absolute once its default is known;
    a recorded path that no longer exists stops the re-run in one line naming the file and the key."""
    from detlib.engine import path, resolve_data_defaults

    module = load_script(script)
    parser = module.build_parser()
    flags = {a.dest for a in parser._actions if a.type is path}
    assert flags == PATH_FLAGS[script]
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    monkeypatch.chdir(first)
    argv = []
    for dest in sorted(flags - {"config"}):
        (first / dest).mkdir()
        argv += [f"--{dest}", f"./{dest}/"]
    args = module.parse_args(argv + ["--output_dir", "run"])
    resolve_data_defaults(args, module.DATA_DEFAULTS, synthetic=False)
    recorded = {k: v for k, v in vars(args).items() if k in flags | {"output_dir"} and v is not None}
    assert recorded == {**{k: str(first / k) for k in flags - {"config"}}, "output_dir": str(first / "run")}
    (first / "config.yaml").write_text(yaml.safe_dump(recorded))
    monkeypatch.chdir(other)
    for dest in flags - {"config"}:
        (other / dest).mkdir()  # the same names here: a relative record would read these
    again = module.parse_args(["--config", "../first/config.yaml"])
    assert {k: getattr(again, k) for k in recorded} == recorded
    for dest in sorted(flags - {"config"}):
        shutil.rmtree(first / dest)
        with pytest.raises(SystemExit) as stop:
            module.parse_args(["--config", "../first/config.yaml"])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1, err
        assert err[0].endswith(f"error: --config ../first/config.yaml: {dest}: {first / dest} does not exist (the run "
                               f"that wrote the file read it there); give --{dest} on the command line to read another")
        module.parse_args(["--config", "../first/config.yaml", f"--{dest}", str(other / dest)])  # replaced: no stop
        (first / dest).mkdir()


@pytest.mark.slow  # three short in-process runs of the classifier
def test_case_f09_a_config_rerun_from_another_folder_trains_on_the_first_runs_data(tmp_path, monkeypatch, capsys):
    """`--train_dir data` recorded by a run in p1, re-run with `--config ../p1/run/config.yaml` from p2, which has a
    `data` folder of its own: it reads p1's 4 images (it read p2's 6); with p1's data gone it stops in one line."""
    p1, p2 = tmp_path / "p1", tmp_path / "p2"
    for folder in (p1, p2):
        folder.mkdir()
    make_tiny_folder(tmp_path / "d1", [2, 2]).rename(p1 / "data")
    make_tiny_folder(tmp_path / "d2", [3, 3]).rename(p2 / "data")
    monkeypatch.chdir(p1)
    common = ["--model", "test_resnet", "--image_size", "32", "--per_device_batch_size", "2", "--num_workers", "0",
              "--report_to", "none", "--max_steps", "1"]
    code, _, err = run_main("train_catsdogs", common + ["--train_dir", "data", "--val_dir", "data", "--output_dir",
                                                        "run"], capsys)
    assert code == 0, err[-2000:]
    monkeypatch.chdir(p2)
    code, _, err = run_main("train_catsdogs", ["--config", "../p1/run/config.yaml", "--output_dir", "run2"], capsys)
    assert code == 0, err[-2000:]
    again = yaml.safe_load((p2 / "run2" / "config.yaml").read_text())
    assert again["train_dir"] == str(p1 / "data") and again["num_train_images"] == 4
    shutil.rmtree(p1 / "data")
    code, _, err = run_main("train_catsdogs", ["--config", "../p1/run/config.yaml", "--output_dir", "run3"], capsys)
    assert code == 2 and "Traceback" not in err and not (p2 / "run3").exists()
    assert f"--config ../p1/run/config.yaml: train_dir: {p1 / 'data'} does not exist" in err


# ---- F12: a resume compares paths as the files they name

@pytest.mark.slow  # two short in-process RetinaNet runs
def test_case_f12_a_resume_with_paths_spelt_otherwise_names_only_the_real_change(tmp_path, monkeypatch, capsys):
    """The same four data files spelt another way on resume (`./img/`, `ann/./train.json`, absolute, through a link)
    and one real change (--max_steps 2 -> 3): the warning names that change alone, under its flag."""
    images, anns = [], []
    for i in range(6):
        write_image(tmp_path / "img" / f"{i}.png", 64, 64, seed=i)
        images.append({"id": i + 1, "file_name": f"{i}.png", "width": 64, "height": 64})
        anns.append({"image_id": i + 1, "category_id": 1, "bbox": [4 + i, 6, 30, 24]})
    write_coco(tmp_path / "ann" / "train.json", images, anns)
    write_coco(tmp_path / "ann" / "val.json", images[:2], anns[:2])
    (tmp_path / "link").symlink_to(tmp_path / "ann")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main("train_retinanet", TINY_DETECTOR + [
        "--train_images", "./img/", "--train_annotations", "ann/./train.json", "--val_images", "img",
        "--val_annotations", str(tmp_path / "ann" / "val.json"), "--max_steps", "2", "--output_dir", "run"], capsys)
    assert code == 0, err[-2000:]
    code, out, err = run_main("train_retinanet", TINY_DETECTOR + [
        "--train_images", str(tmp_path / "img"), "--train_annotations", "link/train.json", "--val_images", "./img/",
        "--val_annotations", "ann/val.json", "--max_steps", "3", "--output_dir", "./run/",
        "--resume_from_checkpoint", "latest"], capsys)
    assert code == 0, err[-2000:]
    said = [line.split("with other flags than its run's: ")[1] for line in out.splitlines()
            if "with other flags than its run's: " in line]
    assert said == ["--max_steps 2 -> 3"], said


# ---- F22: a console that is not UTF-8

NAMES = "猫 кошка ü 😺"  # Chinese, Cyrillic, Latin-1, outside the BMP


@pytest.mark.parametrize("encoding", ["ascii", "cp1252", "latin-1", "cp437", "cp932"])
def test_case_f22_every_console_stream_escapes_what_its_encoding_lacks(encoding, tmp_path, monkeypatch):
    """On a console of `encoding` (errors "strict", as PYTHONIOENCODING or a Windows pipe makes it), what our code
    writes (print after the scripts' parser is made; the log handlers of a run; tqdm) reaches it whole, each
    character the encoding lacks escaped; no `--- Logging error ---`; train.log keeps the characters (UTF-8)."""
    import io
    import logging

    from tqdm import tqdm

    from detlib.engine import setup_logging

    out, err = (io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict") for _ in range(2))
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        load_script("train_catsdogs").build_parser()
        print(f"print {NAMES}")
        setup_logging(str(tmp_path), is_main=True)
        logging.getLogger("detlib.test").warning("log %s", NAMES)
        for _ in tqdm([1], desc=f"bar {NAMES}", disable=False):
            pass
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in handlers:
            root.addHandler(h)
    seen = [s.buffer.getvalue().decode(encoding) for s in (out, err)]
    shown = NAMES.encode(encoding, "backslashreplace").decode(encoding)
    assert f"print {shown}" in seen[0] and f"log {shown}" in seen[0] and f"bar {shown}" in seen[1], seen
    assert "Logging error" not in seen[1]
    assert f"log {NAMES}" in (tmp_path / "train.log").read_text(encoding="utf-8")


@pytest.mark.slow  # one launch of the classifier
def test_case_f22_a_cp1252_console_gets_every_line_of_a_run_with_chinese_class_names(tmp_path):
    """PYTHONIOENCODING=cp1252 and class folders 猫 / 狗 with an unreadable file: the data check's warning, the class
    line and the per-class evaluation reach the console escaped (they were lost, each with a `--- Logging error ---`
    traceback through our code)."""
    import subprocess
    import sys

    from conftest import REPO, launch_env, traceback_through_our_code

    data = make_tiny_folder(tmp_path / "gen", [4, 4])
    (data / "horizontal").rename(data / "猫")
    (data / "vertical").rename(data / "狗")
    (data / "猫" / "坏.jpg").write_text("not an image")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train_catsdogs.py"), "--train_dir", data,
                           "--val_dir", data, "--model", "test_resnet", "--image_size", "32", "--max_steps", "1",
                           "--num_workers", "0", "--report_to", "none", "--output_dir", tmp_path / "run"], cwd=REPO,
                          capture_output=True, timeout=300, env=launch_env({"PYTHONIOENCODING": "cp1252"}))
    text = (proc.stdout + proc.stderr).decode("cp1252", errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "Logging error" not in text and not traceback_through_our_code(text), text[-3000:]
    assert "cannot be read: left out (1 not an image) [1]; e.g." in text and r"\u732b/\u574f.jpg" in text
    assert r"2 classes (\u72d7, \u732b)" in text
    assert r"\u72d7: P " in text and r"\u732b: P " in text  # the per-class evaluation


# ---- F21: caches outside --output_dir in an unwritable home

@pytest.mark.parametrize("failure", ["EACCES", "EPERM", "EROFS", "ENOTDIR", "ENOSPC"])
@pytest.mark.parametrize("generator", ["make_synthetic_coco", "make_synthetic_image_folder"])
def test_case_f21_a_builtin_data_cache_that_cannot_be_written_is_one_line_naming_it(generator, failure, tmp_path,
                                                                                   monkeypatch):
    """Every way the built-in data's cache fails to be written (not permitted, read-only file system, a file in the
    way, a full disk midway): CacheNotWritable, one line naming the cache, its folder, the OS's reason and
    DETLIB_CACHE; a cache that is there is read without writing."""
    import errno

    from detlib.data import builtin
    from detlib.files import CacheNotWritable

    monkeypatch.setenv("DETLIB_CACHE", str(tmp_path / "cache"))
    make = getattr(builtin, generator)
    code = getattr(errno, failure)

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    # the folder refused (permission, read-only, a file in the way), or the disk full at the first image
    monkeypatch.setattr("PIL.Image.Image.save" if failure == "ENOSPC" else "os.makedirs", refuse)
    with pytest.raises(CacheNotWritable) as stop:
        make(num_train=2, num_val=1)
    root = tmp_path / "cache" / ("synthetic_shapes_v2" if generator == "make_synthetic_coco" else "synthetic_imagefolder_v2")
    assert str(stop.value) == (f"the built-in data's cache cannot be written at {root} ({os.strerror(code)}); set "
                               "DETLIB_CACHE to a writable folder (or pass a data set)")
    monkeypatch.undo()
    monkeypatch.setenv("DETLIB_CACHE", str(tmp_path / "cache"))
    made = make(num_train=2, num_val=1)
    monkeypatch.setattr("os.makedirs", refuse)
    assert make(num_train=2, num_val=1) == made  # there: read, nothing written


@pytest.mark.parametrize("script,flags,line", [
    ("train_catsdogs", [], "the built-in data's cache cannot be written at /sys/nohome/.cache/detlib/synthetic_"
                           "imagefolder_v2 (Operation not permitted); set DETLIB_CACHE"),
    ("train_retinanet", [], "the built-in data's cache cannot be written at /sys/nohome/.cache/detlib/synthetic_"
                            "shapes_v2 (Operation not permitted); set DETLIB_CACHE"),
    ("train_catsdogs", ["--report_to", "wandb"], "--report_to wandb: the data folder of wandb cannot be written at "
                                                  "/sys/nohome/.local/share/wandb (Operation not permitted); set "
                                                  "WANDB_DATA_DIR")], ids=["catsdogs", "retinanet", "wandb"])
def test_case_f21_an_unwritable_home_stops_a_run_in_one_line_naming_the_cache(script, flags, line, tmp_path,
                                                                              monkeypatch, capsys):
    """HOME where nothing can be made (/sys/nohome: "Operation not permitted", as a read-only or foreign home): the
    built-in data's cache, or wandb's folders with --report_to wandb (DETLIB_CACHE set), stop the run before its
    work in one line (it was a traceback through detlib/data/builtin.py, and wandb's at the first evaluation).
    In-process: both folders are read from the environment when the run starts, and main() stops as a launch does."""
    from conftest import traceback_through_our_code
    from helpers import error_lines

    monkeypatch.setenv("HOME", "/sys/nohome")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("DETLIB_CACHE", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    if flags:  # the built-in data's cache elsewhere: wandb's folders in HOME are what stops the run
        monkeypatch.setenv("DETLIB_CACHE", str(tmp_path / "cache"))
    small = ["--model", "test_resnet", "--image_size", "32"] if script == "train_catsdogs" else []
    code, out, err = run_main(script, [*small, *flags, "--max_steps", "1", "--num_workers", "0", "--output_dir",
                                       tmp_path / "run"], capsys)
    text = out + err
    assert code == 1 and not traceback_through_our_code(text), text[-3000:]
    assert len(error_lines(text)) == 1 and error_lines(text)[0].startswith(f"error: {line}"), text[-3000:]
    assert json.loads((tmp_path / "run" / "run_status.json").read_text())["status"] == "failed"


# ---- F25: a process of a 2-process run killed

def test_case_f25_a_collective_error_is_a_lost_process_when_a_rank_has_ended(tmp_path):
    """`lost_process` on each way a rank's process can be gone: reaped, a zombie its launcher has not reaped yet,
    on another host (only the error's words tell); a live process, or an error that is no lost connection, is not."""
    import socket
    import subprocess
    import sys

    from torch.distributed import DistNetworkError

    from detlib.engine.run import lost_process

    here, me = socket.gethostname(), os.getpid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    try:
        import time

        while not os.path.exists(f"/proc/{zombie.pid}") or open(f"/proc/{zombie.pid}/stat").read().split()[2] != "Z":
            time.sleep(0.05)
        reset = RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:33972: Connection reset by peer.")
        for pid in (zombie.pid, reaped.pid):
            assert lost_process(reset, [(here, me), (here, pid)]) == f"another process of the run ended (rank 1, pid {pid})"
            assert lost_process(RuntimeError("any"), [(here, pid), (here, me)]) == (
                f"another process of the run ended (rank 0, pid {pid})")
        remote = "another process of the run ended (on another host, or its connection broke)"
        assert lost_process(reset, [(here, me), ("node2", 1)]) == remote
        assert lost_process(DistNetworkError("timed out"), [(here, me), ("node2", 1)]) == remote
        assert lost_process(RuntimeError("a shape mismatch"), [(here, me), (here, live.pid)]) is None
        assert lost_process(ValueError("Connection reset by peer"), [(here, me), (here, reaped.pid)]) is None
        assert lost_process(reset, [(here, me)]) is None  # one process: nothing to lose
    finally:
        live.kill()
        live.wait()
        zombie.wait()


@pytest.mark.slow  # one 2-process launch
def test_case_f25_kill9_of_rank_1_after_a_checkpoint_is_one_line_naming_it_and_the_checkpoint(tmp_path):
    """kill -9 of rank 1 of a 2-process gloo run after a checkpoint: rank 0 ends with one line saying rank 1 ended,
    the last good checkpoint and the resume command; run_status.json says the same (it was a gloo `Connection
    reset by peer` traceback through scripts/, recorded as `unhandled RuntimeError`); no process is left."""
    import signal

    from conftest import traceback_through_our_code
    from detlib.engine.checkpoints import verify_checkpoint
    from helpers import Launch, error_lines

    data = make_tiny_folder(tmp_path / "data", [16, 16])
    out = tmp_path / "run"
    run = Launch("train_catsdogs.py", ["--train_dir", data, "--val_dir", data, "--model", "test_resnet", "--image_size",
                                       "32", "--report_to", "none", "--num_workers", "2", "--epochs", "50",
                                       "--per_device_batch_size", "2", "--checkpoint_steps", "2", "--output_dir", out],
                 "cpu_2proc.yaml")
    run.wait_for("saved checkpoint")
    ranks = {}
    for pid in run.trainers():
        with open(f"/proc/{pid}/environ") as f:
            env = dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)
        ranks[int(env["RANK"])] = pid
    os.kill(ranks[1], signal.SIGKILL)
    code, _ = run.finish("kill -9 of rank 1")
    assert code != 0 and not traceback_through_our_code(run.text), run.text[-4000:]
    status = json.loads((out / "run_status.json").read_text())
    lines = error_lines(run.text.replace("\r", "\n"))  # tqdm's bar ends in a carriage return
    assert len(lines) == 1 and lines[0] == f"error: {status['message']}", run.text[-4000:]
    assert status["status"] == "failed" and status["message"].startswith(
        f"another process of the run ended (rank 1, pid {ranks[1]}) at step {status['global_step']}: ")
    checkpoint = status["message"].split("the last good checkpoint is ")[1].split(":")[0]
    verify_checkpoint(checkpoint)
    assert status["checkpoint"] == checkpoint
    newest = max((out / "checkpoints").iterdir(), key=os.path.getmtime)
    assert checkpoint == str(newest) and status["message"].endswith(
        "to continue, run the same command with --resume_from_checkpoint latest")
