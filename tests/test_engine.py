"""The run machinery's parts in one process: checkpoint verification and fallback (C07), a failed save (disk
full), the output-folder lock, flag values, schedule continuation after a resume."""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import socket

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO
from detlib.engine import checkpoint_io as ckpt
from detlib.engine import run_folder
from detlib.engine.schedules import build_lr_scheduler, lr_factor, set_position
from detlib.weights import WeightsFileError, load_model_weights
from helpers import fake_checkpoint


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- damaged checkpoints (C07)

def test_verify_checkpoint_names_each_kind_of_damage(tmp_path):
    good = fake_checkpoint(tmp_path / "good", 10)
    ckpt.verify_checkpoint(str(good))  # whole: no error

    half = fake_checkpoint(tmp_path / "half", 10)
    data = (half / "model.safetensors").read_bytes()
    (half / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match=r"half/model.safetensors is (truncated|not a whole)"):
        ckpt.verify_checkpoint(str(half))

    empty_state = fake_checkpoint(tmp_path / "empty_state", 10)
    (empty_state / "trainer_state.json").write_text("")
    with pytest.raises(ckpt.CheckpointError, match="trainer_state.json is damaged"):
        ckpt.verify_checkpoint(str(empty_state))

    bad_opt = fake_checkpoint(tmp_path / "bad_opt", 10)
    blob = (bad_opt / "optimizer.bin").read_bytes()
    (bad_opt / "optimizer.bin").write_bytes(blob[:-40])
    with pytest.raises(ckpt.CheckpointError, match="optimizer.bin does not load"):
        ckpt.verify_checkpoint(str(bad_opt))

    no_weights = fake_checkpoint(tmp_path / "no_weights", 10)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointError, match="holds no model weights"):
        ckpt.verify_checkpoint(str(no_weights))


@pytest.mark.parametrize("damage", ["truncated_weights", "empty_state"])
def test_case_c07_latest_falls_back_past_a_damaged_newest_checkpoint(tmp_path, damage, caplog):
    root = tmp_path / "checkpoints"
    fake_checkpoint(root / "epoch_0001", 5)
    fake_checkpoint(root / "epoch_0002", 10)
    newest = fake_checkpoint(root / "step_00000012", 12)
    if damage == "truncated_weights":
        f = newest / "model.safetensors"
        f.write_bytes(f.read_bytes()[:40])
    else:
        (newest / "trainer_state.json").write_text("")
    # an older damaged checkpoint never blocks `latest` either
    (root / "epoch_0001" / "trainer_state.json").write_text("")
    assert ckpt.resolve_resume(str(tmp_path), "latest") == str(root / "epoch_0002")
    warned = [r.getMessage() for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()]
    assert len(warned) == 1 and "step_00000012" in warned[0]
    assert ("model.safetensors" in warned[0]) if damage == "truncated_weights" else ("trainer_state.json" in warned[0])
    with pytest.raises(ckpt.CheckpointError):  # named explicitly, a damaged checkpoint is an error
        ckpt.resolve_resume(str(tmp_path), str(newest))
    assert ckpt.list_checkpoints(str(tmp_path)) == [str(root / "epoch_0002")] + (
        [str(newest)] if damage == "truncated_weights" else [])


def test_truncated_or_foreign_weights_are_one_line_errors(tmp_path):
    from detlib.retinanet.model import RetinaNet

    model = RetinaNet(2, "resnet18", fpn_channels=16, freeze_backbone_bn=False)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(WeightsFileError, match="cut.safetensors is truncated"):
        load_model_weights(model, str(tmp_path / "cut.safetensors"))
    (tmp_path / "notes.pt").write_text("these are not weights")
    with pytest.raises(WeightsFileError, match="notes.pt is not a readable weights file"):
        load_model_weights(model, str(tmp_path / "notes.pt"))


