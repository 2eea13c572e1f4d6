"""The run machinery's parts in one process: checkpoint verification and fallback (C07), a failed save (disk
full), the output-folder lock and its checks, flag values, the step guard, the train line, the preemption flag,
best/, the flag comparison of a resume, the console."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import math
import os
import socket
import time

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO
from detlib.engine import checkpoints as ckpt
from detlib.engine import bookkeeping, exits, model_folders, signals
from detlib.engine import run_folder
from detlib.engine.exits import RunStop
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
    assert ckpt.find_checkpoint(str(tmp_path), "latest") == str(root / "epoch_0002")
    warned = [r.getMessage() for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()]
    assert len(warned) == 1 and "step_00000012" in warned[0]
    assert ("model.safetensors" in warned[0]) if damage == "truncated_weights" else ("trainer_state.json" in warned[0])
    with pytest.raises(ckpt.CheckpointError):  # named explicitly, a damaged checkpoint is an error
        ckpt.find_checkpoint(str(tmp_path), str(newest))
    assert ckpt.last_good_checkpoint(str(tmp_path)) == str(root / "epoch_0002")  # the one every line names
    assert ckpt.checkpoint_folders(str(tmp_path))[-2:] == [str(root / "epoch_0002"), str(newest)]  # damaged ones too


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
    assert ckpt.find_checkpoint(str(tmp_path), "latest") == str(root / "epoch_0001")


def test_json_files_that_parse_but_hold_the_wrong_thing_are_one_line_errors(tmp_path):
    from detlib.weights import read_model_config

    deep = "[" * 100_000 + "]" * 100_000  # parses to Python's recursion limit: a RecursionError, not a ValueError
    root = tmp_path / "checkpoints"
    fake_checkpoint(root / "epoch_0001", 5)
    nested = fake_checkpoint(root / "epoch_0002", 10)
    (nested / "trainer_state.json").write_text(deep)
    with pytest.raises(ckpt.CheckpointError, match=r"epoch_0002/trainer_state.json is damaged \(RecursionError"):
        ckpt.verify_checkpoint(str(nested))
    assert ckpt.last_good_checkpoint(str(tmp_path)) == str(root / "epoch_0001")  # never raises for a damaged folder
    listed = fake_checkpoint(root / "epoch_0003", 15)
    (listed / "model_config.json").write_text("[]")
    with pytest.raises(ckpt.CheckpointError, match=r"epoch_0003/model_config.json is damaged \(\[\], not a JSON object"):
        ckpt.verify_checkpoint(str(listed))
    assert ckpt.find_checkpoint(str(tmp_path), "latest") == str(root / "epoch_0001")
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
    first = ckpt.save_checkpoint(acc, str(tmp_path), state, [model], limit=1)
    ckpt.verify_checkpoint(first)

    def full_disk(folder, *a, **k):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 100)  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(acc, "save_state", full_disk)
    state.epoch, state.global_step = 2, 8
    with pytest.raises(RunStop) as e:
        ckpt.save_checkpoint(acc, str(tmp_path), state, [model], limit=1)
    msg = str(e.value)
    assert msg.startswith(f"could not write checkpoint {tmp_path}/checkpoints/epoch_0002.tmp: OSError: [Errno 28] No "
                          "space left on device (") and " MiB free in " in msg and "epoch_0001 is kept" in msg
    assert "\n" not in msg and e.value.code == 1
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch_0001"]  # no partial epoch_0002(.tmp); the older kept
    ckpt.verify_checkpoint(first)
    monkeypatch.undo()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(RunStop, match="non-finite weights at step 8: not writing") as e:
        ckpt.save_checkpoint(acc, str(tmp_path), state, [model], limit=1)
    assert e.value.code == exits.EXIT_DIVERGED and sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch_0001"]


def test_write_failure_names_the_error_the_free_space_and_a_full_disk():
    from detlib.files import write_failure

    line = write_failure(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0"),
                         "/tmp/x/y.tmp", needed_bytes=2**60)
    assert line.startswith("no space left on device: RuntimeError: [enforce fail at inline_container.cc:664] . "
                           "unexpected pos 64 vs 0 (") and line.endswith(" MiB needed)") and " MiB free in /tmp" in line
    line = write_failure(PermissionError(13, "Permission denied"), "/tmp/x")
    assert line.startswith("PermissionError: [Errno 13] Permission denied (") and "no space" not in line


# ---- the output folder's lock

def test_lock_refuses_a_second_run_naming_the_holder_and_is_free_once_released(tmp_path):
    out = str(tmp_path)
    assert run_folder.acquire_lock(out) is None
    # a second open of the file is a second holder to the kernel, even in this process
    assert run_folder.acquire_lock(out) == (f"another run (pid {os.getpid()} on {socket.gethostname()}) is writing to "
                                            f"{out}; use another --output_dir")
    run_folder.release_lock(out)
    assert run_folder.acquire_lock(out) is None
    run_folder.release_lock(out)


@pytest.mark.parametrize("content", ["", "{not json", "[]", "5", "null", '{"pid": 1, "host": "node-17"}', "this process"])
def test_a_lock_file_no_process_holds_is_no_lock_whatever_it_says(tmp_path, content):
    """What a dead run left in run.lock (a live pid reused since, another host, an empty or cut file) holds nothing."""
    if content == "this process":  # a live pid on this host (the id stays the same for every pytest worker)
        content = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
    (tmp_path / run_folder.LOCK_FILE).write_text(content)
    assert run_folder.acquire_lock(str(tmp_path)) is None
    assert json.loads((tmp_path / run_folder.LOCK_FILE).read_text())["pid"] == os.getpid()
    run_folder.release_lock(str(tmp_path))


def test_a_killed_holder_frees_the_folder_at_once(tmp_path):
    """kill -9 leaves no chance to clean up: the kernel ends the lock with the process."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from detlib.engine import run_folder; "
                               "print(run_folder.acquire_lock(sys.argv[1]), flush=True); time.sleep(120)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "None\n"
        assert f"another run (pid {holder.pid} on " in run_folder.acquire_lock(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert run_folder.acquire_lock(str(tmp_path)) is None
    run_folder.release_lock(str(tmp_path))


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_lets_go(tmp_path):
    """DataLoader workers are forked with the lock's file open; a worker that outlives its run must not hold it."""
    import signal

    assert run_folder.acquire_lock(str(tmp_path)) is None
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # the worker, alive throughout the check; never returns to pytest's code
        try:
            os.write(started, b"1")
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"
        run_folder.release_lock(str(tmp_path))
        assert run_folder.acquire_lock(str(tmp_path)) is None
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    run_folder.release_lock(str(tmp_path))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_an_output_folder_on_a_full_disk_is_one_line_at_start(tmp_path, monkeypatch):
    """A full disk still creates an empty file: the folder check writes a byte. /dev/full stands in for the full disk:
    every write to it fails with ENOSPC."""
    out = tmp_path / "run"
    monkeypatch.setattr(run_folder.tempfile, "TemporaryFile", lambda dir: open("/dev/full", "wb"))
    refused, _ = run_folder.prepare_output_dir(str(out), False, None, False)
    assert refused == (f"cannot write to --output_dir {out}: No space left on device", False)

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


# ---- the step guard and the train line (detlib.engine.bookkeeping)

def _guarded_bn_model():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _script_step(acc, guard, model, opt, loss, step) -> bool:
    """The optimizer step as scripts/train_*.py write it. Returns whether it was skipped."""
    grad_norm = acc.clip_grad_norm_(model.parameters(), math.inf)
    finite = guard.check(loss, grad_norm, step, 0.1)
    if finite or acc.scaler is not None:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return not finite


def test_step_guard_skips_a_nonfinite_step_keeps_weights_and_bn_stats_and_counts_the_streak(caplog):
    from detlib.engine.bookkeeping import StepGuard

    acc, model, opt = _guarded_bn_model()
    guard = StepGuard(acc, max_nonfinite_steps=2)
    x = torch.randn(4, 3)

    guard.snapshot(model)
    loss = model(x).pow(2).mean()
    loss.backward()
    before = model[0].weight.detach().clone()
    assert not _script_step(acc, guard, model, opt, loss, 1) and not torch.equal(model[0].weight, before)
    assert guard.loss == pytest.approx(loss.item()) and guard.grad_norm > 0 and guard.streak == 0 and not guard.diverged

    weights, running_mean = model[0].weight.detach().clone(), model[1].running_mean.clone()
    for step in (2, 3):
        guard.snapshot(model)
        loss = model(x).sum() * float("nan")  # the forward moves the running mean, the loss is NaN
        loss.backward()
        assert _script_step(acc, guard, model, opt, loss, step)
        assert torch.equal(model[0].weight, weights) and torch.equal(model[1].running_mean, running_mean)
        assert guard.streak == step - 1 and guard.diverged == (step == 3) and math.isnan(guard.grad_norm)
        assert math.isnan(guard.loss)
    warned = [r.getMessage() for r in caplog.records if "non-finite loss" in r.getMessage()]
    assert warned == ["step 2: non-finite loss (lr 0.1); the step is skipped on every process (1 in a row)",
                      "step 3: non-finite loss (lr 0.1); the step is skipped on every process (2 in a row)"]
    guard.snapshot(model)
    loss = model(x).pow(2).mean()
    loss.backward()
    assert not _script_step(acc, guard, model, opt, loss, 4) and guard.streak == 0  # a finite step ends the streak


def test_train_window_line_is_the_mean_over_images_and_restarts():
    from accelerate import Accelerator

    from detlib.engine.bookkeeping import TrainWindow

    window = TrainWindow(Accelerator(cpu=True))
    assert list(window.timed([1, 2])) == [1, 2]
    window.add({"loss": torch.tensor(2.0), "cls_loss": torch.tensor(1.0)}, 3)
    window.add({"loss": torch.tensor(6.0), "cls_loss": torch.tensor(5.0)}, 1)
    line = window.line()
    assert list(line)[:2] == ["loss", "cls_loss"] and window.images_seen == 4
    assert line["loss"] == pytest.approx((2 * 3 + 6) / 4) and line["cls_loss"] == pytest.approx((1 * 3 + 5) / 4)
    assert 0 <= line["data_time_fraction"] <= 1 and line["images_per_s"] > 0
    window.add({"loss": torch.tensor(1.0), "cls_loss": torch.tensor(1.0)}, 2)
    assert window.line()["loss"] == pytest.approx(1.0) and window.images_seen == 6  # a new window


def test_train_line_shows_each_lr_once_on_the_console_and_every_group_in_metrics(tmp_path, caplog):
    from accelerate import Accelerator

    from detlib.engine.bookkeeping import TrainWindow
    from detlib.engine.trackers import MetricsLog

    acc = Accelerator(cpu=True)
    metrics, window, state = MetricsLog(acc, str(tmp_path)), TrainWindow(acc), ckpt.TrainState()
    with caplog.at_level(logging.INFO, logger="detlib"):
        for lrs in ([0.5, 0.5], [0.5, 0.25]):  # the groups equal (decay / no decay), then a group of its own
            window.add({"loss": torch.tensor(1.0)}, 2)
            window.log(metrics, state, lrs, grad_norm=1.0, steps_per_epoch=10)
    consoled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 1 step 0:")]
    assert [m.count("lr") for m in consoled] == [1, 2] and "lr_1 0.25" in consoled[1], consoled
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["lr"], line["lr_1"]) for line in lines] == [(0.5, 0.5), (0.5, 0.25)]


