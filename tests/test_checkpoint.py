"""Weights files and checkpoints: wrapper prefixes (B18), model_config, TrainState, latest resolution, and that
nothing read from a checkpoint folder or a weights file runs code (a planted pickle)."""

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from detlib.engine import checkpoints as ckpt
from detlib.retinanet.model import RetinaNet
from detlib.weights import WeightsFileError, load_model_weights, load_state_dict_file
from helpers import fake_checkpoint, plant


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return RetinaNet(2, "resnet18", fpn_channels=16, freeze_backbone_bn=False).eval()


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_prefixed_state_dicts_load_strictly_case_b18(tmp_path, tiny_model, prefix, fmt):
    sd = {prefix + k: v.clone().contiguous() for k, v in tiny_model.state_dict().items()}
    path = tmp_path / f"w.{fmt}"
    if fmt == "safetensors":
        save_file(sd, str(path))
    else:
        torch.save({"state_dict": sd}, path)
    fresh = RetinaNet(2, "resnet18", fpn_channels=16, freeze_backbone_bn=False).eval()
    load_model_weights(fresh, str(path))
    x = torch.randint(0, 255, (1, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        a, b = tiny_model(x), fresh(x)
    assert torch.equal(a["cls_logits"], b["cls_logits"]) and torch.equal(a["box_deltas"], b["box_deltas"])


def test_weights_of_another_model_fail_clearly(tmp_path, tiny_model):
    save_file({k: v.contiguous() for k, v in tiny_model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    other = RetinaNet(2, "resnet18", fpn_channels=32, freeze_backbone_bn=False)
    with pytest.raises(RuntimeError, match="do not fit this model .*size mismatch"):
        load_model_weights(other, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model_weights(other, str(tmp_path / "nowhere"))


def test_backbone_weights_file_feeds_the_backbone(tmp_path):
    import timm

    torch.manual_seed(1)
    classifier = timm.create_model("resnet18", pretrained=False)
    save_file({k: v.contiguous() for k, v in classifier.state_dict().items()}, str(tmp_path / "r18.safetensors"))
    model = RetinaNet(2, "resnet18", fpn_channels=16, backbone_weights=str(tmp_path / "r18.safetensors"))
    torch.testing.assert_close(model.backbone.conv1.weight, classifier.conv1.weight)
    # frozen BN by default with weights: no BN parameter is trainable
    assert not any(p.requires_grad for n, p in model.backbone.named_parameters() if "bn" in n)
    with pytest.raises(ValueError, match="does not fit"):
        save_file({"conv1.weight": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
        RetinaNet(2, "resnet18", fpn_channels=16, backbone_weights=str(tmp_path / "bad.safetensors"))


def test_pretrained_download_offline_fails_with_advice(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the hub reads the variable once, at import: set its flag too, else the download is tried (and times out)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="--backbone_weights"):
        RetinaNet(2, "resnet18", fpn_channels=16, pretrained_backbone=True)


def test_resolve_resume_picks_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for name, step in (("epoch_0001", 10), ("epoch_0002", 20), ("step_00000025", 25)):
        fake_checkpoint(root / name, step)
    (root / "epoch_0003.tmp").mkdir()  # a save that was killed half-way is never picked
    (root / "epoch_0004").mkdir()  # nor a folder without trainer_state.json
    assert ckpt.find_checkpoint(str(tmp_path), "latest") == str(root / "step_00000025")
    assert ckpt.find_checkpoint(str(tmp_path / "empty"), "latest") is None
    with pytest.raises(ckpt.CheckpointError, match="epoch_0004 is not a complete checkpoint"):
        ckpt.find_checkpoint(str(tmp_path), str(root / "epoch_0004"))


def test_load_state_dict_file_rejects_non_state_dicts(tmp_path):
    torch.save([1, 2, 3], tmp_path / "x.pt")
    with pytest.raises(ValueError, match="state dict"):
        load_state_dict_file(tmp_path / "x.pt")


# ---- nothing read from a checkpoint folder or a weights file runs code

def accelerate_state(folder):
    """A real `accelerator.save_state` folder of a run (model, SGD momentum, a registered LR scheduler and EMA
    loss normaliser, RNG states) plus trainer_state.json and model_config.json; returns the live objects."""
    from accelerate import Accelerator

    from detlib.retinanet.loss import EmaLossNormalizer

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    norm = EmaLossNormalizer()
    acc.register_for_checkpointing(sched, norm)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    sched.step()
    norm(torch.tensor(7.0))
    acc.save_state(str(folder))
    (folder / "trainer_state.json").write_text(json.dumps({"epoch": 1, "global_step": 1}))
    (folder / "model_config.json").write_text(json.dumps({"classes": ["a", "b"]}))
    return acc, model, opt, sched, norm


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("state") / "epoch_0001"
    accelerate_state(folder)
    return folder


# Every kind of file a checkpoint folder holds: what save_state wrote above, and what it writes in other setups
# (a prepared scheduler, fp16's GradScaler, a seedable sampler, a stateful loader, torch weights, a 2nd process).
PLANTED = ["model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl",
           "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin", "scaler.pt", "sampler.bin",
           "dl_state_dict.bin", "pytorch_model.bin", "trainer_state.json", "model_config.json"]


@pytest.mark.parametrize("fmt", ["torch", "pickle"])
@pytest.mark.parametrize("name", PLANTED)
def test_planted_pickle_payload_never_runs(tmp_path, saved_run, name, fmt, caplog):
    root = tmp_path / "checkpoints"
    older = shutil.copytree(saved_run, root / "epoch_0001")
    ckpt.verify_checkpoint(str(older))  # a real accelerate checkpoint reads back without unpickling code
    newest = shutil.copytree(saved_run, root / "step_00000012")
    marker = tmp_path / "MARKER"
    plant(newest / name, marker, fmt)
    os.utime(older, (1e9, 1e9))  # written before the planted one
    assert ckpt.find_checkpoint(str(tmp_path), "latest") == str(older)  # falls back, saying why
    (warned,) = [r.getMessage() for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()]
    assert f"step_00000012/{name}" in warned and "\n" not in warned
    if name.endswith((".bin", ".pt", ".pkl")):
        assert "holds pickled objects other than tensors and plain values" in warned and "refused" in warned
    with pytest.raises(ckpt.CheckpointError, match=f"step_00000012/{name}"):  # named explicitly: one line
        ckpt.find_checkpoint(str(tmp_path), str(newest))
    assert not marker.exists()


def test_load_checkpoint_restores_exactly_and_refuses_a_payload_planted_after_the_verification(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # a user's setting is set aside, then restored
    folder = tmp_path / "step_00000001"
    acc, model, opt, sched, norm = accelerate_state(folder)
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, sched.state_dict(), norm.value,
             opt.state_dict()["state"][0]["momentum_buffer"].clone())
    draws = (torch.rand(3), np.random.rand(3), random.random())
    model(torch.ones(4, 3)).sum().backward()  # the run goes on
    opt.step()
    sched.step()
    norm(torch.tensor(50.0))
    state = ckpt.TrainState()
    ckpt.load_checkpoint(acc, str(folder), state)
    assert state.global_step == 1 and state.epoch == 1
    assert all(torch.equal(v, saved[0][k]) for k, v in model.state_dict().items())
    assert sched.state_dict() == saved[1] and norm.value == saved[2]
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], saved[3])
    again = (torch.rand(3), np.random.rand(3), random.random())  # the RNG states were restored too
    assert torch.equal(again[0], draws[0]) and np.array_equal(again[1], draws[1]) and again[2] == draws[2]
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1" and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ

    marker = tmp_path / "MARKER"
    plant(folder / "custom_checkpoint_0.pkl", marker, "torch")  # after verify_checkpoint passed the folder
    with pytest.raises(ckpt.CheckpointError, match="custom_checkpoint_0.pkl holds pickled objects .*refused"):
        ckpt.load_checkpoint(acc, str(folder), ckpt.TrainState())
    assert not marker.exists()


@pytest.mark.parametrize("fmt", ["torch", "pickle"])
@pytest.mark.parametrize("name", ["model.pt", "model.pth", "pytorch_model.bin", "resnet18.pth"])
def test_planted_pickle_in_a_weights_file_never_runs(tmp_path, tiny_model, name, fmt):
    """--init_from / --weights / --evaluate_only / --backbone_weights files: read with weights_only=True."""
    marker = tmp_path / "MARKER"
    plant(tmp_path / name, marker, fmt)
    for given in (tmp_path / name, tmp_path):  # the file, or the folder that holds it
        if given == tmp_path and name == "resnet18.pth":
            continue  # not a name a folder is searched for
        with pytest.raises(WeightsFileError, match=f"{name} holds pickled objects other than .*refused"):
            load_model_weights(tiny_model, str(given))
    with pytest.raises(RuntimeError, match="refused, nothing in it was run"):
        load_state_dict_file(tmp_path / name)
    assert not marker.exists()


def test_planted_pickle_in_the_torchvision_cache_never_runs(tmp_path, monkeypatch):
    """torch.hub reads a cached download with weights_only=False by default; the classifier's resnet18 does not."""
    from torchvision.models import ResNet18_Weights

    from detlib.classification import build_classifier

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = tmp_path / "torch" / "hub" / "checkpoints" / os.path.basename(ResNet18_Weights.IMAGENET1K_V1.url)
    cached.parent.mkdir(parents=True)
    marker = tmp_path / "MARKER"
    plant(cached, marker, "torch")
    with pytest.raises(RuntimeError, match="cached torchvision weights of 'resnet18' .* refused") as e:
        build_classifier("resnet18", 2, pretrained=True)
    assert "\n" not in str(e.value) and not marker.exists()
