"""Shared test helpers: where the real data lies, tiny COCO files, and launching the scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

# One thread per pytest process: the suite's two xdist workers and the processes they launch share 2 cores, and
# torch's default (a thread per core) in both workers makes their OpenMP threads wait on each other's cores.
torch.set_num_threads(1)

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


def pytest_collection_modifyitems(items):
    """The test files with the most `slow` tests first (each file's tests keep their order). xdist's `loadfile` hands
    out whole files in this order, so the long files start first and the two workers end together instead of one
    waiting on the other's last launch file."""
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])


FOREIGN_RUNTIMES = ("openvino", "nncf")  # their native libraries beside torch's crashed a later run (SIGSEGV)


@pytest.fixture(autouse=True)
def _no_foreign_runtime_in_the_test_process():
    """A test that loads OpenVINO or NNCF into the pytest worker fails: they run in the scripts' own processes, as
    a user runs them. Loaded beside the in-process training runs of the worker's other files, they crashed one
    (SIGSEGV: xdist's "node down", and the session hung until CI's limit)."""
    yield
    loaded = [name for name in FOREIGN_RUNTIMES if name in sys.modules]
    assert not loaded, f"{loaded} imported in the test process: run it in a subprocess (tests/test_deploy.py's `script`)"


LAUNCH_LOG = "DETLIB_LAUNCH_LOG"  # the file every process of a session appends one line to per process it starts


def pytest_configure(config):
    """The controller (or a run without xdist) names the session's launch log before its workers start; they
    inherit it through the environment, as the processes they start do."""
    if not hasattr(config, "workerinput") and not os.environ.get(LAUNCH_LOG):
        fd, path = tempfile.mkstemp(prefix="detlib_launches_", suffix=".txt")
        os.close(fd)
        os.environ[LAUNCH_LOG] = path


def log_launch(kind: str, nodeid: str, words: str) -> None:
    """One line `<kind> <test id> <words>` in the session's launch log: kind `launch:<config>` (`accelerate
    launch`), `script` (`python scripts/<x>.py`), `python` (any other fresh Python process) or `fork<N>` (a run of
    N ranks forked from the fork server)."""
    path = os.environ.get(LAUNCH_LOG)
    if path:
        with open(path, "a") as f:
            f.write(f"{kind} {nodeid} {words}\n")


@pytest.fixture(autouse=True)
def _count_launches(request, monkeypatch):
    """Every Python process a test starts, logged (`log_launch`) for the count printed at the end of the session."""
    init = subprocess.Popen.__init__

    def counted(self, args, *a, **k):
        words = [str(w) for w in ([args] if isinstance(args, (str, os.PathLike)) else args)]
        if words and Path(words[0]).name.startswith("python"):
            launched = "accelerate.commands.launch" in words or Path(words[0]).name == "accelerate"
            config = words[words.index("--config_file") + 1] if "--config_file" in words else ""
            script = any(Path(w).parent == REPO / "scripts" for w in words[1:3])
            kind = f"launch:{Path(config).name}" if launched else "script" if script else "python"
            log_launch(kind, request.node.nodeid, " ".join(Path(w).name for w in words[1:6]))
        init(self, args, *a, **k)

    monkeypatch.setattr(subprocess.Popen, "__init__", counted)
    yield


def pytest_terminal_summary(terminalreporter, config):
    """The session's started processes, by kind: what the suite pays in start-ups (issue 48 caps real launches)."""
    path = os.environ.get(LAUNCH_LOG)
    if hasattr(config, "workerinput") or not path or not os.path.exists(path):
        return
    import yaml

    kinds = [line.split(" ", 2) for line in Path(path).read_text().splitlines() if line.strip()]
    launches = [k for k, *_ in kinds if k.startswith("launch:")]
    ranks = sum(yaml.safe_load((REPO / "accelerate_configs" / k.split(":", 1)[1]).read_text()).get("num_processes", 1)
                for k in launches)
    scripts = sum(k == "script" for k, *_ in kinds)
    python = sum(k == "python" for k, *_ in kinds)
    forks = [int(k[4:]) for k, *_ in kinds if k.startswith("fork")]
    terminalreporter.write_line(
        f"started processes: {len(launches) + scripts} real launches of a script ({len(launches)} through `accelerate "
        f"launch`, {ranks} training processes; {scripts} `python scripts/...`), {python} other Python processes "
        f"(probes, --help), {len(forks)} forked runs of {sum(forks)} ranks (list: {path})")


