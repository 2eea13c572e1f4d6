"""End-to-end runs of the run machinery (detlib.engine): divergence (C11), kill -9 and SIGTERM mid-epoch with
exact resume, damaged checkpoints (C07), another process count refused (C08), the partial accumulation window (C09), a
training set too small for the processes (C10), the output-folder guards, and two "machines" on loopback. (An EMA
loss normalizer's exact resume is tests/test_train_retinanet.py's B19 test.)

Tiny on purpose: noise images of 64 px with a box or two, resnet18 with a 16-channel head (RetinaNet) or timm's
`test_resnet` at 32 px (cats/dogs). A launch costs ~8 s of start-up per process before any work, so only what
needs the launcher is launched: signals through it, two "machines". A kill -9 of a whole run and a start-up
error on 2 processes are forked runs (`helpers.ForkedRun`, `forked_launch`). A 2-process run
whose launcher plays no part (the reference a signal test compares against, the resumes, C08) is forked from
the test process (`helpers.forked_ok`: the rank variables of cpu_2proc.yaml, a third of a launch's CPU time), and a
1-process one runs `main(argv)` in-process (`helpers.run_ok` / `run_main`), without DataLoader workers unless a
run is compared with a launched one (the exit paths with workers, a kill -9 of the launcher included, are
tests/test_exit_paths.py's). The loopback test compares two launched "machines" with the forked reference.
Launches and runs of more than a few steps are marked `slow`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, read_metrics, start_script, traceback_through_our_code, write_coco, write_image
from detlib.engine.run_folder import acquire_lock, release_lock
from helpers import ForkedRun, Launch, error_lines, forked_launch, forked_ok, free_port, make_tiny_folder, run_main, run_ok

# DataLoader workers on, as users run (2: the default 4 capped at this machine's cores): every launched exit path
# below runs through worker processes (the cats/dogs ones persistent); in-process runs add NO_WORKERS
TINY = ["--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "16", "--per_device_batch_size", "2",
        "--per_device_eval_batch_size", "4", "--num_workers", "2", "--log_interval", "1", "--report_to", "none",
        "--eval_interval", "100"]
CATS = ["--model", "test_resnet", "--image_size", "32", "--num_workers", "2", "--log_interval", "1", "--report_to", "none"]
NO_WORKERS = ["--num_workers", "0"]


def make_detection_set(root: Path, n_train: int, n_val: int = 2) -> list[str]:
    """Noise images of 64x64 px with one or two boxes of 2 categories; returns the four data flags."""
    images, anns = [], []
    for i in range(n_train + n_val):
        write_image(root / "img" / f"{i}.png", 64, 64, seed=i)
        images.append({"id": i + 1, "file_name": f"{i}.png", "width": 64, "height": 64})
        anns.append({"image_id": i + 1, "category_id": 1 + i % 2, "bbox": [4 + i, 6, 30, 24 + i % 5]})
        if i % 3 == 0:
            anns.append({"image_id": i + 1, "category_id": 2, "bbox": [30, 30, 20, 20]})
    cats = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
    train_ids = {im["id"] for im in images[:n_train]}
    write_coco(root / "train.json", images[:n_train], [a for a in anns if a["image_id"] in train_ids], cats)
    write_coco(root / "val.json", images[n_train:], [dict(a) for a in anns if a["image_id"] not in train_ids], cats)
    return ["--train_images", str(root / "img"), "--train_annotations", str(root / "train.json"),
            "--val_images", str(root / "img"), "--val_annotations", str(root / "val.json")]


def wait_for_step(out: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}:\n{proc.stdout.read()[-4000:]}")
        try:
            if any(m.get("step", 0) >= step and "loss" in m for m in read_metrics(out)):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


def children(pid: int) -> list[int]:
    """All descendants of `pid`, from /proc."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def saved_tensors(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {str(f.relative_to(out)): load_file(str(f)) for f in out.rglob("*.safetensors")}


def assert_same_weights(a: Path, b: Path, atol: float = 1e-6) -> float:
    wa, wb = load_file(str(a / "last" / "model.safetensors")), load_file(str(b / "last" / "model.safetensors"))
    worst = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa if wa[k].is_floating_point())
    assert worst <= atol, worst
    return worst


def trains(out: Path) -> list[dict]:
    return [m for m in read_metrics(out) if "loss" in m]


