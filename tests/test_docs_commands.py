"""Every command in README.md and docs/*.md names scripts, flags and files that exist.

The commands are read from the code blocks (fenced, or indented by 4 spaces): lines that run `python
scripts/...`, `python benchmarks/...`, `accelerate launch`, `bash`, `sbatch` (after `ENV=value` words and `$ `),
with `\\` continuation lines joined, and the inline code spans that are such commands. Each script's parser is
built in process (its `__main__` run with `ArgumentParser.parse_args` stopped before it parses), and every `--flag` the command passes must be one of its
options; the flags before the script in `accelerate launch` must be accelerate's own. `--config_file` files,
the repo-relative paths the pages name and their relative links must exist. The README stays short.
"""
from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_BYTES = 12_500
LAUNCHERS = ("python", "accelerate", "bash", "sbatch", "...")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def code_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks and of the 4-space indented blocks, in order, unindented, then the
    inline code spans of the prose and tables (`python scripts/x.py --help`)."""
    out, inline, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append(line.strip())
        elif line.startswith("    ") and line.strip():
            out.append(line.strip())
        else:
            inline += [span.strip() for span in re.findall(r"`([^`]+)`", line)]
    return out + [span for span in inline if not span.endswith("\\")]


def commands(text: str) -> list[str]:
    """The shell commands of a page's code blocks: continuation lines joined, `$ ` prompts removed, each
    `&&` / `;` / `|` part on its own, only those a launcher in LAUNCHERS runs."""
    joined, current = [], ""
    for line in code_lines(text):
        if line.startswith("$ "):
            line = line[2:]
        if current:
            current += " " + line
        else:
            current = line
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        joined.append(current)
        current = ""
    out = []
    for line in joined:
        if line.startswith("#"):
            continue
        for part in re.split(r"&&|;|\|(?!\d)", line):
            words = shlex.split(part.strip().rstrip("&"), comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]  # OMP_NUM_THREADS=1, CUDA_VISIBLE_DEVICES=0,1, OUTPUT_DIR=...
            if words[:2] == ["taskset", "-c"]:
                words = words[3:]
            if words and words[0] in LAUNCHERS and any(w.endswith((".py", ".sh", ".sbatch")) for w in words):
                out.append(" ".join(shlex.quote(w) for w in words))
    return out


@lru_cache(maxsize=None)
def script_options(relpath: str) -> frozenset[str]:
    """The option strings of the parser a script builds when run as `__main__`."""
    path = REPO / relpath
    if "argparse" not in path.read_text():
        raise AssertionError(f"{relpath} has no argparse parser to check flags against")
    Parser = argparse.ArgumentParser
    original, original_known, argv = Parser.parse_args, Parser.parse_known_args, sys.argv

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    def capture_known(self, args=None, namespace=None):
        if not self.add_help:  # a pre-parser such as parse_with_config's --config one: let it parse
            return original_known(self, args, namespace)
        raise _Captured(self)

    Parser.parse_args, Parser.parse_known_args = capture, capture_known
    sys.argv = [str(path)]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except _Captured as c:
        return frozenset(c.parser._option_string_actions)
    finally:
        Parser.parse_args, Parser.parse_known_args, sys.argv = original, original_known, argv
    raise AssertionError(f"{relpath} ran without building an argparse parser")


@lru_cache(maxsize=None)
def accelerate_options() -> frozenset[str]:
    from accelerate.commands.launch import launch_command_parser
    return frozenset(launch_command_parser()._option_string_actions)


def flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def check_command(command: str) -> list[str]:
    """The problems of one command: a missing script or config file, a flag its parser does not have."""
    words = [w.strip("[]") for w in shlex.split(command)]
    problems = []
    i = next(i for i, w in enumerate(words) if w.endswith((".py", ".sh", ".sbatch")))
    script, before, after = words[i], words[1:i], words[i + 1:]
    if not (REPO / script).is_file():
        return [f"{script}: no such script"]
    if words[0] == "accelerate":
        unknown = [f for f in flags(before) if f not in accelerate_options()]
        problems += [f"accelerate launch has no {f}" for f in unknown]
        for k, w in enumerate(before[:-1]):
            if w == "--config_file" and not (REPO / before[k + 1]).is_file():
                problems.append(f"--config_file {before[k + 1]}: no such file")
    if script.endswith(".sbatch"):
        script = "scripts/train_retinanet.py"  # the sbatch script passes its arguments to it
    elif not script.endswith(".py"):
        return problems
    options = script_options(script)
    problems += [f"{script} has no {f}" for f in flags(after) if f not in options]
    return problems


PATH_RE = re.compile(r"(?<![\w./$-])((?:accelerate_configs|slurm|docs|scripts|benchmarks|tests|detlib)/[\w./-]*\w)")
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def page_commands() -> list[tuple[str, str]]:
    return [(p.relative_to(REPO).as_posix(), c) for p in PAGES for c in commands(p.read_text())]


def test_commands_are_found_in_every_kind_of_block():
    text = ("```bash\n$ OMP_NUM_THREADS=1 accelerate launch --config_file a.yaml scripts/x.py \\\n"
            "  --lr 1 && ls\n```\n\n"
            "    # comment\n    ... scripts/y.py --a b\n\n```python\nimport x\n```\n")
    assert commands(text) == ["accelerate launch --config_file a.yaml scripts/x.py --lr 1", "... scripts/y.py --a b"]


def test_the_pages_hold_the_commands_of_every_job():
    found = page_commands()
    scripts = {re.search(r"\S+\.(?:py|sbatch|sh)\b", c).group(0) for _, c in found}
    assert {"scripts/train_retinanet.py", "scripts/train_catsdogs.py", "scripts/predict_retinanet.py",
            "scripts/export_retinanet.py", "scripts/check_dataset.py", "scripts/convert_weights.py",
            "scripts/predict_catsdogs.py", "slurm/train_retinanet.sbatch"} <= scripts
    assert len([1 for page, _ in found if page == "README.md"]) >= 8


def test_a_wrong_flag_is_caught():
    assert check_command("python scripts/predict_retinanet.py --weights w --sorce photos/") == [
        "scripts/predict_retinanet.py has no --sorce"]
    assert check_command("accelerate launch --config_file accelerate_configs/none.yaml --num_proc 2 "
                         "scripts/train_retinanet.py --lr 1") == [
        "accelerate launch has no --num_proc", "--config_file accelerate_configs/none.yaml: no such file"]
    assert check_command("python scripts/no_such.py --x 1") == ["scripts/no_such.py: no such script"]


@pytest.mark.parametrize("page,command", page_commands())
def test_command_scripts_and_flags_exist(page, command):
    assert check_command(command) == [], f"{page}: {command}"


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES])
def test_named_paths_and_links_exist(page):
    path = REPO / page
    text = path.read_text()
    missing = [p for p in PATH_RE.findall(text) if not (REPO / p).exists()]
    missing += [link for link in LINK_RE.findall(text)
                if "://" not in link and not (path.parent / link).exists()]
    assert missing == []


def test_each_process_count_has_its_config_named_after_it_and_the_commands_use_it():
    """Ngpu.yaml starts N processes, cpu.yaml 1, cpu_Nproc.yaml N, Nnode_example.yaml spans N machines; a page's
    command takes the config of its process count instead of overriding one with --num_processes."""
    import yaml

    for path in sorted((REPO / "accelerate_configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        if m := re.fullmatch(r"(\d+)gpu|cpu(?:_(\d+)proc)?", path.stem):
            assert config["num_processes"] == int(m[1] or m[2] or 1), path.name
        else:
            m = re.fullmatch(r"(\d+)node_example", path.stem)
            assert m and config["num_machines"] == int(m[1]), path.name
    overriding = [(page, c) for page, c in page_commands()
                  if c.startswith("accelerate") and "--num_processes" in c.split(" scripts/")[0]]
    assert overriding == []


def test_pages_do_not_point_at_the_projects_shared_folder_in_a_users_commands():
    # A user's clone has no ../shared; only the README's note on the tests' data may name it.
    for page in PAGES:
        for command in commands(page.read_text()):
            assert "../shared" not in command, (page.name, command)


def test_readme_is_short():
    assert (REPO / "README.md").stat().st_size <= README_MAX_BYTES


def python_snippet(page: Path, first_line: str) -> str:
    """The fenced ```python block of `page` that starts with `first_line`."""
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"{page.name}: no python block starting with {first_line!r}")


@pytest.mark.slow
def test_onnx_snippet_runs_as_pasted(tmp_path, monkeypatch):
    """docs/predict_export.md's onnxruntime snippet, pasted into the folder where the README's train and export
    commands leave their files: it finds the export's files and reads the photo upright (EXIF orientation 6)."""
    pytest.importorskip("onnxruntime")
    import json

    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from detlib.retinanet.model import RetinaNet

    best = tmp_path / "outputs" / "retinanet_builtin" / "best"
    best.mkdir(parents=True)
    torch.manual_seed(0)
    model = RetinaNet(3, "resnet18", fpn_channels=16)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, best / "model.safetensors")
    (best / "model_config.json").write_text(json.dumps({
        "num_classes": 3, "backbone": "resnet18", "fpn_channels": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 64, "max_size": None,
        "category_ids": [1, 2, 3], "category_names": ["circle", "square", "triangle"]}))
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8))  # 80 wide, 48 high
    exif = photo.getexif()
    exif[0x0112] = 6  # shown rotated by 90 degrees: 48 wide, 80 high
    photo.save(tmp_path / "photo.jpg", exif=exif)
    monkeypatch.chdir(tmp_path)

    readme_export = next(c for c in commands((REPO / "README.md").read_text()) if "export_retinanet.py" in c)
    argv = shlex.split(readme_export)[2:] + ["--check_source", "photo.jpg", "--num_check_images", "1",
                                             "--score_thresh", "0"]
    export = runpy.run_path(str(REPO / "scripts" / "export_retinanet.py"))
    export["main"](argv)

    snippet = python_snippet(REPO / "docs" / "predict_export.md", "import json, numpy as np, onnxruntime")
    scope: dict = {}
    exec(compile(snippet, "docs/predict_export.md", "exec"), scope)
    assert scope["photo"].size == (48, 80)
    assert scope["boxes"].shape == (100, 4) and len(scope["names"]) == 100
    assert set(scope["names"]) <= {"circle", "square", "triangle"}
    assert scope["boxes"][:, 2].max() <= 48 + 1e-3 and scope["boxes"][:, 3].max() <= 80 + 1e-3  # the upright image


def test_readme_examples_use_the_folder_the_first_run_writes():
    """The README's outputs folder is the one the built-in run writes by default, and its predict / export
    examples read that folder (they once named outputs/r50_600, which no command of the README makes)."""
    train = runpy.run_path(str(REPO / "scripts" / "train_retinanet.py"))
    default = train["DATA_DEFAULTS"]["output_dir"][0]  # the built-in data's (README's first command)
    text = (REPO / "README.md").read_text()
    assert f"The run leaves everything in `{default}/`" in text
    for command in commands(text):
        words = shlex.split(command)
        if any(w.endswith(("predict_retinanet.py", "export_retinanet.py")) for w in words):
            weights = words[words.index("--weights") + 1]
            assert weights == default or weights.startswith(default + "/"), command
