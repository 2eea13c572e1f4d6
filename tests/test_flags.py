"""The scripts' command line: `--help` with every default and the data- and optimizer-dependent defaults (one
table per script)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from conftest import REPO
from detlib import flags

SCRIPTS = ("train_retinanet", "train_catsdogs")


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=SCRIPTS)
def script(request):
    return load_script(request.param)


def resolved(script, argv: list[str], synthetic: bool = True) -> argparse.Namespace:
    """The args as `main` resolves them before the run starts (the data-dependent defaults applied)."""
    args = script.parse_args(argv)
    flags.resolve_data_defaults(args, script.DATA_DEFAULTS, synthetic)
    return args


# ---- defaults: one table per script, in the docstring and --help

def test_default_lr_and_weight_decay_follow_the_optimizer_and_an_explicit_lr_wins():
    retinanet, catsdogs = load_script("train_retinanet"), load_script("train_catsdogs")
    assert resolved(retinanet, []).lr == 1e-3 and resolved(retinanet, [], synthetic=False).lr == 1e-4
    assert resolved(retinanet, ["--optimizer", "sgd"]).lr == 0.01  # the COCO SGD 1x recipe's, 16 images per step
    assert resolved(retinanet, ["--optimizer", "sgd"], synthetic=False).lr == 0.01
    assert resolved(retinanet, ["--optimizer", "sgd"]).weight_decay == 1e-4
    assert resolved(retinanet, ["--optimizer", "sgd", "--lr", "0.02"]).lr == 0.02
    assert resolved(catsdogs, ["--optimizer", "sgd"]).lr == 0.05 and resolved(catsdogs, []).lr == 1e-3
    assert resolved(catsdogs, ["--optimizer", "sgd"], synthetic=False).weight_decay == 5e-5


def test_data_defaults_apply_only_to_flags_left_unset():
    retinanet = load_script("train_retinanet")
    args = resolved(retinanet, ["--image_size", "320"], synthetic=False)
    assert (args.image_size, args.backbone, args.fpn_channels, args.epochs, args.per_device_batch_size) == \
        (320, "resnet50", 256, 12, 15)
    args = resolved(retinanet, [])
    assert (args.image_size, args.backbone, args.fpn_channels, args.epochs, args.per_device_batch_size) == \
        (160, "resnet18", 64, 30, 16)


def test_help_shows_every_default_once(script, capsys):
    with pytest.raises(SystemExit) as e:
        script.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser = script.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            line = " ".join(formatter._format_action(action).split())
            assert line.count("default:") == 1, line
            if action.dest in script.DATA_DEFAULTS:
                assert "default: None" not in line and ("built-in data" in line or "adamw:" in line), line
    # the docstring's commands are printed as written (a raw description), the table with them
    assert "    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/" in text
    assert "    --lr with --optimizer sgd " in text and "    --epochs  " in text


def test_data_defaults_table_and_help_text_by_hand():
    table = {"image_size": (160, 600), "lr": {"adamw": (1e-3, 1e-4), "sgd": (0.01, 0.01)}}
    assert flags.data_defaults_table(table).splitlines() == [
        "    flag                          built-in data   real data",
        "    --image_size                  160             600",
        "    --lr with --optimizer adamw   0.001           0.0001",
        "    --lr with --optimizer sgd     0.01            0.01"]
    assert flags.data_default_text(table["image_size"]) == "built-in data 160, real data 600"
    assert flags.data_default_text(table["lr"]) == "adamw: built-in data 0.001, real data 0.0001; sgd: 0.01"


def test_script_docstring_holds_the_table(script):
    assert script.__doc__.endswith(flags.data_defaults_table(script.DATA_DEFAULTS))
