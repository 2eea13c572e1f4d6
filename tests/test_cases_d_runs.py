"""Bad inputs of the D round that concern a whole run: data that cannot teach what the run claims (D03), logs that
grow with the number of classes (D04), trackers that cannot start (D12), saves that fail (D21)."""

from __future__ import annotations

from detlib.engine import model_folders
import contextlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO, SHARED_DATA, write_coco, write_image
from detlib.data.imagefolder import scan_image_folder
from detlib.datacheck.coco import check_coco_data
from detlib.datacheck.imagefolder import check_folder_scans

CATSDOGS = SHARED_DATA / "catsdogs"
needs_catsdogs = pytest.mark.skipif(not (CATSDOGS / "train" / "cat").is_dir(), reason="../shared/data/catsdogs is not present")
# the smallest in-process classifier run: no workers (a fork per test), no tracker, 16 px
FAST = ["--report_to", "none", "--num_workers", "0", "--image_size", "16", "--epochs", "1", "--verify_images", "header"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def real_images(cls: str, n: int, split: str = "train") -> list[Path]:
    return sorted((CATSDOGS / split / cls).glob("*.jpg"))[:n]


def image_folder(root: Path, files: dict[str, list[Path]]) -> Path:
    """root/<class>/<file> copies of real images ({class: files}; an empty list makes an empty class folder)."""
    for cls, paths in files.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copy(p, root / cls / p.name)
    return root


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# ---- D03: a data set that cannot teach what the run claims

@needs_catsdogs
def test_case_d03_one_class_image_folder_stops_at_start(tmp_path, capsys):
    train = image_folder(tmp_path / "train", {"cat": real_images("cat", 6)})
    val = image_folder(tmp_path / "val", {"cat": real_images("cat", 2, "val")})
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        load_script("train_catsdogs").main([*FAST, "--train_dir", str(train), "--val_dir", str(val), "--output_dir", str(out)])
    assert e.value.code == 1
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert "Traceback" not in err
    assert "a classifier needs at least 2 classes" in err and "e.g. cat" in err
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "failed" and status["global_step"] == 0
    assert not (out / "best").exists() and not (out / "checkpoints").exists()


def test_case_d03_val_folders_whose_accuracy_means_nothing(tmp_path):
    for cls in ("cat", "dog"):
        for i in range(3):
            write_image(tmp_path / "train" / cls / f"{i}.png", 20, 20, seed=10 * ("cat", "dog").index(cls) + i)  # distinct: no two files alike
    # val: images of one class only (the other folder empty) -> a warning; no image at all -> an error
    write_image(tmp_path / "val1" / "cat" / "a.png", 20, 20, seed=7)
    (tmp_path / "val1" / "dog").mkdir()
    (tmp_path / "val0" / "cat").mkdir(parents=True)
    (tmp_path / "val0" / "dog").mkdir()
    train = scan_image_folder(str(tmp_path / "train"), verify="header")
    _, report = check_folder_scans({"train": train, "val": scan_image_folder(str(tmp_path / "val1"), verify="header")})
    assert report.ok
    (w,) = [f for f in report.findings if "one class only" in f.message]
    assert w.level == "warning" and w.examples == ["cat"] and "accuracy 1.0" in w.message
    _, report = check_folder_scans({"train": train, "val": scan_image_folder(str(tmp_path / "val0"), verify="header")})
    (e,) = report.errors
    assert e.split == "val" and "the accuracy cannot be computed" in e.message
    # two classes in train: no "at least 2 classes" error
    _, report = check_folder_scans({"train": train})
    assert report.ok and not report.findings


def _coco_pair(tmp_path: Path, train_anns: list[dict], val_anns: list[dict]) -> dict:
    images = [{"id": i, "file_name": f"{i}.png", "width": 40, "height": 40} for i in (1, 2)]
    for i in (1, 2):
        write_image(tmp_path / "img" / f"{i}.png", 40, 40, seed=i)
    cats = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]
    return {"train_annotations": str(write_coco(tmp_path / "train.json", images, train_anns, cats)),
            "val_annotations": str(write_coco(tmp_path / "val.json", images, val_anns, cats)),
            "train_images": str(tmp_path / "img"), "val_images": str(tmp_path / "img")}


