"""Library pieces used instead of our own (timm's ImageNet statistics and weights reader, torchvision's image
extensions) give the values ours gave; the built-in data sets keep their cache folders; how a predict script stops
on a signal around Python's and multiprocessing's own handling (`detlib.inference.run_prediction`)."""

from __future__ import annotations

from detlib.engine import exits
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO, launch_env
from detlib import classification
from detlib.data import imagefolder
from detlib.data import builtin
from detlib.retinanet import model
from detlib.weights import load_state_dict_file

# ---- ImageNet statistics: timm's constants, in 0-1 units (classifier) and 0-255 units (RetinaNet)


def test_imagenet_statistics_keep_their_values_in_both_units():
    from detlib.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    assert IMAGENET_MEAN == pytest.approx((123.675, 116.28, 103.53), abs=1e-9)
    assert IMAGENET_STD == pytest.approx((58.395, 57.12, 57.375), abs=1e-9)
    # the float32 buffers RetinaNet normalises with (from resnet18's pretrained_cfg, 0-1 scale) are bit-identical to the
    # literals used before
    detector = model.RetinaNet(2, "resnet18", fpn_channels=16)
    assert torch.equal(detector.pixel_mean.flatten(), torch.tensor((123.675, 116.28, 103.53)))
    assert torch.equal(detector.pixel_std.flatten(), torch.tensor((58.395, 57.12, 57.375)))
    normalize = classification.classification_transform(32, train=False).transforms[-1]
    assert tuple(normalize.mean) == (0.485, 0.456, 0.406) and tuple(normalize.std) == (0.229, 0.224, 0.225)


def test_image_extensions_are_torchvisions_and_cover_ours():
    ours_before = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    assert set(ours_before) <= set(imagefolder.IMG_EXTENSIONS)
    assert all(e == e.lower() for e in imagefolder.IMG_EXTENSIONS)  # the scan lower-cases names before the check


# ---- weights files: timm's reader plus our repeated prefix stripping

STATE = {"a.weight": torch.arange(4.0).reshape(2, 2), "b.bias": torch.ones(3)}


@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.", "_orig_mod.module.", "module._orig_mod.",
                                    "module.module.", "module._orig_mod.module."])
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_wrapper_prefixes_are_stripped_however_deep(tmp_path, prefix, fmt):
    sd = {prefix + k: v for k, v in STATE.items()}
    path = tmp_path / f"w.{fmt}"
    save_file(sd, str(path)) if fmt == "safetensors" else torch.save(sd, path)
    loaded = load_state_dict_file(path)
    assert sorted(loaded) == ["a.weight", "b.bias"]
    assert all(torch.equal(loaded[k], STATE[k]) for k in STATE)


def test_containers_are_unwrapped_and_ema_weights_not_taken(tmp_path):
    torch.save({"state_dict": {f"module.{k}": v for k, v in STATE.items()}, "epoch": 3}, tmp_path / "sd.pth")
    torch.save({"model": STATE, "optimizer": {}}, tmp_path / "model.pth")
    # a timm training checkpoint: the raw weights, as before (timm's reader alone would take the EMA ones)
    torch.save({"state_dict": STATE, "state_dict_ema": {k: v * 0 for k, v in STATE.items()}}, tmp_path / "ema.pth")
    for name in ("sd.pth", "model.pth", "ema.pth"):
        loaded = load_state_dict_file(tmp_path / name)
        assert sorted(loaded) == ["a.weight", "b.bias"] and float(loaded["a.weight"].sum()) == 6.0, name


def test_missing_and_foreign_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"weights file not found: {tmp_path / 'nothing.pt'}"):
        load_state_dict_file(tmp_path / "nothing.pt")
    torch.save({"epoch": 3, "note": "no tensors"}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match="does not hold a state dict of tensors"):
        load_state_dict_file(tmp_path / "meta.pt")


# ---- the built-in data sets share one cache root; their folders are those of before


