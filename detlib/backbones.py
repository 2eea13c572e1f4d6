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
