"""The detector on fake CUDA tensors (torch._subclasses.fake_tensor.FakeTensorMode): backbone, FPN, heads,
anchors, matching and losses, and decoding up to the threshold run with every tensor on the CUDA device, on a
machine without one. FakeTensorMode refuses an op that mixes a CPU tensor with a CUDA one
(FakeTensorDeviceMismatchError); a dispatch mode also records every tensor made on the CPU, so a tensor built on
the host and copied over (a host-device transfer per call) fails the test too."""

import collections
import traceback

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import REPO
from detlib.retinanet.anchors import AnchorGenerator, torchvision_anchor_settings
from detlib.retinanet.decode import decode_candidates
from detlib.retinanet.loss import retinanet_loss
from detlib.retinanet.model import RetinaNet


class CpuTensorLog(TorchDispatchMode):
    """Records (op, shape, the detlib line) of every op that returns a tensor on the CPU."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ours = [f for f in traceback.extract_stack() if f.filename.startswith(str(REPO / "detlib"))]
                where = f"{ours[-1].filename.removeprefix(str(REPO) + '/')}:{ours[-1].lineno}" if ours else "?"
                self.made.append((str(func), tuple(t.shape), where))
        return out


def _fake_cuda_run(model_kwargs: dict, anchor_kwargs: dict, box_loss: str, H: int = 128, W: int = 96):
    # the shape environment gives the threshold's boolean mask a symbolic size
    with FakeTensorMode(shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True)):
        with torch.device("cuda"):
            model = RetinaNet(3, "resnet18", fpn_channels=32, **model_kwargs)
            images = torch.zeros(2, 3, H, W, dtype=torch.uint8)
            boxes = torch.tensor([[[4.0, 4.0, 40.0, 40.0], [0.0, 0.0, 0.0, 0.0]], [[10.0, 20.0, 60.0, 50.0], [1.0, 2.0, 30.0, 33.0]]])
            labels = torch.tensor([[0, -1], [2, 1]])
            crowd = torch.tensor([[[50.0, 50.0, 90.0, 90.0]], [[0.0, 0.0, 0.0, 0.0]]])
            image_sizes = torch.tensor([[H, W - 10], [H - 20, W]])
            scales = torch.tensor([[0.5, 0.5], [1.0, 1.0]])
        anchor_gen = AnchorGenerator(**anchor_kwargs)
        with CpuTensorLog() as log:
            out = model(images)
            anchors, counts = anchor_gen(H, W, device=images.device)
            losses = retinanet_loss(out["cls_logits"], out["box_deltas"], anchors, boxes, labels, crowd, box_loss=box_loss)
            cand = decode_candidates(out["cls_logits"], out["box_deltas"], anchors, counts, image_sizes, scales)
            keep = cand[1] > 0.05  # the threshold's mask and what it selects, as decode_detections does
            kept = [t[keep] for t in cand]
        return out, anchors, counts, losses, cand, kept, log.made


@pytest.mark.parametrize("model_kwargs,anchor_kwargs,box_loss", [
    ({}, {}, "l1"),  # ours: P6 from C5, plain heads, frozen BatchNorm folded into the convs
    ({"p6_input": "p5", "head_norm": "gn", "freeze_backbone_bn": False}, torchvision_anchor_settings(), "giou"),
])
def test_detector_on_fake_cuda_makes_no_tensor_on_the_cpu(model_kwargs, anchor_kwargs, box_loss):
    out, anchors, counts, losses, cand, kept, made = _fake_cuda_run(model_kwargs, anchor_kwargs, box_loss)
    where = collections.Counter(w for _, _, w in made)
    assert not made, f"tensors made on the CPU during the CUDA forward / loss / decode: {dict(where)}"
    A = sum(counts)
    assert A == 9 * sum((-(-128 // s)) * (-(-96 // s)) for s in (8, 16, 32, 64, 128))
    assert out["cls_logits"].shape == (2, A, 3) and out["box_deltas"].shape == (2, A, 4)
    assert anchors.shape == (A, 4)
    for t in (out["cls_logits"], out["box_deltas"], anchors, *losses.values(), *cand, *kept):
        assert t.device.type == "cuda"
    assert all(losses[k].dtype == torch.float32 and losses[k].dim() == 0 for k in ("loss", "cls_loss", "box_loss"))
    N = sum(min(1000, n * 3) for n in counts)
    assert cand[0].shape == (2, N, 4) and cand[1].shape == cand[2].shape == cand[3].shape == (2, N)


def test_fake_cuda_checks_can_fail():
    """The two checks the test above relies on: a CPU tensor meeting a CUDA one raises, and a tensor made on the
    CPU (as the anchors were: the grid built on the host, then copied) is recorded."""
    with FakeTensorMode():
        x = torch.zeros(4, 4, device="cuda")
        with pytest.raises(FakeTensorDeviceMismatchError):
            x + torch.ones(4, 4)
        with CpuTensorLog() as log:
            (torch.arange(4, dtype=torch.float32) + 0.5).to(x.device)
            x * 2
    assert [op for op, _, _ in log.made] == ["aten.arange.default", "aten.add.Tensor"]


def test_anchors_on_a_device_equal_the_cpu_ones():
    """The grid is built on the device it is asked for, with the same values as on the CPU (bit for bit)."""
    for kwargs in ({}, torchvision_anchor_settings()):
        gen = AnchorGenerator(**kwargs)
        cpu, counts = gen(800, 1216)
        meta, meta_counts = gen(800, 1216, device="meta")  # no host tensor, no copy
        assert meta.device.type == "meta" and meta.shape == cpu.shape and meta_counts == counts
        assert torch.equal(gen(800, 1216, device=torch.device("cpu"))[0], cpu)