def test_case_d03_detection_val_sets_whose_ap_is_undefined_or_trivially_zero(tmp_path):
    def box(img, cat, crowd=0):
        return {"image_id": img, "category_id": cat, "bbox": [5, 5, 20, 20], "iscrowd": crowd}

    # train boxes all of one class: fine for a detector (no finding about it)
    _, _, report = check_coco_data(_coco_pair(tmp_path, [box(1, 1), box(2, 1)], [box(1, 1)]), progress=False)
    assert report.ok and not [f for f in report.findings if f.kind in ("boxes", "categories") and f.split == "val"]
    # val without any box, or with crowd boxes only: AP undefined
    for val in ([], [box(1, 1, crowd=1)]):
        _, _, report = check_coco_data(_coco_pair(tmp_path, [box(1, 1)], val), progress=False)
        (e,) = report.errors
        assert e.split == "val" and "AP is undefined" in e.message
    # val boxes only of a category that no training box has: AP 0 whatever is learnt (error); some of them: warning
    _, _, report = check_coco_data(_coco_pair(tmp_path, [box(1, 1)], [box(1, 2)]), progress=False)
    (e,) = report.errors
    assert "AP is 0 whatever the model learns" in e.message and e.examples == ["2 'dog' (1 boxes)"]
    _, _, report = check_coco_data(_coco_pair(tmp_path, [box(1, 1)], [box(1, 1), box(2, 2)]), progress=False)
    assert report.ok
    (w,) = [f for f in report.findings if "without any training box" in f.message]
    assert w.level == "warning" and w.examples == ["2 'dog' (1 boxes)"]
    # crowd boxes only in train: nothing to learn from, unless --include_crowd trains on them
    paths = _coco_pair(tmp_path, [box(1, 1, crowd=1)], [box(1, 1)])
    (e,) = check_coco_data(paths, progress=False)[2].errors
    assert e.split == "train" and "no usable (non-crowd, non-degenerate) box" in e.message
    assert check_coco_data(paths, progress=False, include_crowd=True)[2].ok
    # evaluation only (no train json): the val check alone
    paths = _coco_pair(tmp_path, [], [])
    (e,) = check_coco_data({**paths, "train_annotations": None}, progress=False)[2].errors
    assert e.split == "val" and "AP is undefined" in e.message
    # the library's data set is not a run: a json without boxes still loads (B01: all-background images)
    from detlib.data.coco import CocoDetection

    assert len(CocoDetection(paths["val_images"], paths["val_annotations"], train=False)) == 2


# ---- D04: log lines of bounded length whatever the number of classes

MAX_LINE = 600  # characters of a console / train.log line, the test's tmp folder counted as "TMP" wherever it is


def long_lines(text: str, tmp_path) -> list[str]:
    """Lines over MAX_LINE once each occurrence of `tmp_path` is 3 characters: the bound is on our words, not on
    how deep the machine's temporary folder is (xdist's popen-gwN/ made a CI-length path cross it)."""
    lines = [line.replace(str(tmp_path), "TMP") for line in text.splitlines()]
    return [f"{len(line)}: {line[:200]}" for line in lines if len(line) > MAX_LINE]


