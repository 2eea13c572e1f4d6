"""COCO data set, transforms and collate: bad inputs B01-B05, B07, B08, B24, B26, B30 and clear errors."""

import logging
import math

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from detlib.data.coco import PAD_VALUE, CocoDetection, collate_detection
from detlib.data.transforms import build_transform
from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.loss import retinanet_loss

from conftest import COCO_SUBSET, needs_coco_subset, write_coco, write_image


def _dataset(tmp_path, images, annotations, categories=None, transform=None, **kw):
    for im in images:
        write_image(tmp_path / "img" / im["file_name"], im["width"], im["height"], seed=im["id"])
    ann = write_coco(tmp_path / "ann.json", images, annotations, categories)
    return CocoDetection(str(tmp_path / "img"), str(ann), transform, **kw)


def test_image_without_annotations_case_b01(tmp_path):
    images = [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 64}, {"id": 2, "file_name": "b.jpg", "width": 64, "height": 64}]
    ds = _dataset(tmp_path, images, [{"image_id": 1, "category_id": 1, "bbox": [5, 5, 20, 20]}])
    empty = ds[1]
    assert empty["image_id"] == 2
    assert empty["boxes"].shape == (0, 4) and empty["labels"].shape == (0,)
    batch = collate_detection([empty])
    anchors, _ = AnchorGenerator()(*batch["images"].shape[-2:])
    A = anchors.shape[0]
    out = retinanet_loss(torch.zeros(1, A, 1), torch.zeros(1, A, 4), anchors, batch["boxes"], batch["labels"], batch["crowd_boxes"])
    assert out["cls_loss"].item() > 0 and math.isfinite(out["cls_loss"].item()) and out["box_loss"].item() == 0.0


def test_degenerate_boxes_dropped_with_ids_logged_case_b02(tmp_path, caplog):
    images = [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 100}]
    anns = [{"id": 11, "image_id": 1, "category_id": 1, "bbox": [10, 10, 0, 5]},
            {"id": 12, "image_id": 1, "category_id": 1, "bbox": [50, 50, -5, 10]},
            {"id": 13, "image_id": 1, "category_id": 1, "bbox": [20, 20, 30, 30]}]
    with caplog.at_level(logging.WARNING):
        ds = _dataset(tmp_path, images, anns)
    assert ds.num_dropped_boxes == 2
    assert "[11, 12]" in caplog.text
    assert ds[0]["boxes"].tolist() == [[20.0, 20.0, 50.0, 50.0]]


def test_boxes_outside_the_image_case_b03(tmp_path, caplog):
    images = [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 100}]
    anns = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [90, 90, 30, 30]},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [150, 150, 10, 10]},
            {"id": 3, "image_id": 1, "category_id": 1, "bbox": [53, 89, 7, 26]}]
    with caplog.at_level(logging.WARNING):
        ds = _dataset(tmp_path, images, anns)
    assert "[2]" in caplog.text  # the fully-outside box is named
    # partly outside -> clipped; valid xywh -> xyxy once (its y2 115 is clipped to the 100 px image)
    assert ds[0]["boxes"].tolist() == [[90.0, 90.0, 100.0, 100.0], [53.0, 89.0, 60.0, 100.0]]


def test_crowd_only_image_and_crowd_only_set_case_b05(tmp_path):
    images = [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 64}]
    anns = [{"image_id": 1, "category_id": 1, "bbox": [20, 10, 40, 30], "iscrowd": 1}]
    ds = _dataset(tmp_path, images, anns)
    s = ds[0]
    assert s["boxes"].shape == (0, 4) and s["crowd_boxes"].tolist() == [[20.0, 10.0, 60.0, 40.0]]
    assert ds.num_target_boxes() == 0  # the training script stops early on this (tested end to end)
    with_crowd = CocoDetection(str(tmp_path / "img"), str(tmp_path / "ann.json"), include_crowd=True)
    assert with_crowd[0]["boxes"].shape == (1, 4) and with_crowd[0]["crowd_boxes"].shape == (0, 4)


