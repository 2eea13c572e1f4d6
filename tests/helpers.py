"""Helpers that several test modules share (test modules never import each other): the scripts loaded as
modules and run in-process, the tiny ImageFolder trees, planted checkpoint payloads, launches watched from
outside, and runs on several processes forked from the test process.

`tests/conftest.py` holds the data paths, the COCO writers and the launch helpers; this module holds what needs
more than the standard library and numpy to build (PIL, torch, detlib)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
from PIL import Image

from conftest import launch_command, launch_env  # the suite's conftest, not a test module

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


def fresh_accelerate() -> None:
    """Forget the accelerate state of the previous in-process run (accelerate's singletons keep the first
    Accelerator's settings for the whole process, and refuse another `mixed_precision`): call before and after a
    `main(argv)` whose settings differ from the others' (fp16, gradient accumulation)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_ok(name: str, argv: list, capsys=None) -> str:
    """`scripts/<name>.py`'s `main(argv)` in this process on a fresh accelerate state (reset again after it), which
    must succeed (a non-zero exit fails the test with the end of the output). Returns what it printed: stdout with
    `capsys`; without it (a module fixture has none) stdout and stderr, caught in a buffer."""
    import contextlib
    import io

    fresh_accelerate()
    try:
        if capsys is not None:
            code, out, err = run_main(name, argv, capsys)
            assert code == 0, f"{name} {' '.join(map(str, argv))} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
            return out
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            try:
                result = load_script(name).main([str(a) for a in argv])
                code = result if isinstance(result, int) and not isinstance(result, bool) else 0
            except SystemExit as e:
                code = 0 if e.code is None else e.code
        assert code == 0, f"{name} {' '.join(map(str, argv))} exited {code}:\n{printed.getvalue()[-4000:]}"
        return printed.getvalue()
    finally:
        fresh_accelerate()  # the next in-process run (of any test) starts from the defaults again


def enable_cpu_fp16(accelerator) -> None:
    """Make an Accelerator on the CPU run fp16 as it does on a GPU: the prepared model's forward under
    `torch.autocast("cpu", torch.float16)` (outputs cast back to float32, as accelerate does on a GPU) and a
    `torch.amp.GradScaler("cpu")` for `backward`, `clip_grad_norm_` (unscaled first) and the optimizer step (skipped,
    and the scale halved, on a non-finite gradient). Call before `accelerator.prepare`.

    accelerate runs `mixed_precision: fp16` on a CPU with no autocast and no GradScaler, in plain fp32, so a CPU run
    would test nothing of fp16; this switches on the two pieces accelerate leaves out, and the rest is accelerate's
    own GPU code path. Raises ValueError unless the accelerator is on the CPU with mixed precision "fp16"."""
    import torch

    if accelerator.device.type != "cpu" or accelerator.mixed_precision != "fp16":
        raise ValueError(f"enable_cpu_fp16 needs a CPU accelerator with mixed_precision fp16, got "
                         f"{accelerator.device.type} / {accelerator.mixed_precision}")
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu")


def fresh_root_logging() -> None:
    """No handlers on the root logger, as in a fresh process: a one-process tool's `logging.basicConfig` (export,
    data check) then prints to this test's stderr, not to pytest's log capture or to the console and train.log
    handlers that an earlier in-process training run left behind."""
    import logging

    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)


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

def write_tiny_detector(folder: Path) -> Path:
    """A freshly initialised tiny RetinaNet (ResNet-18, 16-channel FPN, 3 classes, 64 px; seed 0) as a weights folder
    (model.safetensors, model_config.json): what predict reads, without a training run."""
    import json

    import torch
    from safetensors.torch import save_file

    from detlib.retinanet.model import build_retinanet_from_config

    config = {"num_classes": 3, "backbone": "resnet18", "fpn_channels": 16, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "image_size": 64, "max_size": None,
              "category_ids": [1, 2, 3], "category_names": ["cat", "dog", "bird"]}
    torch.manual_seed(0)
    model = build_retinanet_from_config(config).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps(config))
    return folder


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


# ---- launches watched from outside (tests/test_exit_paths.py, tests/test_synthetic.py)
HANG_S = 150  # a launch that has not returned by then hangs


