"""The scripts' command line: `--config` (timm's two-stage parse), `--help` with every default, the data- and
optimizer-dependent defaults (one table per script), and the one-line errors of a bad config file."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re

import pytest
import yaml

from conftest import REPO, write_coco, write_image
from detlib.engine import flags
from detlib.engine.flags import save_config
from helpers import forked_launch

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


def run_like_config(script, args: argparse.Namespace) -> dict:
    """What `main` writes to config.yaml: the resolved flags and the record keys beside them."""
    return {**vars(args), **{k: 1 for k in (*flags.RUN_RECORD_KEYS, *script.RECORD_KEYS)}}


def one_line_error(capsys, script, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        script.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---- --config

def test_config_yaml_fed_back_gives_the_same_args(script, tmp_path):
    argv = ["--epochs", "3", "--optimizer", "sgd", "--seed", "7", "--output_dir", str(tmp_path / "run"), "--report_to", "none"]
    first = resolved(script, argv)
    save_config(run_like_config(script, first), str(tmp_path / "config.yaml"))
    again = resolved(script, ["--config", str(tmp_path / "config.yaml")])
    assert again.config == str(tmp_path / "config.yaml")
    assert {**vars(again), "config": None} == vars(first)
    assert (again.epochs, again.seed, again.optimizer, again.report_to) == (3, 7, "sgd", "none")


def test_command_line_overrides_the_config(script, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 3\nseed: 7\nlr: 1e-4\n")  # YAML reads 1e-4 (no dot) as a string: the flag's type parses it
    args = resolved(script, ["--config", str(path), "--epochs", "9"])
    assert (args.epochs, args.seed, args.lr) == (9, 7, 1e-4)
    args = resolved(script, ["--epochs", "9", f"--config={path}"])  # the order on the command line does not matter
    assert (args.epochs, args.seed) == (9, 7)
    path.write_text("model_ema_warmup: false\ncompile: true\nmodel_ema: 0.99\nmixed_precision: null\n")
    args = resolved(script, ["--config", str(path)])  # --no-model_ema_warmup --compile --model_ema=0.99
    assert (args.model_ema_warmup, args.compile, args.model_ema, args.mixed_precision) == (False, True, 0.99, None)
    assert resolved(script, ["--config", str(path), "--model_ema_warmup"]).model_ema_warmup is True


def test_folder_actions_of_the_recorded_run_are_not_applied_from_a_file(script, tmp_path, capsys):
    # a resumed run records resume_from_checkpoint: latest; its config.yaml must start fresh, not resume or wipe
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 3\nresume_from_checkpoint: latest\noverwrite_output_dir: true\n")
    args = resolved(script, ["--config", str(path)])
    assert (args.epochs, args.resume_from_checkpoint, args.overwrite_output_dir) == (3, None, False)
    err = capsys.readouterr().err
    assert "resume_from_checkpoint: latest is not applied from a file" in err and "overwrite_output_dir" in err
    args = resolved(script, ["--config", str(path), "--resume_from_checkpoint", "latest"])  # the command line can
    assert args.resume_from_checkpoint == "latest"


def test_unknown_config_key_is_a_one_line_error_naming_it(script, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("epoch: 3\n")
    err = one_line_error(capsys, script, ["--config", str(path)])
    assert f"--config {path}: unknown key 'epoch'" in err and "did you mean 'epochs'?" in err


@pytest.mark.parametrize("text,kind", [("- epochs\n- 3\n", "list"), ("epochs 3\n", "str"), ("", "NoneType")])
def test_config_that_is_not_a_mapping_is_a_one_line_error(script, tmp_path, capsys, text, kind):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    err = one_line_error(capsys, script, ["--config", str(path)])
    assert f"--config {path}: must be a mapping of flag names to values" in err and f"not {kind}" in err


@pytest.mark.parametrize("text,message", [
    ("epochs: 0\n", "argument --epochs: must be an integer >= 1, got 0"),
    ("optimizer: adam\n", "argument --optimizer: invalid choice: 'adam' (choose from 'adamw', 'sgd')"),
    ("strict_data: 1\n", "argument --strict_data: ignored explicit argument '1'"),
    ("epochs: [3]\n", "argument --epochs: invalid integer >= 1 value: '[3]'"),
    ("seed: null\n", "argument --seed: expected one argument"),
    ("lr: ten\n", "argument --lr: invalid number value: 'ten'"),
    ("epochs: [3\n", "not valid YAML"),
])
def test_config_values_are_checked_like_flags(script, tmp_path, capsys, text, message):
    """The file's values are parsed by the script's own parser, as the command line they stand for."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert f"error: --config {path}: {message}" in one_line_error(capsys, script, ["--config", str(path)])