def test_train_state_counts_steps_and_the_epoch_mean():
    state = ckpt.TrainState()
    for stepped, loss in ((True, 2.0), (False, math.nan), (True, 4.0)):
        state.step_done(stepped, loss)
    assert (state.global_step, state.step_in_epoch, state.skipped_steps, state.epoch_steps) == (3, 3, 1, 2)
    assert state.end_epoch() == pytest.approx(3.0)  # the mean of the finite steps
    assert (state.epoch, state.step_in_epoch, state.epoch_loss_sum, state.epoch_steps) == (1, 0, 0.0, 0)


# ---- the preemption flag (detlib.engine.run_folder)

def test_stop_signals_set_a_flag_and_a_late_second_sigint_stops():
    """In a process of its own (a signal to itself reaches no pytest process): SIGUSR1 and a Ctrl-C (twice at once,
    from the terminal and forwarded by the launcher) only set the flag, the first signal is the one named; a SIGINT
    a second later raises KeyboardInterrupt; `release_signals` puts the handlers back."""
    import subprocess
    import sys
    import textwrap

    from conftest import launch_env

    code = textwrap.dedent("""
        import os, signal, time
        from accelerate import Accelerator
        from detlib.engine import bookkeeping, signals

        def preempted():
            try:
                bookkeeping.stop_if_preempted(acc)
            except bookkeeping.Preempted as e:
                return e.signal_name

        acc, before = Accelerator(cpu=True), signal.getsignal(signal.SIGUSR1)
        handlers = signals.catch_signals()
        print(preempted(), signals.signal_received())
        os.kill(os.getpid(), signal.SIGUSR1)
        print(preempted())
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C forwarded by the launcher: still only the flag
        print(preempted(), signals.signal_received())
        time.sleep(signals.SECOND_SIGINT_AFTER_S)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt as e:
            print("KeyboardInterrupt:", e)
        signals.release_signals(handlers, stopped=False)
        print(signal.getsignal(signal.SIGUSR1) is before)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=launch_env({"PYTHONPATH": str(REPO)}))
    assert run.stdout.splitlines() == ["None None", "SIGUSR1", "SIGUSR1 SIGUSR1",
                                       "KeyboardInterrupt: second SIGINT: stopping at once", "True"], run.stderr


def test_an_output_dir_that_cannot_be_made_names_what_is_in_the_way(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for where, what in ((tmp_path / "file" / "run", f"{tmp_path / 'file'} is a file, not a folder"),
                        (tmp_path / "dangling" / "run", f"{tmp_path / 'dangling'} is a link to {tmp_path / 'gone'}, "
                                                        "which does not exist"),
                        (tmp_path / "dangling", f"{tmp_path / 'dangling'} is a link to {tmp_path / 'gone'}")):
        refused, _ = run_folder.prepare_output_dir(str(where), False, None, False)
        assert refused[0].startswith(f"cannot make --output_dir {where}: {what}") and not refused[1]


# ---- best/, the summary, the flag comparison of a resume (detlib.engine.checkpoints)

def test_best_is_kept_only_when_it_beats_the_best_on_disk(tmp_path):
    from accelerate import Accelerator

    from detlib.engine.run_log import summary_lines

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 2))
    out = str(tmp_path)
    state = ckpt.TrainState(global_step=10)
    assert model_folders.improves_best(acc, out, "AP", 0.5, state) and state.best_metric == 0.5
    model_folders.save_weights(acc, model, out, "best", {"num_classes": 2},
                      {"metric": "AP", "value": 0.5, "epoch": 1, "step": 10, "weights": "trained"})
    assert model_folders.best_record(acc, out, "AP") == {"metric": "AP", "value": 0.5, "epoch": 1, "step": 10, "weights": "trained"}
    assert model_folders.best_record(acc, out, "accuracy") is None  # another metric's best/ does not count
    older = ckpt.TrainState(global_step=4)  # a resume from an older checkpoint: best_metric -1
    assert not model_folders.improves_best(acc, out, "AP", 0.4, older) and older.best_metric == 0.4
    assert not model_folders.improves_best(acc, out, "AP", float("nan"), state) and state.best_metric == 0.5
    (tmp_path / "predictions_val.csv").write_text("path,label\n")  # a classifier's run: no plots/, samples/, last/
    state.skipped_steps = 1
    lines = summary_lines(out, "AP", 90.0, state, model_folders.best_record(acc, out, "AP"), {"AP": 0.45, "AP50": 0.931}, 300,
                          {"best": "best", "last": "final"}, also=("AP50",))
    # only what exists is named; the verdict is the last line
    assert lines == [f"weights: {out}/best/ (best)", f"metrics: {out}/metrics.jsonl; evaluation: {out}/predictions_val.csv",
                     "mean throughput 3.3 images/s (all processes)",
                     "run finished in 1.5 min: 10 steps, 1 skipped; best AP 0.5000 (epoch 1, step 10), final AP 0.4500, "
                     "AP50 0.9310"]


def _checkpoint_with_config(folder, config: dict, model_config: dict):
    from helpers import fake_checkpoint

    fake_checkpoint(folder, 10)
    import yaml

    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "model_config.json").write_text(json.dumps(model_config))
    return folder


def test_a_resume_names_every_flag_that_differs_and_refuses_the_fixed_ones(tmp_path, caplog):
    run = {"lr": 0.001, "epochs": 6, "image_size": 128, "lr_steps": [8, 11], "output_dir": "a", "resume_from_checkpoint": None}
    classes = {"classes": ["cat", "dog"]}
    folder = str(_checkpoint_with_config(tmp_path / "epoch_0002", run, classes))
    same = {**run, "resume_from_checkpoint": "latest"}  # what to do with the folder is not compared
    assert ckpt._compare(folder, {**same, **classes}, ("lr",), "--init_from") is None and not caplog.records
    changed = {**same, "epochs": 10, "image_size": 160, "lr_steps": (8, 12)}
    assert ckpt._compare(folder, {**changed, **classes}, ("lr",), "--init_from") is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (f"resuming {folder} with other flags than its run's: --epochs 6 -> 10, --image_size 128 -> 160, "
                    "--lr_steps [8, 11] -> [8, 12]")
    refusal = ckpt._compare(folder, {**changed, "lr": 0.01, **classes}, ("lr",), "--weights")
    assert refusal == (f"cannot resume from {folder}: it does not fit this run: --lr 0.001 -> 0.01 (fixed by the "
                       f"checkpoint's state); resume with its values, or start a new run from its weights with --weights "
                       f"{folder}")
    for other in (["dog", "cat"], ["cat", "fox"], ["cat", "dog", "fox"]):  # the classes are always fixed
        refusal = ckpt._compare(folder, {**same, "classes": other}, (), "--init_from")
        assert refusal.startswith(f"cannot resume from {folder}: it does not fit this run: classes (2 -> {len(other)}; "
                                  "first difference: ") and "\n" not in refusal
    assert "'dog' -> 'fox'" in ckpt._compare(folder, {**same, "classes": ["cat", "fox"]}, (), "--init_from")


# ---- a quiet console

def test_console_has_our_info_lines_and_only_the_warnings_of_other_libraries(tmp_path, capsys):
    """Other libraries' INFO lines (onnxscript's 80 per export, faster-coco-eval's, accelerate's) are left out of the
    console and train.log unless --verbose; ours and every library's warnings stay."""
    import logging

    from detlib.engine.logs import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for verbose in (False, True):
            out = tmp_path / f"verbose_{verbose}"
            setup_logging(str(out), is_main=True, verbose=verbose)
            logging.getLogger("detlib.engine.bookkeeping").info("ours")
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

    from detlib.engine.logs import OWN_LOGGERS

    names = {m for f in (REPO / "scripts").glob("*.py") for m in re.findall(r'getLogger\("([\w.]+)"\)', f.read_text())}
    assert names and all(n.split(".")[0] in OWN_LOGGERS for n in names), names


