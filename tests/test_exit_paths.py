"""Every run ends: each exit path of both training scripts and both predict scripts, launched as users launch them
(DataLoader workers on: the cats/dogs loaders keep theirs alive between epochs, RetinaNet's do not), 1 and 2
processes, under a timeout that makes a hang a failure.

The ends without a signal (an epoch's end, --max_steps, --evaluate_only, divergence, errors at start and mid-run)
are tests/test_exit_paths_without_signals.py's: a file each, so that the suite's two workers share them.

A signal that reaches one process alone (a `kill` of --evaluate_only) is sent to a forked run (`helpers.ForkedRun`:
the same checks, without a launcher or ~6 s of imports). Each run checks the exit code, `run_status.json`, and that
no process of the run is left: every process seen
under the launcher (training processes, DataLoader workers) and every process group they were in is gone within
seconds of the launcher's exit. The seconds from the last output to the end of the last process are printed
(`pytest -s`) as `exit path ...: N.N s`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import launch_env, traceback_through_our_code
from helpers import EXIT_WORKERS as WORKERS
from helpers import ForkedRun, Launch, data_and_flags, process_table, processes, run_status as status

pytestmark = pytest.mark.slow

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


def test_sigterm_mid_evaluate_only_is_one_line_and_exit_75(cats_data, detection_data, tmp_path):
    """--evaluate_only has nothing to checkpoint: a stop signal in its evaluation ends it with one `stopped:` line,
    exit 75 and run_status "preempted" (`running` turns the uncaught Preempted into the line), nothing written
    into the run it evaluates."""
    script = "train_catsdogs.py"
    data, flags = data_and_flags(script, cats_data, detection_data)
    out = tmp_path / "run"
    trained = ForkedRun(script, data + flags + ["--max_steps", "1", "--output_dir", out])
    assert trained.finish(f"{script} 1 step")[0] == 0, trained.text[-2000:]
    run = ForkedRun(script, data + flags + ["--evaluate_only", out / "best", "--per_device_eval_batch_size", "1",
                                            "--output_dir", out])  # forked: `kill` reaches the process alone
    run.wait_for("eval:")
    run.signal(signal.SIGTERM)
    code, _ = run.finish(f"{script} --evaluate_only SIGTERM mid-evaluation")
    last = [ln for ln in run.text.replace("\r", "\n").splitlines() if ln.strip()][-1]
    assert code == 75 and last == "stopped: stopped by SIGTERM during evaluation", run.text[-2000:]
    st = status(out / "evaluate_only")
    assert st["status"] == "preempted" and st["exit_code"] == 75 and not traceback_through_our_code(run.text)
    assert not (out / "evaluate_only" / "checkpoints").exists() and status(out)["status"] == "finished"


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
