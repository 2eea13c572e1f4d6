"""Library pieces used instead of our own (timm's ImageNet statistics and weights reader, torchvision's image
extensions) give the values ours gave; the built-in data sets keep their cache folders."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from detlib import classification
from detlib.data import imagefolder
from detlib.data import builtin
from detlib.retinanet import model
from detlib.weights import load_state_dict_file

# ---- ImageNet statistics: timm's constants, in 0-1 units (classifier) and 0-255 units (RetinaNet)


def test_imagenet_statistics_keep_their_values_in_both_units():
    assert model.IMAGENET_MEAN == pytest.approx((123.675, 116.28, 103.53), abs=1e-9)
    assert model.IMAGENET_STD == pytest.approx((58.395, 57.12, 57.375), abs=1e-9)
    # the float32 buffers RetinaNet normalises with are bit-identical to the literals used before
    assert torch.equal(torch.tensor(model.IMAGENET_MEAN), torch.tensor((123.675, 116.28, 103.53)))
    assert torch.equal(torch.tensor(model.IMAGENET_STD), torch.tensor((58.395, 57.12, 57.375)))
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


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_inside_an_except_exception_block_still_stops_a_prediction(signame, monkeypatch, tmp_path):
    """The signal lands while the predict script is inside an `except Exception` (as `exif_orientation`'s, which
    reads a damaged EXIF block as orientation 1): the prediction still stops with its `stopped:` exit, it does not
    run on to the end (seen: a Ctrl-C to predict_retinanet.py exited 0 after all 600 images)."""
    import os
    import signal
    import sys

    from detlib.evaluation import drawing
    from detlib.inference import run_prediction

    image = tmp_path / "a.png"
    image.write_bytes(b"not an image")
    real_open, reached_the_end = drawing.Image.open, []

    def open_and_signal(path):  # the handler runs here, inside exif_orientation's try block
        os.kill(os.getpid(), getattr(signal, signame))
        return real_open(path)

    def main():
        monkeypatch.setattr(drawing.Image, "open", open_and_signal)
        orientations = [drawing.exif_orientation(image) for _ in range(3)]
        reached_the_end.append(orientations)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # run_prediction installs its own
    try:
        with pytest.raises(SystemExit) as stop:
            run_prediction(main)
    finally:  # run_prediction installs its handlers in this process
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert stop.value.code == (130 if signame == "SIGINT" else 143) and reached_the_end == []
