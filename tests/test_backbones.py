"""Any timm backbone, pretrained: the stages `--freeze_at` freezes, a plain timm checkpoint loaded, the backbone's own
input normalisation, checked over timm's registry (one model per family, built on the meta device) and end to end on a
few real families."""

from __future__ import annotations

import copy
import functools
import json
import re

import pytest
import timm
import torch
from safetensors.torch import save_file
from torchvision.ops.misc import FrozenBatchNorm2d

from detlib.backbones import FREEZE_ALL, backbone_mean_std, frozen_parameters, load_timm_weights
from detlib.retinanet.model import BACKBONE_REDUCTIONS, RetinaNet, build_retinanet_from_config, check_backbone

# The smallest-sounding model of each family: the registry's families are what users choose from.
SMALL = re.compile(r"(atto|femto|pico|nano|tiny|small|_xs|_s\b|b0|18|_050|_100|mini|lite|t8|_002|w18_small|light|m0)")
FAMILIES = {f: sorted(names, key=lambda n: (not SMALL.search(n), len(n), n))[0]
            for f in timm.list_modules() if (names := timm.list_models(module=f))}

# Families whose freezing is not "what the features finer than stride 8 are computed from", each with why and what it
# freezes instead, by hand: prefixes added to (+) or taken from (-) that set, or the whole set (=).
NOT_THE_FINER_FEATURES = {
    # timm takes their stride-4 feature before the last stride-4 blocks; the rule freezes everything before stride 8
    "ghostnet": ("+", ["blocks_2."]), "repghost": ("+", ["blocks_2."]),
    "inception_v4": ("+", ["features_3.", "features_4."]),
    # its stride-4 feature is inside block 1, before the block's stride-2 conv: the block that reaches stride 8 trains
    "xception_aligned": ("-", ["blocks_1."]),
    # its finer features pass through every stage (the incre modules): the stem, layer1 and transition1's stride-4 branch
    "hrnet": ("=", ["conv1.", "bn1.", "conv2.", "bn2.", "layer1.", "transition1.0."]),
    # no feature finer than stride 8: the stem, and what runs before the module of the first feature (visformer's
    # stride-8 patch embedding, as a ConvNeXt's patchify stem)
    "pit": ("=", ["body.patch_embed.", "body.cls_token", "body.pos_embed"]), "csatv2": ("=", ["stem_dct."]),
    "visformer": ("=", ["model.stem.", "model.patch_embed1."]),
}


@functools.lru_cache(maxsize=None)
def _built_on_meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return timm.create_model(name, features_only=True)


def meta_features(name: str) -> torch.nn.Module:
    """A fresh copy of timm's `features_only` model on the meta device: each family's model is built once (the
    registry test builds them all; a copy costs a third of a build) and each caller may change its copy."""
    return copy.deepcopy(_built_on_meta(name))


def finer_feature_parameters(name: str) -> set[str]:
    """The parameters the features finer than stride 8 are computed from (autograd on the meta device): the stem and
    the first stage, by another method than `frozen_parameters`' (which follows the calls and the activation sizes)."""
    backbone = meta_features(name).eval()
    reductions = backbone.feature_info.reduction()
    level = next(i for i, r in enumerate(reductions) if r >= 8)
    if level == 0:
        return set()
    size = backbone.pretrained_cfg.get("input_size", (3, 224, 224))[-2:]
    features = backbone(torch.zeros(1, 3, *size, device="meta"))
    sum(f.float().sum() for f in features[:level]).backward()
    return {n for n, p in backbone.named_parameters() if p.grad is not None}


def expected_frozen(family: str, name: str) -> set[str]:
    finer = finer_feature_parameters(name)
    if family not in NOT_THE_FINER_FEATURES:
        return finer
    how, prefixes = NOT_THE_FINER_FEATURES[family]
    names = [n for n, _ in meta_features(name).named_parameters()]
    marked = {n for n in names if n.startswith(tuple(prefixes))}
    return {"+": finer | marked, "-": finer - marked, "=": marked}[how]


