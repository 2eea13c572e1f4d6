"""Recipe settings of the references (the frozen stages: tests/test_backbones.py): no weight decay on norms and
biases, training images without a usable box left out."""

from __future__ import annotations

import pytest
import torch

from conftest import write_coco, write_image
from detlib.data.coco import CocoDetection
from detlib.retinanet.model import RetinaNet


def test_weight_decay_groups_leave_out_norms_and_biases():
    from timm.optim import param_groups_weight_decay

    model = RetinaNet(3, "resnet18", fpn_channels=16, freeze_backbone_bn=False, freeze_at=2)
    groups = param_groups_weight_decay(model, 0.01)
    by_wd = {g["weight_decay"]: g["params"] for g in groups}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in by_wd[0.0]}
    decay = {names[id(p)] for p in by_wd[0.01]}
    assert "cls_head.logits.bias" in no_decay or any(n.endswith("bias") for n in no_decay)
    assert all(n.endswith(("bias", ".weight")) for n in no_decay)
    assert all(dict(model.named_parameters())[n].ndim == 1 for n in no_decay)
    assert all(dict(model.named_parameters())[n].ndim > 1 for n in decay)
    assert not any(n.startswith(("backbone.conv1", "backbone.bn1", "backbone.layer1")) for n in no_decay | decay)  # frozen


def test_filter_empty_leaves_out_training_images_without_a_usable_box(tmp_path):
    for i in range(3):
        write_image(tmp_path / "img" / f"{i}.png", 48, 48, seed=i)
    images = [{"id": i + 1, "file_name": f"{i}.png", "width": 48, "height": 48} for i in range(3)]
    anns = [{"image_id": 1, "category_id": 1, "bbox": [4, 4, 20, 20]},
            {"image_id": 2, "category_id": 1, "bbox": [4, 4, 20, 20], "iscrowd": 1}]  # image 2: crowd only; 3: nothing
    ann = write_coco(tmp_path / "a.json", images, anns)
    assert len(CocoDetection(str(tmp_path / "img"), str(ann), filter_empty=False)) == 3
    kept = CocoDetection(str(tmp_path / "img"), str(ann), filter_empty=True)
    assert [r["id"] for r in kept.records] == [1] and kept.num_filtered_empty == 2
    sample = kept[0]
    assert sample["boxes"].shape == (1, 4) and torch.equal(sample["labels"], torch.tensor([0]))


def test_train_scales_draw_a_size_per_sample_and_the_boxes_follow(tmp_path):
    write_image(tmp_path / "img" / "0.png", 200, 100, seed=0)  # W 200, H 100
    ann = write_coco(tmp_path / "a.json", [{"id": 1, "file_name": "0.png", "width": 200, "height": 100}],
                     [{"image_id": 1, "category_id": 1, "bbox": [20, 10, 100, 50]}])
    from detlib.data.transforms import build_transform

    ds = CocoDetection(str(tmp_path / "img"), str(ann), build_transform([50, 80, 120], "none", max_size=1000), seed=0)
    seen = set()
    for epoch in range(12):
        ds.set_epoch(epoch)
        s = ds[0]
        h, w = s["image"].shape[-2:]
        assert h in (50, 80, 120) and w == 2 * h  # the shorter side is one of the scales, aspect kept
        k = h / 100
        torch.testing.assert_close(s["boxes"], torch.tensor([[20 * k, 10 * k, 120 * k, 60 * k]]))
        seen.add(h)
        ds.set_epoch(epoch)
        assert ds[0]["image"].shape == s["image"].shape  # the draw is the sample's seeded one: replayable
    assert seen == {50, 80, 120}


