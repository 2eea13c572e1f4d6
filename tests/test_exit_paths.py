"""Every run ends: each exit path of both training scripts and both predict scripts, launched as users launch them
(DataLoader workers on: the cats/dogs loaders keep theirs alive between epochs, RetinaNet's do not), 1 and 2
processes, under a timeout that makes a hang a failure.

Each launch checks the exit code, `run_status.json`, and that no process of the run is left: every process seen
under the launcher (training processes, DataLoader workers) and every process group they were in is gone within
seconds of the launcher's exit. The seconds from the last output to the end of the last process are printed
(`pytest -s`) as `exit path ...: N.N s`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import launch_env, traceback_through_our_code, write_coco, write_image
from helpers import Launch, error_lines, process_table

pytestmark = pytest.mark.slow

WORKERS = ["--num_workers", "2"]  # the default is 4, capped at the core count: 2 on this machine, and in CI
CATS = ["--model", "test_resnet", "--image_size", "32", "--log_interval", "1", "--report_to", "none", *WORKERS]
DETECT = ["--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "16", "--per_device_batch_size", "2",
          "--per_device_eval_batch_size", "1", "--log_interval", "1", "--report_to", "none", *WORKERS]


def status(out: Path) -> dict:
    return json.loads((out / "run_status.json").read_text())


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


def processes(config: str) -> int:
    return 2 if config == "cpu_2proc.yaml" else 1


def data_and_flags(script: str, cats_data, detection_data) -> tuple[list[str], list[str]]:
    return (cats_data, CATS) if script == "train_catsdogs.py" else (detection_data, DETECT)


# ---- the ends of a run: an epoch's end and --max_steps, --evaluate_only, then predict on what it wrote

@pytest.mark.parametrize("script,config", [("train_catsdogs.py", "cpu.yaml"), ("train_catsdogs.py", "cpu_2proc.yaml"),
                                           ("train_retinanet.py", "cpu.yaml"), ("train_retinanet.py", "cpu_2proc.yaml")])
def test_normal_end_max_steps_and_evaluate_only_return_to_the_shell(script, config, cats_data, detection_data, tmp_path):
    """One training launch ends an epoch (evaluation, checkpoint; the cats/dogs workers stay alive for the next
    epoch) and then stops at --max_steps one step into the next (its workers abandoned mid-epoch). On 2 processes,
    an --evaluate_only launch of what it wrote; on 1 process, the predict script on it (and, for RetinaNet, its
    error at start, launched on 2 processes: both predict scripts end through `detlib.inference.run_prediction`)."""
    data, flags = data_and_flags(script, cats_data, detection_data)
    batch = 8 if script == "train_catsdogs.py" else 2  # 32 and 16 training images: 4 and 8 steps on 1 process
    steps_per_epoch = (32 if script == "train_catsdogs.py" else 16) // (batch * processes(config))
    out = tmp_path / "run"
    flags = flags + ["--per_device_eval_batch_size", "4"]  # the evaluation's end matters here, not its length
    run = Launch(script, data + flags + ["--per_device_batch_size", batch, "--epochs", "2",
                                         "--max_steps", steps_per_epoch + 1, "--output_dir", out], config)
    code, _ = run.finish(f"{script} {config} an epoch, then --max_steps mid-epoch")
    assert code == 0 and status(out)["status"] == "finished", run.text[-3000:]
    assert status(out)["global_step"] == steps_per_epoch + 1, status(out)
    assert (out / "checkpoints" / "epoch_0001").is_dir() and (out / "best" / "model.safetensors").is_file()
    if config == "cpu_2proc.yaml":
        run = Launch(script, data + flags + ["--evaluate_only", out / "best", "--output_dir", tmp_path / "eval"], config)
        code, _ = run.finish(f"{script} {config} --evaluate_only")
        assert code == 0 and (tmp_path / "eval" / "evaluate_only" / "metrics.jsonl").is_file(), run.text[-3000:]
        return
    predict = script.replace("train_", "predict_")
    source = data[data.index("--val_dir") + 1] if "--val_dir" in data else data[data.index("--val_images") + 1]
    run = Launch(predict, ["--weights", out / "best", "--source", source, *WORKERS, "--output_dir", tmp_path / "pred"])
    code, _ = run.finish(f"{predict} normal end")
    assert code == 0, run.text[-3000:]
    if script == "train_retinanet.py":  # on 2 processes: the line once, and no `stopped:` line for the second
        # process, which waits for the first and is then stopped by the launcher
        run = Launch(predict, ["--weights", tmp_path / "missing", "--source", source, *WORKERS, "--output_dir",
                               tmp_path / "p2"], "cpu_2proc.yaml")
        code, _ = run.finish(f"{predict} cpu_2proc.yaml error at start")
        assert code != 0 and not traceback_through_our_code(run.text), run.text[-3000:]
        assert len(error_lines(run.text)) == 1 and "stopped:" not in run.text, run.text[-3000:]


@pytest.mark.parametrize("script", ["predict_catsdogs.py", "predict_retinanet.py"])
def test_ctrl_c_to_a_prediction(script, tmp_path):
    """Ctrl-C while a predict script runs (with workers): one `stopped:` line last, no traceback, exit 130."""
    from safetensors.torch import save_file

    from helpers import make_tiny_folder

    weights = tmp_path / "best"
    weights.mkdir()
    if script == "predict_catsdogs.py":
        from detlib.classification import build_classifier

        model, config = build_classifier("test_resnet", 2), {"model": "test_resnet", "num_classes": 2,
                                                              "classes": ["horizontal", "vertical"], "image_size": 32}
    else:
        from detlib.retinanet.model import RetinaNet

        model = RetinaNet(2, "resnet18", fpn_channels=16)
        config = {"num_classes": 2, "backbone": "resnet18", "fpn_channels": 16, "image_size": 64, "mean": model.mean,
                  "std": model.std}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights / "model.safetensors")
    (weights / "model_config.json").write_text(json.dumps(config))
    source = make_tiny_folder(tmp_path / "images", [300, 300], size=64)
    run = Launch(script, ["--weights", weights, "--source", source, "--batch_size", "1", *WORKERS,
                          "--output_dir", tmp_path / "out"], None)
    run.wait_for("predict:")
    time.sleep(1.0)
    os.killpg(run.proc.pid, signal.SIGINT)
    code, _ = run.finish(f"{script} Ctrl-C")
    last = [ln for ln in run.text.replace("\r", "\n").splitlines() if ln.strip()][-1]
    assert code == 130 and last.startswith("stopped: SIGINT before the end"), run.text[-2000:]
    assert "Traceback" not in run.text, run.text[-2000:]


# ---- stops: preemption mid-epoch and mid-evaluation, the launcher killed, divergence, errors

def test_sigterm_to_the_launcher_mid_epoch(cats_data, detection_data, tmp_path):
    """SIGTERM to the 1-process launcher, with the cats/dogs loaders' persistent workers; on 2 processes it is
    tests/test_run_launch.py's SIGTERM test (RetinaNet, through the same `Launch` checks, then an exact resume)."""
    script, config = "train_catsdogs.py", "cpu.yaml"
    data, flags = data_and_flags(script, cats_data, detection_data)
    out = tmp_path / "run"
    run = Launch(script, data + flags + ["--epochs", "50", "--per_device_batch_size", "2", "--output_dir", out], config)
    run.wait_for_step(out, 3)
    os.kill(run.proc.pid, signal.SIGTERM)
    code, _ = run.finish(f"{script} {config} SIGTERM mid-epoch")
    st = status(out)
    assert st["status"] == "preempted" and "in epoch" in st["message"], st
    assert code != 0