def test_non_contiguous_categories_map_to_contiguous_labels_case_b07(tmp_path):
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 64, "height": 64} for i in (1, 2, 3)]
    cats = [{"id": 7, "name": "c"}, {"id": 1, "name": "a"}, {"id": 3, "name": "b"}]
    anns = [{"image_id": i, "category_id": c, "bbox": [4, 4, 30, 30]} for i, c in ((1, 1), (2, 3), (3, 7))]
    ds = _dataset(tmp_path, images, anns, cats)
    assert [int(ds[i]["labels"][0]) for i in range(3)] == [0, 1, 2]
    assert ds.category_map.to_category_ids(torch.tensor([0, 1, 2])).tolist() == [1, 3, 7]
    assert ds.category_map.names == ["a", "b", "c"]


def test_json_image_ids_are_kept_case_b08(tmp_path):
    images = [{"id": 1002, "file_name": "b.jpg", "width": 64, "height": 64}, {"id": 1001, "file_name": "a.jpg", "width": 64, "height": 64}]
    ds = _dataset(tmp_path, images, [])
    ids = [ds[i]["image_id"] for i in range(2)]
    assert ids == [1001, 1002] and all(type(i) is int for i in ids)
    assert collate_detection([ds[0], ds[1]])["image_ids"].tolist() == [1001, 1002]


def test_truncated_jpeg_in_coco_folder_case_b24(tmp_path, caplog):
    images = [{"id": 1, "file_name": "t.jpg", "width": 64, "height": 48}]
    ds = _dataset(tmp_path, images, [{"image_id": 1, "category_id": 1, "bbox": [4, 4, 30, 30]}])
    path = tmp_path / "img" / "t.jpg"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with caplog.at_level(logging.WARNING):
        s = ds[0]
    assert s["valid"] and s["image"].shape == (3, 48, 64)
    assert "truncated" in caplog.text


def test_unreadable_image_is_skipped_in_training_and_flagged_in_evaluation(tmp_path, caplog):
    images = [{"id": 1, "file_name": "bad.jpg", "width": 64, "height": 64}, {"id": 2, "file_name": "ok.jpg", "width": 64, "height": 64}]
    ann = [{"image_id": 2, "category_id": 1, "bbox": [4, 4, 30, 30]}]
    train = _dataset(tmp_path, images, ann)
    (tmp_path / "img" / "bad.jpg").write_text("this is not a jpeg")
    with caplog.at_level(logging.WARNING):
        s = train[0]
    assert s["image_id"] == 2 and "bad.jpg" in caplog.text
    val = CocoDetection(str(tmp_path / "img"), str(tmp_path / "ann.json"), train=False)
    s = val[0]
    assert s["image_id"] == 1 and s["valid"] is False


def test_zero_byte_and_missing_files_left_out_at_start(tmp_path, caplog):
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 32, "height": 32} for i in (1, 2, 3)]
    write_image(tmp_path / "img" / "1.jpg", 32, 32)
    (tmp_path / "img" / "2.jpg").write_bytes(b"")
    ann = write_coco(tmp_path / "ann.json", images, [])
    with caplog.at_level(logging.WARNING):
        ds = CocoDetection(str(tmp_path / "img"), str(ann))
    assert len(ds) == 1 and "2 images" in caplog.text and "2.jpg (empty file)" in caplog.text
    # scripts/predict_retinanet.py lists these in skipped.txt
    img = tmp_path / "img"
    assert ds.missing_images == [f"{img / '2.jpg'} (empty file)", f"{img / '3.jpg'} (missing)"]