def test_ema_loss_normalizer_by_hand():
    from detlib.retinanet.loss import EmaLossNormalizer, retinanet_loss

    ema = EmaLossNormalizer()
    assert float(ema(torch.tensor(10.0))) == pytest.approx(0.9 * 100 + 0.1 * 10)  # 91
    assert float(ema(torch.tensor(0.0))) == pytest.approx(0.9 * 91 + 0.1 * 1)  # a count under 1 counts as 1
    restored = EmaLossNormalizer()
    restored.load_state_dict(ema.state_dict())
    assert restored.value == ema.value
    torch.manual_seed(0)
    anchors = torch.tensor([[0.0, 0, 10, 10], [5, 5, 15, 15], [20, 20, 30, 30]])
    logits, deltas = torch.randn(1, 3, 2), torch.randn(1, 3, 4)
    gt, labels = torch.tensor([[[0.0, 0, 10, 10]]]), torch.tensor([[1]])
    batch = retinanet_loss(logits, deltas, anchors, gt, labels)
    fixed = retinanet_loss(logits, deltas, anchors, gt, labels, normalizer=lambda n: torch.tensor(50.0))
    assert float(batch["num_pos"]) == 1.0
    torch.testing.assert_close(fixed["loss"], batch["loss"] / 50)  # the same sums, another divisor


def test_head_norm_gn_for_a_fresh_run(tmp_path, capsys):
    """--head_norm gn builds torchvision's v2 heads for a run from scratch (GroupNorm after each hidden conv, which
    has no bias), records it in model_config.json, and --evaluate_only rebuilds the same model from it; a width
    GroupNorm(32) cannot split is one line at start."""
    import importlib.util
    import json

    from safetensors.torch import load_file

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("train_retinanet", REPO / "scripts" / "train_retinanet.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    images = [{"id": i + 1, "file_name": f"{i}.png", "width": 64, "height": 64} for i in range(4)]
    for i in range(4):
        write_image(tmp_path / "img" / f"{i}.png", 64, 64, seed=i)
    write_coco(tmp_path / "a.json", images, [{"image_id": i + 1, "category_id": 1, "bbox": [8, 8, 30, 30]} for i in range(4)])
    data = ["--train_images", str(tmp_path / "img"), "--train_annotations", str(tmp_path / "a.json"),
            "--val_images", str(tmp_path / "img"), "--val_annotations", str(tmp_path / "a.json")]
    fast = ["--backbone", "resnet18", "--image_size", "64", "--per_device_batch_size", "2", "--max_steps", "1",
            "--epochs", "1", "--num_workers", "0", "--report_to", "none", "--num_log_images", "0", "--skip_image_check"]
    with pytest.raises(SystemExit) as e:
        train.main([*fast, *data, "--fpn_channels", "48", "--head_norm", "gn", "--output_dir", str(tmp_path / "bad")])
    assert e.value.code == 2 and "--head_norm gn needs --fpn_channels divisible by 32" in capsys.readouterr().err
    # 32 channels at 64 px: one channel per group on P7's single cell (it was a traceback from the FLOP count)
    with pytest.raises(SystemExit) as e:
        train.main([*fast, *data, "--fpn_channels", "32", "--head_norm", "gn", "--output_dir", str(tmp_path / "bad")])
    assert e.value.code == 2 and "at inputs of at most 64 px, where P7 is 1x1" in capsys.readouterr().err
    out = tmp_path / "gn"
    train.main([*fast, *data, "--fpn_channels", "64", "--head_norm", "gn", "--output_dir", str(out)])
    assert json.loads((out / "last" / "model_config.json").read_text())["head_norm"] == "gn"
    # from scratch on real data: the start says what to expect and where pretrained weights come from (issue 39)
    assert "backbone from scratch on real data (no --backbone_weights): expect an AP near 0" in (out / "train.log").read_text()
    keys = set(load_file(out / "last" / "model.safetensors"))
    assert {"cls_head.tower.1.weight", "cls_head.tower.1.bias", "box_head.tower.10.weight"} <= keys  # GroupNorms
    assert "cls_head.tower.0.weight" in keys and "cls_head.tower.0.bias" not in keys  # convs without bias
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    stats = train.main([*data, "--evaluate_only", str(out / "last"), "--num_workers", "0", "--report_to", "none",
                        "--num_log_images", "0", "--skip_image_check", "--output_dir", str(out)])
    assert "AP" in stats