@pytest.mark.parametrize("script,config", [("train_catsdogs.py", "cpu.yaml"), ("train_retinanet.py", "cpu_2proc.yaml")])
def test_ctrl_c_mid_evaluation(script, config, cats_data, detection_data, tmp_path):
    data, flags = data_and_flags(script, cats_data, detection_data)
    out = tmp_path / "run"
    run = Launch(script, data + flags + ["--epochs", "50", "--per_device_eval_batch_size", "1", "--output_dir", out], config)
    run.wait_for("eval:")  # the evaluation's progress bar
    os.killpg(run.proc.pid, signal.SIGINT)  # as a terminal sends it: the launcher's whole group
    code, _ = run.finish(f"{script} {config} Ctrl-C mid-evaluation")
    assert (out / "run_status.json").is_file(), run.text[-4000:]
    st = status(out)
    assert st["status"] == "preempted" and "in the evaluation" in st["message"], st
    assert code != 0 and not traceback_through_our_code(run.text), run.text[-3000:]
    assert "KeyboardInterrupt" not in run.text or config == "cpu.yaml", run.text[-3000:]  # 1 process: accelerate's own
    written = Path(st["message"].split("checkpoint ")[1].split(" written")[0])  # both ranks' states, one checkpoint
    assert written.parent == out / "checkpoints" and (written / f"random_states_{processes(config) - 1}.pkl").is_file()
    epoch = int(st["message"].split("in the evaluation after epoch ")[1].split(")")[0])  # the epoch that was evaluated
    assert written.name == f"epoch_{epoch:04d}" and json.loads((written / "trainer_state.json").read_text())[
        "eval_pending"] == epoch  # the resume runs that evaluation first, under its epoch


