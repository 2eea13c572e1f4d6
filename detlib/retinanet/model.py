"""RetinaNet: a timm backbone, an FPN with P6/P7, and the classification and box heads.

Lin et al., "Focal Loss for Dense Object Detection", ICCV 2017 (arXiv:1708.02002), section 4 and
figure 3. The model returns raw head outputs only; matching, losses and decoding live in
`detlib.retinanet.matching`, `detlib.retinanet.loss` and `detlib.retinanet.decode` and take plain tensors.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

import timm
import torch
import torch.nn as nn
from timm.models.resnet import BasicBlock, Bottleneck
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelP6P7
from torchvision.ops.misc import FrozenBatchNorm2d

from ..backbones import (backbone_mean_std, frozen_parameters, freeze_stages, load_timm_weights, meta_forward_problem,
                         unknown_timm_model)
from ..data.transforms import INPUT_DIVISIBILITY
from ..weights import read_weights_file
from .anchors import DEFAULT_NUM_ANCHORS, anchor_generator_from_config
from .options import HEAD_NORMS  # beside the flags, where --help reads it without torch

logger = logging.getLogger(__name__)



# What the P6 conv reads: the backbone's C5 (the paper) or the FPN's P5 (torchvision's v1 RetinaNet).
P6_INPUTS = ("c5", "p5")
# Norm of the heads' hidden convs: none (the paper) or GroupNorm (torchvision's v2).

# The strides the FPN takes from the backbone: C3, C4, C5.
BACKBONE_REDUCTIONS = (8, 16, 32)
# What model_config.json must hold to rebuild the model (the rest has defaults: p6_input, head_norm, anchors).
MODEL_CONFIG_KEYS = ("num_classes", "backbone", "fpn_channels", "mean", "std")


class ModelConfigError(KeyError):
    """A model_config.json that lacks what rebuilds the model; its message is one line (KeyError's str quotes it)."""

    def __str__(self) -> str:
        return str(self.args[0])


# Devices whose autocast the heads' float32 output leaves (`RetinaNetHead._output`); a meta tensor has none.
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu")


def _prior_bias(p: float) -> float:
    """-log((1 - p) / p): the logit whose sigmoid is p (paper, section 4.1, pi = 0.01 -> -4.595)."""
    return -math.log((1 - p) / p)


class RetinaNetHead(nn.Module):
    """One of RetinaNet's two subnets: 4 x (3x3 conv + ReLU), then a 3x3 conv to `num_anchors * out_per_anchor`.

    Shared across pyramid levels (paper, section 4, "Classification Subnet" / "Box Regression Subnet").

    Args:
        channels: input and hidden width (the FPN width; 256 in the paper).
        num_anchors: anchors per location A.
        out_per_anchor: K class logits, or 4 box deltas.
        bias_prior: if given, the output bias is set to -log((1 - p) / p) so every anchor starts with
            foreground probability p (paper, section 4.1 "Initialization", pi = 0.01).
        num_convs: hidden conv layers.
        norm: "none" (the paper) or "gn": each hidden conv without bias and followed by GroupNorm(32) before its
            ReLU, torchvision's v2 RetinaNet head (`retinanet_resnet50_fpn_v2`); tower indices then step by 3.
    Raises:
        ValueError: for another `norm`.
    """

    def __init__(self, channels: int, num_anchors: int, out_per_anchor: int, bias_prior: float | None = None,
                 num_convs: int = 4, norm: str = "none"):
        super().__init__()
        if norm not in HEAD_NORMS:
            raise ValueError(f"head norm must be one of {HEAD_NORMS}, got {norm!r}")
        layers = []
        for _ in range(num_convs):
            if norm == "gn":
                layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.GroupNorm(32, channels),
                           nn.ReLU(inplace=True)]
            else:
                layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(inplace=True)]
        self.tower = nn.Sequential(*layers)
        self.out = nn.Conv2d(channels, num_anchors * out_per_anchor, 3, padding=1)
        self.out_per_anchor = out_per_anchor
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, std=0.01)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if bias_prior is not None:
            # the bias only: the weights were drawn above, in the same random stream as before reset_output existed
            nn.init.constant_(self.out.bias, _prior_bias(bias_prior))

    def reset_output(self, bias_prior: float) -> None:
        """Re-initialise the output conv: weights N(0, 0.01), bias -log((1 - p) / p) (paper, section 4.1)."""
        nn.init.normal_(self.out.weight, std=0.01)
        nn.init.constant_(self.out.bias, _prior_bias(bias_prior))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        """features: list of [B, C, H_l, W_l]. Returns [B, sum_l H_l * W_l * A, out_per_anchor]: float32 in eval mode
        whatever the autocast precision (`_output`), the autocast dtype in training."""
        outs = []
        for f in features:
            o = self._output(self.tower(f))  # [B, A * k, H, W]
            b, _, h, w = o.shape
            # -> [B, H, W, A, k] -> [B, H*W*A, k]: the level -> y -> x -> anchor order of the anchors.
            outs.append(o.view(b, -1, self.out_per_anchor, h, w).permute(0, 3, 4, 1, 2).reshape(b, -1, self.out_per_anchor))
        return torch.cat(outs, dim=1)

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast the output conv would return bf16 / fp16, and its logits are the scores: ranked, thresholded
        # and compared by the evaluation. bf16 keeps 8 bits of mantissa, so logits near the prior's -4.6 step by 0.03
        # and an early model's scores fall onto a few values, ties that AP breaks at random (seen: AP 0.0021 in fp32,
        # 0.0000 in bf16, all 400 detections one score). So in eval mode (evaluation, predict, export) the output
        # conv runs in float32 at every precision (the towers stay in the autocast dtype); in training the focal loss
        # is computed in float32 from the logits anyway (loss.py) and the conv keeps the autocast dtype's speed.
        kind = x.device.type
        if self.training or kind not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(kind):
            return self.out(x)
        with torch.autocast(kind, enabled=False):
            return self.out(x.float())


