"""What a run leaves on disk is readable like every other output: weights files and checkpoints get the
mode the umask allows (0644 under 022), not safetensors' private 0600."""

import os
import stat

import pytest
import torch

from detlib.engine import checkpoints as ckpt
from detlib.weights import load_model_weights, save_model_weights


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_weights_and_checkpoint_files_are_0644_under_umask_022(tmp_path, umask_022):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(torch.nn.Linear(3, 2), torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1))
    weights = save_model_weights(acc, model, str(tmp_path / "best"), model_config={"num_classes": 2})
    assert _mode(weights) == 0o644
    assert _mode(tmp_path / "best" / "model_config.json") == 0o644
    folder = ckpt.save_checkpoint(acc, str(tmp_path), ckpt.TrainState(epoch=1, global_step=3), [model])
    modes = {name: _mode(os.path.join(folder, name)) for name in os.listdir(folder)
             if os.path.isfile(os.path.join(folder, name))}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    # the weights still load after the mode change, through the same reader as --init_from
    loaded = load_model_weights(torch.nn.Linear(3, 2), weights)
    assert loaded == weights or os.path.samefile(loaded, weights)


def test_a_stricter_umask_is_respected(tmp_path):
    from accelerate import Accelerator

    old = os.umask(0o077)
    try:
        acc = Accelerator(cpu=True)
        model = acc.prepare(torch.nn.Linear(3, 2))
        weights = save_model_weights(acc, model, str(tmp_path / "last"))
    finally:
        os.umask(old)
    assert _mode(weights) == 0o600


def test_a_file_system_that_refuses_chmod_still_gets_the_weights_and_the_checkpoint(tmp_path, monkeypatch):
    from accelerate import Accelerator

    def refuse(*a, **k):
        raise PermissionError(1, "Operation not permitted")

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(3, 2))
    monkeypatch.setattr(os, "chmod", refuse)
    weights = save_model_weights(acc, model, str(tmp_path / "last"))
    folder = ckpt.save_checkpoint(acc, str(tmp_path), ckpt.TrainState(epoch=1, global_step=3), [model])
    ckpt.verify_checkpoint(folder)
    assert load_model_weights(torch.nn.Linear(3, 2), weights) == weights