# ---- the plateau scheduler's drop

def test_a_plateau_drop_is_logged_and_trains_the_next_epoch_at_the_lower_lr(tmp_path, capsys, monkeypatch):
    """ReduceLROnPlateau, told that no epoch improves (patience 0): after epoch 1 the LR drops 10x, one line
    says so, and epoch 2 trains at the lower LR (the epoch line gives the LR the epoch trained at)."""
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    monkeypatch.setattr(plateau, "_is_better" if hasattr(plateau, "_is_better") else "is_better", lambda *a: False)
    data = make_detection_set(tmp_path / "d", 4)
    out = tmp_path / "run"
    stdout = run_ok("train_retinanet", data + TINY + NO_WORKERS + [
        "--lr_scheduler", "plateau", "--plateau_patience", "0", "--lr", "0.001", "--epochs", "2",
        "--output_dir", out], capsys)
    assert "epoch 1: mean loss" in stdout and "lr 0.001," in stdout.split("epoch 1: mean loss")[1].splitlines()[0]
    assert "plateau: no lower mean loss in 1 epoch(s), lr 0.001 -> 0.0001 from epoch 2 on" in stdout, stdout[-3000:]
    assert {m["epoch"]: m["lr"] for m in trains(out)} == {1: pytest.approx(1e-3), 2: pytest.approx(1e-4)}


# ---- divergence (C11)

@pytest.mark.slow
def test_case_c11_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path, capsys):
    data = make_detection_set(tmp_path / "d", 4)
    out = tmp_path / "run"
    code, stdout, stderr = run_main("train_retinanet", data + TINY + [
        "--optimizer", "sgd", "--lr", "100", "--max_grad_norm", "0", "--epochs", "3", "--checkpoint_total_limit", "1",
        "--per_device_batch_size", "1", "--output_dir", str(out), "--num_workers", "0"], capsys)  # in-process
    text = stdout + stderr
    assert code == 3, text[-3000:]
    assert "training diverged: 5 non-finite steps in a row up to step" in text and "lr 100" in text
    assert "resume from it with a lower --max_grad_norm, or start a new run from its weights with a lower --lr" in text
    m = trains(out)
    assert m[-1]["skipped_steps"] >= 5
    skipped = [t for t in m if not math.isfinite(float(t["loss"]))]
    assert len(skipped) >= 5
    for name, tensors in saved_tensors(out).items():  # nothing non-finite was ever written
        assert all(torch.isfinite(v).all() for v in tensors.values() if v.is_floating_point()), name
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(ckpts) == 1 and ckpts[0] in text  # the last finite checkpoint is kept and named


# ---- kill -9 and SIGTERM mid-epoch, exact resume

@pytest.mark.slow
def test_kill9_mid_epoch_resume_redoes_at_most_checkpoint_steps(tmp_path, capsys):
    data = make_detection_set(tmp_path / "d", 8)
    common = data + TINY + ["--epochs", "2", "--per_device_batch_size", "1", "--optimizer", "sgd", "--lr", "0.01",
                            "--lr_scheduler", "cosine", "--warmup_steps", "2", "--checkpoint_steps", "5"]
    full, part = tmp_path / "full", tmp_path / "part"
    run = ForkedRun("train_retinanet.py", common + ["--output_dir", part])  # the run that is killed (with its workers)
    run.wait_for_step(part, 13)
    run.kill()  # every process of the run at once: nothing can save (a kill -9 of the launcher's group: test_exit_paths)
    assert run.finish("kill -9 mid-epoch")[0] == -signal.SIGKILL
    logged = max(m["step"] for m in trains(part))
    # the uninterrupted run and the resume in-process, with the same flags (DataLoader workers included)
    run_ok("train_retinanet", common + ["--output_dir", full], capsys)
    resumed = run_ok("train_retinanet", common + ["--output_dir", part, "--resume_from_checkpoint", "latest"], capsys)
    assert "global step 10" in resumed  # step_00000010, in the folder whose lock the killed run held
    assert logged - 10 <= 5
    worst = assert_same_weights(full, part, atol=1e-6)
    print(f"kill -9 at step {logged}: resumed from step 10, {logged - 10} steps redone; max weight difference {worst:.2e}")
    f, p = trains(full), trains(part)
    by_step = {m["step"]: m for m in p}  # the resumed run's values (later lines win)
    for x in f:
        assert by_step[x["step"]]["lr"] == pytest.approx(x["lr"], rel=1e-12)


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref2")
    data = make_detection_set(root / "d", 12)
    common = data + TINY + ["--epochs", "2", "--optimizer", "sgd", "--lr", "0.01", "--lr_scheduler", "plateau",
                            "--checkpoint_steps", "100", "--eval_interval", "2"]
    forked_ok("train_retinanet.py", common + ["--output_dir", root / "ref"])  # the 2-process run, forked
    return common, root / "ref"


