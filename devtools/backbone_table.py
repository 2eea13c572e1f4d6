"""Write the table of docs/backbones.md: one model per timm family (the test's choice, tests/test_backbones.py), its
feature strides, what `--freeze_at 2` freezes and its normalisation. `python -m devtools.backbone_table > table.md`"""

from __future__ import annotations

import sys

import timm
import torch

sys.path.insert(0, "tests")
from test_backbones import FAMILIES, hierarchical, meta_features  # noqa: E402

from detlib.backbones import backbone_mean_std, frozen_parameters  # noqa: E402


def parts(names: list[str]) -> str:
    """The frozen parameters as their modules two levels down, in order (`layer1.0`, `stages_0`), at most 6 named."""
    seen = list(dict.fromkeys(".".join(n.split(".")[:2 if n.split(".")[0] in ("model", "body") else 1]) for n in names))
    return ", ".join(seen[:6]) + (f" + {len(seen) - 6} more" if len(seen) > 6 else "") if seen else "nothing"


def main() -> None:
    print("| family | model | strides | `--freeze_at 2` freezes | frozen share | mean / std |")
    print("|---|---|---|---|---|---|")
    for family, name in sorted(FAMILIES.items()):
        backbone = meta_features(name)
        strides = backbone.feature_info.reduction()
        mean, std = backbone_mean_std(backbone)
        norm = f"{'/'.join(f'{v:g}' for v in mean)} / {'/'.join(f'{v:g}' for v in std)}"
        if not hierarchical(name):
            print(f"| {family} | {name} | {strides} | refused: no stride 8/16/32 features | | {norm} |")
            continue
        frozen = set(frozen_parameters(name, 2))
        total = sum(p.numel() for p in backbone.parameters())
        share = sum(p.numel() for n, p in backbone.named_parameters() if n in frozen) / total
        print(f"| {family} | {name} | {strides} | {parts([n for n, _ in backbone.named_parameters() if n in frozen])} "
              f"| {100 * share:.1f} % | {norm} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
