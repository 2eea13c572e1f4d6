"""timm model names and the meta-device check of a model's input sizes, shared by the detector's backbone
(`detlib.retinanet.model`) and the classifier (`detlib.classification`)."""

from __future__ import annotations

import timm
import torch
from torch import nn

from .logtext import close_names


def unknown_timm_model(name: str, extra: tuple[str, ...] = ()) -> str | None:
    """None when `name` is a timm model name (or one of `extra`), else the one-line reason with close names."""
    if name in extra or timm.is_model(name):
        return None
    close = close_names(name, [*extra, *timm.list_models()])
    return f"{name!r} is not a timm model name" + (f" (close names: {', '.join(close)})" if close else
                                                  " (`timm.list_models('*pattern*')` lists them)")


def meta_forward_problem(model: nn.Module, shapes: list[tuple[int, int]], build_on_cpu) -> str | None:
    """Run `model` (built on the meta device: no weights allocated) in eval mode on [1, 3, H, W] inputs of each
    shape; None when every shape goes through, else the model's own message for the first that does not. A failure
    on the meta device alone (an op without a meta kernel) is checked again on a CPU copy (`build_on_cpu()`), so
    only a real refusal is reported."""
    def first_failure(m: nn.Module, device: str) -> str | None:
        m.eval()
        for h, w in shapes:
            try:
                with torch.no_grad():
                    m(torch.zeros(1, 3, h, w, device=device))
            except Exception as e:  # a model's own size checks are asserts, shape errors, value errors
                return f"{h}x{w} inputs fail in the model ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        return None

    if first_failure(model, "meta") is None:
        return None
    return first_failure(build_on_cpu(), "cpu")


# --freeze_at k (1..4) freezes what the backbone computes before its first feature of stride 2 ** (k + 1): 1 the stem
# (before stride 4), 2 the stem and the first stage (before stride 8: detectron2's FREEZE_AT=2 on a ResNet), 3 and 4 one
# stage more each; FREEZE_ALL the whole backbone. By stride, so it means the same on every family (a ConvNeXt's first
# feature is at stride 4, a ResNet's at 2, a CSPDarkNet's at 1).
FREEZE_ALL = 5


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _at_size(t: torch.Tensor, h: int, w: int) -> bool:
    """Whether `t` is an activation of h x w cells: [..., h, w] (NCHW), [B, h, w, C] (NHWC) or [B, h * w, C] (tokens)."""
    s = tuple(t.shape)
    return (len(s) >= 3 and s[-2:] == (h, w)) or (len(s) == 4 and s[1:3] == (h, w)) or (len(s) == 3 and s[1] == h * w)