@pytest.mark.slow
def test_sigterm_two_processes_stop_together_and_resume_exactly(two_process_reference, tmp_path):
    """SIGTERM to a 2-process launcher (SLURM's preemption; the exit path of RetinaNet on 2 processes, with its
    DataLoader workers: tests/test_exit_paths.py's `Launch` checks that no process of the run is left)."""
    common, ref = two_process_reference
    out = tmp_path / "run"
    run = Launch("train_retinanet.py", common + ["--output_dir", out], "cpu_2proc.yaml")
    run.wait_for_step(out, 4)
    os.kill(run.proc.pid, signal.SIGTERM)  # to the launcher (torchrun), which forwards it to both workers
    code, _ = run.finish("train_retinanet.py cpu_2proc.yaml SIGTERM mid-epoch")
    text = run.text
    assert code != 0 and "in epoch" in json.loads((out / "run_status.json").read_text())["message"]
    assert text.count("preempted by SIGTERM at step") == 1, text[-3000:]  # one message, from the main process
    # exactly one preemption checkpoint, written by both ranks together
    (ckpt_dir,) = [p for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")]
    state = json.loads((ckpt_dir / "trainer_state.json").read_text())
    assert ckpt_dir.name == f"step_{state['global_step']:08d}" and {f.name for f in ckpt_dir.iterdir()} >= {
        "random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"}
    assert max(m["step"] for m in trains(out)) == state["global_step"]  # no rank went on after the decision
    forked_ok("train_retinanet.py", common + ["--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert_same_weights(ref, out, atol=1e-6)
    # the plateau scheduler's epoch mean covers the whole interrupted epoch after the resume
    mean = lambda o: [ln for ln in (o / "train.log").read_text().splitlines() if "epoch 1: mean loss" in ln][-1].split("mean loss ")[1][:6]  # noqa: E731
    assert mean(out) == mean(ref)


# ---- damaged checkpoints (C07), trackers after a resume from an older checkpoint

@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory):
    """One 2-epoch run (in-process) that the C07 cases copy and damage."""
    root = tmp_path_factory.mktemp("c07")
    data = make_detection_set(root / "d", 4)
    run_ok("train_retinanet", data + TINY + NO_WORKERS + ["--epochs", "2", "--output_dir", root / "run"])
    return data, root / "run"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate_weights", "empty_state"])
def test_case_c07_resume_skips_a_damaged_newest_checkpoint(two_epoch_run, tmp_path, damage, capsys):
    data, run = two_epoch_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    common = data + TINY + NO_WORKERS + ["--output_dir", str(out)]
    newest = out / "checkpoints" / "epoch_0002"
    if damage == "truncate_weights":
        f = newest / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        (newest / "trainer_state.json").write_text("")
    stdout = run_ok("train_retinanet", common + ["--epochs", "3", "--resume_from_checkpoint", "latest"], capsys)
    assert "skipping damaged checkpoint epoch_0002" in stdout
    assert ("model.safetensors is truncated" in stdout) if damage == "truncate_weights" else ("trainer_state.json is damaged" in stdout)
    assert "resumed from" in stdout and "epoch_0001" in stdout
    m = trains(out)
    assert [t["step"] for t in m] == [1, 2, 3, 4, 3, 4, 5, 6]  # the trackers get the true step, as metrics.jsonl
    # named explicitly, a damaged checkpoint is a one-line error
    f = out / "checkpoints" / "epoch_0003" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    code, _, err = run_main("train_retinanet", common + ["--epochs", "4", "--resume_from_checkpoint", f.parent], capsys)
    assert code != 0
    assert f"error: --resume_from_checkpoint: {f} is truncated" in err


def test_planted_pickle_payload_never_runs_on_resume(tmp_path, capsys):
    """A checkpoint folder from someone else: a custom_checkpoint_0.pkl (what accelerate writes for a registered object) whose
    `__reduce__` calls os.system. Named explicitly it is one error line; `latest` falls back to the older
    checkpoint, saying why; the command never runs. (Every kind of state file: tests/test_checkpoint.py.)"""
    from helpers import plant

    from detlib.engine.checkpoints import checkpoint_folders

    data = make_tiny_folder(tmp_path / "data", [4, 4])
    out, marker = tmp_path / "run", tmp_path / "MARKER"
    common = CATS + ["--train_dir", str(data), "--val_dir", str(data), "--per_device_batch_size", "4",
                     "--checkpoint_steps", "1", "--output_dir", str(out), "--num_workers", "0"]
    assert run_main("train_catsdogs", common + ["--max_steps", "2"], capsys)[0] == 0
    older, planted = map(Path, checkpoint_folders(str(out)))  # step_00000001, then epoch_0001 (the end of epoch 1)
    plant(planted / "custom_checkpoint_0.pkl", marker, "torch")
    code, _, err = run_main("train_catsdogs", common + ["--max_steps", "3", "--resume_from_checkpoint", planted], capsys)
    assert code != 0 and not traceback_through_our_code(err) and not marker.exists()
    (line,) = error_lines(err)
    assert line.startswith(f"error: --resume_from_checkpoint: {planted}/custom_checkpoint_0.pkl holds pickled")
    code, stdout, _ = run_main("train_catsdogs", common + ["--max_steps", "3", "--resume_from_checkpoint", "latest"], capsys)
    assert code == 0
    assert (f"skipping damaged checkpoint {planted.name}: {planted}/custom_checkpoint_0.pkl holds pickled objects "
            "other than tensors and plain values (Trying to load unsupported GLOBAL posix.system") in stdout
    assert f"resumed from {older}: epoch 1, step 1 in epoch" in stdout and not marker.exists()


def test_evaluate_only_on_truncated_or_foreign_weights_is_one_line(tmp_path, capsys):
    data = make_detection_set(tmp_path / "d", 2)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    for weights in (bad, REPO / "README.md"):
        code, out, err = run_main("train_retinanet", data[4:] + ["--evaluate_only", str(weights), "--output_dir",
                                                                 str(tmp_path / "e"), "--report_to", "none"] + TINY, capsys)
        assert code != 0 and not traceback_through_our_code(out + err)  # no traceback of ours
        (line,) = error_lines(err)
        assert str(weights) in line


# ---- another process count (C08)

@pytest.mark.slow
def test_case_c08_resume_on_another_process_count_or_batch_is_refused_and_another_length_said(tmp_path, capsys):
    """A checkpoint of 2 processes resumed on 1, or with another batch size: refused in one line that names what to
    keep equal (its data position and samples per step are those of its geometry); --epochs is said and trained on,
    the cosine schedule spanning the new length."""
    data = make_detection_set(tmp_path / "d", 8)
    out = tmp_path / "run"
    # no DataLoader workers: the refusal reads the checkpoint's geometry, not how its batches were loaded
    common = data + TINY + NO_WORKERS + ["--lr_scheduler", "cosine", "--warmup_steps", "0", "--lr", "1e-3",
                                         "--output_dir", str(out)]
    forked_ok("train_retinanet.py", common + ["--epochs", "2"])  # 2 processes, forked
    assert [t["step"] for t in trains(out)] == [1, 2, 3, 4]  # 8 images / (2 processes x 2) = 2 steps per epoch
    latest = out / "checkpoints" / "epoch_0002"
    for extra, said in (([], "--num_processes 2 -> 1"), (["--per_device_batch_size", "1"], "--per_device_batch_size 2 -> 1")):
        code, _, err = run_main("train_retinanet", common + ["--epochs", "3", "--resume_from_checkpoint", "latest"]
                                + extra, capsys)
        (line,) = error_lines(err)
        assert code == 1 and line.startswith(f"error: cannot resume from {latest}: it does not fit this run: ") and said in line
        assert "resume with its values" in line and not traceback_through_our_code(err)
    text = forked_ok("train_retinanet.py", common + ["--epochs", "3", "--resume_from_checkpoint", "latest"])
    assert "with other flags than its run's: --epochs 2 -> 3" in text
    last = trains(out)[4:]
    assert [t["step"] for t in last] == [5, 6] and all(t["epoch"] == 3 for t in last)
    assert [t["lr"] for t in last] == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * s / 6)) for s in (4, 5)])