def test_a_checkpoint_whose_weights_or_state_file_is_a_link_to_nothing_fails_verification(tmp_path):
    """A dangling symlink (a copy whose links point at a cleaned scratch disk) is no weights file: `latest` skips the
    checkpoint naming the link (the resume crashed in accelerate's load_state, looking for pytorch_model.bin)."""
    root = tmp_path / "checkpoints"
    fake_checkpoint(root / "epoch_0001", 5)
    for i, name in enumerate(("model.safetensors", "optimizer.bin")):
        newest = fake_checkpoint(root / f"step_0000001{i}", 10 + i)
        (newest / name).unlink()
        (newest / name).symlink_to(tmp_path / "gone" / name)
        with pytest.raises(ckpt.CheckpointError, match=rf"step_0000001{i}/{name} is a symlink whose target "
                                                       rf"{tmp_path / 'gone' / name} is missing"):
            ckpt.verify_checkpoint(str(newest))
    weights_dir = fake_checkpoint(root / "step_00000020", 20)  # a folder where the weights file should be
    (weights_dir / "model.safetensors").unlink()
    (weights_dir / "model.safetensors").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="step_00000020 holds no model weights"):
        ckpt.verify_checkpoint(str(weights_dir))
    assert ckpt.resolve_resume(str(tmp_path), "latest") == str(root / "epoch_0001")


def test_json_files_that_parse_but_hold_the_wrong_thing_are_one_line_errors(tmp_path):
    from detlib.weights import read_model_config

    deep = "[" * 100_000 + "]" * 100_000  # parses to Python's recursion limit: a RecursionError, not a ValueError
    root = tmp_path / "checkpoints"
    fake_checkpoint(root / "epoch_0001", 5)
    nested = fake_checkpoint(root / "epoch_0002", 10)
    (nested / "trainer_state.json").write_text(deep)
    with pytest.raises(ckpt.CheckpointError, match=r"epoch_0002/trainer_state.json is damaged \(RecursionError"):
        ckpt.verify_checkpoint(str(nested))
    assert ckpt.list_checkpoints(str(tmp_path)) == [str(root / "epoch_0001")]  # never raises for a damaged folder
    listed = fake_checkpoint(root / "epoch_0003", 15)
    (listed / "model_config.json").write_text("[]")
    with pytest.raises(ckpt.CheckpointError, match=r"epoch_0003/model_config.json is damaged \(\[\], not a JSON object"):
        ckpt.verify_checkpoint(str(listed))
    assert ckpt.resolve_resume(str(tmp_path), "latest") == str(root / "epoch_0001")
    # the weights folders the scripts read (predict, --evaluate_only): a model_config.json of another JSON type
    for text in ("[]", '"resnet18"', "5", "null", deep):
        (listed / "model_config.json").write_text(text)
        with pytest.raises(WeightsFileError, match=r"epoch_0003/model_config.json is damaged"):
            read_model_config(str(listed))


# ---- a save that fails (disk full)

def test_failed_save_removes_its_folder_keeps_the_previous_and_says_no_space(tmp_path, monkeypatch):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    state = ckpt.TrainState(epoch=1, global_step=4)
    first = ckpt.save_checkpoint(acc, str(tmp_path), state, total_limit=1)
    ckpt.verify_checkpoint(first)

    def full_disk(folder, *a, **k):
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 100)  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(acc, "save_state", full_disk)
    state.epoch, state.global_step = 2, 8
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save_checkpoint(acc, str(tmp_path), state, total_limit=1)
    msg = str(e.value)
    assert "no space left on device" in msg and "MiB free" in msg and "epoch_0001 is kept" in msg and "\n" not in msg
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["epoch_0001"]  # no partial epoch_0002(.tmp); the older one kept
    ckpt.verify_checkpoint(first)


# ---- the output folder's lock

def test_lock_refuses_a_live_run_and_replaces_a_stale_one(tmp_path):
    out = str(tmp_path)
    error, note = run_folder.acquire_lock(out)
    assert error is None and note is None
    error, _ = run_folder.acquire_lock(out)  # this (live) process holds it
    assert error and f"pid {os.getpid()}" in error and "another run" in error
    run_folder.release_lock(out)
    assert not os.path.exists(tmp_path / run_folder.LOCK_FILE)

    dead = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / run_folder.LOCK_FILE).write_text(json.dumps({"pid": dead, "host": socket.gethostname()}))
    error, note = run_folder.acquire_lock(out)
    assert error is None and f"stale lock of process {dead}" in note
    run_folder.release_lock(out)

    (tmp_path / run_folder.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "node-17"}))
    error, _ = run_folder.acquire_lock(out)
    assert "host node-17" in error and "delete" in error



