"""Training on tiles (detlib.data.train_tiles, `--train_tile`) and the built-in small-object set: the grid and the
box rules on boxes worked out by hand, the tiles of a built set pixel for pixel, the epoch's empty tiles, 2 processes,
and a run on small_objects resumed mid-epoch that continues exactly."""

from __future__ import annotations

import itertools
import json
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import REPO, read_metrics, write_coco
from detlib.data import CocoDetection, TrainingTiles, make_small_objects_coco
from detlib.data.transforms import PAD_VALUE
from detlib.data.train_tiles import tile_boxes, training_tile_grid
from helpers import forked_ok, run_main, run_ok


def test_tile_grid_ends_at_the_image_edge():
    # 128 px tiles every 96 px (overlap 0.25); the last column starts at 300 - 128 = 172
    assert training_tile_grid(300, 100, 128).tolist() == [[0, 0, 128, 100], [96, 0, 224, 100], [172, 0, 300, 100]]
    assert training_tile_grid(256, 256, 128).tolist() == [[x, y, x + 128, y + 128] for y in (0, 96, 128)
                                                          for x in (0, 96, 128)]  # sahi's slicing gives the same
    assert training_tile_grid(128, 128, 128).tolist() == [[0, 0, 128, 128]]
    assert training_tile_grid(100, 50, 128).tolist() == [[0, 0, 100, 50]]  # smaller than a tile: one window
    assert training_tile_grid(200, 10, 100, overlap=0).tolist() == [[0, 0, 100, 10], [100, 0, 200, 10]]
    with pytest.raises(ValueError):
        training_tile_grid(100, 100, 64, overlap=1.0)


def test_training_tiles_are_the_windows_of_tiled_prediction():
    from detlib.tiling import tile_grid

    for width, height, tile, overlap in itertools.product((1, 50, 128, 129, 300, 1280), (64, 128, 1000), (6, 128, 640),
                                                          (0.0, 0.2, 0.25, 0.5, 0.9)):
        assert training_tile_grid(width, height, tile, overlap).tolist() == [list(w) for w in tile_grid(
            width, height, tile, overlap)], (width, height, tile, overlap)


def test_tile_boxes_worked_out_by_hand():
    window = (100, 100, 228, 228)  # a 128 px tile
    boxes = np.array([
        [228, 120, 248, 140],  # on the right edge, outside: touches the tile along a line only
        [218, 120, 238, 140],  # half inside (10 of 20 px): a target, clipped
        [220, 150, 240, 170],  # 40 % inside (8 of 20 px): ignored, clipped
        [50, 50, 300, 300],    # larger than the tile: 128^2 / 250^2 = 26 % inside: ignored, the whole tile
        [110, 110, 130, 130],  # inside
        [150, 200, 170, 220],  # a crowd box inside: stays ignored
        [0, 0, 20, 20],        # elsewhere in the image
    ], dtype=np.float32)
    crowd = np.array([0, 0, 0, 0, 0, 1, 0], dtype=bool)
    index, clipped, ignored = tile_boxes(boxes, crowd, window, min_visible=0.5)
    assert index.tolist() == [1, 2, 3, 4, 5]
    assert clipped.tolist() == [[118, 20, 128, 40], [120, 50, 128, 70], [0, 0, 128, 128], [10, 10, 30, 30],
                                [50, 100, 70, 120]]
    assert ignored.tolist() == [False, True, True, False, True]
    # the share is a parameter: at 0.4 the box 40 % inside is a target, at 0.6 the half one is ignored
    assert tile_boxes(boxes, crowd, window, 0.4)[2].tolist() == [False, False, True, False, True]
    assert tile_boxes(boxes, crowd, window, 0.6)[2].tolist() == [True, True, True, False, True]
    none = tile_boxes(np.zeros((0, 4), np.float32), np.zeros(0, bool), window, 0.5)
    assert none[0].shape == (0,) and none[1].shape == (0, 4)


