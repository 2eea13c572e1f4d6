"""Torchvision's RetinaNet in detlib: its anchor convention, the conversion of its weights
(scripts/convert_weights.py), detections equal to its own, and fine-tuning from the converted file (--init_from)."""

from __future__ import annotations

import torch
from torchvision.models.detection.anchor_utils import AnchorGenerator as TVAnchorGenerator
from torchvision.models.detection.image_list import ImageList

from detlib.anchors import AnchorGenerator, anchor_config, anchor_generator_from_config, torchvision_anchor_settings


def test_torchvision_anchor_settings_equal_torchvision_anchor_generator():
    """On a 800 x 1216 input (P6 / P7 grids of 13 x 19 and 7 x 10: torchvision's strides there are 61 x 64 and
    114 x 121, not 64 and 128) our anchors with torchvision's settings are torchvision's, to the bit, in the same
    order; the default (offset 0.5, exact sizes) differs."""
    settings = torchvision_anchor_settings()
    assert settings["sizes"][0] == [32, 40, 50] and settings["sizes"][4] == [512, 645, 812]
    tv = TVAnchorGenerator(tuple(tuple(s) for s in settings["sizes"]), ((0.5, 1.0, 2.0),) * 5)
    h, w = 800, 1216
    ours = AnchorGenerator(**settings)
    feats = [torch.zeros(1, 1, gh, gw) for gh, gw in ours.grid_sizes(h, w)]
    expected = tv(ImageList(torch.zeros(1, 3, h, w), [(h, w)]), feats)[0]
    anchors, counts = ours(h, w)
    assert counts == [9 * f.shape[-2] * f.shape[-1] for f in feats]
    assert torch.equal(anchors, expected)
    # a worked value: P3's first anchor, ratio 0.5 at size 32: w = 32 * sqrt(2) = 45.25 -> half 22.6 -> 23,
    # h = 32 / sqrt(2) = 22.6 -> half 11.3 -> 11, centred on pixel (0, 0)
    assert anchors[0].tolist() == [-23.0, -11.0, 23.0, 11.0]
    # the last P7 anchor: cell (6, 9), strides 800 // 7 = 114 and 1216 // 10 = 121, ratio 2 at size 812
    assert anchors[-1].tolist() == [9 * 121 - 287.0, 6 * 114 - 574.0, 9 * 121 + 287.0, 6 * 114 + 574.0]
    assert anchor_config(settings) == {"anchor_sizes": settings["sizes"], "anchor_offset": 0.0, "anchor_round_cell": True,
                                       "anchor_stride_from_grid": True}
    assert anchor_generator_from_config(anchor_config(settings))(h, w)[0].equal(expected)
    assert not torch.equal(anchor_generator_from_config({})(h, w)[0], expected)