def test_offline_wandb_prints_nothing_of_its_own_unless_verbose(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from detlib.engine.trackers import resolve_trackers

    for verbose in (False, True):
        env = {"HOME": str(tmp_path), "WANDB_BASE_URL": "http://127.0.0.1:9"}  # no key, no ~/.netrc
        monkeypatch.setattr(os, "environ", env)
        assert resolve_trackers("wandb", verbose=verbose) == ["wandb"]
        assert env["WANDB_MODE"] == "offline" and env.get("WANDB_SILENT") == (None if verbose else "true")
    env = {"HOME": str(tmp_path), "WANDB_SILENT": "false", "WANDB_MODE": "offline"}
    monkeypatch.setattr(os, "environ", env)
    resolve_trackers("all")
    assert env["WANDB_SILENT"] == "false"  # the user's own setting wins


# ---- what a tester broke (docs: long_runs.md)

def test_resume_and_overwrite_together_are_refused_and_nothing_is_deleted(tmp_path):
    (tmp_path / "config.yaml").write_text("epochs: 1\n")
    refused, _ = run_folder.prepare_output_dir(str(tmp_path), False, "latest", True)
    assert refused == ("--resume_from_checkpoint continues the run in the folder, --overwrite_output_dir deletes it: "
                       "give one", False)
    assert (tmp_path / "config.yaml").read_text() == "epochs: 1\n" and not (tmp_path / run_folder.LOCK_FILE).exists()


def test_a_run_that_stops_before_its_first_step_keeps_the_earlier_run_status_beside(tmp_path):
    run_folder.write_run_status(str(tmp_path), 0, "", global_step=24, epoch=2)
    run_folder.write_run_status(str(tmp_path), 1, "cannot resume from ...", global_step=0, epoch=0)
    status = json.loads((tmp_path / "run_status.json").read_text())
    assert status["status"] == "failed" and status["previous"]["status"] == "finished"
    assert status["previous"]["global_step"] == 24
    run_folder.write_run_status(str(tmp_path), 1, "again", global_step=0, epoch=0)  # the run's record stays
    assert json.loads((tmp_path / "run_status.json").read_text())["previous"]["global_step"] == 24


def test_max_steps_past_the_epochs_is_said_and_the_schedule_spans_what_runs(caplog):
    from types import SimpleNamespace

    from detlib.engine.bookkeeping import run_length

    acc = SimpleNamespace(gather=lambda t: t, device="cpu", num_processes=1)
    loader = list(range(12))  # 12 batches
    assert run_length(acc, loader, 1, epochs=1, max_steps=50) == (12, 12)
    assert "--max_steps 50 is past --epochs 1 (12 steps): the run ends after its 1 epochs" in caplog.text
    assert run_length(acc, loader, 2, epochs=3, max_steps=10) == (6, 10) and run_length(acc, loader, 5, 3, 0) == (3, 9)


def test_nothing_left_names_the_limit_and_other_ranks_log_only_errors(caplog):
    import logging

    from detlib.engine.logs import set_log_levels
    from detlib.engine.run_log import log_plan

    log_plan(ckpt.TrainState(epoch=1, global_step=8), epochs=3, total_steps=8, steps_per_epoch=6, images_per_step=4,
             lr=0.1)
    assert "nothing left to train" in caplog.text and "pass a larger --max_steps" in caplog.text
    try:
        set_log_levels(is_main=False)
        assert logging.getLogger("detlib").level == logging.ERROR  # a warning every rank computes comes once
    finally:
        set_log_levels(is_main=True)