@pytest.fixture()
def tiled_set(tmp_path):
    """A 256 x 192 PNG (lossless, so tiles can be compared pixel for pixel) and a 100 x 80 one, 128 px tiles: the
    first image's grid is x in (0, 96, 128), y in (0, 64), six tiles."""
    rng = np.random.RandomState(0)
    for name, (w, h) in {"a.png": (256, 192), "b.png": (100, 80)}.items():
        Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / name)
    images = [{"id": 1, "file_name": "a.png", "width": 256, "height": 192},
              {"id": 2, "file_name": "b.png", "width": 100, "height": 80}]
    annotations = [
        {"image_id": 1, "category_id": 1, "bbox": [10, 10, 20, 20]},     # tile (0, 0) only
        {"image_id": 1, "category_id": 2, "bbox": [90, 150, 12, 20]},    # x 90-102: half in tile x0 = 96 (6 of 12)
        {"image_id": 2, "category_id": 2, "bbox": [40, 30, 30, 20]},     # the small image
    ]
    path = write_coco(tmp_path / "train.json", images, annotations,
                      categories=[{"id": 1, "name": "a"}, {"id": 2, "name": "b"}])
    return CocoDetection(str(tmp_path), str(path), transform=None, seed=5)


def test_tiles_of_a_built_set_pixel_for_pixel(tiled_set):
    tiles = TrainingTiles(tiled_set, 128, min_visible=0.5, empty_rate=0.0)
    # targets: (0, 0) holds box 1; (0, 64) and (96, 64) hold box 2 (whole in one, half in the other); image b's tile
    assert [t.tolist() for t in tiles.positive] == [[0, 0, 0, 128, 128], [0, 0, 64, 128, 192], [0, 96, 64, 224, 192],
                                                    [1, 0, 0, 100, 80]]
    assert len(tiles.empty) == 3 and len(tiles) == 4  # (96, 0), (128, 0), (128, 64); none at rate 0
    whole = np.array(Image.open(tiled_set.records[0]["path"]))
    item = tiles[2]  # the tile at (96, 64): box 2 exactly half inside, a target clipped to x 96-102
    assert torch.equal(item["image"], torch.from_numpy(whole[64:192, 96:224]).permute(2, 0, 1))
    assert item["boxes"].tolist() == [[0, 86, 6, 106]] and item["labels"].tolist() == [1]
    assert item["crowd_boxes"].shape == (0, 4) and item["image_id"] == 1 and item["scale"] == (1.0, 1.0)
    small = tiles[3]  # a 100 x 80 image is one tile, padded at the bottom and right to 128 x 128
    assert small["image"].shape == (3, 128, 128)
    assert (small["image"][:, 80:, :] == torch.tensor(PAD_VALUE, dtype=torch.uint8).view(3, 1, 1)).all()
    assert small["boxes"].tolist() == [[40, 30, 70, 50]]
    # at min_visible 0.6 the half box is ignored: a crowd box of its tile, which then has no target
    strict = TrainingTiles(tiled_set, 128, min_visible=0.6, empty_rate=1.0)
    assert len(strict.positive) == 3 and len(strict) == 3 + 4
    ignored = [strict[i] for i in range(len(strict)) if strict.tile_of(i).tolist() == [0, 96, 64, 224, 192]]
    assert len(ignored) == 1 and ignored[0]["crowd_boxes"].tolist() == [[0, 86, 6, 106]]
    assert ignored[0]["boxes"].shape == (0, 4)
    with pytest.raises(ValueError, match="nothing to learn from"):  # 8 px tiles show at most 27 % of any box
        TrainingTiles(tiled_set, 8)


