"""The RetinaNet module's own choices: what P6 reads, and anchors per location taken from the generator."""

import torch

from detlib.retinanet.anchors import AnchorGenerator
from detlib.retinanet.model import RetinaNet


def _p6_from(model, c5, p5):
    # LastLevelP6P7.forward(p, c, names): P6 = conv(P5 or C5), P7 = conv(relu(P6))
    results, _ = model.fpn.extra_blocks([p5], [c5], ["p5"])
    return results[-2]


def test_p6_reads_c5_even_when_c5_is_as_wide_as_the_fpn():
    # resnet18's C5 has 512 channels: with a 512-wide FPN torchvision's LastLevelP6P7 would pick P5 on its own
    torch.manual_seed(0)
    model = RetinaNet(2, "resnet18", fpn_channels=512, freeze_backbone_bn=False).eval()
    c5, p5 = torch.randn(1, 512, 4, 4), torch.randn(1, 512, 4, 4)
    extra = model.fpn.extra_blocks
    with torch.no_grad():
        p6 = _p6_from(model, c5, p5)
        assert torch.equal(p6, extra.p6(c5))
        assert not torch.allclose(p6, extra.p6(p5))


def test_p6_reads_p5_when_asked():
    torch.manual_seed(0)
    model = RetinaNet(2, "resnet18", fpn_channels=32, freeze_backbone_bn=False, p6_input="p5").eval()
    c5, p5 = torch.randn(1, 512, 4, 4), torch.randn(1, 32, 4, 4)
    with torch.no_grad():
        assert torch.equal(_p6_from(model, c5, p5), model.fpn.extra_blocks.p6(p5))


def test_heads_have_as_many_anchors_per_location_as_the_generator():
    gen = AnchorGenerator(scales=(1.0, 2 ** 0.5), ratios=(0.5, 1.0, 2.0))
    assert gen.num_anchors_per_location == 6
    model = RetinaNet(3, "resnet18", fpn_channels=16, freeze_backbone_bn=False,
                      num_anchors=gen.num_anchors_per_location).eval()
    anchors, counts = gen(64, 96)
    with torch.no_grad():
        out = model(torch.zeros(1, 3, 64, 96))
    assert out["cls_logits"].shape == (1, anchors.shape[0], 3)
    assert out["box_deltas"].shape == (1, anchors.shape[0], 4)
    assert AnchorGenerator().num_anchors_per_location == RetinaNet(1, "resnet18", fpn_channels=16).cls_head.out.out_channels
