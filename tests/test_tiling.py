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


def merge(boxes, scores, labels, sources, windows):
    out = merge_detections(torch.tensor(boxes, dtype=torch.float32), torch.tensor(scores), torch.tensor(labels),
                           torch.tensor(sources), torch.tensor(windows, dtype=torch.float32))
    return [(tuple(b), round(s, 4), c) for b, s, c in zip(out["boxes"].tolist(), out["scores"].tolist(),
                                                          out["labels"].tolist())]


def test_merge_by_hand():
    """Windows 0: x 0-100 and 1: x 80-180 (a 20 px strip both saw). Boxes of one object in both windows agree in the
    strip; a box of window 1 is extended to where window 0's box of the object reaches beyond window 1."""
    windows = [(0, 0, 100, 100), (80, 0, 180, 100)]
    boxes = [(85, 10, 95, 30),   # 0: an object inside the strip, seen by both windows ...
             (86, 10, 95, 31),   # 1: ... window 1's box of it: IoU 0.86, dropped
             (86, 10, 95, 31),   # 2: the same box, another class: kept
             (10, 50, 100, 90),  # 3: an object cut by window 0's right edge (x = 100) ...
             (80, 50, 120, 90),  # 4: ... window 1's, cut by its left edge: the same in the strip (80-100), one object
             (85, 60, 95, 70),   # 5: a small box inside 4, of 4's window: its NMS kept both, so does the merge
             (150, 10, 170, 30)]  # 6: window 1 alone
    scores = [0.9, 0.95, 0.3, 0.5, 0.8, 0.7, 0.6]
    labels = [0, 0, 1, 0, 0, 0, 0]
    sources = [0, 1, 1, 0, 1, 1, 1]
    assert merge(boxes, scores, labels, sources, windows) == [
        ((86, 10, 95, 31), 0.95, 0),    # the higher-scored box of the object in the strip; no extension (inside)
        ((10, 50, 120, 90), 0.8, 0),    # 4 extended left past window 1's edge to where 3 reaches: the whole object
        ((85, 60, 95, 70), 0.7, 0),
        ((150, 10, 170, 30), 0.6, 0),
        ((86, 10, 95, 31), 0.3, 1)]
    empty = merge_detections(torch.zeros((0, 4)), torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                             torch.zeros(0, dtype=torch.int64), torch.tensor([windows], dtype=torch.float32)[0])
    assert [v.shape[0] for v in empty.values()] == [0, 0, 0]


def test_merge_never_removes_what_one_window_kept():
    """G05: the boxes of one window (what the decoder's NMS kept there, however much they overlap) all come out, by
    decreasing score: the merge only merges boxes of different windows."""
    g = torch.Generator().manual_seed(0)
    xy = torch.rand((80, 2), generator=g) * 100
    boxes = torch.cat((xy, xy + torch.rand((80, 2), generator=g) * 60 + 2), dim=1)
    scores, labels = torch.rand(80, generator=g), torch.randint(0, 2, (80,), generator=g)
    one_window = torch.zeros(80, dtype=torch.int64)
    out = merge_detections(boxes, scores, labels, one_window, torch.tensor([[0.0, 0.0, 170.0, 170.0]]))
    order = torch.sort(scores, descending=True, stable=True).indices
    assert torch.equal(out["boxes"], boxes[order]) and torch.equal(out["scores"], scores[order])
    assert torch.equal(out["labels"], labels[order])


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


def test_a_box_larger_than_a_tile_is_stitched_from_its_fragments():
    """Object 4 (160 px wide) is larger than a tile: each window sees a fragment; they agree in the strip both windows
    saw (x 80-100), so they are one object, the box of the first extended to where the second reaches; with `full`
    the whole image's box is found and both fragments are merged into it."""
    objects = {4: (10, 10, 170, 90)}
    image = draw(180, 100, objects)
    assert detected(image, objects) == [((10, 10, 170, 90), round(0.9 * 90 / 160 + 0.004, 4), 2)]
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


# ---- the merge's rule through detect_tiled, the grid's size, the stop between windows, the windows' scale

def per_window(found: dict[int, list[tuple]]):
    """A `detect` for `detect_tiled` that answers window k (in row order) with `found[k]`: (box in the window's
    pixels, score, label) each, and counts the windows it ran."""
    ran = []

    def detect(batch):
        out = []
        for _ in range(len(batch["image_ids"])):
            k = len(ran)
            ran.append(k)
            d = found.get(k, [])
            out.append({"boxes": torch.tensor([b for b, _, _ in d], dtype=torch.float32).reshape(-1, 4),
                        "scores": torch.tensor([s for _, s, _ in d]), "labels": torch.tensor([c for _, _, c in d],
                                                                                          dtype=torch.int64)})
        return out
    detect.ran = ran
    return detect


def tiled(detect, image, tile=100, overlap=0.2, **kw) -> list[tuple]:
    d = detect_tiled(detect, image, None, tile, overlap, batch_size=1, **kw)  # a batch of 1 is filled with a copy:
    return [(tuple(b), round(s, 4), c) for b, s, c in zip(d["boxes"].int().tolist(), d["scores"].tolist(),
                                                          d["labels"].tolist())]