@pytest.mark.parametrize("content", ["", "{not json", "[]", "5", "null"])
def test_a_lock_file_that_names_no_run_is_one_line_that_says_what_to_delete(tmp_path, content):
    """An empty or damaged run.lock (a run killed as it took the lock, a hand-edited file): one refusal that names the
    file to delete, never an AttributeError traceback (a JSON list or number) nor 'pid None on None'."""
    out = str(tmp_path)
    (tmp_path / run_folder.LOCK_FILE).write_text(content)
    error, note = run_folder.acquire_lock(out)
    assert error == (f"{tmp_path / run_folder.LOCK_FILE} does not say which run holds {out} (empty or damaged); if no "
                     "run is writing there, delete it") and note is None
    run_folder.release_lock(out)  # not this process's lock: kept
    assert (tmp_path / run_folder.LOCK_FILE).read_text() == content


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_an_output_folder_on_a_full_disk_is_one_line_at_start(tmp_path, monkeypatch):
    """A full disk still creates an empty file: the folder check writes a byte and the lock's write failing is an error
    too (it was an OSError traceback from acquire_lock, leaving an empty run.lock that refused the next run).
    /dev/full stands in for the full disk: every write to it fails with ENOSPC."""
    out = tmp_path / "run"
    monkeypatch.setattr(run_folder.tempfile, "TemporaryFile", lambda dir: open("/dev/full", "wb"))
    error, _, locked = run_folder.prepare_output_dir(str(out), False, None, False)
    assert error == f"cannot write to --output_dir {out}: No space left on device" and not locked
    monkeypatch.undo()
    real_fdopen = os.fdopen
    monkeypatch.setattr(run_folder.os, "fdopen", lambda fd, mode: (os.close(fd), real_fdopen(os.open("/dev/full",
                                                                                                     os.O_WRONLY), mode))[1])
    error, note = run_folder.acquire_lock(str(out))  # the disk filled between the folder check and the lock
    assert error == f"could not write the lock {out / run_folder.LOCK_FILE}: No space left on device" and note is None
    assert sorted(os.listdir(out)) == []  # no empty lock left to refuse the next run

# ---- flag values: argparse errors at start, never a traceback or a lost epoch later

@pytest.mark.parametrize("script", ["train_retinanet", "train_catsdogs"])
@pytest.mark.parametrize("flag,value", [("--epochs", "0"), ("--eval_interval", "0"), ("--checkpoint_interval", "0"),
                                        ("--lr", "-1"), ("--gradient_accumulation_steps", "0"), ("--log_interval", "0"),
                                        ("--per_device_batch_size", "0"), ("--checkpoint_steps", "-2"),
                                        ("--max_grad_norm", "nan"), ("--image_size", "7"), ("--num_workers", "-1")])
def test_nonsense_flag_values_are_argparse_errors(script, flag, value, capsys):
    module = load_script(script)
    with pytest.raises(SystemExit) as e:
        module.parse_args([flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "must be" in err and "Traceback" not in err


def test_retinanet_max_size_below_image_size_is_refused(capsys):
    with pytest.raises(SystemExit):
        load_script("train_retinanet").parse_args(["--image_size", "800", "--max_size", "600"])
    assert "--max_size 600 is smaller than --image_size 800" in capsys.readouterr().err


# ---- schedules after a resume

def test_cosine_anchor_continues_from_the_current_lr_without_a_jump():
    total_old, at = 100, 60
    f_at = lr_factor(at, "cosine", total_old, warmup_steps=10)
    # the run is resumed at step 60 with twice as many epochs: from f_at down to 0 at step 200
    anchored = [lr_factor(s, "cosine", 200, warmup_steps=10, anchor=(at, f_at)) for s in range(at, 201)]
    assert anchored[0] == pytest.approx(f_at)
    assert all(a >= b for a, b in zip(anchored, anchored[1:])) and anchored[-1] == pytest.approx(0.0, abs=1e-12)
    assert anchored[70] == pytest.approx(f_at * 0.5 * (1 + math.cos(math.pi * 70 / 140)))
    # without the anchor the new schedule would jump up at the resume step
    assert lr_factor(at, "cosine", 200, warmup_steps=10) > 1.5 * f_at


def test_set_position_moves_a_lambda_schedule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_lr_scheduler(opt, "cosine", 40, warmup_steps=0)
    set_position(sched, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 10 / 40)))
    opt.step()
    sched.step()
    assert sched.last_epoch == 11
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 11 / 40)))