@functools.lru_cache(maxsize=None)  # asked of every family by the registry test, then again by each family's test
def hierarchical(name: str) -> bool:
    return all(r in meta_features(name).feature_info.reduction() for r in BACKBONE_REDUCTIONS)


def test_the_registry_is_mostly_hierarchical_families():
    """The families checked below are this timm's registry, not a list of ours: most give stride 8/16/32 features."""
    kinds = [hierarchical(name) for name in FAMILIES.values()]
    assert len(kinds) >= 90 and sum(kinds) >= 60 and len(kinds) - sum(kinds) >= 20, (len(kinds), sum(kinds))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_timm_family_freezes_its_stem_and_first_stage_loads_its_plain_checkpoint_and_keeps_its_normalisation(family):
    """One model of each timm family: with stride 8/16/32 features it freezes exactly its stem and first stage at
    --freeze_at 2, takes every backbone tensor from the plain model's state dict (classifier left), and normalises with
    its pretrained_cfg's mean/std; without them it is refused at start in one line."""
    name = FAMILIES[family]
    backbone = meta_features(name)
    if not hierarchical(name):
        with pytest.raises(ValueError, match="RetinaNet's FPN needs strides 8, 16 and 32") as e:
            check_backbone(name)
        assert "\n" not in str(e.value)
        return
    frozen = set(frozen_parameters(name, 2))
    assert frozen == expected_frozen(family, name)
    assert frozen and frozen < {n for n, _ in backbone.named_parameters()}
    with torch.device("meta"):
        plain = timm.create_model(name).state_dict()
    line = load_timm_weights(backbone, plain, f"{name}.safetensors")
    assert f"{len(backbone.state_dict())} tensors loaded" in line
    cfg = backbone.pretrained_cfg  # what RetinaNet normalises with (tested on the model below)
    assert backbone_mean_std(backbone) == (tuple(cfg["mean"]) * (3 // len(cfg["mean"])),
                                           tuple(cfg["std"]) * (3 // len(cfg["std"])))


@pytest.mark.parametrize("freeze_bn", [True, False])
def test_freeze_at_counts_strides_on_a_resnet_and_a_convnext(freeze_bn):
    """resnet18 (first feature at stride 2) and convnext_atto (stride 4) freeze the same thing at each --freeze_at:
    the stem at 1, then a stage more per level, everything at 5; the FPN and heads always train."""
    stages = {"resnet18": ["layer1", "layer2", "layer3", "layer4"], "convnext_atto": [f"stages_{i}" for i in range(4)]}
    stems = {"resnet18": {"conv1"}, "convnext_atto": {"stem_0", "stem_1"}}  # frozen BatchNorm: buffers, not parameters
    for name in stages:
        trainable = []
        for k in range(6):
            model = RetinaNet(3, name, fpn_channels=16, freeze_backbone_bn=freeze_bn, freeze_at=k)
            frozen_parts = {n.split(".")[1] for n, p in model.named_parameters() if not p.requires_grad}
            assert frozen_parts == (stems[name] if k else set()) | set(stages[name][:max(0, k - 1)]), (name, k)
            assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("backbone."))
            trainable.append(sum(p.numel() for p in model.parameters() if p.requires_grad))
        assert trainable == sorted(trainable, reverse=True) and len(set(trainable)) == 6
        with torch.device("meta"):
            assert frozen_parameters(name, FREEZE_ALL) == [n for n, _ in meta_features(name).named_parameters()]
    with pytest.raises(ValueError, match="freeze_at must be in 0..5"):
        frozen_parameters("resnet18", 6)


def test_frozen_stages_have_frozen_batchnorm_whatever_backbone_bn_says():
    """--backbone_bn train (freeze_backbone_bn=False) with --freeze_at 2: the stem's and layer1's BatchNorm are
    FrozenBatchNorm2d (a training step neither uses the batch statistics nor updates theirs); layer2's train."""
    model = RetinaNet(3, "resnet18", fpn_channels=16, freeze_backbone_bn=False, freeze_at=2).train()
    bb = model.backbone
    assert isinstance(bb.bn1, FrozenBatchNorm2d) and isinstance(bb.layer1[0].bn1, FrozenBatchNorm2d)
    assert type(bb.layer2[0].bn1) is torch.nn.BatchNorm2d
    before = {n: b.clone() for n, b in bb.named_buffers()}
    model(torch.rand(2, 3, 64, 64) * 255)
    changed = {n.rsplit(".", 1)[0] for n, b in bb.named_buffers() if not torch.equal(b, before[n])}
    assert changed and not any(n.startswith(("bn1", "layer1.")) for n in changed)
    assert any(n.startswith("layer2.") for n in changed)


REAL_FAMILIES = ["resnet18", "convnext_atto", "efficientnet_b0", "regnetx_002", "pvt_v2_b0"]


@pytest.mark.parametrize("name", REAL_FAMILIES)
def test_a_plain_timm_checkpoint_trains_the_stages_after_the_first(name, tmp_path):
    """A ResNet, a ConvNeXt, an EfficientNet, a RegNet and a hierarchical transformer: the timm model's own state dict
    (classifier included) loads into the backbone, every tensor taken from the file; two training steps change the
    trainable backbone weights and leave the frozen ones (the stem and first stage) as loaded."""
    from detlib.retinanet import AnchorGenerator, retinanet_loss

    torch.manual_seed(0)
    plain = timm.create_model(name)
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(tmp_path / "w.safetensors"))
    model = RetinaNet(2, name, fpn_channels=32, backbone_weights=str(tmp_path / "w.safetensors"), freeze_at=2)
    flat = {k.replace(".", "_", 1): v for k, v in plain.state_dict().items()}
    for n, t in model.backbone.state_dict().items():  # the file's values, under the plain model's name or timm's flattened one
        assert torch.equal(t, plain.state_dict().get(n, flat.get(n))), n
    frozen = set(frozen_parameters(name, 2))
    params, buffers = dict(model.backbone.named_parameters()), dict(model.backbone.named_buffers())
    assert frozen and {n for n, p in params.items() if not p.requires_grad} == frozen & set(params)
    assert all(n in buffers for n in frozen - set(params))  # a frozen stage's BatchNorm: FrozenBatchNorm2d's buffers
    loaded = {n: t.detach().clone() for n, t in model.backbone.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    images = torch.rand(2, 3, 128, 128) * 255
    anchors, _ = AnchorGenerator()(128, 128)
    boxes = torch.tensor([[[10.0, 20.0, 70.0, 90.0]], [[40.0, 30.0, 120.0, 100.0]]])
    model.train()
    for _ in range(2):
        out = model(images)
        loss = retinanet_loss(out["cls_logits"], out["box_deltas"], anchors, boxes, torch.tensor([[0], [1]]))
        sum(loss.values()).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.backbone.state_dict()
    assert all(torch.equal(after[n], loaded[n]) for n in frozen)
    trainable = [n for n in params if n not in frozen]
    moved = [n for n in trainable if not torch.equal(after[n], loaded[n])]
    assert len(moved) >= 0.9 * len(trainable), (len(moved), len(trainable))


def test_a_checkpoint_of_another_model_stops_in_one_line(tmp_path):
    save_file(timm.create_model("resnet18").state_dict(), str(tmp_path / "r18.safetensors"))
    with pytest.raises(ValueError) as e:
        RetinaNet(2, "convnext_atto", fpn_channels=32, backbone_weights=str(tmp_path / "r18.safetensors"))
    assert "\n" not in str(e.value) and "tensors are not in the file" in str(e.value)
    save_file(timm.create_model("resnet26").state_dict(), str(tmp_path / "r26.safetensors"))
    with pytest.raises(ValueError, match="tensors of other shapes") as e:  # bottlenecks: the same names, other shapes
        RetinaNet(2, "resnet18", fpn_channels=32, backbone_weights=str(tmp_path / "r26.safetensors"))
    assert "\n" not in str(e.value)
    (tmp_path / "damaged.safetensors").write_text("not weights")  # was a safetensors traceback through the script
    with pytest.raises(RuntimeError, match="damaged.safetensors is not a readable weights file") as e:
        RetinaNet(2, "resnet18", fpn_channels=32, backbone_weights=str(tmp_path / "damaged.safetensors"))
    assert "\n" not in str(e.value)


def test_case_g19_a_timm_training_checkpoint_gives_its_ema_copy_as_timm_does_and_the_line_names_it(tmp_path, caplog):
    """timm's train.py's model_best.pth.tar (state_dict, state_dict_ema, optimizer, an argparse.Namespace under args,
    ...): the backbone takes the EMA copy, as timm's own load_checkpoint does by default (the raw weights were taken),
    or the raw weights when asked; the load line names the part taken, the checkpoint's contents and the other
    choice (it said neither)."""
    import argparse
    import logging

    from timm.models import load_checkpoint

    torch.manual_seed(0)
    raw, ema = timm.create_model("resnet18"), timm.create_model("resnet18")
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9)
    raw(torch.rand(1, 3, 64, 64)).sum().backward()
    optimizer.step()  # a momentum buffer per parameter, as in a real checkpoint
    f = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 3, "arch": "resnet18", "optimizer": optimizer.state_dict(), "version": 2,
                "args": argparse.Namespace(model="resnet18", lr=0.1, model_ema=True), "state_dict": raw.state_dict(),
                "state_dict_ema": ema.state_dict(), "metric": 71.2}, f)
    timm_reads = timm.create_model("resnet18")
    load_checkpoint(timm_reads, str(f))  # timm's default
    assert torch.equal(timm_reads.conv1.weight, ema.conv1.weight) and not torch.equal(raw.conv1.weight, ema.conv1.weight)
    contents = "of a checkpoint holding epoch, arch, optimizer, version, args, state_dict, state_dict_ema, metric"
    for use_ema, want, said in [
            (True, ema, f"(state_dict_ema (the EMA copy) {contents}; --no-backbone_weights_ema takes the raw weights)"),
            (False, raw, f"(state_dict (the raw weights) {contents}; without --no-backbone_weights_ema the EMA copy, "
                         "timm's default)")]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="detlib.retinanet.model"):
            model = RetinaNet(2, "resnet18", fpn_channels=16, backbone_weights=str(f), backbone_weights_ema=use_ema)
        for n, t in model.backbone.state_dict().items():
            if n in want.state_dict() and not n.endswith("num_batches_tracked"):
                assert torch.equal(t, want.state_dict()[n]), n
        (line,) = [r.getMessage() for r in caplog.records if "tensors loaded" in r.getMessage()]
        assert line.startswith(f"backbone weights {f} {said}: ") and "tensors loaded, every backbone tensor" in line
    caplog.clear()
    save_file(raw.state_dict(), str(tmp_path / "plain.safetensors"))  # a state dict itself: no part to name
    with caplog.at_level(logging.INFO, logger="detlib.retinanet.model"):
        RetinaNet(2, "resnet18", fpn_channels=16, backbone_weights=str(tmp_path / "plain.safetensors"))
    assert any(r.getMessage().startswith(f"backbone weights {tmp_path / 'plain.safetensors'}: ") for r in caplog.records)