@needs_catsdogs
@pytest.mark.slow  # a whole run in-process, 300 classes
def test_case_d04_300_classes_keep_console_and_train_log_readable(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = sorted((CATSDOGS / "train").glob("*/*.jpg"))[:300]
    assert len(images) == 300
    data = tmp_path / "data"
    for i, p in enumerate(images):
        image_folder(data, {f"class_{i:03d}": [p]})
    out = tmp_path / "run"
    load_script("train_catsdogs").main([*FAST, "--model", "test_resnet", "--image_size", "32", "--train_dir", str(data),
                                        "--val_dir", str(data), "--output_dir", str(out), "--report_to", "tensorboard"])
    console = capsys.readouterr()
    log = (out / "train.log").read_text()
    for text in (log, console.out, console.err):
        assert not long_lines(text, tmp_path), long_lines(text, tmp_path)
    assert len(log) < 20_000  # was 278,822 characters on one line
    (line,) = [ln for ln in log.splitlines() if " eval on 300 images" in ln]
    assert "300 classes, mean precision " in line and "lowest recall (images): class_" in line and "; highest: " in line
    assert line.endswith(f"per class and confusion matrix in {out}/plots/epoch_0001")
    assert "class_000, class_001, class_002, class_003, class_004, class_005, class_006, class_007, ... (300 in all)" in log
    (config_line,) = [ln for ln in log.splitlines() if " config: " in ln]  # one line; config.yaml keeps all 300
    assert "config.yaml" in config_line and "class_" not in config_line
    assert (out / "config.yaml").read_text().count("\n- class_") == 300

    # the full detail in files: 300 classes, the 300 x 300 matrix; they agree with predictions_val.csv
    per_class = json.loads((out / "plots" / "epoch_0001" / "per_class.json").read_text())
    cm = json.loads((out / "plots" / "epoch_0001" / "confusion_matrix.json").read_text())
    assert len(per_class) == 300 and cm["names"] == sorted(per_class) and len(cm["matrix"]) == 300
    assert all(len(row) == 300 for row in cm["matrix"]) and sum(map(sum, cm["matrix"])) == 300
    import csv

    with open(out / "predictions_val.csv") as f:
        rows = list(csv.DictReader(f))
    right = sum(r["label"] == r["pred"] for r in rows)
    assert sum(cm["matrix"][i][i] for i in range(300)) == right
    assert sum(v["recall"] for v in per_class.values()) == pytest.approx(right)  # 1 image per class
    (ev,) = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val_accuracy" in m]
    assert ev["val_mean_recall"] == pytest.approx(right / 300) and ev["val_accuracy"] == pytest.approx(right / 300)
    assert not [k for k in ev if k.startswith(("val_precision_", "val_recall_", "val_confusion"))]
    assert (out / "plots" / "epoch_0001" / "confusion_matrix.png").is_file()

    # tensorboard: the table as text and the matrix as an image, not 600 per-class scalars
    acc = EventAccumulator(str(next((out / "tensorboard").rglob("events.out.tfevents.*")).parent),
                           size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"val_accuracy", "val_mean_precision", "val_mean_recall"} <= set(tags["scalars"])
    assert not [t for t in tags["scalars"] if t.startswith(("val_precision_", "val_recall_"))]
    assert "plots/confusion_matrix" in tags["images"]
    (text,) = [t for t in tags["tensors"] if t.startswith("per_class/table")]
    table = acc.Tensors(text)[0].tensor_proto.string_val[0].decode()
    assert table.count("\n| class_") == 300


def test_case_d04_per_class_tables_and_lists_have_a_bounded_size():
    from detlib.classification import per_class_summary, per_class_table
    from detlib.evaluation.metrics import format_per_class
    from detlib.logtext import class_counts, short_list

    long = "a-class-name-that-a-converter-made-from-a-whole-sentence-of-the-label-tool " * 3
    for k in (3, 80, 1000):
        per_class = {f"{long}{i}": {"AP": i / k, "AP50": min(1.0, 2 * i / k), "num_gt": i} for i in range(k)}
        table = format_per_class(per_class, full_table="run/plots/epoch_0004/per_class_ap.json").splitlines()
        assert len(table) <= 14 and max(map(len, table)) <= 120
        if k > 12:
            assert table[1].split()[1:] == ["0.000", "0.000", "0"]  # the worst first, the best last
            assert table[-1].split()[1:] == [f"{(k - 1) / k:.3f}", "1.000", str(k - 1)]
            assert table[7] == (f"... {k - 12} classes between (mean AP {sum(range(6, k - 6)) / (k - 12) / k:.3f}); "
                                f"all {k}: run/plots/epoch_0004/per_class_ap.json")
        names = [f"{long}{i}" for i in range(k)]
        confusion = [[int(i == j) * (i % 3) for j in range(k)] for i in range(k)]
        summary = per_class_summary(per_class_table(names, confusion), confusion)
        assert len(summary) <= 400
        assert len(short_list(names)) <= 400 and len(class_counts(names, list(range(k)))) <= 400
    # train and val folders that differ: the differences, not both lists of 300
    from detlib.data.imagefolder import check_split_classes

    with pytest.raises(ValueError) as e:
        check_split_classes([f"c{i}" for i in range(300)], [f"c{i}" for i in range(1, 301)], "/data/train", "/data/val")
    assert str(e.value).endswith("only in train ['c0'], only in val ['c300'] (300 train classes, 300 val classes)")
    cats = per_class_table(["cat", "dog"], [[3, 1], [0, 4]])
    assert cats["cat"] == {"precision": 1.0, "recall": 0.75, "f1": pytest.approx(6 / 7), "support": 4, "predicted": 3}
    assert per_class_summary(cats, [[3, 1], [0, 4]]) == ("cat: P 1.000 R 0.750, dog: P 0.800 R 1.000; confusion (rows "
                                                         "true) [[3, 1], [0, 4]]")


@pytest.mark.slow  # an evaluation of 90 classes in-process
def test_case_d04_detector_per_class_table_at_90_classes_is_bounded_and_in_a_file(tmp_path, caplog):
    """The detector's evaluation extras with 90 classes (COCO-like): a bounded table in the log, all in the json."""
    from accelerate import Accelerator

    from detlib.evaluation.coco import CocoEvaluator
    from detlib.evaluation.report import log_evaluation_extras

    write_image(tmp_path / "img" / "1.png", 400, 400)
    cats = [{"id": c, "name": f"category number {c} of a long-named taxonomy {'x' * 30}"} for c in range(1, 91)]
    anns = [{"id": c, "image_id": 1, "category_id": c, "bbox": [4 * (c % 10) * 10, 40 * (c // 10), 30, 30], "area": 900,
             "iscrowd": 0} for c in range(1, 91)]
    gt = {"images": [{"id": 1, "file_name": "1.png", "width": 400, "height": 400}], "annotations": anns, "categories": cats}
    ev = CocoEvaluator(gt, backend="pycocotools")
    ev.add(1, [{"image_id": 1, "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.9} for a in anns[::2]])
    ev.evaluate()
    caplog.set_level("INFO", logger="detlib.evaluation.report")
    per_class = log_evaluation_extras(Accelerator(cpu=True), str(tmp_path / "run"), 4, 40, gt, ev.results, ev.coco_eval,
                                      str(tmp_path / "img"), num_log_images=0)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("per-class AP at step 40")]
    lines = record.getMessage().splitlines()
    assert len(lines) <= 16 and max(len(line.replace(str(tmp_path), "TMP")) for line in lines) <= 200
    full = tmp_path / "run" / "plots" / "epoch_0004" / "per_class_ap.json"
    assert lines[8] == f"... 78 classes between (mean AP 0.500); all 90: {full}"
    assert len(json.loads(full.read_text())) == 90 == len(per_class)
    assert sum(v["AP"] for v in per_class.values()) == pytest.approx(45)


# ---- D21: a failed save names its cause

UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 361600 vs 361488"


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` (root only; the test is skipped where mount is not allowed), unmounted after."""
    import subprocess

    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs."""
    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        yield disk


def fill(disk: Path, leave_free: int) -> None:
    """Fill the file system of `disk` from outside the run, leaving `leave_free` bytes."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler.bin", "wb") as f:
        f.write(b"\1" * max(0, free - leave_free))


def trained_accelerator():
    import torch
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(256, 256)  # 263,168 bytes of weights; AdamW keeps two more of them
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    return acc, model, opt


@pytest.mark.parametrize("leave_free", [100_000, 400_000], ids=["weights_file_fails", "optimizer_file_fails"])
def test_case_d21_disk_filling_during_a_checkpoint_save_says_no_space(small_disk, leave_free):
    """A disk that fills during a save: the line says no space is left, with the writer's own error (safetensors'
    "os error 28", torch's zip writer's "unexpected pos"), the free space and the size of a checkpoint (the previous
    one); the partial folder is removed and the previous checkpoint kept."""
    from detlib.engine import checkpoints as ckpt
    from detlib.engine.exits import RunStop

    acc, model, opt = trained_accelerator()
    out = small_disk / "run"
    state = ckpt.TrainState(epoch=1, global_step=1)
    first = ckpt.save_checkpoint(acc, str(out), state, [model], limit=1)
    fill(small_disk, leave_free)  # 100 kB: model.safetensors fails; 400 kB: it fits, then torch's optimizer.bin fails
    state.epoch, state.global_step = 2, 2
    with pytest.raises(RunStop) as e:
        ckpt.save_checkpoint(acc, str(out), state, [model], limit=1)
    msg = str(e.value)
    tmp = out / "checkpoints" / "epoch_0002.tmp"
    assert msg.startswith(f"could not write checkpoint {tmp}: no space left on device: "), msg
    assert f"MiB free in {out / 'checkpoints'}, ~" in msg and " MiB needed); removed the partial folder" in msg
    assert "epoch_0001 is kept" in msg and "\n" not in msg
    free_mib = float(msg.split(" MiB free in ")[0].rsplit("(", 1)[1])
    size = sum(f.stat().st_size for f in Path(first).iterdir())
    assert free_mib * 2**20 < size  # it says how much is missing
    assert sorted(os.listdir(out / "checkpoints")) == ["epoch_0001"]  # no partial folder; the previous one kept
    ckpt.verify_checkpoint(first)


def test_case_d21_weights_on_a_full_disk_keep_the_old_file(small_disk):
    from detlib.weights import WeightsFileError, load_state_dict_file, save_model_weights

    acc, model, _ = trained_accelerator()
    best = small_disk / "run" / "best"
    save_model_weights(acc, model, str(best))
    before = load_state_dict_file(best / "model.safetensors")
    fill(small_disk, 50_000)
    with pytest.raises(WeightsFileError) as e:
        save_model_weights(acc, model, str(best))
    assert str(e.value).startswith(f"could not write {best / 'model.safetensors'}: no space left on device: ")
    assert f"MiB free in {best}, ~0.3 MiB needed)" in str(e.value)
    assert sorted(os.listdir(best)) == ["model.safetensors"]  # no .tmp left, the old file intact
    after = load_state_dict_file(best / "model.safetensors")
    assert all((before[k] == after[k]).all() for k in before)


def test_case_d21_read_only_disk_is_named(tmp_path):
    from detlib.engine import checkpoints as ckpt
    from detlib.engine.exits import RunStop
    from detlib.weights import WeightsFileError, save_model_weights

    acc, model, _ = trained_accelerator()
    with tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        with pytest.raises(RunStop, match=rf"^could not write checkpoint {ro}/checkpoints/epoch_0000.tmp: OSError: "
                           r"\[Errno 30\] Read-only file system: .* MiB free in .*; removed the partial folder, no "
                           "earlier checkpoint exists$"):
            ckpt.save_checkpoint(acc, str(ro), ckpt.TrainState(), [model])
        with pytest.raises(WeightsFileError, match=rf"^could not write {ro}/best/model.safetensors: OSError: \[Errno 30\] "
                           "Read-only file system"):
            save_model_weights(acc, model, str(ro / "best"))


def test_case_d21_other_causes_are_the_os_error_and_the_free_space(tmp_path, monkeypatch):
    """A writer's error that names no errno (torch's "unexpected pos") with room on the disk, a folder that is a
    file, best/ that is a file: each the writer's error and the free space in one line, the older files kept."""
    from collections import namedtuple

    from detlib import files
    from detlib.engine import checkpoints as ckpt
    from detlib.engine.exits import RunStop

    acc, model, opt = trained_accelerator()
    first = ckpt.save_checkpoint(acc, str(tmp_path), ckpt.TrainState(epoch=1, global_step=1), [model])

    def short_write(folder, *a, **k):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "optimizer.bin"), "wb") as f:
            f.write(b"\0" * 1000)
        raise RuntimeError(UNEXPECTED_POS)

    monkeypatch.setattr(acc, "save_state", short_write)
    usage = namedtuple("usage", "total used free")
    for free, full in ((200, True), (50 * 2**30, False)):
        monkeypatch.setattr(files.shutil, "disk_usage", lambda _, f=free: usage(0, 0, f))
        with pytest.raises(RunStop) as e:
            ckpt.save_checkpoint(acc, str(tmp_path), ckpt.TrainState(epoch=2, global_step=2), [model])
        assert f"epoch_0002.tmp: {'no space left on device: ' * full}RuntimeError: {UNEXPECTED_POS} (" in str(e.value)
        assert "MiB needed); removed the partial folder" in str(e.value) and "epoch_0001 is kept" in str(e.value)
        assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch_0001"]
    monkeypatch.undo()
    ckpt.verify_checkpoint(first)

    a_file = tmp_path / "a_file"
    a_file.mkdir()
    (a_file / "checkpoints").write_text("not a folder")
    with pytest.raises(RunStop, match=rf"^could not write checkpoint {a_file}/checkpoints/epoch_0001.tmp: "
                       r"(FileExistsError|NotADirectoryError): .*MiB free in .*no earlier checkpoint exists$"):
        ckpt.save_checkpoint(acc, str(a_file), ckpt.TrainState(epoch=1, global_step=1), [model])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "best").write_text("")  # best/ that is a file: one line on every process, the checkpoints kept
    with pytest.raises(RunStop, match=rf"^could not write {run_dir}/best/model.safetensors: FileExistsError: .*MiB free in "
                       rf"{run_dir}, ~0.3 MiB needed\); the checkpoints in {run_dir}/checkpoints are kept$"):
        model_folders.save_weights(acc, model, str(run_dir), "best", None)


# ---- D12: a tracker that cannot start (or close) is one line, and run_status.json says so

def wandb_env(tmp_path: Path, **env) -> dict:
    """No wandb key anywhere (a fresh HOME and wandb config folder, no WANDB_API_KEY), the built-in data where the
    other tests have it, and short wandb timeouts."""
    from detlib.data.builtin import cache_root

    home = tmp_path / "home"
    (home / ".config" / "wandb").mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return {**base, "HOME": str(home), "WANDB_CONFIG_DIR": str(home / ".config" / "wandb"), "DETLIB_CACHE": cache_root(),
            "WANDB_INIT_TIMEOUT": "5", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}


def run_alone(args: list, env: dict) -> tuple[int, str]:
    """The catsdogs script in a process of its own (forked, `helpers.ForkedRun`: wandb's service, HOME and config
    are that process's, and its imports come after `env` is set): (exit code, stdout + stderr). The launcher plays
    no part in how a tracker fails (tests/test_catsdogs_launch.py launches a wandb run)."""
    from helpers import ForkedRun

    run = ForkedRun("train_catsdogs.py", args, 1, env=env)
    code, _ = run.finish("train_catsdogs.py --report_to wandb")
    return code, run.text


TRACKER_RUN = ["--max_steps", "1", "--image_size", "16", "--num_workers", "0", "--per_device_batch_size", "8",
               "--per_device_eval_batch_size", "50"]


@pytest.mark.slow  # wandb in a process of its own: its service, HOME and config are the process's
@pytest.mark.parametrize("variant", ["no_key", "key_no_network"])
def test_case_d12_wandb_online_without_key_or_network_is_one_line_and_a_run_status(tmp_path, variant):
    env = {"WANDB_MODE": "online"}
    if variant == "key_no_network":  # a closed port on this machine: refused at once, nothing leaves it
        env.update(WANDB_API_KEY="0123456789abcdef0123456789abcdef01234567", WANDB_BASE_URL="http://127.0.0.1:9")
    out = tmp_path / "run"
    code, text = run_alone([*TRACKER_RUN, "--report_to", "wandb", "--output_dir", out], wandb_env(tmp_path, **env))
    assert code == 1, text[-3000:]
    assert "Traceback" not in text and "has no attribute 'run'" not in text
    (line,) = error_lines(text)
    assert line.startswith("error: --report_to wandb: wandb could not start (")
    assert ("No API key configured" in line) if variant == "no_key" else ("connection refused" in line.lower())
    assert "log in (`wandb login`, or set WANDB_API_KEY), check the network and WANDB_BASE_URL" in line
    assert f"WANDB_MODE=offline (upload later with `wandb sync {out}/wandb/offline-run-*`), or pass --report_to none" in line
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "failed" and status["message"] == line.removeprefix("error: ")
    assert status["global_step"] == 0 and not (out / "checkpoints").exists()


@pytest.mark.slow
def test_case_d12_wandb_disabled_keeps_working(tmp_path):
    """(WANDB_MODE=offline without a key: test_case_b13_b21_... in test_catsdogs_launch.py.)"""
    out = tmp_path / "run"
    code, text = run_alone([*TRACKER_RUN, "--report_to", "wandb", "--output_dir", out],
                           wandb_env(tmp_path, WANDB_MODE="disabled"))
    assert code == 0, text[-3000:]
    assert "Traceback" not in text and not error_lines(text)
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    assert not list((out / "wandb").glob("offline-run-*"))


def test_case_d12_tensorboard_that_cannot_start_or_close(tmp_path, monkeypatch, capsys):
    """In one process: a tracker whose start raises stops the run in one line before the first step; one whose
    close raises at the end is a warning, and the run still finishes."""
    from accelerate.tracking import TensorBoardTracker

    script = load_script("train_catsdogs")
    args = [*TRACKER_RUN, "--report_to", "tensorboard", "--verify_images", "header"]

    def refuse(self):
        raise PermissionError(13, "Permission denied", self.logging_dir_param)

    monkeypatch.setattr(TensorBoardTracker, "start", refuse)
    out = tmp_path / "start"
    with pytest.raises(SystemExit) as e:
        script.main([*args, "--output_dir", str(out)])
    assert e.value.code == 1
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert line.startswith(f"error: --report_to tensorboard: tensorboard could not start (PermissionError: [Errno 13] "
                           f"Permission denied: '{out}")
    assert line.endswith("); fix that, or pass --report_to none") and "Traceback" not in err
    assert json.loads((out / "run_status.json").read_text())["status"] == "failed"
    monkeypatch.undo()

    def lost(self):
        raise ConnectionError("upload of the event file failed")

    monkeypatch.setattr(TensorBoardTracker, "finish", lost)
    out = tmp_path / "close"
    script.main([*args, "--output_dir", str(out)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err and not error_lines(captured.err)
    assert (f"the tensorboard tracker did not close cleanly (ConnectionError: upload of the event file failed); the "
            f"run's own files in {out} are complete") in (out / "train.log").read_text()
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    assert (out / "last" / "model.safetensors").is_file() and list((out / "tensorboard").rglob("events.out.*"))
