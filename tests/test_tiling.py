"""detlib.tiling: the tile grid, the mapping of a window's boxes back to the image, and the merge across windows, on
boxes worked out by hand (a box on a seam, a box larger than a tile, a box in the overlap of four tiles) and against
sahi's slicing and matching on the same grid (skipped where sahi is not installed: requirements-dev.txt)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from detlib.tiling import detect_tiled, merge_detections, tile_grid


def test_tile_grid_by_hand():
    # 300 x 200, 128 px tiles overlapping int(128 * 0.25) = 32 px: steps of 96; the last column and row end at the edge
    assert tile_grid(300, 200, 128, 0.25) == [(0, 0, 128, 128), (96, 0, 224, 128), (172, 0, 300, 128),
                                              (0, 72, 128, 200), (96, 72, 224, 200), (172, 72, 300, 200)]
    assert tile_grid(256, 128, 128, 0.0) == [(0, 0, 128, 128), (128, 0, 256, 128)]  # an exact fit: no extra window
    assert tile_grid(100, 50, 128, 0.2) == [(0, 0, 100, 50)]  # smaller than a tile: one window, the image
    assert tile_grid(300, 50, 128, 0.5) == [(0, 0, 128, 50), (64, 0, 192, 50), (128, 0, 256, 50), (172, 0, 300, 50)]


@pytest.mark.parametrize("tile, overlap", [(0, 0.2), (128, 1.0), (128, -0.1)])
def test_tile_grid_refuses_a_bad_grid(tile, overlap):
    with pytest.raises(ValueError, match="tile >= 1"):
        tile_grid(300, 200, tile, overlap)


def test_tile_grid_equals_sahi_slicing():
    slicing = pytest.importorskip("sahi.slicing")
    for width, height, tile, overlap in itertools.product((50, 128, 129, 300, 1023), (64, 200, 1000), (64, 128, 200),
                                                         (0.0, 0.1, 0.2, 0.25, 0.5, 0.9)):
        sahi = slicing.get_slice_bboxes(height, width, tile, tile, False, overlap, overlap)
        assert tile_grid(width, height, tile, overlap) == [tuple(b) for b in sahi], (width, height, tile, overlap)


def test_merge_by_hand():
    boxes = torch.tensor([[0, 0, 40, 40],     # a whole object
                          [20, 0, 40, 40],    # its right half, cut by a window's edge: IoU 0.5, IoS 1
                          [20, 0, 40, 40],    # the same half, another class: kept
                          [30, 30, 70, 70],   # overlaps the whole one by 10 x 10: IoS 100 / 1600, kept
                          [50, 50, 70, 90],   # IoS with the previous exactly 0.5 (400 / 800): not above, kept
                          [100, 0, 140, 40]], dtype=torch.float32)  # alone
    scores = torch.tensor([0.9, 0.95, 0.3, 0.8, 0.7, 0.6])
    labels = torch.tensor([0, 0, 1, 0, 0, 0])
    out = merge_detections(boxes, scores, labels)
    # the half scores higher than the whole here: the higher one is kept, as NMS keeps it
    assert out["scores"].tolist() == pytest.approx([0.95, 0.8, 0.7, 0.6, 0.3])
    assert out["boxes"].tolist() == [[20, 0, 40, 40], [30, 30, 70, 70], [50, 50, 70, 90], [100, 0, 140, 40],
                                     [20, 0, 40, 40]]
    assert out["labels"].tolist() == [0, 0, 0, 0, 1]
    empty = merge_detections(torch.zeros((0, 4)), torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    assert [v.shape[0] for v in empty.values()] == [0, 0, 0]


def test_merge_keeps_what_sahi_greedy_matching_keeps():
    combine = pytest.importorskip("sahi.postprocess.combine")
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = 60
        xy = torch.rand((n, 2), generator=g) * 200
        wh = torch.rand((n, 2), generator=g) * 60 + 2
        boxes = torch.cat((xy, xy + wh), dim=1)
        scores = torch.rand(n, generator=g)
        labels = torch.randint(0, 3, (n,), generator=g)
        ours = merge_detections(boxes, scores, labels)
        sahi = combine.batched_greedy_nmm(torch.cat((boxes, scores[:, None], labels[:, None].float()), 1).numpy(),
                                          "IOS", 0.5)
        kept = sorted(sahi, key=lambda i: -float(scores[i]))
        assert ours["scores"].tolist() == scores[kept].tolist(), trial
        assert torch.equal(ours["boxes"], boxes[kept])


# ---- windows detected and mapped back: an oracle detector that sees the objects drawn in its window

OBJECT_CLASS = {1: 0, 2: 1, 3: 0, 4: 2}  # pixel value in channel 0 -> class; 0 is background


def oracle(objects: dict[int, tuple]):
    """A `detect` for `detect_tiled`: in each item of the batch, the box of every object value visible in it (in the
    item's pixels), scored 0.9 x its visible share of the whole object, + value / 1000 (no ties)."""
    def detect(batch):
        out = []
        for image, (h, w) in zip(batch["images"], batch["image_sizes"].tolist()):
            plane = image[0, :h, :w]  # the batch's padding cut off
            boxes, scores, labels = [], [], []
            for value, (x0, y0, x1, y1) in objects.items():
                ys, xs = torch.nonzero(plane == value, as_tuple=True)
                if len(xs):
                    box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
                    share = (box[2] - box[0]) * (box[3] - box[1]) / ((x1 - x0) * (y1 - y0))
                    boxes.append(box)
                    scores.append(0.9 * share + value / 1000)
                    labels.append(OBJECT_CLASS[value])
            out.append({"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                        "scores": torch.tensor(scores), "labels": torch.tensor(labels, dtype=torch.int64)})
        return out
    return detect


def draw(width: int, height: int, objects: dict[int, tuple]) -> torch.Tensor:
    image = torch.zeros((3, height, width), dtype=torch.uint8)
    for value, (x0, y0, x1, y1) in objects.items():
        image[0, y0:y1, x0:x1] = value
    return image


def detected(image, objects, **kw) -> list[tuple]:
    d = detect_tiled(oracle(objects), image, None, 100, 0.2, **kw)
    return [(tuple(b), round(s, 4), c) for b, s, c in zip(d["boxes"].int().tolist(), d["scores"].tolist(),
                                                          d["labels"].tolist())]


def test_a_box_on_a_seam_and_one_in_the_overlap_are_found_once():
    """180 x 100 px, 100 px tiles overlapping 20: windows x 0-100 and 80-180. Object 1 ends exactly on the first
    window's right edge (x = 100): whole there, cut at x = 80 in the second; object 2 lies in both windows whole."""
    objects = {1: (60, 10, 100, 40), 2: (85, 60, 95, 90)}
    found = detected(draw(180, 100, objects), objects)
    assert found == [((85, 60, 95, 90), 0.902, 1), ((60, 10, 100, 40), 0.901, 0)]  # by score


def test_a_box_larger_than_a_tile_is_whole_only_with_the_full_image_pass():
    """Object 4 (160 px wide) is larger than a tile: each window sees a fragment, which do not match each other (IoS
    0.22); with `full` the whole image's box is found and both fragments lie inside it."""
    objects = {4: (10, 10, 170, 90)}
    image = draw(180, 100, objects)
    assert detected(image, objects) == [((10, 10, 100, 90), round(0.9 * 90 / 160 + 0.004, 4), 2),
                                        ((80, 10, 170, 90), round(0.9 * 90 / 160 + 0.004, 4), 2)]
    assert detected(image, objects, full=True) == [((10, 10, 170, 90), 0.904, 2)]


def test_a_box_in_the_overlap_of_four_tiles_is_found_once_in_image_pixels():
    """180 x 180 px: four windows at (0, 0), (80, 0), (0, 80), (80, 80); object 3 lies in all four, object 1 only in
    the last (its box shifted by (80, 80) back to the image)."""
    objects = {3: (85, 85, 95, 95), 1: (150, 150, 170, 175)}
    found = detected(draw(180, 180, objects), objects)
    assert found == [((85, 85, 95, 95), 0.903, 0), ((150, 150, 170, 175), 0.901, 0)]


def test_tiled_detections_do_not_depend_on_the_tile_batch():
    """The same tiles in batches of 1 (filled to 2), 3 and 8 give the same detections (a real model's outputs)."""
    from detlib.data import build_transform
    from detlib.retinanet import AnchorGenerator, decode_detections
    from detlib.retinanet.model import build_retinanet_from_config

    torch.manual_seed(0)
    model = build_retinanet_from_config({"num_classes": 3, "backbone": "resnet18", "fpn_channels": 16,
                                        "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}).eval()
    anchors = AnchorGenerator()

    @torch.no_grad()
    def decode(batch):
        out = model(batch["images"])
        a, counts = anchors(*batch["images"].shape[-2:])
        return decode_detections(out["cls_logits"], out["box_deltas"], a, counts, batch["image_sizes"],
                                 batch["scales"], score_thresh=0.0).per_image(len(batch["image_ids"]))

    image = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 150, 230), dtype=np.uint8))
    runs = [detect_tiled(decode, image, build_transform(64), 96, 0.25, batch_size=b) for b in (1, 3, 8)]
    assert len(runs[0]["scores"]) > 0
    for run in runs[1:]:
        assert all(torch.equal(run[k], runs[0][k]) for k in ("boxes", "scores", "labels"))
    assert float(runs[0]["boxes"][:, 2].max()) > 96  # boxes of the later windows are in the image's pixels


def test_detect_tiled_refuses_an_image_that_is_not_3_h_w_uint8():
    with pytest.raises(ValueError, match=r"\[3, H, W\] uint8"):
        detect_tiled(oracle({}), torch.zeros((100, 100, 3), dtype=torch.uint8), None, 64, 0.2)