# ---- the run machinery's parts (detlib.engine.run.StepWindow, detlib.engine.run_folder, detlib.engine.checkpoint_io)

def _guarded_bn_model():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _script_step(acc, window, model, opt, loss) -> bool:
    """The optimizer step as scripts/train_*.py write it, with Run.end_step's buffer restore."""
    grad_norm = acc.clip_grad_norm_(model.parameters(), math.inf)
    finite = window.all_finite(loss, grad_norm)
    if finite or acc.scaler is not None:
        opt.step()
    opt.zero_grad(set_to_none=True)
    if not finite:
        window.restore_buffers()
    return not finite


def test_step_guard_skips_a_nonfinite_step_keeps_weights_and_bn_stats_and_counts_the_streak(caplog):
    from detlib.engine.run import StepWindow

    acc, model, opt = _guarded_bn_model()
    guard = StepWindow(acc, max_nonfinite_steps=2)
    x = torch.randn(4, 3)

    guard.snapshot_buffers(model)
    loss = model(x).pow(2).mean()
    loss.backward()
    guard.add_losses({"loss": loss}, 4)
    before = model[0].weight.detach().clone()
    skipped, sums = _script_step(acc, guard, model, opt, loss), guard.sums
    assert not skipped and not torch.equal(model[0].weight, before)
    assert sums[:2] == (0.0, 0.0) and sums[2] == pytest.approx(loss.item())
    assert guard.record(1, 0.1) is False and guard.streak == 0
    assert guard.last_grad_norm == pytest.approx(sums[3]) and sums[3] > 0

    weights, running_mean = model[0].weight.detach().clone(), model[1].running_mean.clone()
    for step in (2, 3):
        guard.snapshot_buffers(model)
        loss = model(x).sum() * float("nan")  # the forward moves the running mean, the loss is NaN
        loss.backward()
        guard.add_losses({"loss": loss}, 4)
        skipped, sums = _script_step(acc, guard, model, opt, loss), guard.sums
        assert skipped and sums[0] == 1.0
        assert torch.equal(model[0].weight, weights) and torch.equal(model[1].running_mean, running_mean)
        diverged = guard.record(step, 0.1)
        assert guard.streak == step - 1 and diverged == (step == 3) and math.isnan(guard.last_grad_norm)
    warned = [r.getMessage() for r in caplog.records if "non-finite loss" in r.getMessage()]
    assert warned == ["step 2: non-finite loss (lr 0.1); the step is skipped on every process (1 in a row)",
                      "step 3: non-finite loss (lr 0.1); the step is skipped on every process (2 in a row)"]


def test_step_guard_window_line_is_the_mean_over_images_and_restarts():
    from accelerate import Accelerator

    from detlib.engine.run import StepWindow

    acc = Accelerator(cpu=True)
    guard = StepWindow(acc, max_nonfinite_steps=3)
    assert guard.window_line({"epoch": 0, "step": 0}, 0.1, 0, [{"lr": 0.1}]) is None  # no step yet
    guard.add_losses({"loss": torch.tensor(2.0), "cls_loss": torch.tensor(1.0)}, 3)
    guard.add_losses({"loss": torch.tensor(6.0), "cls_loss": torch.tensor(5.0)}, 1)
    guard.sums = (0.0, 0.0, 6.0, 0.5)
    guard.record(1, 0.1)
    line, images = guard.window_line({"epoch": 0, "step": 1}, 0.1, 0, [{"lr": 0.1}, {"lr": 0.01}])
    assert images == 4
    assert list(line)[:4] == ["epoch", "step", "loss", "cls_loss"]
    assert line["loss"] == pytest.approx((2 * 3 + 6) / 4) and line["cls_loss"] == pytest.approx((1 * 3 + 5) / 4)
    assert line["grad_norm"] == 0.5 and line["lr_1"] == 0.01 and line["skipped_steps"] == 0
    guard.reset_window()
    assert guard.window_line({"epoch": 0, "step": 1}, 0.1, 0, [{"lr": 0.1}]) is None