def build_backbone(name: str, pretrained: bool = False, weights_path: str | None = None,
                   weights_ema: bool = True) -> nn.Module:
    """A timm model with `features_only=True`.

    Args:
        name: any timm model name (`resnet50`, `resnet18`, `convnext_tiny`, ...).
        pretrained: use timm's own download of pretrained weights (needs the internet or a filled cache).
        weights_path: local weights of the same timm model: the plain model's `state_dict()` (what
            `timm.create_model(name)` holds, classifier included) or a `features_only` one, read by `load_timm_weights`;
            or a training checkpoint holding one (timm's train.py's `model_best.pth.tar`).
        weights_ema: from a checkpoint with an EMA copy, take it (timm's `load_checkpoint` default), else the raw
            weights; the load line names the part taken and the checkpoint's contents (`read_weights_file`).
    Raises:
        RuntimeError: if pretrained weights cannot be fetched (with what to do instead).
        ValueError: if the model lacks stride 8/16/32 features, or the weights file does not fit (one line).
    """
    try:
        backbone = timm.create_model(name, pretrained=pretrained, features_only=True)
    except Exception as e:  # timm raises a variety of hub / network errors
        if pretrained:
            raise RuntimeError(
                f"could not fetch pretrained weights for timm model '{name}' ({type(e).__name__}: {e}). "
                "Offline? Download the weights elsewhere and pass them with --backbone_weights PATH "
                "(a .safetensors or .pth state dict of the same timm model)."
            ) from e
        raise
    reductions = backbone.feature_info.reduction()
    missing = [r for r in BACKBONE_REDUCTIONS if r not in reductions]
    if missing:
        raise ValueError(f"timm model '{name}' has feature reductions {reductions}; RetinaNet needs 8, 16 and 32")
    if weights_path:
        state_dict, part, has_ema = read_weights_file(weights_path, use_ema=weights_ema)
        if has_ema:  # which copy is a choice: the line says how to make the other
            part += ("; --no-backbone_weights_ema takes the raw weights" if weights_ema else
                     "; without --no-backbone_weights_ema the EMA copy, timm's default")
        logger.info("%s", load_timm_weights(backbone, state_dict, f"{weights_path} ({part})" if part else weights_path))
    return backbone


