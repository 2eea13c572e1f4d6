"""detlib.classification and the pieces of scripts/train_catsdogs.py that run in-process (no launch).

Bad-input cases of ../shared/cases/README.md: B18, B23, B24, B25, B26, B27 (B13, B16, B19, B21, B31 are in
test_catsdogs_launch.py, they need `accelerate launch`).
"""

from __future__ import annotations

import logging
import math
import os
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from detlib.classification import (build_classifier, classification_metrics, classification_transform,
                                   load_pretrained_weights)
from detlib.data.builtin import STRIPES_CLASSES, make_synthetic_image_folder
from detlib.data.imagefolder import ImageFolderDataset, find_classes, scan_image_folder
from detlib.datacheck.imagefolder import check_folder_scans
from detlib.weights import load_model_weights
from helpers import _noise, make_bad_folder, make_tiny_folder, write_good_images
from helpers import load_script as _load_script

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def load_script():
    """scripts/train_catsdogs.py as a module (scripts/ is not a package)."""
    return _load_script("train_catsdogs", register=True)


# ---- class discovery and the folder scan (B24, B25, B27)

def test_case_b27_hidden_folder_is_not_a_class(tmp_path):
    bad = make_bad_folder(tmp_path / "train")
    val = tmp_path / "val"
    write_good_images(val / "cats", 1, 3)
    write_good_images(val / "dogs", 1, 4)
    classes, class_to_idx, hidden = find_classes(str(bad.root))
    assert classes == ["cats", "dogs"] and class_to_idx == {"cats": 0, "dogs": 1}
    assert hidden == [".ipynb_checkpoints"]
    assert find_classes(str(val))[1] == class_to_idx
    scan = scan_image_folder(str(bad.root))
    assert all(".ipynb_checkpoints" not in p for p, _ in scan.samples)


def test_case_b24_b25_scan_skips_unreadable_files_with_reasons(tmp_path):
    bad = make_bad_folder(tmp_path / "train")
    scan = scan_image_folder(str(bad.root), num_threads=2)
    assert sorted(Path(p) for p, _ in scan.samples) == sorted(bad.good)
    reasons = {Path(p).name: r for p, r in scan.skipped}
    assert set(reasons) == set(bad.skipped)
    for name, word in bad.skipped.items():
        assert reasons[name].startswith(word), (name, reasons[name])
    assert sorted(Path(p).name for p in scan.ignored) == sorted(bad.ignored)
    labels = {Path(p).name: t for p, t in scan.samples}
    assert labels["cmyk.jpg"] == 0 and labels["pal.png"] == 1
    assert scan.class_counts() == [6 + 2, 6 + 2]
    _, report = check_folder_scans({"train": scan})
    left_out = [f for f in report.findings if f.message.startswith("image files that cannot be read")]
    assert [f.message for f in left_out] == ["image files that cannot be read: left out (1 empty file, 1 not an "
                                             "image, 1 truncated)"] and left_out[0].count == 3, report.findings
    assert any("trunc.jpg (truncated)" in e for e in left_out[0].examples)
    assert report.summaries["train"]["ignored files"].startswith("3 (")
    # header-only checking cannot see truncation: the truncated file is kept, the others still skipped
    header = scan_image_folder(str(bad.root), verify="header")
    assert {Path(p).name for p, _ in header.skipped} == {"0.jpg", "fake.jpg"}


def test_scan_cache_is_reused_and_invalidated(tmp_path):
    bad = make_bad_folder(tmp_path / "train")
    cache = tmp_path / "cache.json"
    first = scan_image_folder(str(bad.root), cache_file=str(cache))
    assert cache.is_file()
    import detlib.data.imagefolder as folder

    calls = []
    real_check = folder.check_image_file
    folder.check_image_file = lambda *a, **k: calls.append(a) or real_check(*a, **k)
    try:
        second = scan_image_folder(str(bad.root), cache_file=str(cache))
        assert calls == []  # every result came from the cache
        assert second.samples == first.samples and second.skipped == first.skipped
        (bad.root / "cats" / "0.jpg").write_bytes((bad.root / "cats" / "img_000.jpg").read_bytes())  # repaired
        third = scan_image_folder(str(bad.root), cache_file=str(cache))
        assert [Path(a[0]).name for a in calls] == ["0.jpg"]
        assert len(third.samples) == len(first.samples) + 1
    finally:
        folder.check_image_file = real_check


def test_class_mapping_mismatch_is_a_clear_error(tmp_path):
    write_good_images(tmp_path / "train" / "cats", 2, 1)
    write_good_images(tmp_path / "train" / "dogs", 2, 2)
    write_good_images(tmp_path / "val" / "cats", 1, 3)
    write_good_images(tmp_path / "val" / "dogz", 1, 4)
    with pytest.raises(ValueError, match=r"only in train \['dogs'\], only in val \['dogz'\]"):
        scan_image_folder(str(tmp_path / "val"), class_to_idx={"cats": 0, "dogs": 1})
    script = load_script()
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), verify_images="full", image_size=32, num_workers=0,
                           per_device_batch_size=2, per_device_eval_batch_size=2)
    with pytest.raises(ValueError, match="class folders differ"):
        script.build_dataloaders(args, {"train_dir": str(tmp_path / "train"), "val_dir": str(tmp_path / "val")})


