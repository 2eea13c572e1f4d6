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
from detlib import checkpoint as ckpt
from detlib import rundir
from detlib.schedules import build_lr_scheduler, lr_factor, set_position
from test_checkpoint import fake_checkpoint


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
    from detlib.model import RetinaNet

    model = RetinaNet(2, "resnet18", fpn_channels=16, freeze_backbone_bn=False)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ckpt.CheckpointError, match="cut.safetensors is truncated"):
        ckpt.load_model_weights(model, str(tmp_path / "cut.safetensors"))
    (tmp_path / "notes.pt").write_text("these are not weights")
    with pytest.raises(ckpt.CheckpointError, match="notes.pt is not a readable weights file"):
        ckpt.load_model_weights(model, str(tmp_path / "notes.pt"))


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
    error, note = rundir.acquire_lock(out)
    assert error is None and note is None
    error, _ = rundir.acquire_lock(out)  # this (live) process holds it
    assert error and f"pid {os.getpid()}" in error and "another run" in error
    rundir.release_lock(out)
    assert not os.path.exists(tmp_path / rundir.LOCK_FILE)

    dead = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps({"pid": dead, "host": socket.gethostname()}))
    error, note = rundir.acquire_lock(out)
    assert error is None and f"stale lock of process {dead}" in note
    rundir.release_lock(out)

    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "node-17"}))
    error, _ = rundir.acquire_lock(out)
    assert "host node-17" in error and "delete" in error


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