def test_built_in_data_sets_keep_their_cache_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("DETLIB_CACHE", str(tmp_path))
    assert builtin.cache_root() == str(tmp_path)
    dirs = builtin.make_synthetic_image_folder(num_train=1, num_val=1, image_size=16)
    assert dirs == {"train_dir": str(tmp_path / "synthetic_imagefolder_v2" / "train"),
                    "val_dir": str(tmp_path / "synthetic_imagefolder_v2" / "val")}
    assert json.loads((tmp_path / "synthetic_imagefolder_v2" / "generator.json").read_text()) == {
        "version": 2, "num_train": 1, "num_val": 1, "image_size": 16, "seed": 0}
    paths = builtin.make_synthetic_coco(num_train=1, num_val=1, image_size=64, min_object=12, max_object=30)
    assert paths["train_annotations"] == str(tmp_path / "synthetic_shapes_v2" / "annotations" / "instances_train.json")
    assert paths["train_images"] == str(tmp_path / "synthetic_shapes_v2" / "images")
    assert json.loads((tmp_path / "synthetic_shapes_v2" / "generator.json").read_text())["version"] == 2
    monkeypatch.delenv("DETLIB_CACHE")
    assert builtin.cache_root().endswith("/.cache/detlib")


def test_resource_sharer_closed_listener_traceback_is_dropped_and_others_are_not(monkeypatch, capsys):
    """A Ctrl-C to a predict script with workers: multiprocessing's fd-passing thread may fail on its closed
    listener after the `stopped:` line; that traceback is dropped, any other uncaught exception still prints."""
    import multiprocessing.resource_sharer as rs
    import sys

    from detlib.data.loaders import quiet_resource_sharer_errors

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc[0]))
    quiet_resource_sharer_errors()
    quiet_resource_sharer_errors()  # installed once

    class Conn:  # the second accept: the stop message, which ends the thread's loop
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def recv(self):
            return None

    class Closed:
        calls = 0

        def accept(self):
            Closed.calls += 1
            if Closed.calls == 1:
                raise ValueError("I/O operation on closed file.")
            return Conn()

    sharer = rs._ResourceSharer()
    sharer._listener = Closed()
    monkeypatch.setattr(rs.util, "is_exiting", lambda: False)  # not at exit: the thread reports the error
    import signal

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        sharer._serve()  # what the thread runs (it blocks every signal first): reports through sys.excepthook
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert seen == [] and Closed.calls == 2
    try:
        raise ValueError("ours")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    assert seen == [ValueError]


@pytest.mark.parametrize("dies", ["before reading the challenge", "after reading the challenge"])
def test_resource_sharer_traceback_of_a_receiver_that_died_mid_handshake_is_dropped(dies, monkeypatch):
    """The receiving process (the training or predict process a worker sends a batch to) dies in the handshake
    of multiprocessing's real fd-passing thread: BrokenPipeError before it read the challenge, EOFError after
    (that one printed a traceback after a predict script's `stopped:` line under load). Both are dropped."""
    import multiprocessing.resource_sharer as rs
    import socket
    import sys

    from detlib.data.loaders import quiet_resource_sharer_errors

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc[0]))
    quiet_resource_sharer_errors()
    sharer = rs._ResourceSharer()
    sharer._start()  # the listener and its `_serve` thread, as the first batch a worker sends starts them
    try:
        peer = socket.socket(socket.AF_UNIX)
        peer.connect(sharer._address)
        if dies == "after reading the challenge":
            assert peer.recv(1000)
        peer.close()
    finally:
        sharer.stop(timeout=10)  # the stop message ends the thread's loop; it has handled the dead peer by then
    assert seen == []
    try:
        raise EOFError("ours")
    except EOFError:
        sys.excepthook(*sys.exc_info())
    assert seen == [EOFError]


@pytest.fixture
def prediction_signals(monkeypatch):
    """`run_prediction` in this process: its signal handlers and hooks are put back after the test."""
    import signal
    import sys

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a Python process of its own (this checkout's detlib): a signal it sends itself can reach no pytest
    process."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env=launch_env({"PYTHONPATH": str(REPO)}))


STOPPED_BEFORE_THE_END = ("before the end; the per-image outputs written so far are kept, the merged ones were not "
                          "written: run the same command again")


@pytest.mark.parametrize("signame,code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGUSR1", 138)])
def test_a_signal_stops_a_prediction_at_its_next_poll_even_inside_an_except_exception_block(signame, code):
    """The signal lands while the predict script is inside an `except Exception` (as `exif_orientation`'s, which
    reads a damaged EXIF block as orientation 1): the prediction stops at its next poll between batches with its
    `stopped:` line and exit 128 + the signal's number; it does not run on to the end (seen: a Ctrl-C to
    predict_retinanet.py exited 0 after all 600 images)."""
    run = run_python(f"""
        import os, signal
        from detlib.inference import run_prediction, stop_if_signalled

        def main():
            for batch in range(3):
                stop_if_signalled()
                print("batch", batch, flush=True)
                try:
                    os.kill(os.getpid(), signal.{signame})
                    raise ValueError("a damaged EXIF block")
                except Exception:
                    pass
            print("reached the end", flush=True)

        run_prediction(main)
    """)
    assert run.returncode == code and run.stdout == "batch 0\n", (run.stdout, run.stderr)
    assert run.stderr == f"stopped: {signame} {STOPPED_BEFORE_THE_END}\n"