def test_explosion_is_reported_once_per_order_of_magnitude(caplog):
    from accelerate import Accelerator

    from detlib.engine.run import StepWindow

    guard = StepWindow(Accelerator(cpu=True), max_nonfinite_steps=3)
    for step, loss in enumerate([1.0, 1.0, 1.0, 150.0, 300.0, 2000.0], 1):
        guard.sums = (0.0, 0.0, loss, 1.0)
        guard.record(step, 0.1)
    warned = [r.getMessage() for r in caplog.records if "lowest running level" in r.getMessage()]
    # 150 > 100 x the level 1.0: reported; 300 is under 10 x 150: not; 2000 is over 10 x 150: reported
    assert len(warned) == 2 and warned[0].startswith("step 4: loss 150 is over 100x its lowest running level 1 ")
    assert warned[1].startswith("step 6: loss 2000 ")


def test_run_length_counts_the_partial_accumulation_window_as_a_step():
    from detlib.engine.run import run_length

    # 10 batches per process, 3 per step: steps of 3, 3, 3 and 1 batches
    assert run_length(10, num_processes=2, per_device_batch_size=4, accumulation_steps=3, epochs=5,
                      max_steps=None) == (4, 24, 20)
    assert run_length(10, 2, 4, 3, epochs=5, max_steps=7) == (4, 24, 7)


def test_convert_position_keeps_the_samples_seen_on_another_process_count():
    from detlib.engine.checkpoint_io import convert_position

    # 2 processes x 8 samples per step, 10 steps per epoch; now 1 process: 20 steps per epoch of 8 samples
    saved = ckpt.TrainState(epoch=1, step_in_epoch=4, global_step=14, num_processes=2, steps_per_epoch=10,
                            samples_per_step=16)
    state = ckpt.TrainState(**saved.state_dict())
    assert convert_position(state, saved, num_processes=1, samples_per_step=8, steps_per_epoch=20)
    assert (state.epoch, state.step_in_epoch, state.global_step) == (1, 8, 28)
    same = ckpt.TrainState(**saved.state_dict())
    assert not convert_position(same, saved, num_processes=2, samples_per_step=16, steps_per_epoch=10)
    assert (same.step_in_epoch, same.global_step) == (4, 14)


def test_tracker_offset_continues_after_the_last_logged_step(tmp_path):
    from detlib.engine.tracking import set_tracker_offset

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4, 5, 6)) + "not json\n")
    state = ckpt.TrainState(global_step=3)  # resumed from the step-3 checkpoint; steps 4..6 were logged
    set_tracker_offset(state, str(path), resumed=True)
    assert state.tracker_offset == 3  # step 4 is logged to the trackers at 7
    fresh = ckpt.TrainState(global_step=6)
    set_tracker_offset(fresh, str(path), resumed=True)
    assert fresh.tracker_offset == 0