def process_table() -> dict[int, tuple[int, int, str]]:
    """{pid: (parent pid, process group, state)} of every process, from /proc."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                table[int(d)] = (int(fields[1]), int(fields[2]), fields[0])
            except (OSError, IndexError, ValueError):
                pass
    return table


class Launch:
    """A script under `accelerate launch`, in its own session, its output read as it comes (with the time of each
    chunk) and its process tree sampled every 0.1 s, so a test can wait for a marker, signal it, and check that
    the whole tree is gone at the end."""

    def __init__(self, script: str, args: list, config: str | None = "cpu.yaml"):
        repo = Path(__file__).resolve().parents[1]
        command = (launch_command(script, args, config) if config else  # None: `python scripts/...`, no launcher
                   [sys.executable, str(repo / "scripts" / script), *map(str, args)])
        self.proc = subprocess.Popen(command, cwd=repo,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=launch_env({"PYTHONUNBUFFERED": "1"}))
        self.output, self.last_output = b"", time.time()
        self.seen: dict[int, int] = {}  # pid -> process group, of every process seen under the launcher
        self._readers = [threading.Thread(target=self._read, daemon=True), threading.Thread(target=self._watch, daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            self.output += chunk
            self.last_output = time.time()

    def _watch(self) -> None:
        while self._running():
            table = process_table()
            frontier = list(self._roots())
            while frontier:
                p = frontier.pop()
                for c, (pp, pg, state) in table.items():
                    if pp == p and state != "Z":
                        self.seen[c] = pg
                        frontier.append(c)
            time.sleep(0.1)

    def _running(self) -> bool:
        return self.proc.poll() is None

    def _roots(self) -> list[int]:
        return [self.proc.pid]

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def trainers(self) -> list[int]:
        """The training processes (the launcher's children that run the script)."""
        table = process_table()
        return [c for c, (pp, _, state) in table.items() if pp == self.proc.pid and state != "Z"]

    def wait_for(self, marker: str, timeout: float = HANG_S) -> None:
        t0 = time.time()
        while marker.encode() not in self.output:
            if not self._running() or time.time() - t0 > timeout:
                self.kill()
                raise AssertionError(f"no {marker!r} before the run ended or {timeout} s:\n{self.text[-3000:]}")
            time.sleep(0.05)

    def wait_for_step(self, out: Path, step: int, timeout: float = HANG_S) -> None:
        """Until metrics.jsonl holds a train line of `step`."""
        t0 = time.time()
        while True:
            try:
                lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
                if any(m.get("step", 0) >= step and "loss" in m for m in lines):
                    return
            except (OSError, ValueError):
                pass
            if not self._running() or time.time() - t0 > timeout:
                self.kill()
                raise AssertionError(f"no step {step} before the run ended or {timeout} s:\n{self.text[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        for pg in {self.proc.pid, *self.seen.values()}:
            try:
                os.killpg(pg, signal.SIGKILL)
            except OSError:
                pass

    def finish(self, label: str, timeout: float = HANG_S) -> tuple[int, float]:
        """Wait for the launcher and then for every process of the run. Returns (launcher's exit code, seconds
        from the last output to the end of the last process); a hang kills the tree and fails the test."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            left = self.alive()
            self.kill()
            raise AssertionError(f"{label}: the launcher did not return within {timeout} s (still running: {left})\n"
                                 f"{self.text[-3000:]}") from None
        t0 = time.time()
        while self.alive() and time.time() - t0 < 20:
            time.sleep(0.05)
        left = self.alive()
        self.kill()
        assert not left, f"{label}: processes of the run left after the launcher returned: {left}"
        for t in self._readers:
            t.join(timeout=5)
        seconds = time.time() - self.last_output if not left else float("inf")
        print(f"exit path {label}: exit code {code}, last process gone {seconds:.1f} s after the last output")
        return code, seconds

    def alive(self) -> list[int]:
        """Processes of the run still running: those seen under the launcher, and any in their process groups."""
        groups = {self.proc.pid, *self.seen.values()}
        table = process_table()
        return sorted(p for p, (_, pg, state) in table.items() if state != "Z" and (pg in groups or p in self.seen))


class ForkedRun(Launch):
    """`Launch`'s checks on a run forked from the fork server (`forked_launch`'s ranks, no launcher): the test waits
    for a marker or a step, signals the ranks as a terminal or a scheduler would signal the processes of a run
    started without a launcher (`python scripts/...`), and `finish` checks the exit code of rank 0 and that no
    process of the run (a rank, a DataLoader worker) is left. What a launcher adds (its group, its own exit code,
    its forwarding of signals) stays with `Launch`."""

    def __init__(self, script: str | Path, args: list, num_processes: int = 1, env: dict | None = None):
        import multiprocessing
        import tempfile

        from conftest import log_launch

        path = Path(script) if Path(script).is_absolute() else REPO / "scripts" / script
        log_launch(f"fork{num_processes}", os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], path.name)
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(FORK_SERVER_PRELOAD)
        environment, port, argv = {**os.environ, **(env or {})}, free_port(), [str(a) for a in args]
        self._logs = tempfile.TemporaryDirectory(prefix="forked_")
        self.logs = [os.path.join(self._logs.name, f"rank{rank}.log") for rank in range(num_processes)]
        self.procs = [context.Process(target=_forked_rank, args=(path, argv, rank, num_processes, port, self.logs[rank],
                                                                environment, os.getcwd()))
                      for rank in range(num_processes)]
        for p in self.procs:
            p.start()
        self.seen, self.last_output = {}, time.time()
        self._readers = [threading.Thread(target=self._watch, daemon=True)]
        for t in self._readers:
            t.start()

    def _running(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def _roots(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def texts(self) -> list[str]:
        return [Path(f).read_text(errors="replace") if os.path.exists(f) else "" for f in self.logs]

    @property
    def output(self) -> bytes:
        return "\n".join(self.texts).encode()

    @property
    def text(self) -> str:
        return self.texts[0]

    def signal(self, sig: int, ranks: tuple | None = None) -> None:
        """`sig` to the ranks (all by default), as `kill` or a scheduler sends it to the processes of a run."""
        for i, p in enumerate(self.procs):
            if ranks is None or i in ranks:
                os.kill(p.pid, sig)

    def kill(self) -> None:
        for pid in [*self._roots(), *self.seen]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def finish(self, label: str, timeout: float = HANG_S) -> tuple[int, float]:
        """Wait for every rank and then for every process of the run. Returns (rank 0's exit code, seconds from
        the end of the last rank to the end of the last process); a hang kills the run and fails the test."""
        deadline = time.time() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.time()))
        hung = [p.pid for p in self.procs if p.is_alive()]
        if hung:
            self.kill()
            raise AssertionError(f"{label}: ranks {hung} did not end within {timeout} s\n{self.text[-3000:]}")
        t0 = time.time()
        while self.alive() and time.time() - t0 < 20:
            time.sleep(0.05)
        left = self.alive()
        self.kill()
        assert not left, f"{label}: processes of the run left after its ranks ended: {left}"
        seconds = time.time() - t0
        self.codes = [p.exitcode for p in self.procs]
        print(f"exit path {label} (forked): exit codes {self.codes}, last process gone {seconds:.1f} s after the ranks")
        return self.codes[0], seconds

    def alive(self) -> list[int]:
        table = process_table()
        return sorted(p for p in self.seen if table.get(p, (0, 0, "Z"))[2] != "Z")


# ---- the exit paths' launches (tests/test_exit_paths.py, tests/test_exit_paths_without_signals.py; their data:
# conftest's `cats_data` and `detection_data`)

EXIT_WORKERS = ["--num_workers", "2"]  # the default is 4, capped at the core count: 2 on this machine, and in CI
EXIT_CATS = ["--model", "test_resnet", "--image_size", "32", "--log_interval", "1", "--report_to", "none", *EXIT_WORKERS]
EXIT_DETECT = ["--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "16", "--per_device_batch_size", "2",
               "--per_device_eval_batch_size", "1", "--log_interval", "1", "--report_to", "none", *EXIT_WORKERS]


def run_status(out: Path) -> dict:
    return json.loads((out / "run_status.json").read_text())


def processes(config: str) -> int:
    return 2 if config == "cpu_2proc.yaml" else 1


def data_and_flags(script: str, cats_data, detection_data) -> tuple[list[str], list[str]]:
    return (cats_data, EXIT_CATS) if script == "train_catsdogs.py" else (detection_data, EXIT_DETECT)


# ---- several processes forked from a clean process

Forked = namedtuple("Forked", "codes texts")

# What the forked runs import, loaded once by multiprocessing's fork server (a fresh process of its own, started at
# the first forked run of a test process); the processes it forks start with them loaded.
FORK_SERVER_PRELOAD = ["torch", "torchvision", "timm", "timm.optim", "accelerate", "tqdm.auto", "pycocotools.cocoeval",
                       "safetensors.torch", "detlib.classification", "detlib.data", "detlib.datacheck", "detlib.engine",
                       "detlib.evaluation", "detlib.inference", "detlib.retinanet", "detlib.weights", "detlib.hub",
                       "helpers"]


def forked_launch(script: str | Path, args: list, num_processes: int = 2, timeout: float = HANG_S,
                  env: dict | None = None) -> Forked:
    """`scripts/<script>` (or a probe's absolute path) run as `__main__` on `num_processes` gloo processes forked
    from multiprocessing's fork server, with this process's environment and working folder, the variables
    `accelerate launch --config_file accelerate_configs/cpu_2proc.yaml` gives its processes (1 process: those of
    `cpu.yaml`), and `env`.

    The same run without the launcher and without each process's ~6 s of imports (the fork server loaded
    `FORK_SERVER_PRELOAD` once; a 2-process run costs a third of a launch's CPU time): for what our code does
    across processes (what each rank computes, gathers and writes) and for a 1-process run that needs a process of
    its own. The launcher's part (signals, exit codes, what reaches the terminal, a process left behind) is
    tested with real launches (`Launch`, `conftest.run_script`). Not forked from the test process itself: after a
    backward pass in it (an in-process run), torch refuses autograd in a forked child.

    Returns each rank's exit code (0, or the SystemExit code; 1 for an exception) and its stdout + stderr. A run
    not ended within `timeout` seconds is killed and fails the test."""
    import multiprocessing
    import tempfile

    from conftest import log_launch

    path = Path(script) if Path(script).is_absolute() else REPO / "scripts" / script
    log_launch(f"fork{num_processes}", os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], Path(script).name)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_SERVER_PRELOAD)  # read when the server starts, at the first forked run
    environment, port, argv = {**os.environ, **(env or {})}, free_port(), [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="forked_") as logs:
        log = [os.path.join(logs, f"rank{rank}.log") for rank in range(num_processes)]
        procs = [context.Process(target=_forked_rank, args=(path, argv, rank, num_processes, port, log[rank],
                                                           environment, os.getcwd())) for rank in range(num_processes)]
        for p in procs:
            p.start()
        deadline = time.time() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.time()))
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        texts = [Path(f).read_text(errors="replace") if os.path.exists(f) else "" for f in log]
    assert not hung, f"forked ranks {hung} did not end within {timeout} s:\n" + "\n".join(t[-2000:] for t in texts)
    return Forked([p.exitcode for p in procs], texts)


def _forked_rank(path: Path, args: list, rank: int, world: int, port: int, log: str, environment: dict,
                 cwd: str) -> None:
    import multiprocessing
    import runpy

    # fork, as in a process `accelerate launch` starts on Linux: a fork server's children inherit forkserver as their
    # default, and the DataLoader workers (`detlib.data.loaders.WorkerProcess`) would each start through a new server
    # of their own, a fresh interpreter importing torch: a start-up users never pay, and not their workers' start
    multiprocessing.set_start_method("fork", force=True)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO", "OMP_NUM_THREADS": "1",
                       "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"})
    if world > 1:  # torchrun's variables (cpu_2proc.yaml); 1 process is accelerate's simple launcher (cpu.yaml)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    else:
        os.environ["ACCELERATE_USE_CPU"] = "True"
    os.chdir(cwd)
    stream = open(log, "a", buffering=1, errors="replace")
    os.dup2(stream.fileno(), 1)  # what C code (gloo, torch) prints, too
    os.dup2(stream.fileno(), 2)
    sys.stdout = sys.stderr = stream
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    runpy.run_path(str(path), run_name="__main__")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a rendezvous port, as accelerate's main_process_port 0 picks one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forked_ok(script: str | Path, args: list, num_processes: int = 2, env: dict | None = None) -> str:
    """`forked_launch` that must succeed on every rank (a non-zero exit fails the test with the ends of the
    outputs). Returns the main process's output (the other ranks log nothing)."""
    run = forked_launch(script, args, num_processes, env=env)
    assert run.codes == [0] * num_processes, f"{script} exited {run.codes}:\n" + "\n".join(t[-3000:] for t in run.texts)
    return run.texts[0]