def test_missing_folder_and_folder_without_classes(tmp_path):
    with pytest.raises(FileNotFoundError, match="image folder not found"):
        find_classes(str(tmp_path / "nope"))
    write_good_images(tmp_path / "flat", 2, 1)  # images directly in the root: not an ImageFolder
    with pytest.raises(ValueError, match="no class folders"):
        find_classes(str(tmp_path / "flat"))


# ---- colour modes (B26)

def test_case_b26_every_mode_becomes_3_channels_and_batches_stack(tmp_path):
    bad = make_bad_folder(tmp_path / "train")
    scan = scan_image_folder(str(bad.root))
    raw = ImageFolderDataset(scan, transform=None, train=False)
    by_name = {Path(p).name: raw[i] for i, (p, _) in enumerate(scan.samples)}
    for name in ("gray.jpg", "cmyk.jpg", "alpha.png", "pal.png", "img_000.jpg"):
        image = by_name[name]["image"]
        assert image.dtype == torch.uint8 and image.shape == (3, 40, 40), (name, image.shape)
    gray = by_name["gray.jpg"]["image"]
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    alpha = by_name["alpha.png"]["image"]  # alpha dropped, colour kept exactly (PNG is lossless)
    assert torch.equal(alpha, torch.from_numpy(_noise(10, 40)).permute(2, 0, 1))

    ds = ImageFolderDataset(scan, classification_transform(24, train=True), train=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=len(ds), shuffle=False)
    batch = next(iter(loader))
    assert batch["image"].shape == (len(ds), 3, 24, 24) and batch["image"].dtype == torch.float32
    assert batch["label"].tolist() == [t for _, t in scan.samples]
    assert batch["index"].tolist() == list(range(len(ds)))
    assert torch.isfinite(batch["image"]).all()


def test_val_transform_is_deterministic_resize_and_centre_crop():
    img = Image.fromarray(_noise(3, 100)[:, :80].copy())  # 80 wide, 100 high
    t = classification_transform(32, train=False)
    a, b = t(img), t(img)
    assert a.shape == (3, 32, 32) and torch.equal(a, b)
    flat = t(Image.new("RGB", (80, 100), (124, 116, 104)))  # the ImageNet mean colour -> about 0
    assert flat.abs().max() < 0.02


def test_file_broken_after_the_scan_never_crashes(tmp_path):
    root = tmp_path / "train"
    write_good_images(root / "a", 3, 1)
    write_good_images(root / "b", 3, 2)
    scan = scan_image_folder(str(root))
    (root / "a" / "img_001.jpg").write_bytes(b"")  # damaged after the start-up check
    train = ImageFolderDataset(scan, classification_transform(16, train=True), train=True)
    item = train[1]
    assert item["index"] == 2  # the next image instead
    val = ImageFolderDataset(scan, classification_transform(16, train=False), train=False)
    item = val[1]
    assert item["index"] == 1 and item["label"] == 0 and item["image"].shape == (3, 16, 16)


def test_shared_odd_files_load(tmp_path):
    odd = SHARED_DATA / "catsdogs" / "odd"
    if not odd.is_dir():
        pytest.skip(f"shared test data not found at {odd}")
    scan = scan_image_folder(str(odd))
    assert scan.classes == ["cat", "dog"] and len(scan.samples) == 3 and not scan.skipped
    ds = ImageFolderDataset(scan, classification_transform(32, train=False), train=False)
    shapes = {tuple(ds[i]["image"].shape) for i in range(len(ds))}
    assert shapes == {(3, 32, 32)}


def test_built_in_data_set_is_seeded_and_cached(tmp_path):
    a = make_synthetic_image_folder(str(tmp_path / "a"), num_train=3, num_val=2, image_size=24)
    b = make_synthetic_image_folder(str(tmp_path / "b"), num_train=3, num_val=2, image_size=24)
    scan = scan_image_folder(a["train_dir"])
    assert scan.classes == list(STRIPES_CLASSES) and scan.class_counts() == [3, 3] and not scan.skipped
    assert scan_image_folder(a["val_dir"]).class_counts() == [2, 2]
    files = sorted(Path(a["train_dir"]).rglob("*.jpg"))
    assert [f.read_bytes() for f in files] == [f.read_bytes() for f in sorted(Path(b["train_dir"]).rglob("*.jpg"))]
    mtimes = [f.stat().st_mtime_ns for f in files]
    make_synthetic_image_folder(str(tmp_path / "a"), num_train=3, num_val=2, image_size=24)  # reused, not rewritten
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    horizontal = np.asarray(Image.open(files[0]).convert("L"), dtype=np.float32)
    # stripes along rows: the rows vary far less along themselves than the columns do
    assert horizontal.std(axis=1).mean() < horizontal.std(axis=0).mean()


# ---- the model and its weights (B18)