def test_preemption_signals_set_a_flag_and_a_late_second_sigint_stops(monkeypatch):
    import signal

    signals = run_folder.PreemptionSignals()
    before = signal.getsignal(signal.SIGUSR1)
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.received == signal.SIGUSR1
        clock = [100.0]
        monkeypatch.setattr(run_folder.time, "monotonic", lambda: clock[0])
        signals._on_signal(signal.SIGINT, None)
        clock[0] += 0.5  # the same Ctrl-C forwarded by the launcher: still only the flag
        signals._on_signal(signal.SIGINT, None)
        assert signals.received == signal.SIGUSR1  # the first signal is the one named
        clock[0] += run_folder.SECOND_SIGINT_AFTER_S
        with pytest.raises(KeyboardInterrupt):
            signals._on_signal(signal.SIGINT, None)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_disk_check_refuses_less_than_one_checkpoint_and_warns_below_the_kept_ones(tmp_path, monkeypatch, caplog):
    from collections import namedtuple

    model = torch.nn.Linear(256, 256)  # 65,792 float32 = 263,168 bytes
    opt = torch.optim.AdamW(model.parameters())
    weights, per_ckpt = run_folder.checkpoint_bytes(model, opt)
    assert (weights, per_ckpt) == (263168, 3 * 263168)  # Adam: exp_avg and exp_avg_sq per weight
    assert run_folder.checkpoint_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1))[1] == 2 * 263168
    usage = namedtuple("usage", "total used free")
    caplog.set_level("INFO", logger="detlib.engine.run_folder")
    for free, expect in [(per_ckpt + 2 * weights - 1, "error"), (per_ckpt * 3 + 2 * weights - 1, "warning"),
                         (per_ckpt * 3 + 2 * weights, "info")]:
        monkeypatch.setattr(run_folder.shutil, "disk_usage", lambda _, f=free: usage(0, 0, f))
        caplog.clear()
        error = run_folder.check_disk_space(str(tmp_path), model, opt, num_checkpoints=2)
        if expect == "error":
            assert error.startswith(f"not enough disk space in {tmp_path}: 1 MiB free, one checkpoint needs ~1 MiB")
            assert not caplog.records
        else:
            (record,) = [r for r in caplog.records if "start-up checks" in r.getMessage()]
            assert error is None and record.levelname == expect.upper()
            assert "for 2 checkpoints of ~1 MiB + best/ + last/" in record.getMessage()


def test_best_is_kept_only_when_it_beats_the_best_on_disk(tmp_path):
    from accelerate import Accelerator

    from detlib.engine.checkpoint_io import Checkpointer, read_best_record, summary_lines

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 2))

    def fail(message, code):
        raise AssertionError(message)

    saver = Checkpointer(acc, str(tmp_path), "AP", total_limit=2, fail=fail)
    state = ckpt.TrainState(global_step=10)
    assert saver.keep_best(model, 0.5, state, epoch=1) and state.best_metric == 0.5
    assert read_best_record(str(tmp_path), "AP") == {"metric": "AP", "value": 0.5, "epoch": 1, "step": 10,
                                                     "weights": "trained"}
    assert read_best_record(str(tmp_path), "accuracy") is None  # another metric's best/ does not count
    older = ckpt.TrainState(global_step=4)  # a resume from an older checkpoint: best_metric -1
    assert not saver.keep_best(model, 0.4, older, epoch=0) and older.best_metric == 0.4
    assert saver.best_record()["value"] == 0.5  # best/ kept
    assert not saver.keep_best(model, float("nan"), state, epoch=2) and state.best_metric == 0.5
    (tmp_path / "predictions_val.csv").write_text("path,label\n")  # a classifier's run: no plots/, samples/, last/
    out = str(tmp_path)
    lines = summary_lines(out, f"{out}/metrics.jsonl", "AP", 90.0, 10, 1, 0.5, saver.best_record(), 0.45, 300)
    # only what exists is named; the verdict is the last line
    assert lines == [f"weights: {out}/best/ (best)", f"metrics: {out}/metrics.jsonl; evaluation: {out}/predictions_val.csv",
                     "mean throughput 3.3 images/s (all processes)",
                     "run finished in 1.5 min: 10 steps, 1 skipped; best AP 0.5000 (epoch 1, step 10), final AP 0.4500"]
    lines = summary_lines(out, f"{out}/metrics.jsonl", "AP", 90.0, 10, 1, 0.5, None, 0.45, 0, {"AP50": 0.931})
    assert lines[-1] == "run finished in 1.5 min: 10 steps, 1 skipped; best AP 0.5000, final AP 0.4500, AP50 0.9310"