def test_merge_keeps_the_whole_object_over_a_border_cut_fragment_that_scores_higher():
    """G04: windows x 0-100 and 80-180; an object at x 82-120 is cut by window 0's edge: the fragment x 82-100 (IoU
    0.47 with the object) scores 0.8 there, the whole box 0.7 in window 1. The merge keeps one box, the whole object,
    with the higher score; a large low-scored box of window 1 around the fragment is another box, kept apart."""
    image = torch.zeros((3, 100, 180), dtype=torch.uint8)
    fragment, whole, around = ((82, 10, 100, 40), 0.8, 0), ((2, 10, 40, 40), 0.7, 0), ((0, 0, 60, 80), 0.1, 0)
    detect = per_window({0: [fragment], 2: [whole, around]})  # each window run twice: itself and the filling copy
    assert tiled(detect, image) == [((82, 10, 120, 40), 0.8, 0), ((80, 0, 140, 80), 0.1, 0)]
    # the whole box scoring higher: kept as it is
    detect = per_window({0: [((82, 10, 100, 40), 0.6, 0)], 2: [whole]})
    assert tiled(detect, image) == [((82, 10, 120, 40), 0.7, 0)]


def test_two_overlapping_objects_of_one_class_in_each_window_are_both_kept():
    """G05: objects A (x 80-96) and B (x 83-100) of one class, IoU 0.24 (intersection over the smaller 0.54), both
    inside the strip both windows see, both kept by each window's NMS: one box each comes out, not one for both."""
    image = torch.zeros((3, 100, 180), dtype=torch.uint8)
    a, b = (80, 10, 96, 40), (83, 20, 100, 70)
    in_1 = lambda box: (box[0] - 80, box[1], box[2] - 80, box[3])  # noqa: E731  window 1's pixels
    detect = per_window({0: [(a, 0.9, 0), (b, 0.6, 0)], 2: [(in_1(a), 0.85, 0), (in_1(b), 0.65, 0)]})
    assert tiled(detect, image) == [(a, 0.9, 0), (b, 0.65, 0)]


def test_a_grid_of_absurdly_many_windows_is_refused_in_one_line():
    """G03: 128 px tiles overlapping 0.99 step 2 px: 66,049 windows on a 640 px image where 0.5 gives 81. Refused
    from the flags, before any image is read; up to 16x the windows of overlap 0.5 (0.875 here) pass."""
    from detlib.tiling import grid_error

    line = grid_error(128, 0.99)
    assert "66,049 windows on an image of 640 x 640 px instead of 81" in line and "at most 0.875" in line
    assert "1,024x the windows" in line
    assert grid_error(128, 0.875) is None and grid_error(128, 0.5) is None and grid_error(16, 0.0) is None
    assert len(tile_grid(640, 640, 128, 0.99)) == 66049


@pytest.mark.parametrize("script", ["predict_retinanet", "train_retinanet"])
def test_both_scripts_refuse_a_grid_of_absurdly_many_windows_before_any_work(script, tmp_path, capsys):
    """G03: --tile 128 --tile_overlap 0.99 is a usage error of both scripts, one line (exit 2), before the weights
    (here missing) are looked for."""
    from helpers import run_main

    args = (["--weights", tmp_path / "none", "--source", tmp_path] if script == "predict_retinanet"
            else ["--evaluate_only", tmp_path / "none"])
    code, _, err = run_main(script, [*args, "--tile", "128", "--tile_overlap", "0.99", "--output_dir", tmp_path / "o"],
                            capsys)
    assert code == 2 and "error: --tile 128 --tile_overlap 0.99 steps 2 px: 1,024x the windows" in err
    assert "Traceback" not in err


def test_a_stop_signal_is_honoured_between_windows():
    """G03: `poll` is asked before each batch of windows: a true answer stops the image's windows there (9 windows
    in batches of 2: the third poll stops it after 4); a poll that raises stops the call."""
    image = torch.zeros((3, 300, 300), dtype=torch.uint8)
    detect, polls = per_window({k: [((10, 10, 20, 20), 0.5, 0)] for k in range(9)}), []

    def poll():
        polls.append(1)
        return len(polls) == 3

    out = detect_tiled(detect, image, None, 100, 0.0, batch_size=2, poll=poll)
    assert len(polls) == 3 and len(detect.ran) == 4 and len(out["boxes"]) == 4

    def signalled():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        detect_tiled(per_window({}), image, None, 100, 0.0, poll=signalled)


def test_windows_go_to_the_model_at_the_scale_it_was_trained_at():
    """Issue 52: a model trained on 64 px tiles (model_config.json train_tile) gets its windows unresized whatever its
    --image_size; a model trained on whole images gets each window resized to its size; a window size or scale more
    than 1.5x from training's is said with the factor."""
    from detlib.data.transforms import make_sample
    from detlib.tiling import window_transform

    transform, rule, mismatch = window_transform({"train_tile": 64, "image_size": 256}, 64, 256)
    assert transform is None and mismatch is None
    assert "native scale (x1)" in rule and "--image_size 256 sizes whole images only" in rule
    assert "4x the 64 px tiles" in window_transform({"train_tile": 64}, 256, 256)[2]
    assert window_transform({"train_tile": 64}, 90, 256)[2] is None  # 1.4x
    transform, rule, mismatch = window_transform({"image_size": 128}, 256, 128)
    assert "resized x0.5 to the model's 128 px" in rule and "shrunk x0.5" in mismatch
    sample = transform(make_sample(torch.zeros((3, 256, 256), dtype=torch.uint8), torch.zeros((0, 4)),
                                   torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)))
    assert tuple(sample["image"].shape) == (3, 128, 128)
    assert "enlarged x4" in window_transform({"image_size": 1024}, 256, 1024)[2]  # the 16x the work
    assert window_transform({"image_size": 128}, 100, 128)[2] is None  # 1.28x