@pytest.mark.parametrize("mode,fmt,ext", [("L", "JPEG", "jpg"), ("CMYK", "JPEG", "jpg"), ("RGBA", "PNG", "png"), ("P", "PNG", "png")])
def test_colour_modes_become_rgb_case_b26(tmp_path, mode, fmt, ext):
    images = [{"id": 1, "file_name": f"x.{ext}", "width": 40, "height": 30}]
    write_image(tmp_path / "img" / f"x.{ext}", 40, 30, mode=mode, fmt=fmt)
    ann = write_coco(tmp_path / "ann.json", images, [{"image_id": 1, "category_id": 1, "bbox": [4, 4, 20, 20]}])
    ds = CocoDetection(str(tmp_path / "img"), str(ann), build_transform(64, "flip_crop_translate"))
    assert Image.open(tmp_path / "img" / f"x.{ext}").mode == mode
    batch = collate_detection([ds[0], ds[0]])
    assert batch["images"].shape[:2] == (2, 3) and batch["images"].dtype == torch.uint8


class _TopLeftCrop:
    def __call__(self, sample):
        out = dict(sample)
        out["image"] = F.crop(sample["image"], 0, 0, 50, 50)
        out["boxes"] = F.clamp_bounding_boxes(F.crop(sample["boxes"], 0, 0, 50, 50))
        return out


def test_crop_that_removes_every_box_case_b30(tmp_path):
    images = [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 100}]
    tf = v2.Compose([_TopLeftCrop(), build_transform(64, "none")])
    ds = _dataset(tmp_path, images, [{"image_id": 1, "category_id": 1, "bbox": [80, 80, 10, 10]}], transform=tf)
    s = ds[0]
    assert s["boxes"].shape == (0, 4) and s["labels"].shape == (0,) and s["labels"].dtype == torch.int64
    batch = collate_detection([s])
    anchors, _ = AnchorGenerator()(*batch["images"].shape[-2:])
    A = anchors.shape[0]
    out = retinanet_loss(torch.zeros(1, A, 1), torch.zeros(1, A, 4), anchors, batch["boxes"], batch["labels"])
    assert math.isfinite(out["loss"].item()) and out["box_loss"].item() == 0.0


def test_augmentation_keeps_boxes_on_the_objects(tmp_path):
    # a white square on black: after any flip / crop / translate / resize the box still frames white pixels
    img = torch.zeros(3, 100, 120, dtype=torch.uint8)
    img[:, 30:60, 40:80] = 255
    (tmp_path / "img").mkdir()
    F.to_pil_image(img).save(tmp_path / "img" / "a.png")
    ann = write_coco(tmp_path / "ann.json", [{"id": 1, "file_name": "a.png", "width": 120, "height": 100}],
                     [{"image_id": 1, "category_id": 1, "bbox": [40, 30, 40, 30]}])
    ds = CocoDetection(str(tmp_path / "img"), str(ann), build_transform(96, "flip_crop_translate"))
    torch.manual_seed(0)
    for _ in range(20):
        s = ds[0]
        assert max(s["image"].shape[-2:]) == 96
        for x1, y1, x2, y2 in s["boxes"].round().int().tolist():
            inside = s["image"][0, y1 + 2:y2 - 2, x1 + 2:x2 - 2].float()
            if inside.numel():
                assert inside.mean() > 200


def test_collate_pads_to_multiple_of_32_with_mean_colour(tmp_path):
    images = [{"id": 1, "file_name": "a.jpg", "width": 70, "height": 40}, {"id": 2, "file_name": "b.jpg", "width": 30, "height": 90}]
    ds = _dataset(tmp_path, images, [{"image_id": 1, "category_id": 1, "bbox": [1, 1, 20, 20]}], transform=build_transform(90, "none"))
    b = collate_detection([ds[0], ds[1]])
    assert set(b) == {"images", "boxes", "labels", "crowd_boxes", "image_ids", "image_sizes", "scales", "valid"}
    assert b["images"].shape == (2, 3, 96, 96)
    assert b["image_sizes"].tolist() == [[51, 90], [90, 30]]
    assert b["images"][0, :, 95, 95].tolist() == list(PAD_VALUE)
    assert b["labels"].tolist() == [[0], [-1]] and b["boxes"].shape == (2, 1, 4)
    torch.testing.assert_close(b["scales"][0], torch.tensor([51 / 40, 90 / 70]))