def test_the_tag_gives_the_normalisation_and_a_model_config_without_it_stops():
    """resnetv2_50x1_bit.goog_in21k was trained on inputs scaled by mean 0.5 / std 0.5: the model normalises with those,
    ImageNet's for resnet18; a model_config.json without mean and std is refused, naming both."""
    with torch.device("meta"):
        bit = RetinaNet(2, "resnetv2_50x1_bit.goog_in21k", fpn_channels=32)
        r18 = RetinaNet(2, "resnet18", fpn_channels=32)
    assert bit.mean == (0.5, 0.5, 0.5) and bit.std == (0.5, 0.5, 0.5)
    assert torch.equal(bit.pixel_mean.flatten().cpu(), torch.full((3,), 127.5)) if bit.pixel_mean.device.type != "meta" else True
    assert r18.mean == pytest.approx((0.485, 0.456, 0.406)) and r18.std == pytest.approx((0.229, 0.224, 0.225))
    config = {"num_classes": 2, "backbone": "resnet18", "fpn_channels": 32}
    with pytest.raises(KeyError, match="lacks mean, std"):
        build_retinanet_from_config(config)
    rebuilt = build_retinanet_from_config({**config, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]})
    assert torch.equal(rebuilt.pixel_mean.flatten(), torch.full((3,), 127.5))
    assert torch.equal(rebuilt.pixel_std.flatten(), torch.full((3,), 63.75))
    json.dumps({"mean": rebuilt.mean, "std": rebuilt.std})  # what model_config.json records