@pytest.mark.parametrize("script", ["train_catsdogs.py", "train_retinanet.py"])
def test_ctrl_c_without_a_launcher_ends_with_our_line(script, cats_data, detection_data, tmp_path):
    """`python scripts/...` (1 process, no launcher, as the README's 1-process commands run): Ctrl-C ends with our
    own `stopped: ...` line as the last thing printed, saying what to type next, and exit code 75."""
    data, flags = data_and_flags(script, cats_data, detection_data)
    out = tmp_path / "run"
    run = Launch(script, data + flags + ["--epochs", "50", "--per_device_batch_size", "2", "--output_dir", out], None)
    run.wait_for_step(out, 3)
    os.killpg(run.proc.pid, signal.SIGINT)
    code, _ = run.finish(f"{script} no launcher, Ctrl-C mid-epoch")
    last = [ln for ln in run.text.replace("\r", "\n").splitlines() if ln.strip()][-1]
    assert code == 75 and last.startswith("stopped: preempted by SIGINT at step"), run.text[-2000:]
    assert "run the same command with --resume_from_checkpoint latest" in last and status(out)["status"] == "preempted"


@pytest.mark.parametrize("script,config", [("train_catsdogs.py", "cpu.yaml"), ("train_retinanet.py", "cpu_2proc.yaml")])
def test_kill9_of_the_launcher(script, config, cats_data, detection_data, tmp_path):
    data, flags = data_and_flags(script, cats_data, detection_data)
    out = tmp_path / "run"
    run = Launch(script, data + flags + ["--epochs", "50", "--per_device_batch_size", "2", "--output_dir", out], config)
    run.wait_for_step(out, 3)
    trainers = run.trainers()
    assert len(trainers) == processes(config)
    run.proc.kill()  # the launcher alone: the training processes get SIGTERM from the kernel
    _, gone = run.finish(f"{script} {config} kill -9 of the launcher")
    assert status(out)["status"] == "preempted" and "preempted by SIGTERM" in (out / "train.log").read_text()
    assert gone < 10  # no process waits for a first one that no launcher will stop (it did, 10 s)


def test_divergence_stop(cats_data, detection_data, tmp_path):
    """The divergence stop is the run machinery's (`Run.end_step`), the same for both scripts: launched once, on 2
    processes with the cats/dogs loaders' persistent workers; RetinaNet's is tests/test_run_launch.py's C11."""
    script = "train_catsdogs.py"
    data, flags = data_and_flags(script, cats_data, detection_data)
    out = tmp_path / "run"
    run = Launch(script, data + flags + ["--epochs", "3", "--optimizer", "sgd", "--lr", "1e30", "--max_grad_norm", "0", "--per_device_batch_size", "2",
                                         "--max_nonfinite_steps", "2", "--output_dir", out], "cpu_2proc.yaml")
    code, _ = run.finish(f"{script} divergence")
    assert status(out)["status"] == "diverged" and code != 0, run.text[-3000:]


@pytest.mark.parametrize("script", ["train_catsdogs.py", "train_retinanet.py"])
def test_errors_at_start_and_mid_run(script, cats_data, detection_data, tmp_path):
    """An error at start (the run machinery's refusal of a folder that holds another run: launched for cats/dogs on
    2 processes; RetinaNet's start-up errors on 2 processes are tests/test_run_launch.py's C10) and an error mid-run
    (the checkpoint folder became a file), for both scripts."""
    data, flags = data_and_flags(script, cats_data, detection_data)
    if script == "train_catsdogs.py":
        out = tmp_path / "run"
        (out / "checkpoints").mkdir(parents=True)  # an error at start: the folder holds another run
        (out / "checkpoints" / "epoch_0001").mkdir()
        run = Launch(script, data + flags + ["--epochs", "1", "--output_dir", out], "cpu_2proc.yaml")
        code, _ = run.finish(f"{script} error at start (a folder of another run)")
        assert code != 0 and "holds another run" in run.text and not traceback_through_our_code(run.text)
    mid = tmp_path / "mid"
    run = Launch(script, data + flags + ["--epochs", "50", "--per_device_batch_size", "2", "--checkpoint_steps", "6",
                                         "--output_dir", mid], "cpu.yaml")
    run.wait_for_step(mid, 2)
    for _ in range(50):  # an error mid-run: the checkpoint folder is now a file (the run may recreate it meanwhile)
        shutil.rmtree(mid / "checkpoints", ignore_errors=True)
        try:
            (mid / "checkpoints").write_text("not a folder")
            break
        except IsADirectoryError:
            time.sleep(0.1)
    code, _ = run.finish(f"{script} error mid-run (checkpoint save fails)")
    assert code != 0 and status(mid)["status"] == "failed", run.text[-3000:]


