"""Helpers that several test modules share (test modules never import each other): the scripts loaded as
modules and run in-process, the tiny ImageFolder trees, planted checkpoint payloads.

`tests/conftest.py` holds the data paths, the COCO writers and the launch helpers; this module holds what needs
more than the standard library and numpy to build (PIL, torch, detlib)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


# ---- the scripts, in-process

def load_script(name: str, register: bool = False):
    """scripts/<name>.py as a fresh module (scripts/ is not a package); `register`: also put it in sys.modules
    under `name` when no module of that name is there (what pickling a function of the script needs)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def run_main(name: str, argv: list, capsys) -> tuple[int, str, str]:
    """`scripts/<name>.py`'s `main(argv)` in this process, as `accelerate launch` of 1 process would run it:
    returns (exit code, stdout, stderr); 0 when main returns. Any exception other than SystemExit propagates
    (in a launched process it would be a traceback through our code), so the test fails on it."""
    module = load_script(name)
    capsys.readouterr()
    try:
        result = module.main([str(a) for a in argv])
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):  # `raise SystemExit("error: ...")` prints the message on stderr
            print(e.code, file=sys.stderr)
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# ---- ImageFolder trees built by the tests themselves

def _noise(seed: int, size: int = 40) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8)


def write_good_images(folder: Path, count: int, seed: int, size: int = 40) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        p = folder / f"img_{i:03d}.jpg"
        Image.fromarray(_noise(seed * 1000 + i, size)).save(p, quality=90)
        paths.append(p)
    return paths


BadFolder = namedtuple("BadFolder", "root good skipped ignored")


def make_bad_folder(root: Path, good_per_class: int = 6, size: int = 40) -> BadFolder:
    """An ImageFolder with every kind of bad input of cases B24-B27.

    cats/: good JPEGs, `0.jpg` (0 bytes), `fake.jpg` (text), `trunc.jpg` (a JPEG without its last 100 bytes),
           `gray.jpg` (mode L), `cmyk.jpg` (CMYK), `._img_000.jpg` (macOS AppleDouble, hidden)
    dogs/: good JPEGs, `alpha.png` (RGBA), `pal.png` (P with transparency), `Thumbs.db`, `.DS_Store`
    .ipynb_checkpoints/ (with an image inside: it must not become a class)
    Returns the root, the usable files, {file: reason word} of the skipped ones and the ignored names.
    """
    cats, dogs = root / "cats", root / "dogs"
    good = write_good_images(cats, good_per_class, 1, size) + write_good_images(dogs, good_per_class, 2, size)
    (cats / "0.jpg").write_bytes(b"")
    (cats / "fake.jpg").write_text("this is not an image, but it is called .jpg\n")
    Image.fromarray(_noise(7, 64)).save(cats / "full.jpg", quality=90)
    data = (cats / "full.jpg").read_bytes()
    (cats / "full.jpg").unlink()
    (cats / "trunc.jpg").write_bytes(data[:-100])
    Image.fromarray(_noise(8, size)[..., 0], mode="L").save(cats / "gray.jpg")
    Image.fromarray(_noise(9, size)).convert("CMYK").save(cats / "cmyk.jpg")
    (cats / "._img_000.jpg").write_bytes(b"\x00\x05\x16\x07" + b"\x00" * 60)
    rgba = np.concatenate([_noise(10, size), np.full((size, size, 1), 128, np.uint8)], axis=2)
    Image.fromarray(rgba, mode="RGBA").save(dogs / "alpha.png")
    pal = Image.fromarray(_noise(11, size)).convert("P")
    pal.info["transparency"] = 0
    pal.save(dogs / "pal.png")
    (dogs / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0" + b"\x00" * 100)
    (dogs / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    hidden = root / ".ipynb_checkpoints"
    hidden.mkdir()
    Image.fromarray(_noise(12, size)).save(hidden / "img-checkpoint.jpg")
    good += [cats / "gray.jpg", cats / "cmyk.jpg", dogs / "alpha.png", dogs / "pal.png"]
    skipped = {"0.jpg": "empty file", "fake.jpg": "not an image", "trunc.jpg": "truncated"}
    return BadFolder(root, good, skipped, ["._img_000.jpg", "Thumbs.db", ".DS_Store"])


def make_tiny_folder(root: Path, per_class: list[int], size: int = 32, seed: int = 0) -> Path:
    """The built-in generator's two classes (`horizontal`, `vertical` stripes) with the given counts."""
    from detlib.data.builtin import STRIPES_CLASSES, make_synthetic_image_folder

    dirs = make_synthetic_image_folder(str(root / "gen"), num_train=max(per_class), num_val=1, image_size=size, seed=seed)
    for cls, n in zip(STRIPES_CLASSES, per_class):
        (root / "set" / cls).mkdir(parents=True, exist_ok=True)
        for p in sorted(Path(dirs["train_dir"], cls).iterdir())[:n]:
            os.link(p, root / "set" / cls / p.name)
    return root / "set"


# ---- checkpoint folders

def fake_checkpoint(folder, step: int):
    """A checkpoint folder with the files accelerate's save_state writes (tiny tensors)."""
    import json

    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"w": torch.arange(6.0)}, str(folder / "model.safetensors"))
    torch.save({"state": {}, "param_groups": [{"lr": 0.1}]}, folder / "optimizer.bin")
    (folder / "trainer_state.json").write_text(json.dumps({"epoch": 2, "global_step": step}))
    return folder


class Payload:
    """What a planted state file holds: unpickling it runs `touch MARKER` (os.system through `__reduce__`)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path, marker, fmt: str) -> None:
    """Overwrite `path` with a payload: a torch.save zip archive (what accelerate writes) or a bare pickle."""
    import torch

    obj = {"state": Payload(marker), "param_groups": [], "w": torch.zeros(1)}
    if fmt == "torch":
        torch.save(obj, path)
    else:
        path.write_bytes(pickle.dumps(obj))