def test_empty_tiles_are_a_function_of_seed_and_epoch(tmp_path):
    paths = make_small_objects_coco(str(tmp_path), num_train=2, num_val=1)
    images = CocoDetection(paths["train_images"], paths["train_annotations"], seed=3)
    tiles = TrainingTiles(images, 128, empty_rate=0.5)
    assert len(tiles) == len(tiles.positive) + round(0.5 * len(tiles.empty)) == len(tiles.records)
    chosen = [tiles.empty_tiles(e).tolist() for e in range(3)]
    assert all(len(c) == tiles.num_empty and c == sorted(set(c)) for c in chosen)
    assert chosen[0] != chosen[1] != chosen[2]
    again = TrainingTiles(CocoDetection(paths["train_images"], paths["train_annotations"], seed=3), 128, empty_rate=0.5)
    assert again.empty_tiles(1).tolist() == chosen[1]  # a resumed run's
    tiles.set_epoch(1)
    assert tiles.tile_of(len(tiles) - 1).tolist() == tiles.empty[chosen[1][-1]].tolist()


def test_small_objects_set_is_large_images_of_small_objects(tmp_path):
    a = make_small_objects_coco(str(tmp_path / "a"), num_train=3, num_val=1)
    b = make_small_objects_coco(str(tmp_path / "b"), num_train=3, num_val=1)
    assert open(a["train_annotations"]).read() == open(b["train_annotations"]).read()  # seeded
    data = json.loads(open(a["train_annotations"]).read())
    assert all(im["width"] in (768, 1024, 1280) and im["height"] in (768, 1024, 1280) for im in data["images"])
    sides = [a_["bbox"][2] for a_ in data["annotations"]]
    assert 8 <= min(sides) and max(sides) <= 32 and len(sides) >= 3 * 20
    size = {im["id"]: (im["width"], im["height"]) for im in data["images"]}
    for ann in data["annotations"]:
        x, y, w, h = ann["bbox"]
        assert 0 <= x and x + w <= size[ann["image_id"]][0] and 0 <= y and y + h <= size[ann["image_id"]][1]


# ---- the script: a run on small_objects, 2 processes

