"""Weights files and checkpoints: wrapper prefixes (B18), model_config, TrainState, latest resolution."""

import json

import pytest
import torch
from safetensors.torch import save_file

from detlib import checkpoint as ckpt
from detlib.model import RetinaNet
from detlib.weights import load_model_weights, load_state_dict_file


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
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="--backbone_weights"):
        RetinaNet(2, "resnet18", fpn_channels=16, pretrained_backbone=True)


def fake_checkpoint(folder, step: int):
    """A checkpoint folder with the files accelerate's save_state writes (tiny tensors)."""
    folder.mkdir(parents=True)
    save_file({"w": torch.arange(6.0)}, str(folder / "model.safetensors"))
    torch.save({"state": {}, "param_groups": [{"lr": 0.1}]}, folder / "optimizer.bin")
    (folder / "trainer_state.json").write_text(json.dumps({"epoch": 2, "global_step": step}))
    return folder


def test_resolve_resume_picks_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for name, step in (("epoch_0001", 10), ("epoch_0002", 20), ("step_00000025", 25)):
        fake_checkpoint(root / name, step)
    (root / "epoch_0003.tmp").mkdir()  # a save that was killed half-way is never picked
    (root / "epoch_0004").mkdir()  # nor a folder without trainer_state.json
    assert ckpt.resolve_resume(str(tmp_path), "latest") == str(root / "step_00000025")
    assert ckpt.resolve_resume(str(tmp_path / "empty"), "latest") is None
    with pytest.raises(FileNotFoundError, match="epoch_0004"):
        ckpt.resolve_resume(str(tmp_path), str(root / "epoch_0004"))


def test_load_state_dict_file_rejects_non_state_dicts(tmp_path):
    torch.save([1, 2, 3], tmp_path / "x.pt")
    with pytest.raises(ValueError, match="state dict"):
        load_state_dict_file(tmp_path / "x.pt")
