"""Shared test helpers: where the real data lies, tiny COCO files, and launching the scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
COCO_SUBSET = SHARED_DATA / "coco_subset"

needs_coco_subset = pytest.mark.skipif(not (COCO_SUBSET / "annotations" / "instances_train.json").is_file(),
                                       reason="../shared/data/coco_subset is not present")


def write_coco(path: Path, images: list[dict], annotations: list[dict], categories: list[dict] | None = None,
               info: bool = True) -> Path:
    """Write a COCO json; ids of annotations are filled in when missing."""
    for i, a in enumerate(annotations):
        a.setdefault("id", i + 1)
        a.setdefault("iscrowd", 0)
        a.setdefault("area", float(a["bbox"][2] * a["bbox"][3]))
    data = {"images": images, "annotations": annotations, "categories": categories or [{"id": 1, "name": "thing"}]}
    if info:
        data["info"] = {}
        data["licenses"] = []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def write_image(path: Path, width: int, height: int, seed: int = 0, mode: str = "RGB", fmt: str | None = None) -> Path:
    """A random-noise image file (so a JPEG has real content)."""
    rng = np.random.RandomState(seed)
    arr = rng.randint(0, 256, (height, width, 3), dtype=np.uint8)
    img = Image.fromarray(arr).convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt)
    return path


def launch_command(script: str | Path, args: list[str], config: str = "cpu.yaml", launcher_args: tuple = ()) -> list[str]:
    """`accelerate launch --config_file accelerate_configs/<config> [launcher_args] scripts/<script> <args>`; an
    absolute `script` path (a probe written by a test) is launched as it is."""
    path = Path(script) if Path(script).is_absolute() else REPO / "scripts" / script
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / config),
            *launcher_args, str(path), *map(str, args)]


def launch_env(env: dict | None = None) -> dict:
    # 1 thread per process: the tests' launches share 2 cores (docs/distributed.md, "Threads on a CPU")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **(env or {})}


def run_script(script: str | Path, args: list[str], config: str = "cpu.yaml", timeout: int = 600, env: dict | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run a script under `accelerate launch` from the repo root and wait; `check`: fail the test on a non-zero exit,
    showing the ends of stdout and stderr."""
    cmd = launch_command(script, args, config)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=launch_env(env))
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def start_script(script: str | Path, args: list[str], config: str = "cpu.yaml", launcher_args: tuple = (),
                 env: dict | None = None, stderr=subprocess.STDOUT) -> subprocess.Popen:
    """Start a script under `accelerate launch` without waiting, in its own session (so a test can signal the
    launcher alone, or its whole group); stderr merged into stdout unless `stderr=subprocess.PIPE`."""
    return subprocess.Popen(launch_command(script, args, config, launcher_args), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True, env=launch_env(env))


def traceback_through_our_code(text: str) -> bool:
    """True when `text` shows a traceback frame in detlib/ or scripts/ (a launcher's own trailer, or a virtual
    environment inside the repo, does not count)."""
    return any(f'File "{REPO / folder}' in text for folder in ("detlib", "scripts"))


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