def test_missing_config_file_is_a_one_line_error(script, tmp_path, capsys):
    err = one_line_error(capsys, script, ["--config", str(tmp_path / "nope.yaml")])
    assert f"--config {tmp_path / 'nope.yaml'}: No such file or directory" in err


def test_evaluate_only_config_writes_where_the_evaluation_did(script, tmp_path):
    # an evaluation-only run records OUTPUT_DIR/evaluate_only as the output_dir of an evaluation-only run
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"evaluate_only": "runs/a/best", "output_dir": "runs/a/evaluate_only"}))
    args = script.parse_args(["--config", str(path)])
    assert (args.evaluate_only, args.output_dir) == ("runs/a/best", "runs/a")


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


def test_gradient_clipping_follows_the_optimizer_and_the_start_line_says_it(caplog):
    """--max_grad_norm: 0.1 with AdamW (the 600 px recipe's), off with SGD as the SGD references train (a 0.1 clip
    scales down every SGD step); a given value wins; the start line names what is used."""
    import logging

    from detlib.engine.run_log import log_plan
    from detlib.engine.train_state import TrainState

    retinanet = load_script("train_retinanet")
    for synthetic in (True, False):
        assert resolved(retinanet, [], synthetic).max_grad_norm == 0.1
        assert resolved(retinanet, ["--optimizer", "sgd"], synthetic).max_grad_norm == 0.0
    assert resolved(retinanet, ["--optimizer", "sgd", "--max_grad_norm", "5"]).max_grad_norm == 5.0
    with caplog.at_level(logging.INFO):
        log_plan(TrainState(), 1, 10, 10, 8, 0.01, 0.0)
        log_plan(TrainState(), 1, 10, 10, 8, 1e-3, 0.1)
    assert "no gradient clipping (--max_grad_norm 0)" in caplog.messages[0]
    assert "gradients clipped to norm 0.1 (--max_grad_norm)" in caplog.messages[1]


def test_data_defaults_apply_only_to_flags_left_unset():
    retinanet = load_script("train_retinanet")
    recipe = ("image_size", "backbone", "fpn_channels", "augmentation", "epochs", "per_device_batch_size",
              "lr_scheduler", "warmup_steps")
    args = resolved(retinanet, ["--image_size", "320"], synthetic=False)
    assert tuple(getattr(args, k) for k in recipe) == (320, "resnet50", 256, "flip_crop_translate", 12, 15, "plateau", 500)
    args = resolved(retinanet, [])  # the built-in demo's recipe (issue 17: minutes on 2 CPU cores)
    assert tuple(getattr(args, k) for k in recipe) == (128, "resnet18", 64, "flip", 6, 8, "cosine", 100)
    args = resolved(retinanet, ["--lr_scheduler", "plateau"])
    assert (args.lr_scheduler, args.augmentation) == ("plateau", "flip")


def test_builtin_and_real_data_runs_get_their_own_default_folders(script):
    """A real-data run after a built-in one (or the other way) is not refused as "the folder of another run"; the
    folder is absolute (config.yaml records it)."""
    name = "retinanet" if "DATA_DEFAULTS" in vars(script) and "backbone" in script.DATA_DEFAULTS else "catsdogs"
    assert resolved(script, []).output_dir == os.path.abspath(f"outputs/{name}_builtin")
    assert resolved(script, [], synthetic=False).output_dir == os.path.abspath(f"outputs/{name}")
    assert resolved(script, ["--output_dir", "x"]).output_dir == os.path.abspath("x")


def test_builtin_run_keeps_one_checkpoint_real_data_two_and_the_flag_keeps_more(script):
    """The built-in run keeps what a resume needs (issue 39: at most 150 MB, one ResNet-18 checkpoint is 0.14 GB)."""
    assert resolved(script, []).checkpoint_total_limit == 1
    assert resolved(script, [], synthetic=False).checkpoint_total_limit == 2
    assert resolved(script, ["--checkpoint_total_limit", "0"]).checkpoint_total_limit == 0  # 0: all


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
    assert re.search(r"^    (OMP_NUM_THREADS=1 )?accelerate launch --config_file accelerate_configs/cpu.yaml scripts/", text, re.M)
    assert "    --lr with --optimizer sgd " in text and "    --epochs  " in text


SCRIPT_FILES = sorted(str(f.relative_to(REPO)) for folder in ("scripts", "benchmarks") for f in (REPO / folder).glob("*.py")
                      if "argparse" in f.read_text())