def test_resume_onto_other_class_names_or_order_is_refused_in_one_line(tmp_path):
    from detlib.engine.checkpoint_io import ResumeError, check_same_classes

    (tmp_path / "model_config.json").write_text(json.dumps({"num_classes": 2, "classes": ["cat", "dog"]}))
    check_same_classes(str(tmp_path), {"num_classes": 2, "classes": ["cat", "dog"]})  # same list: fine
    check_same_classes(str(tmp_path), None)  # nothing to compare with
    for other in (["dog", "cat"], ["cat", "fox"], ["cat", "dog", "fox"]):
        with pytest.raises(ResumeError) as e:
            check_same_classes(str(tmp_path), {"num_classes": len(other), "classes": other})
        msg = str(e.value)
        assert "classes differ" in msg and "--init_from" in msg and "\n" not in msg
    with pytest.raises(ResumeError, match="first difference at label 1: 'dog' vs 'fox'"):
        check_same_classes(str(tmp_path), {"classes": ["cat", "fox"]})
    (tmp_path / "model_config.json").write_text(json.dumps({"category_ids": [1, 3], "category_names": ["a", "b"]}))
    with pytest.raises(ResumeError, match="category_ids"):
        check_same_classes(str(tmp_path), {"category_ids": [1, 2], "category_names": ["a", "b"]})
    for damaged in ("[1, 2]", "{not json"):  # a list, or no JSON: one line naming the file, not a traceback
        (tmp_path / "model_config.json").write_text(damaged)
        with pytest.raises(ResumeError, match=r"^cannot resume from .*model_config.json is damaged"):
            check_same_classes(str(tmp_path), {"category_ids": [1, 2]})


# ---- a quiet console

def test_console_has_our_info_lines_and_only_the_warnings_of_other_libraries(tmp_path, capsys):
    """Other libraries' INFO lines (onnxscript's 80 per export, faster-coco-eval's, accelerate's) are left out of the
    console and train.log unless --verbose; ours and every library's warnings stay."""
    import logging

    from detlib.engine.tracking import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for verbose in (False, True):
            out = tmp_path / f"verbose_{verbose}"
            setup_logging(str(out), is_main=True, verbose=verbose)
            logging.getLogger("detlib.engine.run").info("ours")
            logging.getLogger("train_retinanet").info("the script's")
            logging.getLogger("onnxscript.optimizer").info("initializer_deduplication: Replaced initializer 'x'")
            logging.getLogger("faster_coco_eval.core").info("theirs")
            logging.getLogger("accelerate.checkpointing").warning("their warning")
            for text in (capsys.readouterr().out, (out / "train.log").read_text()):
                assert "ours" in text and "the script's" in text and "their warning" in text
                assert ("Replaced initializer" in text) == verbose and ("theirs" in text) == verbose
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_every_script_logs_under_a_name_the_console_shows():
    """A script's logger outside runtime.OWN_LOGGERS would have its INFO lines hidden like another library's."""
    import re

    from detlib.engine.tracking import OWN_LOGGERS

    names = {m for f in (REPO / "scripts").glob("*.py") for m in re.findall(r'getLogger\("([\w.]+)"\)', f.read_text())}
    assert names and all(n.split(".")[0] in OWN_LOGGERS for n in names), names


def test_offline_wandb_prints_nothing_of_its_own_unless_verbose(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from detlib.engine.tracking import resolve_trackers

    for verbose in (False, True):
        env = {"HOME": str(tmp_path), "WANDB_BASE_URL": "http://127.0.0.1:9"}  # no key, no ~/.netrc
        monkeypatch.setattr(os, "environ", env)
        assert resolve_trackers("wandb", verbose=verbose) == ["wandb"]
        assert env["WANDB_MODE"] == "offline" and env.get("WANDB_SILENT") == (None if verbose else "true")
    env = {"HOME": str(tmp_path), "WANDB_SILENT": "false", "WANDB_MODE": "offline"}
    monkeypatch.setattr(os, "environ", env)
    resolve_trackers("all")
    assert env["WANDB_SILENT"] == "false"  # the user's own setting wins