TILE_RUN = ["--builtin", "small_objects", "--train_tile", "128", "--fpn_channels", "32", "--head_norm", "none",
            "--per_device_batch_size", "4", "--num_workers", "0", "--report_to", "none", "--log_interval", "1",
            "--num_log_images", "0", "--eval_bootstrap", "0", "--eval_interval", "10", "--augmentation", "flip",
            "--lr_scheduler", "constant", "--warmup_steps", "0", "--empty_tile_rate", "0.02"]


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    """The built-in small-object set, generated once for the module's runs (DETLIB_CACHE)."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow  # in-process, three short trainings on tiles (about a minute)
def test_tile_run_on_small_objects_resumed_mid_epoch_continues_exactly(small_cache, tmp_path, monkeypatch, capsys):
    """Stopped by --max_steps mid-epoch, resumed: the same losses (so the same tiles, augmented alike) and weights as
    the uninterrupted run; config and model config record the tiles and the small anchors."""
    monkeypatch.setenv("DETLIB_CACHE", str(small_cache))
    full, part = tmp_path / "full", tmp_path / "part"
    steps = ["--max_steps", "6", "--epochs", "1"]
    run_ok("train_retinanet", TILE_RUN + steps + ["--output_dir", full], capsys)
    run_ok("train_retinanet", TILE_RUN + steps[:1] + ["3"] + steps[2:] + ["--output_dir", part], capsys)
    stdout = run_ok("train_retinanet", TILE_RUN + steps + ["--output_dir", part, "--resume_from_checkpoint", "latest"],
                    capsys)
    assert "resumed from" in stdout and "global step 3" in stdout
    assert "--train_tile 128:" in stdout and "tiles an epoch" in stdout
    train = lambda folder: [m for m in read_metrics(folder) if "loss" in m and "AP" not in m]  # noqa: E731
    f, p = train(full), train(part)
    assert [t["step"] for t in p] == list(range(1, 7))
    for x, y in zip(f, p):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)
    wf, wp = load_file(str(full / "last" / "model.safetensors")), load_file(str(part / "last" / "model.safetensors"))
    for k in wf:
        torch.testing.assert_close(wf[k], wp[k], rtol=0, atol=1e-6)
    model_config = json.loads((full / "last" / "model_config.json").read_text())
    assert model_config["anchor_sizes"] == [8, 16, 32, 64, 128]
    config = (full / "config.yaml").read_text()
    assert "train_tile: 128" in config and "builtin: small_objects" in config


def test_tile_flags_refused_together_in_one_line(tmp_path, capsys):
    code, _, err = run_main("train_retinanet", ["--train_tile", "128", "--train_scales", "96", "128",
                                                "--output_dir", tmp_path / "o"], capsys)
    assert code == 2 and "--train_tile trains at their native resolution" in err
    code, _, err = run_main("train_retinanet", ["--train_tile", "128", "--empty_tile_rate", "1.5"], capsys)
    assert code == 2 and "--empty_tile_rate" in err


def test_small_objects_run_gets_its_own_default_folder():
    from helpers import load_script

    script = load_script("train_retinanet")
    assert script.parse_args(["--builtin", "small_objects"]).output_dir == "outputs/retinanet_small_objects"
    assert script.parse_args(["--builtin", "small_objects", "--output_dir", "o"]).output_dir.endswith("o")
    assert script.parse_args([]).output_dir is None  # shapes: the data defaults' outputs/retinanet_builtin


TILES_PROBE = textwrap.dedent('''
    import importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location("train_retinanet", sys.argv[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from detlib.engine import make_accelerator
    out = sys.argv[2]
    args = script.parse_args(["--builtin", "small_objects", "--train_tile", "128", "--per_device_batch_size", "8",
                              "--num_workers", "0", "--empty_tile_rate", "0.3", "--output_dir", out])
    script.resolve_data_defaults(args, script.DATA_DEFAULTS, True)
    args.resize_mode = "antialias"
    accelerator = make_accelerator(None, 1, "none", out, seed=args.seed)
    with accelerator.main_process_first():
        train_ds, _, train_loader, _ = script.build_dataloaders(args, script.resolve_data(args))
    train_loader = accelerator.prepare(train_loader)
    digest = lambda batch: [float(x) for x in batch["images"].float().sum((1, 2, 3))]
    indices, contents = [], []
    for e in range(2):  # what main and train_one_epoch do: the data set's epoch, then the loader's
        train_ds.set_epoch(e)
        train_loader.set_epoch(e)
        indices.append([i for b in train_loader.batch_sampler for i in b][:8 * 4])
        contents.append([digest(b) for _, b in zip(range(4), train_loader)])
    train_ds.set_epoch(1)
    train_loader.set_epoch(1)
    resumed = [digest(b) for _, b in zip(range(2), accelerator.skip_first_batches(train_loader, 2))]
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"indices": indices, "contents": contents, "resumed": resumed, "len": len(train_ds),
                   "batches": len(train_loader), "processes": accelerator.num_processes}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()
''')


@pytest.mark.slow
def test_tiles_on_two_processes_disjoint_and_resumed_alike(small_cache, tmp_path):
    """2 processes: each its own tiles of an epoch, a new order each epoch, and a resume two batches into epoch 1 sees
    the uninterrupted run's batches of that epoch (the first 4 batches of each rank are looked at)."""
    probe = tmp_path / "tiles_probe.py"
    probe.write_text(TILES_PROBE)
    out = tmp_path / "out"
    out.mkdir()
    forked_ok(probe, [REPO / "scripts" / "train_retinanet.py", out], env={"DETLIB_CACHE": str(small_cache)})
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["processes"] for r in ranks] == [2, 2] and ranks[0]["batches"] == ranks[1]["batches"] >= 4
    for e in range(2):
        a, b = ranks[0]["indices"][e], ranks[1]["indices"][e]
        assert len(a) == len(b) == 32 and not set(a) & set(b) and len(set(a)) == 32  # no tile twice
    assert ranks[0]["indices"][0] != ranks[0]["indices"][1]
    for r in ranks:
        assert r["resumed"] == r["contents"][1][2:4]
        assert r["contents"][0] != r["contents"][1]