# ---- the partial accumulation window (C09)

@pytest.mark.slow  # in-process, but two trainings with an evaluation (seconds)
def test_case_c09_last_partial_window_gets_its_full_gradient_catsdogs(tmp_path, capsys):
    data = make_tiny_folder(tmp_path / "data", [20, 20])
    norms = {}
    for accum in (1, 2):
        out = tmp_path / f"acc{accum}"
        run_ok("train_catsdogs", CATS + NO_WORKERS + ["--train_dir", data, "--val_dir", data, "--per_device_batch_size", "8",
                                                      "--gradient_accumulation_steps", accum, "--lr", "0", "--epochs", "1",
                                                      "--output_dir", out], capsys)
        norms[accum] = [t["grad_norm"] for t in trains(out)]
    assert len(norms[1]) == 5 and len(norms[2]) == 3  # 5 batches: windows of 2, 2 and 1
    # the last window holds batch 5 alone: its gradient is batch 5's, not half of it
    assert norms[2][-1] == pytest.approx(norms[1][-1], rel=1e-5)
    assert norms[2][0] != pytest.approx(norms[1][0], rel=1e-3)  # (a full window is a real mean of two batches)


@pytest.mark.slow  # in-process, but two trainings with an evaluation (seconds)
def test_case_c09_last_partial_window_gets_its_full_gradient_retinanet(tmp_path, capsys):
    data = make_detection_set(tmp_path / "d", 10)
    norms = {}
    for accum in (1, 2):
        out = tmp_path / f"acc{accum}"
        run_ok("train_retinanet", data + TINY + NO_WORKERS + ["--gradient_accumulation_steps", accum, "--lr", "0",
                                                              "--epochs", "1", "--output_dir", out], capsys)
        norms[accum] = [t["grad_norm"] for t in trains(out)]
    assert len(norms[1]) == 5 and len(norms[2]) == 3
    assert norms[2][-1] == pytest.approx(norms[1][-1], rel=1e-5)


