"""The augmentation presets of `--augmentation` (detlib.data.transforms), each over many seeded samples: boxes inside
the image, each box still on its own object (so kept with its label), and the preset doing what it says."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms.v2 import functional as F

from conftest import write_coco
from detlib.data import AUGMENTATIONS, CocoDetection, build_transform
from detlib.data.transforms import PAD_VALUE

SIDE = 96
# three squares on black, the colour channel of each is its label: red 0, green 1, blue 2
OBJECTS = [(0, [10, 10, 30, 30]), (1, [60, 20, 40, 24]), (2, [30, 60, 26, 30])]  # (label, xywh)


@pytest.fixture(scope="module")
def three_squares(tmp_path_factory):
    root = tmp_path_factory.mktemp("aug")
    image = torch.zeros(3, 100, 120, dtype=torch.uint8)
    for label, (x, y, w, h) in OBJECTS:
        image[label, y:y + h, x:x + w] = 255
    (root / "img").mkdir()
    F.to_pil_image(image).save(root / "img" / "a.png")
    return write_coco(root / "ann.json", [{"id": 1, "file_name": "a.png", "width": 120, "height": 100}],
                      [{"image_id": 1, "category_id": label + 1, "bbox": xywh} for label, xywh in OBJECTS],
                      [{"id": i + 1, "name": n} for i, n in enumerate(["red", "green", "blue"])]), root / "img"


def samples(three_squares, augmentation: str, n: int = 60) -> list[dict]:
    """The image's sample in epochs 0..n-1 of a seeded training set (the stream a run uses)."""
    ann, img = three_squares
    ds = CocoDetection(str(img), str(ann), build_transform(SIDE, augmentation), seed=0)
    out = []
    for epoch in range(n):
        ds.set_epoch(epoch)
        out.append(ds[0])
    return out


PRESETS = ("none", "flip", "flip_crop_translate", "photometric", "scale_jitter")  # the choices of --augmentation


def test_the_flag_offers_every_preset_tested_here():
    assert AUGMENTATIONS == PRESETS


@pytest.mark.parametrize("augmentation", PRESETS)
def test_every_preset_keeps_boxes_inside_the_image_and_on_their_own_object(three_squares, augmentation):
    kept = 0
    for s in samples(three_squares, augmentation):
        image, boxes, labels = s["image"], s["boxes"], s["labels"]
        h, w = image.shape[-2:]
        assert (h, w) == (SIDE, SIDE) if augmentation == "scale_jitter" else max(h, w) == SIDE
        assert labels.dtype == torch.int64 and len(labels) == len(boxes) and len(set(labels.tolist())) == len(labels)
        assert ((boxes[:, 0] >= 0) & (boxes[:, 1] >= 0) & (boxes[:, 2] <= w) & (boxes[:, 3] <= h)).all(), boxes
        assert ((boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)).all(), boxes
        for (x1, y1, x2, y2), label in zip(boxes.tolist(), labels.tolist()):
            # the middle half of the box (resizing blurs the edges): the label's colour channel is the brightest
            mx, my = (x2 - x1) / 4, (y2 - y1) / 4
            inside = image[:, round(y1 + my):round(y2 - my), round(x1 + mx):round(x2 - mx)].float()
            if inside.numel():
                kept += 1
                assert int(inside.mean(dim=(1, 2)).argmax()) == label, (augmentation, label, inside.mean(dim=(1, 2)))
    assert kept >= 60  # most boxes checked (scale_jitter shrinks or crops some away)


def test_the_presets_change_what_they_say(three_squares):
    def red_box(s):  # the red square's box and its mean red value
        (i,) = (s["labels"] == 0).nonzero()[:, 0].tolist() or [None]
        if i is None:
            return None, None
        x1, y1, x2, y2 = s["boxes"][i].tolist()
        return s["boxes"][i], s["image"][0, round(y1) + 2:round(y2) - 2, round(x1) + 2:round(x2) - 2].float().mean()

    none = [red_box(s) for s in samples(three_squares, "none", 10)]
    assert len({tuple(b.tolist()) for b, _ in none}) == 1  # no augmentation: the same sample every epoch
    photometric = [v for _, v in map(red_box, samples(three_squares, "photometric")) if v is not None]
    flip = [v for _, v in map(red_box, samples(three_squares, "flip")) if v is not None]
    assert max(flip) - min(flip) < 2 and max(photometric) - min(photometric) > 40  # colour jitter on top of the geometry
    widths = [float(b[2] - b[0]) for b, _ in map(red_box, samples(three_squares, "scale_jitter")) if b is not None]
    # the red square is 30 px of 120 (24 px at SIDE): the jitter's factor 0.1-2.0 gives about 2.4-48 px, crops less
    assert min(widths) < 8 and max(widths) > 35
    padded = [s["image"] for s in samples(three_squares, "scale_jitter", 20)]
    assert any((im[:, -1, -1] == torch.tensor(PAD_VALUE, dtype=torch.uint8)).all() for im in padded)  # shrunk: padded