def test_a_second_signal_while_a_prediction_stops_is_the_same_stop():
    """A double Ctrl-C (or `timeout` forwarding the terminal's SIGINT a second time): a late one (a second after the
    first: it raises KeyboardInterrupt) in the cleanup the first one's stop runs, a SIGTERM from a `__del__` as the
    loader's iterator is dropped (its workers' shutdown) and one as the `stopped:` line is printed. One line, exit
    130, no traceback and no "Exception ignored"."""
    run = run_python("""
        import builtins, os, signal, time
        from detlib.inference import run_prediction, stop_if_signalled

        class Iterator:  # a DataLoader iterator: its __del__ runs as the stop's exception is dropped
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)

        def main():
            batches = Iterator()
            os.kill(os.getpid(), signal.SIGINT)
            try:
                stop_if_signalled()
            finally:  # the cleanup of the stop (a progress bar's close, a video writer's)
                time.sleep(1.2)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
            print("ran on", flush=True)

        real_print = print

        def print_and_signal(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            real_print(*args, **kwargs)

        builtins.print = print_and_signal
        run_prediction(main)
    """)
    assert run.returncode == 130 and run.stdout == "", (run.stdout, run.stderr)
    assert run.stderr == f"stopped: SIGINT {STOPPED_BEFORE_THE_END}\n"


@pytest.mark.parametrize("where", ["in_a_del", "after_the_outputs"])
def test_a_signal_after_the_last_poll_ends_the_prediction_with_its_code_and_says_the_outputs_are_complete(where):
    """A signal after the last poll: in a `__del__` (a DataLoader iterator's worker shutdown as the loop ends), where
    Python drops any exception (seen: exit 0 after an `Exception ignored in: ... __del__` traceback), or as the merged
    outputs are written (it said "the merged ones were not written" of complete outputs): the prediction runs on to
    its end, then exits 130 / 143 with a line saying its outputs are complete, and nothing else is printed. A
    prediction that ends with no signal leaves the signals to their default action and exits 0."""
    sig, code = ("SIGINT", 130) if where == "in_a_del" else ("SIGTERM", 143)
    run = run_python(f"""
        import os, signal, sys
        from detlib.inference import run_prediction, stop_if_signalled

        class Iterator:
            def __del__(self):
                os.kill(os.getpid(), signal.{sig})

        def main():
            stop_if_signalled()
            if sys.argv[-1] == "in_a_del":
                Iterator()  # dropped at once: its __del__ runs here
            elif sys.argv[-1] == "after_the_outputs":
                os.kill(os.getpid(), signal.{sig})
            print("reached the end", flush=True)

        sys.argv.append("{where}")
        try:
            run_prediction(main)
        except SystemExit as e:
            sys.argv.append("none")
            run_prediction(main)
            print(signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1))
            raise
    """)
    assert run.returncode == code, (run.stdout, run.stderr)
    assert run.stdout == "reached the end\nreached the end\n0 0 0\n"  # SIG_DFL
    assert run.stderr == f"stopped: {sig} came as the prediction ended; it ran to its end and its outputs are complete\n"


def test_the_other_processes_leave_a_stop_silently_when_the_launcher_stops_them(monkeypatch,
                                                                                            prediction_signals, capsys):
    """On a process other than the first, `stop` waits for the first to print; a launcher that
    SIGTERMs the waiting one meanwhile must end it silently (it was: a false `stopped: SIGTERM before the end` line
    from run_prediction's handler). Checked: the wait leaves SIGINT and SIGTERM to their default action, and the
    process exits 1 without a line."""
    import signal

    from detlib.engine import exits
    from detlib.inference import run_prediction

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    during_the_wait = []
    monkeypatch.setattr(exits, "_meet", lambda: during_the_wait.append(
        [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)]))

    def main():
        exits.stop("no model weights at /nowhere", 1)

    with pytest.raises(SystemExit) as stop:
        run_prediction(main)
    assert during_the_wait == [[signal.SIG_DFL, signal.SIG_DFL]]
    assert stop.value.code == 1 and capsys.readouterr().err == ""