# ---- accumulation and processes are one batch (F14)

def first_step(data: list, out: Path, batch: int, accum: int, capsys=None, processes: int = 1) -> tuple[dict, dict]:
    """One SGD step (no momentum, decay or clipping: the weights move by -lr * the gradient) on the 2 training
    images, backbone BatchNorm frozen; returns the train line and the weights after it."""
    argv = data + TINY + NO_WORKERS + ["--per_device_batch_size", batch, "--gradient_accumulation_steps", accum,
                                       "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0", "--weight_decay", "0",
                                       "--max_grad_norm", "0", "--augmentation", "none", "--backbone_bn", "frozen", "--epochs", "1",
                                       "--num_log_images", "0", "--output_dir", out]
    if processes == 1:
        run_ok("train_retinanet", argv, capsys)
    else:
        forked_ok("train_retinanet.py", [str(a) for a in argv], processes)
    (line,) = trains(out)
    return line, load_file(str(out / "last" / "model.safetensors"))


def test_case_f14_two_accumulated_micro_batches_of_one_image_give_the_gradient_of_one_batch_of_two(tmp_path, capsys):
    """RetinaNet's loss divides by the positive anchors of the whole accumulation window, not of each micro-batch:
    the same 2 images as one batch of 2 or as 2 accumulated micro-batches of 1 give the same pre-clip gradient norm,
    loss and updated weights (before the fix: grad_norm 1.125 vs 1.119, each micro-batch divided by its own count).
    BatchNorm frozen: trained BatchNorm sees other batch statistics in a batch of 1, a difference no normaliser
    removes."""
    data = make_detection_set(tmp_path / "d", 2)
    one, w_one = first_step(data, tmp_path / "batch2", 2, 1, capsys)
    acc, w_acc = first_step(data, tmp_path / "accum2", 1, 2, capsys)
    assert acc["pos_anchors_per_image"] == pytest.approx(one["pos_anchors_per_image"])  # the same images
    assert acc["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert acc["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for k in w_one:
        torch.testing.assert_close(w_acc[k], w_one[k], rtol=0, atol=1e-7)


@pytest.mark.slow  # a forked 2-process run
def test_case_f14_two_processes_of_one_image_give_the_gradient_of_one_batch_of_two(tmp_path, capsys):
    """The window's positive anchors are counted over all processes: 2 processes with 1 image each step as 1 process
    with both (before the fix each process divided by its own count and DDP averaged: 1.125 vs 1.119)."""
    data = make_detection_set(tmp_path / "d", 2)
    one, w_one = first_step(data, tmp_path / "batch2", 2, 1, capsys)
    two, w_two = first_step(data, tmp_path / "procs2", 1, 1, processes=2)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for k in w_one:
        torch.testing.assert_close(w_two[k], w_one[k], rtol=0, atol=1e-7)


# ---- tiny data (C10) and the output-folder guards

@pytest.mark.slow
def test_case_c10_no_batch_per_process_stops_at_start(tmp_path):
    """Forked on 2 processes (the launcher's part in a refusal printed once: tests/test_catsdogs_launch.py)."""
    data = make_detection_set(tmp_path / "d", 3)
    run = forked_launch("train_retinanet.py", data + TINY + ["--epochs", "3", "--output_dir", str(tmp_path / "o")])
    text = "\n".join(run.texts)
    assert all(code != 0 for code in run.codes) and not traceback_through_our_code(text), text[-3000:]
    (line,) = error_lines(text)  # one line over both processes, from the first
    assert error_lines(run.texts[0]) == [line]
    assert "3 training images on 2 process(es) with --per_device_batch_size 2" in line
    assert not (tmp_path / "o" / "last").exists()


@pytest.mark.slow  # in-process, but two trainings with an evaluation (seconds)
def test_output_folder_guards(tmp_path, capsys):
    data = make_detection_set(tmp_path / "d", 4)
    out = tmp_path / "run"
    common = data + TINY + ["--output_dir", str(out), "--epochs", "1", "--num_workers", "0"]
    assert run_main("train_retinanet", common + ["--eval_interval", "1"], capsys)[0] == 0
    best = (out / "best" / "model.safetensors").read_bytes()
    lines = len(read_metrics(out))
    # a finished run is never mixed into nor overwritten without being asked
    code, _, err = run_main("train_retinanet", common, capsys)
    assert code != 0 and "holds another run" in err and "--overwrite_output_dir" in err
    assert (out / "best" / "model.safetensors").read_bytes() == best and len(read_metrics(out)) == lines
    # a live run holding the folder (this test's own process stands in for it)
    assert acquire_lock(str(out)) is None
    code, _, err = run_main("train_retinanet", common + ["--resume_from_checkpoint", "latest"], capsys)
    assert code != 0 and f"another run (pid {os.getpid()} on {socket.gethostname()}) is writing" in err
    release_lock(str(out))
    # --overwrite_output_dir replaces it, saying so
    code, stdout, _ = run_main("train_retinanet", common + ["--overwrite_output_dir"], capsys)
    assert code == 0 and "--overwrite_output_dir: removed the previous run's" in stdout
    # latest in a folder without a checkpoint: a warning naming the folder, then a fresh start
    code, stdout, _ = run_main("train_retinanet", data + TINY + ["--output_dir", str(tmp_path / "typo"), "--max_steps", "1",
                                                                 "--resume_from_checkpoint", "latest", "--num_workers", "0"], capsys)
    assert code == 0
    assert f"WARNING detlib.engine.checkpoints: --resume_from_checkpoint latest: no usable checkpoint in {tmp_path / 'typo'}" in stdout


@pytest.mark.slow  # in-process, but a training and an evaluation (seconds)
def test_catsdogs_evaluate_only_keeps_the_run_and_reads_a_checkpoint_of_another_model(tmp_path, capsys):
    data = make_tiny_folder(tmp_path / "data", [4, 4])
    out = tmp_path / "run"
    code, _, _ = run_main("train_catsdogs", CATS + ["--model", "resnet10t", "--train_dir", str(data), "--val_dir", str(data),
                                                    "--per_device_batch_size", "4", "--epochs", "1", "--output_dir", str(out),
                                                    "--num_workers", "0"], capsys)
    assert code == 0
    config, metrics = (out / "config.yaml").read_text(), (out / "metrics.jsonl").read_text()
    (ckpt_dir,) = list((out / "checkpoints").iterdir())
    code, stdout, _ = run_main("train_catsdogs", ["--val_dir", str(data), "--evaluate_only", str(ckpt_dir), "--output_dir",
                                                  str(out), "--num_workers", "0", "--report_to", "none"], capsys)
    assert code == 0 and "resnet10t" in stdout
    assert (out / "config.yaml").read_text() == config and (out / "metrics.jsonl").read_text() == metrics
    (line,) = read_metrics(out / "evaluate_only")
    assert line["weights"] == str(ckpt_dir / "model.safetensors") and line["num_val_samples"] == 8


# ---- two machines on loopback

@pytest.mark.slow
def test_two_machines_on_loopback_equal_two_processes(two_process_reference, tmp_path):
    common, ref = two_process_reference
    out = tmp_path / "nodes"
    port = str(free_port())
    nodes = [start_script("train_retinanet.py", common + ["--output_dir", str(out)], config="cpu_2proc.yaml",
                   launcher_args=("--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                                  "--main_process_ip", "127.0.0.1", "--main_process_port", port))
             for rank in (0, 1)]
    texts = [n.communicate(timeout=600)[0] for n in nodes]
    for n, text in zip(nodes, texts):
        assert n.returncode == 0, text[-3000:]
    assert "2 process(es)" in texts[0]
    assert_same_weights(ref, out, atol=1e-6)
    ev = lambda o: [m for m in read_metrics(o) if "AP" in m][-1]  # noqa: E731
    assert {k: ev(out)[k] for k in ("AP", "AP50", "AR100")} == {k: ev(ref)[k] for k in ("AP", "AP50", "AR100")}


@pytest.mark.slow
def test_sigusr1_to_the_training_process_checkpoints_and_exits_75(tmp_path, capsys):
    """SIGUSR1 (SLURM's `--signal`) to the training process alone, under its launcher. The first Ctrl-C sets the
    same flag: tests/test_exit_paths.py sends it to the training process, with and without a launcher."""
    sig = "SIGUSR1"
    data = make_tiny_folder(tmp_path / "data", [16, 16])
    out = tmp_path / "run"
    common = CATS + ["--train_dir", str(data), "--val_dir", str(data), "--per_device_batch_size", "2", "--epochs", "30",
                     "--output_dir", str(out)]
    proc = start_script("train_catsdogs.py", common)
    wait_for_step(out, proc, 3)
    (trainer,) = [c for c in children(proc.pid) if alive(c)][:1]
    os.kill(trainer, getattr(signal, sig))
    text = proc.communicate(timeout=120)[0]
    assert "returned non-zero exit status 75" in text, text[-3000:]
    status = json.loads((out / "run_status.json").read_text())
    assert status["status"] == "preempted" and f"preempted by {sig}" in status["message"]
    written = Path(status["message"].split("checkpoint ")[1].split(" written")[0])  # step_ or, during an evaluation, epoch_
    assert written.parent == out / "checkpoints" and (written / "trainer_state.json").is_file()
    stdout = run_ok("train_catsdogs", common[:-4] + NO_WORKERS + ["--epochs", "2", "--output_dir", out,
                                                                  "--resume_from_checkpoint", "latest"], capsys)  # in-process
    assert f"global step {status['global_step']}" in stdout
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_training_health_and_evaluation_extras_reach_tensorboard_and_wandb(tmp_path):
    """Read back from the files the trackers wrote (not mocked): the health scalars of every train line, the
    per-class AP, the sample images with boxes; and the same in metrics.jsonl, plots/ and samples/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = make_detection_set(tmp_path / "d", 4, n_val=2)
    out = tmp_path / "run"
    text = forked_ok("train_retinanet.py", data + TINY[:-2] + NO_WORKERS + [  # a process of its own (wandb's), forked
        "--epochs", "2", "--eval_interval", "1", "--score_thresh", "0.0", "--num_log_images", "2", "--log_interval", "10",
        "--report_to", "all", "--output_dir", str(out)], num_processes=1, env={"WANDB_MODE": "offline"})
    m = read_metrics(out)
    tr = [t for t in m if "loss" in t]
    assert [t["epoch"] for t in tr] == [1, 2]  # an epoch shorter than --log_interval still gets its line
    for key in ("grad_norm", "pos_anchors_per_image", "skipped_steps", "images_per_s", "data_time_fraction", "lr"):
        assert all(isinstance(t[key], (int, float)) for t in tr), key
    ev = [e for e in m if "AP" in e]
    assert len(ev) == 2 and all(set(e["per_class"]) <= {"a", "b"} for e in ev)
    assert (out / "plots" / "epoch_0001" / "pr_curve.png").is_file() and (out / "plots" / "training_curves.png").is_file()
    assert len(list((out / "samples" / "epoch_0001").glob("*.png"))) == 2
    assert "summary:" in text and "best AP" in text
    # AdamW's two groups: no weight decay on norms and biases, 0.01 on the rest
    opt = torch.load(out / "checkpoints" / "epoch_0002" / "optimizer.bin", weights_only=True)
    assert sorted(g["weight_decay"] for g in opt["param_groups"]) == [0.0, 0.01]

    acc = EventAccumulator(str(next((out / "tensorboard").rglob("events.out.tfevents.*")).parent),
                           size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    scalars, images = set(acc.Tags()["scalars"]), set(acc.Tags()["images"])
    assert {"loss", "grad_norm", "pos_anchors_per_image", "skipped_steps", "AP", "epoch"} <= scalars
    assert any(t.startswith("per_class/AP50/") for t in scalars)
    assert any(t.startswith("samples/") for t in images)
    (wandb_file,) = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    blob = wandb_file.read_bytes()
    for key in (b"grad_norm", b"pos_anchors_per_image", b"skipped_steps", b"per_class", b"boxes"):
        assert key in blob, key


def test_resume_with_another_model_is_one_line(tmp_path, capsys):
    data = make_detection_set(tmp_path / "d", 4)
    out = tmp_path / "run"
    no_workers = ["--num_workers", "0"]
    assert run_main("train_retinanet", data + TINY + no_workers + ["--max_steps", "1", "--epochs", "1", "--output_dir", out],
                    capsys)[0] == 0
    wider = [("32" if a == "16" and TINY[i - 1] == "--fpn_channels" else a) for i, a in enumerate(TINY)]
    code, out_text, err = run_main("train_retinanet", data + wider + no_workers + [
        "--epochs", "1", "--output_dir", out, "--resume_from_checkpoint", "latest"], capsys)
    # no traceback through our code
    assert code != 0 and not traceback_through_our_code(err) and not traceback_through_our_code(out_text)
    (line,) = error_lines(err)
    assert "cannot resume from" in line and "does not fit this run" in line


# ---- what a tester broke (docs/long_runs.md)

def test_the_epoch_mean_covers_every_micro_batch_and_the_train_line_gives_the_step_s_lrs(tmp_path, capsys):
    """With gradient accumulation the epoch's mean loss (what ReduceLROnPlateau steps on) is over every micro-batch
    of each window (it was the windows' last micro-batch only), so it equals the mean of the step lines; the line's
    lr_1 is the LR the step used, like lr (it was the next step's)."""
    data = make_detection_set(tmp_path / "d", 8)
    out = tmp_path / "run"
    stdout = run_ok("train_retinanet", data + TINY + NO_WORKERS + [
        "--gradient_accumulation_steps", "2", "--per_device_batch_size", "2", "--epochs", "1", "--lr_scheduler",
        "cosine", "--warmup_steps", "2", "--output_dir", out], capsys)
    steps = trains(out)
    assert len(steps) == 2  # 4 batches of 2 images, windows of 2
    mean = float(stdout.split("epoch 1: mean loss ")[1].split(",")[0])
    assert mean == pytest.approx(sum(t["loss"] for t in steps) / 2, abs=1e-4)
    assert all(t["lr_1"] == t["lr"] for t in steps)  # AdamW's two groups (decay, no decay) share the LR


def test_a_resume_with_nothing_left_to_train_keeps_last_and_its_model_card(tmp_path, capsys):
    data = make_tiny_folder(tmp_path / "data", [4, 4])
    common = CATS + NO_WORKERS + ["--train_dir", data, "--val_dir", data, "--per_device_batch_size", "4", "--epochs", "1",
                                  "--output_dir", tmp_path / "run"]
    run_ok("train_catsdogs", common, capsys)
    card = (tmp_path / "run" / "last" / "README.md").read_text()
    stdout = run_ok("train_catsdogs", common + ["--resume_from_checkpoint", "latest"], capsys)
    assert "nothing left to train" in stdout and "pass a larger --epochs" in stdout
    assert (tmp_path / "run" / "last" / "README.md").read_text() == card  # not rewritten without its evaluation