def test_resnet18_head_and_timm_model():
    model = build_classifier("resnet18", 3)
    assert isinstance(model.fc, torch.nn.Linear) and (model.fc.in_features, model.fc.out_features) == (512, 3)
    model.eval()
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 3)
    tiny = build_classifier("test_resnet", 2).eval()
    assert tiny(torch.zeros(1, 3, 32, 32)).shape == (1, 2)
    with pytest.raises(ValueError, match="unknown model 'resnet_doesnotexist'"):
        build_classifier("resnet_doesnotexist", 2)


def test_case_b18_wrapper_prefixes_are_stripped(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = build_classifier("test_resnet", 2).eval()
    x = torch.randn(2, 3, 32, 32)
    expected = src(x)
    sd = src.state_dict()
    save_file({f"module.{k}": v.contiguous() for k, v in sd.items()}, str(tmp_path / "ddp.safetensors"))
    torch.save({f"_orig_mod.{k}": v for k, v in sd.items()}, tmp_path / "compiled.pt")
    for f in ("ddp.safetensors", "compiled.pt"):
        for load in (lambda m: load_model_weights(m, str(tmp_path / f)),
                     lambda m: load_pretrained_weights(m, str(tmp_path / f))):
            torch.manual_seed(1)
            dst = build_classifier("test_resnet", 2).eval()
            assert not torch.allclose(dst(x), expected)
            load(dst)
            assert torch.equal(dst(x), expected), f


def test_weights_with_another_classifier_keep_a_fresh_head(tmp_path):
    from safetensors.torch import save_file

    imagenet = build_classifier("resnet18", 1000)
    save_file({k: v.contiguous() for k, v in imagenet.state_dict().items()}, str(tmp_path / "in1k.safetensors"))
    model = build_classifier("resnet18", 2, weights=str(tmp_path / "in1k.safetensors"))
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)
    assert torch.equal(model.layer4[1].bn2.running_var, imagenet.layer4[1].bn2.running_var)
    assert model.fc.weight.shape == (2, 512)
    other = build_classifier("test_resnet", 2)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="does not fit this model"):
        build_classifier("resnet18", 2, weights=str(tmp_path / "other.safetensors"))


def test_pretrained_offline_is_a_clear_error(monkeypatch):
    import urllib.error

    import torchvision.models._api as api

    def offline(*a, **k):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(api, "load_state_dict_from_url", offline)
    monkeypatch.setenv("TORCH_HOME", "/nonexistent-torch-home")  # no cached download either
    with pytest.raises(RuntimeError, match=r"Offline\?.*--weights PATH"):
        build_classifier("resnet18", 2, pretrained=True)


# ---- metrics and schedule

def test_classification_metrics_by_hand():
    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    preds = torch.tensor([0, 0, 1, 1, 0, 1])
    m = classification_metrics(preds, labels, 3)
    assert m["confusion"] == [[2, 1, 0], [1, 1, 0], [0, 1, 0]]
    assert m["accuracy"] == pytest.approx(3 / 6)
    assert m["precision"] == pytest.approx([2 / 3, 1 / 3, 0.0])  # class 2 never predicted: 0, not NaN
    assert m["recall"] == pytest.approx([2 / 3, 1 / 2, 0.0])


def test_warmup_cosine_schedule_by_hand():
    from detlib.schedules import lr_factor, step_scheduler

    script = load_script()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = step_scheduler(opt, "cosine", 6, 2)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    c = lambda p: 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
    assert lrs == pytest.approx([0.5, 1.0, c(0), c(1 / 4), c(2 / 4), c(3 / 4)])
    assert script.WARMUP_FRACTION == 0.05  # the run resolves it once: 5 steps of a 100-step run
    assert lr_factor(0, "cosine", 100, round(script.WARMUP_FRACTION * 100)) == pytest.approx(1 / 5)


# ---- /dev/shm (B23)

def test_case_b23_small_shm_falls_back_to_no_workers(tmp_path, monkeypatch, caplog):
    import shutil

    root = make_tiny_folder(tmp_path, [4, 4])
    DiskUsage = namedtuple("DiskUsage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(64 * 2**20, 60 * 2**20, 4 * 2**20))
    script = load_script()
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), verify_images="full", image_size=224, num_workers=2,
                           per_device_batch_size=64, per_device_eval_batch_size=64, sampler="shuffle", seed=0)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # the request is not capped by this machine's cores
    with caplog.at_level(logging.WARNING):
        train_ds, val_ds, train_loader, val_loader = script.build_dataloaders(args, {"train_dir": str(root), "val_dir": str(root)})
    assert train_loader.num_workers == 0 and val_loader.num_workers == 0
    msg = [r.getMessage() for r in caplog.records if "/dev/shm" in r.getMessage()]
    assert len(msg) == 1 and "--shm-size" in msg[0] and "--ipc=host" in msg[0] and "num_workers=0" in msg[0]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(8 * 2**30, 0, 8 * 2**30))
    _, _, train_loader, _ = script.build_dataloaders(args, {"train_dir": str(root), "val_dir": str(root)})
    assert train_loader.num_workers == 2