def check_backbone(name: str, image_sizes: tuple[int, ...] = ()) -> None:
    """Check before the data check and the model build that timm model `name` can be RetinaNet's backbone.

    Nothing is downloaded and no weights are allocated: the `features_only` model is built on the meta device
    (`pretrained=False`), its `feature_info` read, and it is run there on the padded input sizes.
    Args:
        image_sizes: longest input sides in pixels (the training size, `--train_scales`, `--max_size`); each is
            rounded up to a multiple of 32 (the padding) and run as a square and as a half-height input, so a
            backbone fixed at one input size (a Swin or CoaT at 224) fails here, not in the first step.
    Raises:
        ValueError: one line: not a timm name (with close names), no stride 8 / 16 / 32 features (with the
            strides it has), an input size the model refuses (its message).
    """
    problem = unknown_timm_model(name)
    if problem:
        raise ValueError(problem)

    def build(device: str):
        with torch.device(device):
            return timm.create_model(name, pretrained=False, features_only=True)

    try:
        backbone = build("meta")
    except Exception:  # a model that cannot be built on the meta device: the real build decides
        return
    reductions = backbone.feature_info.reduction()
    missing = [r for r in BACKBONE_REDUCTIONS if r not in reductions]
    if missing:
        raise ValueError(f"timm model {name!r} gives features at strides {reductions}; RetinaNet's FPN needs strides 8, "
                         "16 and 32 (a CNN or a hierarchical backbone: resnet50, convnext_tiny, efficientnet_b3, "
                         "regnety_016; a plain ViT has one stride)")
    shapes = []
    for size in image_sizes:
        s = int(math.ceil(size / INPUT_DIVISIBILITY) * INPUT_DIVISIBILITY)
        shapes += [(s, s), (max(INPUT_DIVISIBILITY, s // 2 // INPUT_DIVISIBILITY * INPUT_DIVISIBILITY), s)]
    problem = meta_forward_problem(backbone, list(dict.fromkeys(shapes)), lambda: build("cpu"))
    if problem:
        raise ValueError(f"timm model {name!r} as a backbone: {problem}")


def check_head_norm(head_norm: str, fpn_channels: int, largest: int) -> None:
    """Check that heads of `head_norm` ("gn": GroupNorm(32)) work at width `fpn_channels` on inputs whose longer side
    is at most `largest` px. Raises ValueError (one line naming the flags) where they cannot."""
    if head_norm == "gn" and fpn_channels % 32:
        raise ValueError(f"--head_norm gn needs --fpn_channels divisible by 32 (GroupNorm's 32 groups), got {fpn_channels}")
    if head_norm == "gn" and fpn_channels == 32 and largest <= 128:
        # one channel per group on P7's single cell (stride 128): GroupNorm's output there is its bias whatever the
        # image, and torch refuses a batch of one image
        raise ValueError(f"--head_norm gn with --fpn_channels 32 (one channel per group) at inputs of at most {largest} "
                         "px, where P7 is 1x1: GroupNorm would normalise single values; use --fpn_channels 64 or more, "
                         "a larger --image_size, or --head_norm none")


class _FoldedFrozenBatchNorm2d(FrozenBatchNorm2d):
    """A FrozenBatchNorm2d whose transform the conv before it applies (`_Conv2dFrozenBN`): passes x through.

    It keeps the four buffers, so state dicts and checkpoints are the same as without folding.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Conv2dFrozenBN(nn.Conv2d):
    """conv(x) followed by a frozen BatchNorm, computed as one conv with scaled weights and a bias.

    bn(conv(x, W)) = conv(x, W * s) + (b - mean * s), s = gamma / sqrt(var + eps): the same scale and shift
    FrozenBatchNorm2d computes, applied to the [C_out, C_in, k, k] weights instead of to every activation,
    which saves two full passes over the feature map forward and one backward. W stays the trained
    parameter (its gradient is the folded weight's times s), so training is unchanged up to float rounding.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.frozen_bn[0]
        scale = bn.weight * (bn.running_var + bn.eps).rsqrt()
        shift = bn.bias - bn.running_mean * scale
        if self.bias is not None:
            shift = shift + self.bias * scale
        return self._conv_forward(x, self.weight * scale.reshape(-1, 1, 1, 1), shift)


def _fold_pair(parent: nn.Module, conv_name: str, bn_name: str) -> int:
    conv, bn = getattr(parent, conv_name), getattr(parent, bn_name)
    if type(conv) is not nn.Conv2d or type(bn) is not FrozenBatchNorm2d or conv.out_channels != bn.weight.numel():
        return 0
    folded_bn = _FoldedFrozenBatchNorm2d(bn.weight.numel(), eps=bn.eps)
    for name, buf in bn.named_buffers():
        setattr(folded_bn, name, buf)
    folded = _Conv2dFrozenBN(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                             conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
                             device=conv.weight.device, dtype=conv.weight.dtype)
    folded.weight = conv.weight
    if conv.bias is not None:
        folded.bias = conv.bias
    # A plain list, not a submodule: the BatchNorm stays registered (and saved) where it was.
    folded.frozen_bn = [folded_bn]
    setattr(parent, conv_name, folded)
    setattr(parent, bn_name, folded_bn)
    return 1


def fold_frozen_batchnorm(backbone: nn.Module) -> int:
    """Fold every frozen BatchNorm of a timm ResNet backbone into the conv that feeds it, in place.

    Only the pairs whose order is known are folded: conv{i} -> bn{i} in ResNet's BasicBlock and
    Bottleneck, the last (conv, norm) of their `downsample`, and the stem's conv1 -> bn1. Other backbones
    are left as they are. Parameter and buffer names do not change. Returns the number of folded pairs.
    """
    blocks = [m for m in backbone.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    if not blocks:
        return 0
    n = _fold_pair(backbone, "conv1", "bn1") if hasattr(backbone, "conv1") and hasattr(backbone, "bn1") else 0
    for block in blocks:
        for i in (1, 2, 3):
            if hasattr(block, f"conv{i}") and hasattr(block, f"bn{i}"):
                n += _fold_pair(block, f"conv{i}", f"bn{i}")
        down = block.downsample
        if isinstance(down, nn.Sequential) and len(down) >= 2:
            n += _fold_pair(down, str(len(down) - 2), str(len(down) - 1))
    return n


class RetinaNet(nn.Module):
    """RetinaNet with a timm backbone.

    Args:
        num_classes: K, the number of foreground classes (no background class: the classifier is K sigmoids).
        backbone: timm model name.
        fpn_channels: FPN and head width (256 in the paper; narrower heads are for CPUs and tests).
        pretrained_backbone: load timm's pretrained weights (online).
        backbone_weights: path of local backbone weights (safetensors or torch state dict, or a training
            checkpoint holding one: `build_backbone`).
        backbone_weights_ema: from a checkpoint with an EMA copy, take it (timm's default), else the raw weights.
        freeze_backbone_bn: replace the backbone's BatchNorm by FrozenBatchNorm2d (the standard setting
            when fine-tuning from pretrained weights with small per-device batches).
        prior_prob: initial foreground probability of the classifier (pi).
        num_anchors: anchors per location, `AnchorGenerator.num_anchors_per_location` (3 scales x 3 ratios = 9
            by default).
        fold_frozen_bn: with `freeze_backbone_bn`, apply each frozen BatchNorm of a ResNet backbone inside
            the conv before it (`fold_frozen_batchnorm`): the same function, fewer passes over the
            activations; state dict keys are unchanged.
        freeze_at: 0-5, by stride on every family (`detlib.backbones.frozen_parameters`): 1 freezes the stem
            (what runs before stride 4), 2 the stem and the first stage (before stride 8: detectron2's `FREEZE_AT`
            2 of its RetinaNet recipe, torchvision's `trainable_backbone_layers` 3), 3 and 4 a stage more each, 5
            the whole backbone. Frozen parts have FrozenBatchNorm2d whatever `freeze_backbone_bn` says.
        p6_input: "c5" (the paper, footnote 2) or "p5" (torchvision's v1 RetinaNet: its LastLevelP6P7 takes P5
            when the FPN width equals its input width, 256 -> 256): what the P6 conv reads.
        head_norm: "none" or "gn" (GroupNorm in the heads' hidden convs, torchvision's v2; see RetinaNetHead).
        mean, std: the input normalisation, per RGB channel on timm's 0-1 scale (`pretrained_cfg["mean"]`); default
            the backbone's own, from the `pretrained_cfg` of the tag `backbone` names (`resnetv2_50x1_bit.goog_in21k`:
            0.5 / 0.5; an untagged name: timm's default tag's). Kept as `self.mean` / `self.std` for model_config.json.

    Input: images [B, 3, H, W], uint8 or float in [0, 255], RGB, H and W multiples of 32 (see anchors).
    Output: dict with
        cls_logits: [B, A_total, K] logits (float32 in eval mode at every autocast precision; in training the
            autocast context's dtype),
        box_deltas: [B, A_total, 4] deltas for `detlib.retinanet.box_coder.decode`,
    with A_total = sum over P3..P7 of H_l * W_l * num_anchors, ordered level -> y -> x -> anchor.
    """

    def __init__(
        self,
        num_classes: int,
        backbone: str = "resnet50",
        fpn_channels: int = 256,
        pretrained_backbone: bool = False,
        backbone_weights: str | None = None,
        backbone_weights_ema: bool = True,
        freeze_backbone_bn: bool = True,
        prior_prob: float = 0.01,
        num_anchors: int = DEFAULT_NUM_ANCHORS,
        fold_frozen_bn: bool = True,
        freeze_at: int = 0,
        p6_input: str = "c5",
        head_norm: str = "none",
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
    ):
        super().__init__()
        if p6_input not in P6_INPUTS:
            raise ValueError(f"p6_input must be one of {P6_INPUTS}, got {p6_input!r}")
        self.num_classes = num_classes
        self.backbone = build_backbone(backbone, pretrained_backbone, backbone_weights, backbone_weights_ema)
        if freeze_backbone_bn:
            self.backbone = timm.layers.freeze_batch_norm_2d(self.backbone)
        freeze_stages(self.backbone, frozen_parameters(backbone, freeze_at))
        if freeze_backbone_bn and fold_frozen_bn:
            fold_frozen_batchnorm(self.backbone)
        reductions = self.backbone.feature_info.reduction()
        channels = self.backbone.feature_info.channels()
        self.feature_indices = [reductions.index(r) for r in BACKBONE_REDUCTIONS]
        in_channels = [channels[i] for i in self.feature_indices]
        # P6 is computed from C5 as in the paper (section 4, footnote 2), P7 from ReLU(P6). torchvision's
        # LastLevelP6P7 guesses its input from the widths (P5 when in == out), so a backbone whose C5 is as wide
        # as the FPN would silently read P5: the choice is set explicitly after construction.
        p6_in = in_channels[-1] if p6_input == "c5" else fpn_channels
        self.p6_input = p6_input
        extra = LastLevelP6P7(p6_in, fpn_channels)
        extra.use_P5 = p6_input == "p5"
        self.fpn = FeaturePyramidNetwork(in_channels, fpn_channels, extra_blocks=extra)
        self.cls_head = RetinaNetHead(fpn_channels, num_anchors, num_classes, bias_prior=prior_prob, norm=head_norm)
        self.box_head = RetinaNetHead(fpn_channels, num_anchors, 4, norm=head_norm)
        own_mean, own_std = backbone_mean_std(self.backbone)
        self.mean, self.std = tuple(map(float, mean or own_mean)), tuple(map(float, std or own_std))
        # the images come in [0, 255]: the 0-1 statistics scaled once here, in float64 before the float32 buffer (so
        # ImageNet's are the literals 123.675, ... to the bit)
        self.register_buffer("pixel_mean", torch.tensor([255 * v for v in self.mean]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor([255 * v for v in self.std]).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        x = (images.float() - self.pixel_mean) / self.pixel_std
        feats = self.backbone(x)
        c = OrderedDict((f"c{i + 3}", feats[j]) for i, j in enumerate(self.feature_indices))
        p = list(self.fpn(c).values())
        return {"cls_logits": self.cls_head(p), "box_deltas": self.box_head(p)}


def load_matching_weights(model: RetinaNet, state_dict: dict, prior_prob: float = 0.01) -> dict[str, list[str]]:
    """Initialise `model` from another detector's state dict (`--init_from`): every tensor whose name and shape
    fit is copied; when only the classification output does not fit (another class count) it is re-initialised
    with the prior bias (`RetinaNetHead.reset_output`); everything else is skipped.

    Works across timm backbones as far as names and shapes agree (e.g. a converted torchvision ResNet-50 into a
    timm resnet50 model; from a resnet18 detector only the FPN's and heads' tensors of equal width fit).
    Returns:
        {"loaded": names copied, "reinitialised": the classification output's names when re-initialised,
         "skipped": names of the file that do not fit (absent from the model or of another shape; a frozen
         BatchNorm has no `num_batches_tracked`), "not_in_file": the model's names the file lacks (kept as
         initialised)}.
    """
    own = model.state_dict()
    fit, report = {}, {"loaded": [], "reinitialised": [], "skipped": [], "not_in_file": []}
    for k, v in state_dict.items():
        if k in own and tuple(own[k].shape) == tuple(v.shape):
            fit[k] = v
            report["loaded"].append(k)
        else:
            report["skipped"].append(k)
    model.load_state_dict(fit, strict=False)
    report["not_in_file"] = [k for k in own if k not in state_dict]
    cls_out = [k for k in own if k.startswith("cls_head.out.")]
    if any(k not in fit for k in cls_out):
        # the whole output conv, its weight and bias together, so no class starts from half a layer
        model.cls_head.reset_output(prior_prob)
        report["reinitialised"] = cls_out
        report["loaded"] = [k for k in report["loaded"] if k not in cls_out]
    return report


def loaded_weights_line(report: dict[str, list[str]], num_classes: int) -> str:
    """`load_matching_weights`' report as one log line: what was loaded, re-initialised, skipped (the first 8 names;
    BatchNorm's num_batches_tracked counted apart: a frozen BatchNorm has none) and kept as initialised."""
    skipped = report["skipped"]
    named = [k for k in skipped if not k.endswith("num_batches_tracked")]
    missing = report["not_in_file"]
    return (f"loaded {len(report['loaded'])} tensors; re-initialised "
            + (f"the classification output {report['reinitialised']} ({num_classes} classes; prior bias)"
               if report["reinitialised"] else "nothing")
            + f"; skipped {len(skipped)} ({', '.join(named[:8])}{' ...' if len(named) > 8 else ''}"
            + (f"{', ' if named else ''}{len(skipped) - len(named)} BatchNorm num_batches_tracked"
               if len(named) < len(skipped) else "")
            + f"); not in the file, kept as initialised: {len(missing)}"
            + (f" ({', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''})" if missing else ""))


def log_model_size(model: nn.Module, backbone: str, side: int, is_main: bool = True) -> None:
    """The parameter counts and (`is_main`) the forward cost of one image of the largest input, `side` pixels (rounded
    up to INPUT_DIVISIBILITY) square."""
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info("RetinaNet %s: %.2fM parameters (%.2fM trainable)", backbone, n_params / 1e6, n_train / 1e6)
    if is_main:
        from torch.utils.flop_counter import FlopCounterMode

        s = int(math.ceil(side / INPUT_DIVISIBILITY) * INPUT_DIVISIBILITY)
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model.eval()(torch.zeros(1, 3, s, s))
        model.train()
        logger.info("forward cost at %dx%d: %.1f GFLOPs per image", s, s, fc.get_total_flops() / 1e9)


def reorder_class_outputs(model: RetinaNet, source_class: list[int | None], prior_prob: float = 0.01) -> None:
    """After `load_matching_weights` from a detector of the same class count whose classes are matched by name
    (`--init_from ... --categories_by_name`): class j of `model` takes the classification output of the loaded
    detector's class `source_class[j]`; a class with None starts from the prior (`RetinaNetHead.reset_output`).
    The output conv's channels are anchor-major (channel a * K + k, `RetinaNetHead.forward`)."""
    out, k = model.cls_head.out, model.cls_head.out_per_anchor
    weight, bias = out.weight.detach().clone(), out.bias.detach().clone()
    model.cls_head.reset_output(prior_prob)
    with torch.no_grad():
        for a in range(weight.shape[0] // k):
            for j, i in enumerate(source_class):
                if i is not None:
                    out.weight[a * k + j] = weight[a * k + i]
                    out.bias[a * k + j] = bias[a * k + i]


def build_retinanet_from_config(config: dict, freeze_backbone_bn: bool = False) -> RetinaNet:
    """The RetinaNet a model_config.json describes (`MODEL_CONFIG_KEYS`, and `p6_input` /
    `head_norm` when present: "c5" / "none" otherwise), freshly initialised, for loading trained weights into.

    `freeze_backbone_bn=False` builds what `--evaluate_only` builds by default: plain BatchNorm, which in
    eval mode computes the same function as a frozen one (weights of either kind load into it), so predictions
    match the evaluation's to the bit; a frozen, folded BatchNorm rounds differently.

    Raises:
        KeyError: the config lacks one of `MODEL_CONFIG_KEYS` (one line naming them; `mean` / `std` are the input
            normalisation, per channel on timm's 0-1 scale).
    """
    missing = [k for k in MODEL_CONFIG_KEYS if k not in config]
    if missing:
        raise ModelConfigError(f"model_config.json lacks {', '.join(missing)}" + (
            " (the input normalisation, per RGB channel on a 0-1 scale, as timm's pretrained_cfg gives it: what "
            "train_retinanet.py and convert_weights.py write; add it by hand from the backbone's tag)"
            if {"mean", "std"} & set(missing) else ""))
    return RetinaNet(int(config["num_classes"]), config["backbone"], fpn_channels=int(config["fpn_channels"]),
                     freeze_backbone_bn=freeze_backbone_bn, p6_input=config.get("p6_input") or "c5",
                     head_norm=config.get("head_norm") or "none", mean=config["mean"], std=config["std"],
                     num_anchors=anchor_generator_from_config(config).num_anchors_per_location)