@pytest.mark.parametrize("path", SCRIPT_FILES)
def test_every_flag_of_every_script_has_help_text_and_shows_its_default(path, monkeypatch):
    """Each script's parser (`build_parser()`): every option has its own help text, and `--help` shows its default
    (argparse's "(default: X)" or the help's own words), never a bare "default: None"; required flags need none."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the benchmarks import their kit
    spec = importlib.util.spec_from_file_location("_parser_of_" + path.replace("/", "_")[:-3], REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = module.build_parser()
    assert issubclass(parser.formatter_class, flags.HelpFormatter), path  # the one that appends defaults
    formatter = parser._get_formatter()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]
    assert options
    for action in options:
        assert action.help and action.help.strip(), f"{path} {action.option_strings[0]}: no help text"
        line = " ".join(formatter._format_action(action).split())
        if not action.required:
            assert "default" in line and "(default: None)" not in line, f"{path}: {line}"
        if action.default not in (None, False, argparse.SUPPRESS):  # a value: shown as it is ("on" for True)
            # argparse wraps help lines at spaces and after hyphens ("/work/wt-" "copies"): compared without them
            squeezed = "".join(line.split())
            assert "".join(str(action.default).split()) in squeezed or (action.default is True and "default: on" in line), \
                f"{path}: {line}"


def test_the_flags_a_user_gave_on_the_command_line_or_in_a_config_file_and_their_log_line(tmp_path, capsys):
    retinanet = load_script("train_retinanet")
    argv = ["--lr_steps", "3", "5", "--epochs", "30", "--no-aspect_grouping", "--include_crowd", "--output_dir", "a b"]
    args = retinanet.parse_args(argv)
    assert args.given == {"lr_steps", "epochs", "aspect_grouping", "include_crowd", "output_dir"}
    assert retinanet.parse_args([]).given == set()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"seed": 3, "num_classes": 4, "resume_from_checkpoint": "latest"}))
    from_file = retinanet.parse_args(["--config", str(path), "--epochs", "2"])
    assert from_file.given == {"seed", "epochs"}  # record keys and folder actions are not applied from a file
    assert (from_file.seed, from_file.epochs, from_file.resume_from_checkpoint) == (3, 2, None)
    assert capsys.readouterr().err.count("note: --config") == 1  # the folder action's note, printed once
    assert "given" not in vars(args) and "parser" not in vars(args)  # not flags: never in config.yaml
    config = {**vars(args), "num_processes": 1}
    # a command line, in the flags' order, that repeats the choice (the rest is in config.yaml)
    assert flags.format_given(args, config) == \
        "--epochs 30 --output_dir 'a b' --include_crowd --no-aspect_grouping --lr_steps 3 5"


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


# ---- a real run's config.yaml re-runs it

def _tiny_data(tmp_path, name: str) -> list[str]:
    if name == "train_catsdogs":
        for split, n in (("train", 4), ("val", 2)):
            for c in ("cats", "dogs"):
                for k in range(n):
                    write_image(tmp_path / split / c / f"{k}.jpg", 24, 24, seed=k + 10 * (c == "dogs"))
        return ["--train_dir", str(tmp_path / "train"), "--val_dir", str(tmp_path / "val"), "--image_size", "16",
                "--per_device_batch_size", "4", "--per_device_eval_batch_size", "4"]
    for split in ("train", "val"):
        images = [{"id": i + 1, "file_name": f"{i}.jpg", "width": 64, "height": 48} for i in range(2)]
        for i in range(2):
            write_image(tmp_path / "images" / f"{i}.jpg", 64, 48, seed=i)
        write_coco(tmp_path / f"{split}.json", images, [{"image_id": i + 1, "category_id": 1, "bbox": [8, 8, 24, 20]}
                                                         for i in range(2)])
    return ["--train_images", str(tmp_path / "images"), "--train_annotations", str(tmp_path / "train.json"),
            "--val_images", str(tmp_path / "images"), "--val_annotations", str(tmp_path / "val.json"),
            "--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "8", "--per_device_batch_size", "2",
            "--per_device_eval_batch_size", "2", "--num_log_images", "0"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_config_yaml_of_a_real_run_parses_back_to_its_values(name, tmp_path, capsys):
    from helpers import run_main

    out = tmp_path / "run"
    code, stdout, _ = run_main(name, [*_tiny_data(tmp_path, name), "--epochs", "1", "--optimizer", "sgd", "--num_workers",
                                      "0", "--report_to", "none", "--output_dir", str(out)], capsys)  # in-process, 1-2 steps
    assert code == 0
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    # the log says the config in one line: what was given (the rest is the defaults, all in config.yaml)
    (line,) = [ln for ln in stdout.splitlines() if "config: " in ln]
    assert "config: the defaults and --num_workers 0 --epochs 1 --per_device_batch_size " in line and " --optimizer sgd" in line
    assert line.endswith(f"settings in {out / 'config.yaml'}") and "\nseed: 0\n" not in stdout
    # config.yaml says what the run did: the plateau scheduler has no warm-up; the flags it ignores are listed
    if name == "train_retinanet":
        assert recorded["lr_scheduler"] == "plateau" and recorded["warmup_steps"] == 0
        assert recorded["not_used"] == ["lr_steps", "warmup_steps", "tile_overlap", "tile_full"]  # no --tile
    else:
        assert recorded["not_used"] == []
    args = load_script(name).parse_args(["--config", str(out / "config.yaml")])  # every key is a flag or a record
    assert recorded["lr"] == (0.01 if name == "train_retinanet" else 0.05)
    for key, value in vars(args).items():
        if key != "config":
            assert recorded[key] == value, key


@pytest.mark.parametrize("name,flag,value", [
    ("predict_retinanet", "--batch_size", "0"), ("predict_retinanet", "--num_workers", "-1"),
    ("predict_retinanet", "--score_thresh", "-1"), ("predict_retinanet", "--nms_thresh", "0"),
    ("predict_retinanet", "--image_size", "0"), ("predict_retinanet", "--detections_per_image", "0"),
    ("predict_retinanet", "--draw_thresh", "2"), ("predict_catsdogs", "--topk", "0"),
    ("predict_catsdogs", "--image_size", "-1"), ("predict_catsdogs", "--batch_size", "-1"),
])
def test_predict_scripts_refuse_nonsense_values_in_one_line(name, flag, value, capsys):
    script = load_script(name)
    with pytest.raises(SystemExit) as e:
        script.parse_args(["--weights", "w", "--source", "s", "--output_dir", "o", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: must be" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("script,argv,expected", [
    ("train_catsdogs.py", ["--epochs", "0"],
     "train_catsdogs.py: error: argument --epochs: must be an integer >= 1, got 0"),
    ("predict_retinanet.py", ["--source", "x", "--output_dir", "o"],
     "predict_retinanet.py: error: the following arguments are required: --weights")])
def test_a_bad_flag_on_2_processes_is_one_line(script, argv, expected):
    """Every process parses the command line; argparse's usage and error lines come from the first one only
    (`flags.ArgumentParser`), and every process exits 2."""
    run = forked_launch(script, argv)  # nothing is written: the parse fails first
    assert run.codes == [2, 2], run.texts
    assert [ln for ln in run.texts[0].splitlines() if ": error: " in ln] == [expected], run.texts[0]
    assert "usage:" in run.texts[0], run.texts[0]
    # nothing of ours from the second (torch's c10d may warn there when the first leaves the meet: noticed in the note)
    assert "usage:" not in run.texts[1] and ": error: " not in run.texts[1] and "Traceback" not in run.texts[1], run.texts[1]


HEAVY_MODULES = ("torch", "timm", "torchvision", "accelerate", "matplotlib")
HELP_PROBE = """
import contextlib, io, json, runpy, sys
sys.argv = [sys.argv[1], "--help"]
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    runpy.run_path(sys.argv[0], run_name="__main__")
print(json.dumps({"help": out.getvalue(), "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY_MODULES,)


@pytest.mark.parametrize("script", sorted(f.name for f in (REPO / "scripts").glob("*.py")))
def test_help_of_every_script_imports_no_heavy_module(script):
    """`--help` builds the parser only: torch, timm, torchvision, accelerate and matplotlib are imported once a
    command runs (each took seconds at every start of every process). Checked by what is in sys.modules after
    `--help` in a fresh interpreter, not by a time."""
    import json
    import subprocess
    import sys

    from conftest import launch_env

    proc = subprocess.run([sys.executable, "-c", HELP_PROBE, str(REPO / "scripts" / script)], capture_output=True,
                          text=True, timeout=120, env=launch_env({"PYTHONPATH": str(REPO)}))
    result = json.loads(proc.stdout.splitlines()[-1])
    assert "usage:" in result["help"] and "--" in result["help"], proc.stdout[-2000:] + proc.stderr[-2000:]
    assert result["heavy"] == [], f"{script} --help imported {result['heavy']}"


@pytest.mark.parametrize("script", sorted(f.name for f in (REPO / "scripts").glob("*.py")))
def test_no_script_reads_a_shortened_flag_as_a_longer_one(script, capsys):
    """argparse's abbreviations read `--tile 128` as `--tile_min_visible 128` before --tile existed: every script's
    `main(argv)` refuses a prefix of one of its flags (exit 2) rather than guessing (in-process: the parse is the
    first thing each `main` does, before any import a launch would add)."""
    from helpers import run_main

    spec = importlib.util.spec_from_file_location(script[:-3], REPO / "scripts" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = module.build_parser()
    longest = max((o for a in parser._actions for o in a.option_strings if o.startswith("--") and a.nargs != 0),
                  key=len)  # a flag that takes a value
    code, out, err = run_main(script[:-3], [longest[:-1], "1"], capsys)
    assert code == 2, (longest, out[-1000:], err[-1000:])
    assert "unrecognized arguments" in err or "error" in err, err[-1000:]