def frozen_parameters(name: str, freeze_at: int, input_size: tuple[int, int] | None = None) -> list[str]:
    """The parameter names of timm `name`'s `features_only` model that `--freeze_at freeze_at` freezes.

    The rule, by stride, found by running the model (on the meta device: nothing is allocated), not by names: k in 1..4
    freezes what the forward pass computes before the first stride-2 ** (k + 1) activation, i.e. the stem and the
    stages before that stride whatever the family calls them (ResNet's layer1, ConvNeXt's stages.0, Swin's layers.0,
    EfficientNet's blocks.0-1, HRNet's layer1). Precisely: the parameters of every module called before the first
    module whose output is at the size of the model's first feature of stride >= 2 ** (k + 1) (and at no finer
    feature's size), that module not inside one whose output is finer (a downsampling inside a stage is not the next
    stage), or, when the model has no finer feature, before the module that outputs the feature itself (a patchify
    stem that outputs stride 4 is the stem, not the first stage); a parameter used without its module being called
    (Swin v2's qkv weight, a position embedding) is frozen when a finer feature depends on it. 0: none; FREEZE_ALL: all.

    Args:
        input_size: (H, W) of the probe input; default the model's `pretrained_cfg` input size (fixed-size
            transformers accept only that), else 224 x 224.
    Raises:
        ValueError: `freeze_at` outside 0..FREEZE_ALL, or no module outputs the stride's activation (the family's
            features are made by a reshape outside any module: names the stride).
    """
    if not 0 <= freeze_at <= FREEZE_ALL:
        raise ValueError(f"freeze_at must be in 0..{FREEZE_ALL}, got {freeze_at}")
    if freeze_at == 0:
        return []
    with torch.device("meta"):
        backbone = timm.create_model(name, pretrained=False, features_only=True)
    if freeze_at == FREEZE_ALL:
        return [n for n, _ in backbone.named_parameters()]
    reductions = backbone.feature_info.reduction()
    level = next(i for i, r in enumerate(reductions) if r >= 2 ** (freeze_at + 1))
    h, w = input_size or tuple(getattr(backbone, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[-2:])
    order, outputs = {}, {}

    def pre(m, args):
        order.setdefault(m, len(order))

    def post(m, args, out):
        outputs.setdefault(m, _tensors(out))

    hooks = [hk for m in backbone.modules() for hk in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:  # eval: BatchNorm of a 1x1 map (a squeeze-excite) refuses training mode on one image
        features = backbone.eval()(torch.zeros(1, 3, h, w, device="meta"))
    finally:
        for hk in hooks:
            hk.remove()
    sizes = [tuple(f.shape[-2:]) for f in features]

    def finer(m: nn.Module) -> bool:
        return m is not backbone and any(_at_size(t, *s) for t in outputs.get(m, []) for s in sizes[:level])

    def at_level(m: nn.Module) -> bool:
        return any(_at_size(t, *sizes[level]) for t in outputs.get(m, []))

    inside_finer = {id(sub) for m in backbone.modules() if finer(m) for sub in m.modules()}
    starts = [order[m] for m in outputs
              if m is not backbone and id(m) not in inside_finer and not finer(m) and at_level(m)]
    if not starts:
        raise ValueError(f"no module of timm model {name!r} outputs its stride-{reductions[level]} activation (a reshape "
                         "outside any module makes it), so its stages cannot be told apart: use --freeze_at 0")
    first = min(starts)
    # With no finer feature the stem may itself output the stride (ConvNeXt's patchify stem at stride 4): the stage is
    # then the module that outputs the feature itself
    producers = [order[m] for m in outputs if m is not backbone and any(t is features[level] for t in outputs[m])]
    if level == 0 and producers:
        first = max(first, min(producers))
    if level:  # what the finer features depend on, for parameters used without their module being called
        sum(f.float().sum() for f in features[:level]).backward()
    frozen = []
    for module_name, m in backbone.named_modules():
        for p_name, p in m.named_parameters(recurse=False):
            if (order[m] < first) if m in order else p.grad is not None:
                frozen.append(f"{module_name}.{p_name}" if module_name else p_name)
    return frozen


def freeze_stages(backbone: nn.Module, names: list[str]) -> None:
    """Freeze the parameters `names` (`frozen_parameters`) of `backbone` in place: no gradient, and the BatchNorm layers
    holding them made FrozenBatchNorm2d by timm's `freeze` (batch statistics neither used nor updated, whatever
    `--backbone_bn` says for the rest). A module holding both frozen and trainable parameters keeps its type."""
    from timm.utils import freeze

    frozen = set(names)
    whole = []
    for module_name, m in backbone.named_modules():
        own = [f"{module_name}.{p}" if module_name else p for p, _ in m.named_parameters(recurse=False)]
        if own and all(n in frozen for n in own) and not any(True for _ in m.children()):
            whole.append(module_name)
    if whole:
        freeze(backbone, whole)
    for n, p in backbone.named_parameters():
        if n in frozen:
            p.requires_grad_(False)


def backbone_mean_std(backbone: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) per RGB channel on timm's 0-1 scale, from the `pretrained_cfg` of the tag the model was created with
    (timm's default tag for an untagged name); ImageNet's when the model has none."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    cfg = getattr(backbone, "pretrained_cfg", None) or {}
    mean, std = cfg.get("mean") or IMAGENET_DEFAULT_MEAN, cfg.get("std") or IMAGENET_DEFAULT_STD
    if len(mean) == 1:  # a grey-scale model's one value, for the RGB images we feed it
        mean, std = mean * 3, std * 3
    return tuple(mean), tuple(std)


def _file_key(key: str, available) -> str | None:
    """The name under which the plain timm model holds `features_only` parameter `key`: its own, or the one timm's
    feature wrappers changed: FeatureListNet registers a Sequential's children at the top (`stages.1.x` becomes
    `stages_1.x`), FeatureGetterNet holds the whole model as `model` (`model.stages.1.x`), a FeatureHookNet that does
    not flatten as `body`."""
    for k in (key, key.removeprefix("model."), key.removeprefix("body.")):
        if k in available:
            return k
        head, _, rest = k.partition(".")
        for i, c in enumerate(head):
            if c == "_" and (name := f"{head[:i]}.{head[i + 1:]}" + (f".{rest}" if rest else "")) in available:
                return name
    return None


def load_timm_weights(backbone: nn.Module, state_dict: dict, source: str) -> str:
    """Load a timm checkpoint into a `features_only` backbone, in place; returns the one line that says what was used.

    `state_dict` is the plain timm model's (`timm.create_model(name).state_dict()`, saved as safetensors or a torch
    file) or a `features_only` model's. The rule: every tensor of the backbone is read from the file under its own
    name or under the plain model's name for it (`_file_key`); the file's other tensors are what the features do not
    use (the classifier head, a final norm or pooling) and are ignored, counted in the line. BatchNorm's
    `num_batches_tracked` counters may be absent.
    Raises:
        ValueError: one line: backbone tensors the file lacks (how many, the first names) or holds at another shape.
    """
    own = backbone.state_dict()
    taken, missing, shapes = {}, [], []
    for key, tensor in own.items():
        name = _file_key(key, state_dict)
        if name is None:
            if not key.endswith("num_batches_tracked"):
                missing.append(key)
        elif tuple(state_dict[name].shape) != tuple(tensor.shape):
            shapes.append(f"{name} {tuple(state_dict[name].shape)} vs {tuple(tensor.shape)}")
        else:
            taken[key] = state_dict[name]
    if missing:
        raise ValueError(f"{source} does not fit this timm backbone: {len(missing)} of its {len(own)} tensors are not in "
                         f"the file (e.g. {', '.join(missing[:3])}): weights of another model or tag?")
    if shapes:
        raise ValueError(f"{source} does not fit this timm backbone: {len(shapes)} tensors of other shapes (e.g. "
                         f"{'; '.join(shapes[:2])}): weights of another model size?")
    backbone.load_state_dict(taken, strict=False)
    used = {_file_key(k, state_dict) for k in taken}
    unused = [k for k in state_dict if k not in used]
    return (f"backbone weights {source}: {len(taken)} tensors loaded, every backbone tensor; {len(unused)} of the file "
            "not used by the features (the classifier head and what only it uses" + (f": {', '.join(unused[:4])}"
            + (" ..." if len(unused) > 4 else "") if unused else "") + ")")