def traceback_through_our_code(text: str) -> bool:
    """True when `text` shows a traceback frame in detlib/ or scripts/ (a launcher's own trailer, or a virtual
    environment inside the repo, does not count)."""
    return any(f'File "{REPO / folder}' in text for folder in ("detlib", "scripts"))


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def cap_cut(scores_a, scores_b, cap: int | None) -> list[float]:
    """The score at which a `cap` (detections per image) cut the lists, when either is full: the higher of the
    two lowest kept scores; [] when neither reached the cap."""
    full = [float(min(s)) for s in (scores_a, scores_b) if cap is not None and len(s) >= cap and len(s)]
    return [max(full)] if full else []


def assert_same_detections(ours: tuple, ref: tuple, score_atol: float, box_atol: float, cuts=()) -> int:
    """Two detection lists of one image are the same set: every detection of each has one of the other with the same
    label, a box within `box_atol` (pixels, largest coordinate difference) and a score within `score_atol`, one to
    one; the order is never compared (detections whose scores tie within rounding come in any order).

    Except at a cut: where a cap or a threshold cut a run of scores that tie within rounding (`cuts`: the scores at
    which the lists were cut, e.g. `cap_cut(...)` for the detections-per-image cap, the score threshold, a per-level
    top-k's last score), which of them made it is decided by float rounding, on each machine its own way; a
    detection left without a partner must have a score within `score_atol` of a cut (so a list can differ
    from the other only in the detections tied with a cut).

    Args:
        ours, ref: (boxes [N, 4] xyxy pixels, scores [N], labels [N]) as tensors or arrays.
    Returns:
        the number of detections paired.
    """
    import torch

    (ob, os_, ol), (rb, rs, rl) = ([torch.as_tensor(np.asarray(x), dtype=torch.float64) for x in d] for d in (ours, ref))
    used = torch.zeros(len(ol), dtype=torch.bool)
    unpaired_ref = []
    for i in torch.argsort(rs, descending=True, stable=True).tolist():
        ok = (ol == rl[i]) & ~used & ((os_ - rs[i]).abs() <= score_atol)
        if len(ob):
            d = (ob - rb[i]).abs().amax(dim=1)
            ok &= d <= box_atol
        if not ok.any():
            unpaired_ref.append(float(rs[i]))
            continue
        j = int(torch.where(ok, d, torch.full_like(d, float("inf"))).argmin())
        used[j] = True
    unpaired_ours = os_[~used].tolist()
    cuts = [float(c) for c in cuts]
    stray = [s for s in unpaired_ref + unpaired_ours if not any(abs(s - c) <= score_atol for c in cuts)]
    assert not stray, (f"detections without a partner away from any cut {cuts}: ref {unpaired_ref[:10]}, ours "
                       f"{unpaired_ours[:10]} (of {len(rl)} / {len(ol)})")
    return int(used.sum())


def level_cuts(cls_logits, counts, topk: int, score_thresh: float) -> list[float]:
    """The per-level top-k cuts of one image's decoding (`detlib.retinanet.decode`, torchvision's postprocess): for each level
    with more than `topk` candidates above `score_thresh`, the score of its `topk`-th; and the threshold itself.

    Args:
        cls_logits: [A, K] one image's class logits, levels in `counts` order.
    """
    import torch

    cuts = [float(score_thresh)]
    for level in torch.as_tensor(cls_logits).split(list(counts)):
        s = torch.sigmoid(level.float()).flatten()
        s = s[s > score_thresh]
        if s.numel() > topk:
            cuts.append(float(s.topk(topk).values[-1]))
    return cuts


# ---- the exit paths' tiny data (tests/test_exit_paths.py, tests/test_exit_paths_without_signals.py)

@pytest.fixture(scope="module")
def cats_data(tmp_path_factory) -> list[str]:
    from helpers import make_tiny_folder

    root = tmp_path_factory.mktemp("cats")
    train = make_tiny_folder(root / "train", [16, 16])
    val = make_tiny_folder(root / "val", [24, 24], seed=1)
    return ["--train_dir", str(train), "--val_dir", str(val)]


@pytest.fixture(scope="module")
def detection_data(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("det")
    images, anns = [], []
    for i in range(40):
        write_image(root / "img" / f"{i}.png", 64, 64, seed=i)
        images.append({"id": i + 1, "file_name": f"{i}.png", "width": 64, "height": 64})
        anns.append({"image_id": i + 1, "category_id": 1 + i % 2, "bbox": [4 + i % 9, 6, 30, 24 + i % 5]})
    cats = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
    write_coco(root / "train.json", images[:16], anns[:16], cats)
    write_coco(root / "val.json", images[16:], anns[16:], cats)
    return ["--train_images", str(root / "img"), "--train_annotations", str(root / "train.json"),
            "--val_images", str(root / "img"), "--val_annotations", str(root / "val.json")]