def test_missing_paths_fail_at_start_naming_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CocoDetection(str(tmp_path), str(tmp_path / "nope.json"))
    ann = write_coco(tmp_path / "ann.json", [], [])
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        CocoDetection(str(tmp_path / "no_such_dir"), str(ann))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        CocoDetection(str(tmp_path), str(tmp_path / "bad.json"))


@needs_coco_subset
def test_real_coco_subset_loads():
    ds = CocoDetection(str(COCO_SUBSET / "images"), str(COCO_SUBSET / "annotations" / "instances_val.json"),
                       build_transform(320, "none"), train=False)
    assert len(ds) == 30 and ds.num_classes == 80
    s = ds[0]
    assert max(s["image"].shape[-2:]) == 320 and s["boxes"].shape[1] == 4


def test_resize_longer_side_or_shorter_side_with_cap():
    from detlib.data.transforms import ResizeKeepAspect, make_sample

    sample = make_sample(torch.zeros(3, 100, 200, dtype=torch.uint8), torch.tensor([[10.0, 10.0, 110.0, 60.0]]),
                         torch.tensor([0]), torch.tensor([False]))
    longer = ResizeKeepAspect(160)(sample)
    assert longer["image"].shape[-2:] == (80, 160) and longer["scale"] == (0.8, 0.8)
    assert longer["boxes"].tolist() == [[8.0, 8.0, 88.0, 48.0]]
    capped = ResizeKeepAspect(80, max_size=120)(sample)  # shorter side 80 would make the longer 160 > 120
    assert capped["image"].shape[-2:] == (60, 120)
    shorter = ResizeKeepAspect(80, max_size=1333)(sample)
    assert shorter["image"].shape[-2:] == (80, 160)


def test_translation_fills_the_uncovered_area_with_the_padding_colour():
    from torchvision.transforms import v2

    from detlib.data.transforms import PAD_VALUE, build_transform, make_sample

    (apply,) = [t for t in build_transform(64, "flip_crop_translate").transforms if isinstance(t, v2.RandomApply)]
    affine = apply.transforms[0]
    white = torch.full((3, 64, 64), 255, dtype=torch.uint8)
    torch.manual_seed(0)
    uncovered = 0
    for _ in range(5):
        out = affine(make_sample(white, torch.tensor([[8.0, 8.0, 40.0, 40.0]]), torch.tensor([1]), torch.tensor([False])))
        pixels = out["image"].reshape(3, -1).T
        moved = pixels[(pixels != 255).any(dim=1)]
        uncovered += len(moved)
        assert all(tuple(p) == PAD_VALUE for p in moved.tolist())
    assert uncovered > 0  # the translations did uncover some area


def test_load_skipping_unreadable_skips_in_training_stands_in_for_evaluation_and_gives_up_on_a_run():
    from detlib.data.images import MAX_UNREADABLE_IN_A_ROW, load_skipping_unreadable

    bad = {1, 2}

    def load(i):
        if i in bad:
            raise OSError(f"file {i} is damaged")
        return f"image {i}"

    def placeholder(i, error):
        return f"placeholder {i} ({error})"

    assert load_skipping_unreadable(load, 1, 5, True, placeholder) == "image 3"  # the next readable one
    assert load_skipping_unreadable(load, 4, 5, True, placeholder) == "image 4"
    assert load_skipping_unreadable(load, 1, 5, False, placeholder) == "placeholder 1 (file 1 is damaged)"
    bad = set(range(100))
    with pytest.raises(RuntimeError, match="^3 images in a row starting at index 0"):
        load_skipping_unreadable(load, 0, 3, True, placeholder)  # a small set: every image tried once
    with pytest.raises(RuntimeError, match=f"^{MAX_UNREADABLE_IN_A_ROW} images in a row starting at index 7"):
        load_skipping_unreadable(load, 7, 100, True, placeholder)