@pytest.mark.slow
def test_the_training_script_fine_tunes_a_plain_convnext_checkpoint_with_its_own_normalisation(tmp_path, capsys):
    """train_retinanet.py --backbone convnext_atto.d2_in1k --backbone_weights (timm's plain state dict), 2 steps: the
    load line, the stem and first stage frozen by default and unchanged in last/, the later stages trained, and the
    tag's mean/std in model_config.json, which --evaluate_only rebuilds the model from."""
    from safetensors.torch import load_file

    from conftest import write_coco, write_image
    from helpers import run_ok

    name = "convnext_atto.d2_in1k"
    torch.manual_seed(0)
    plain = timm.create_model(name).state_dict()
    save_file(plain, str(tmp_path / "w.safetensors"))
    images = [{"id": i + 1, "file_name": f"{i}.png", "width": 64, "height": 64} for i in range(4)]
    for i in range(4):
        write_image(tmp_path / "img" / f"{i}.png", 64, 64, seed=i)
    write_coco(tmp_path / "a.json", images, [{"image_id": i + 1, "category_id": 1, "bbox": [8, 8, 30, 30]} for i in range(4)])
    data = ["--train_images", tmp_path / "img", "--train_annotations", tmp_path / "a.json",
            "--val_images", tmp_path / "img", "--val_annotations", tmp_path / "a.json"]
    out = tmp_path / "run"
    printed = run_ok("train_retinanet", [*data, "--backbone", name, "--backbone_weights", tmp_path / "w.safetensors",
                                         "--image_size", "64", "--fpn_channels", "32", "--per_device_batch_size", "2",
                                         "--max_steps", "2", "--epochs", "1", "--num_workers", "0", "--report_to", "none",
                                         "--num_log_images", "0", "--lr", "0.01", "--output_dir", out], capsys)
    log = (out / "train.log").read_text()
    assert "tensors loaded, every backbone tensor" in log and "no gradient clipping" not in log, printed[-2000:]
    config = json.loads((out / "last" / "model_config.json").read_text())
    assert config["backbone"] == name and config["mean"] == pytest.approx(list(timm.data.IMAGENET_DEFAULT_MEAN))
    trained = {k.removeprefix("backbone."): v for k, v in load_file(out / "last" / "model.safetensors").items()
               if k.startswith("backbone.")}
    frozen = set(frozen_parameters(name, 2))
    flat = {k.replace(".", "_", 1): v for k, v in plain.items()}
    assert frozen and all(torch.equal(trained[n], flat[n]) for n in frozen)
    later = [n for n in trained if n.startswith(("stages_1.", "stages_2.", "stages_3.")) and n in flat]
    assert sum(not torch.equal(trained[n], flat[n]) for n in later) >= 0.9 * len(later)
    run_ok("train_retinanet", [*data, "--evaluate_only", out / "last", "--num_workers", "0", "--report_to", "none",
                               "--num_log_images", "0", "--output_dir", tmp_path / "eval"], capsys)  # exits 0
    del config["mean"], config["std"]
    (out / "last" / "model_config.json").write_text(json.dumps(config))
    code, _, err = run_main_fresh("train_retinanet", [*data, "--evaluate_only", out / "last", "--num_workers", "0",
                                                      "--report_to", "none", "--output_dir", tmp_path / "eval2"], capsys)
    assert code != 0 and 'lacks "mean" and "std"' in err and "Traceback" not in err


def run_main_fresh(name: str, argv: list, capsys):
    from helpers import fresh_accelerate, run_main

    fresh_accelerate()
    try:
        return run_main(name, argv, capsys)
    finally:
        fresh_accelerate()
