"""Each predict script reads its images once: one DataLoader iterator, on the default --num_workers.

tqdm.auto's bar (tqdm.asyncio's class in a terminal) calls `iter()` on its iterable when it is made and `std.tqdm`
iterates the iterable again, so a `tqdm(loader)` of a plain DataLoader started a second set of workers that loaded
the first batches a second time (and logged their warnings twice).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import load_script, make_tiny_folder, write_tiny_detector


@pytest.fixture
def iterators(monkeypatch) -> list:
    """The DataLoader iterators made in this process from now on."""
    made = []
    original = torch.utils.data.DataLoader._get_iterator

    def counted(self):
        made.append(self.num_workers)
        return original(self)

    monkeypatch.setattr(torch.utils.data.DataLoader, "_get_iterator", counted)
    return made


def tiny_classifier(folder):
    from safetensors.torch import save_file

    from detlib.classification import build_classifier

    folder.mkdir()
    torch.manual_seed(0)
    model = build_classifier("resnet18", 2).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps({"model": "resnet18", "num_classes": 2,
                                                          "classes": ["horizontal", "vertical"], "image_size": 32}))
    return folder


@pytest.mark.parametrize("script", ["predict_retinanet", "predict_catsdogs"])
def test_predict_makes_one_loader_iterator_with_the_default_workers(script, tmp_path, iterators):
    images = make_tiny_folder(tmp_path, [5, 5])
    if script == "predict_retinanet":
        (tmp_path / "det").mkdir()
        weights, extra = write_tiny_detector(tmp_path / "det"), ["--score_thresh", "0"]
    else:
        weights, extra = tiny_classifier(tmp_path / "cls"), []
    load_script(script).main(["--weights", str(weights), "--source", str(images), "--batch_size", "2", *extra,
                              "--output_dir", str(tmp_path / "out")])
    assert iterators == [min(4, os.cpu_count())]  # one set of the default 4 workers (at most one per core)