@pytest.mark.parametrize("script", ["train_catsdogs.py", "train_retinanet.py"])
def test_a_data_check_error_on_2_processes_is_one_line(script, cats_data, detection_data, tmp_path):
    """The data check stops every process (a train class without images; a val json without boxes): one error line
    and exit 1, as on 1 process. The main process used to exit inside `main_process_first`, so the other one's barrier
    failed ('Connection closed by peer') with a traceback through the script."""
    data, flags = data_and_flags(script, cats_data, detection_data)
    if script == "train_catsdogs.py":
        train = tmp_path / "train"
        shutil.copytree(data[1], train)
        shutil.rmtree(train / "vertical")
        (train / "vertical").mkdir()
        data = ["--train_dir", str(train), *data[2:]]
        expected = "classes without a usable image (a class needs training images) [1]; e.g. vertical"
    else:
        val = json.loads(Path(data[data.index("--val_annotations") + 1]).read_text())
        write_coco(tmp_path / "val.json", val["images"], [], val["categories"])
        data = [*data[:data.index("--val_annotations")], "--val_annotations", str(tmp_path / "val.json")]
        expected = "AP is undefined"
    out = tmp_path / "run"
    run = Launch(script, data + flags + ["--epochs", "1", "--output_dir", out], "cpu_2proc.yaml")
    code, _ = run.finish(f"{script} 2 processes, a data check error")
    assert code == 1 and not traceback_through_our_code(run.text), run.text[-3000:]
    errors = [ln for ln in run.text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "the data check found 1 kinds of error" in errors[0] and expected in run.text
    assert "Connection closed by peer" not in run.text and status(out)["status"] == "failed"


def test_worker_ends_with_its_training_process_and_survives_a_stray_sigterm(tmp_path):
    """The worker rule itself (detlib.data.loaders.worker_loader_kwargs), in a plain Python process: a SIGTERM from outside
    leaves a worker serving, the interpreter's exit ends it at once (it hung here forever before), and a worker
    whose training process is killed with -9 ends within a second or so."""
    code = """
import os, signal, subprocess, sys, time, torch
from detlib.data.loaders import worker_loader_kwargs
ds = list(range(1000))
loader = torch.utils.data.DataLoader(ds, batch_size=1, persistent_workers=True, **worker_loader_kwargs(2))
it = iter(loader)
[next(it) for _ in range(8)]  # both workers have served batches: past their worker_init_fn
workers = [w.pid for w in it._workers]
print("workers", *workers, flush=True)
for name in ("TERM", "INT", "USR1"):  # from another process, as SLURM or a terminal sends them
    subprocess.run(["kill", "-" + name, *map(str, workers)], check=True)
time.sleep(1.0)
assert [next(it) for _ in range(10)], "batches after the stray signals"
print("served", flush=True)
if sys.argv[1] == "kill9":
    os.kill(os.getpid(), signal.SIGKILL)
"""
    for mode in ("exit", "kill9"):
        proc = subprocess.Popen([sys.executable, "-c", code, mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=launch_env({"PYTHONPATH": str(Path(__file__).resolve().parents[1])}))
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{mode}: the process did not exit (its DataLoader workers hold it)") from None
        assert "served" in out, out
        workers = [int(w) for w in out.split("workers")[1].split("\n")[0].split()]
        t0 = time.time()
        while any(process_table().get(w, (0, 0, "Z"))[2] != "Z" for w in workers) and time.time() - t0 < 10:
            time.sleep(0.1)
        left = [w for w in workers if process_table().get(w, (0, 0, "Z"))[2] != "Z"]
        assert not left, f"{mode}: workers {left} outlived their training process"
        print(f"{mode}: workers gone {time.time() - t0:.1f} s after their training process")
