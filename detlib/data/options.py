"""The flags of the data's optional capabilities, each added by one call from a training script's parser: the
class-balanced samplers (`balanced`) and training on tiles (`train_tiles`); and the choices of --augmentation
(`transforms`) and --verify_images (`imagefolder`). Here, not in those modules, because they import torch and a
script's --help builds its parser without it.
"""

from __future__ import annotations

AUGMENTATIONS = ("none", "flip", "flip_crop_translate", "photometric", "scale_jitter")  # --augmentation's presets
VERIFY_MODES = ("full", "header", "none")  # how the ImageFolder files are checked (`imagefolder`)

# What --sampler's balanced choice does, per script: the detector's draws images, the classifier's classes.
BALANCED_SAMPLERS = {
    "repeat_factor": "the LVIS rule: an image is drawn max(1, sqrt(T / f)) times per epoch (stochastic rounding), f "
                     "the fraction of images holding its rarest class, for classes far rarer than others "
                     "(docs/flags.md)",
    "class_balanced": "as many draws of each class (the minority's images repeated), for classes far rarer than "
                      "others (docs/catsdogs.md)",
}


def add_sampler_flags(group, balanced: str) -> None:
    """--sampler {shuffle, `balanced`} on an argparse group, `balanced` a key of BALANCED_SAMPLERS; with
    repeat_factor also its --repeat_threshold."""
    from ..argtypes import float_range

    group.add_argument("--sampler", default="shuffle", choices=["shuffle", balanced], help="training images per "
                       f"epoch: each once, shuffled; or {balanced}, {BALANCED_SAMPLERS[balanced]} (default: %(default)s)")
    if balanced == "repeat_factor":
        group.add_argument("--repeat_threshold", type=float_range(0, 1, lo_open=True), default=0.1, metavar="T",
                           help="--sampler repeat_factor: classes in fewer than this fraction of the training images "
                                "are repeated; the images of one in a fraction f of them are drawn sqrt(T / f) times "
                                "as often (default: %(default)s)")


def add_train_tile_flags(group) -> None:
    """--train_tile, --tile_min_visible, --empty_tile_rate on an argparse group (`train_tiles.TrainingTiles`)."""
    from ..argtypes import float_range, int_at_least

    group.add_argument("--train_tile", type=int_at_least(32), metavar="SIZE", help="train on SIZE x SIZE tiles cut "
                       "from the training images at native resolution (not resized; --image_size is the whole-image "
                       "evaluation's size), for objects too small to survive the resize (default: none, whole images)")
    group.add_argument("--tile_min_visible", type=float_range(0, 1, lo_open=True), default=0.5, metavar="FRAC",
                       help="--train_tile: a box with at least this share of its area inside a tile is a target "
                       "there, clipped; one with less is ignored, not taught as background (default: %(default)s)")
    group.add_argument("--empty_tile_rate", type=float_range(0, 1), default=0.1, metavar="R", help="--train_tile: the "
                       "share of the tiles without a target that each epoch holds (default: %(default)s)")


def train_tile_conflict(args) -> str | None:
    """The error line of a flag that --train_tile cannot go with, or None."""
    if args.train_tile and args.train_scales:
        return "--train_scales resizes the training images; --train_tile trains at their native resolution: give one"
    if args.train_tile and args.sampler == "repeat_factor":  # its repeat factors are per image, the items are tiles
        return "--sampler repeat_factor draws images; with --train_tile the items are tiles: not together yet"
    return None
