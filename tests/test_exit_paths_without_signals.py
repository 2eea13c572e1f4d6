"""The exit paths of both training scripts that no signal takes (tests/test_exit_paths.py holds the signals'): an
epoch's end, --max_steps, --evaluate_only and predict on what a run wrote, divergence, an error at start and mid-run,
a data check error on 2 processes. Run as users run them (DataLoader workers on), 1 and 2 processes, under a
timeout that makes a hang a failure; each run checks the exit code, `run_status.json` and that no process of the run
is left. What the launcher adds is tested by two real launches (`helpers.Launch`): the normal end on 2 processes,
whose folder a module fixture shares with the --evaluate_only and folder-refusal checks, and a start-up refusal
printed once by the first of 2 processes; the other runs are forked from the fork server (`helpers.ForkedRun`: the
same checks, without ~6 s of imports per process).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from conftest import traceback_through_our_code, write_coco
from helpers import EXIT_WORKERS as WORKERS
from helpers import ForkedRun, Launch, data_and_flags, error_lines, processes, run_status as status

pytestmark = pytest.mark.slow


# ---- the ends of a run: an epoch's end and --max_steps, --evaluate_only, then predict on what it wrote

def run_to_max_steps(script: str, config: str, data: list, flags: list, out: Path):
    """A training that ends an epoch (evaluation, checkpoint; the cats/dogs workers stay alive for the next epoch)
    and then stops at --max_steps one step into the next (its workers abandoned mid-epoch); `config` gives the
    process count. RetinaNet on 2 processes is a real launch (`Launch`, the module's one), the others are forked."""
    batch = 8 if script == "train_catsdogs.py" else 2  # 32 and 16 training images: 4 and 8 steps on 1 process
    steps_per_epoch = (32 if script == "train_catsdogs.py" else 16) // (batch * processes(config))
    argv = data + flags + ["--per_device_batch_size", batch, "--epochs", "2", "--max_steps", steps_per_epoch + 1,
                           "--output_dir", out]
    launched = script == "train_retinanet.py" and config == "cpu_2proc.yaml"
    run = Launch(script, argv, config) if launched else ForkedRun(script, argv, processes(config))
    code, _ = run.finish(f"{script} {config} an epoch, then --max_steps mid-epoch")
    assert code == 0 and status(out)["status"] == "finished", run.text[-3000:]
    assert status(out)["global_step"] == steps_per_epoch + 1, status(out)
    assert (out / "checkpoints" / "epoch_0001").is_dir() and (out / "best" / "model.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def retinanet_two_process_run(cats_data, detection_data, tmp_path_factory) -> Path:
    """The module's real launch of a training: RetinaNet on 2 processes to an epoch's end and then --max_steps; its
    folder is shared by the --evaluate_only and folder-refusal checks below."""
    data, flags = data_and_flags("train_retinanet.py", cats_data, detection_data)
    flags = flags + ["--per_device_eval_batch_size", "4"]
    return run_to_max_steps("train_retinanet.py", "cpu_2proc.yaml", data, flags, tmp_path_factory.mktemp("r2") / "run")


@pytest.mark.parametrize("script,config", [("train_catsdogs.py", "cpu.yaml"), ("train_catsdogs.py", "cpu_2proc.yaml"),
                                           ("train_retinanet.py", "cpu.yaml"), ("train_retinanet.py", "cpu_2proc.yaml")])
def test_normal_end_max_steps_and_evaluate_only_return_to_the_shell(script, config, cats_data, detection_data, tmp_path,
                                                                    request):
    """An epoch's end and --max_steps (`run_to_max_steps`). On 2 processes, an --evaluate_only of what it wrote; on
    1 process, the predict script on it (and, for RetinaNet, its error at start, launched on 2 processes: both
    predict scripts end through `detlib.inference.run_prediction`)."""
    data, flags = data_and_flags(script, cats_data, detection_data)
    flags = flags + ["--per_device_eval_batch_size", "4"]  # the evaluation's end matters here, not its length
    if script == "train_retinanet.py" and config == "cpu_2proc.yaml":
        out = request.getfixturevalue("retinanet_two_process_run")
    else:
        out = run_to_max_steps(script, config, data, flags, tmp_path / "run")
    if config == "cpu_2proc.yaml":
        run = ForkedRun(script, data + flags + ["--evaluate_only", out / "best", "--output_dir", tmp_path / "eval"], 2)
        code, _ = run.finish(f"{script} {config} --evaluate_only")
        assert code == 0 and (tmp_path / "eval" / "evaluate_only" / "metrics.jsonl").is_file(), run.text[-3000:]
        return
    predict = script.replace("train_", "predict_")
    source = data[data.index("--val_dir") + 1] if "--val_dir" in data else data[data.index("--val_images") + 1]
    run = ForkedRun(predict, ["--weights", out / "best", "--source", source, *WORKERS, "--output_dir", tmp_path / "pred"])
    code, _ = run.finish(f"{predict} normal end")
    assert code == 0, run.text[-3000:]
    if script == "train_retinanet.py":  # on 2 processes: the line once, and no `stopped:` line for the second
        # process, which waits for the first and is then stopped by the launcher: the suite's real launch of a
        # start-up refusal printed once
        run = Launch(predict, ["--weights", tmp_path / "missing", "--source", source, *WORKERS, "--output_dir",
                               tmp_path / "p2"], "cpu_2proc.yaml")
        code, _ = run.finish(f"{predict} cpu_2proc.yaml error at start")
        assert code != 0 and not traceback_through_our_code(run.text), run.text[-3000:]
        assert len(error_lines(run.text)) == 1 and "stopped:" not in run.text, run.text[-3000:]


def test_divergence_stop(cats_data, detection_data, tmp_path):
    """The divergence stop is the run machinery's (`detlib.engine.step_done`), the same for both scripts: on 2
    processes with the cats/dogs loaders' persistent workers; RetinaNet's is tests/test_run_launch.py's C11."""
    script = "train_catsdogs.py"
    data, flags = data_and_flags(script, cats_data, detection_data)
    out = tmp_path / "run"
    run = ForkedRun(script, data + flags + ["--epochs", "3", "--optimizer", "sgd", "--lr", "1e30", "--max_grad_norm", "0",
                                            "--per_device_batch_size", "2", "--max_nonfinite_steps", "2",
                                            "--output_dir", out], 2)
    code, _ = run.finish(f"{script} divergence")
    assert status(out)["status"] == "diverged" and code != 0, run.text[-3000:]


def test_a_folder_of_another_run_is_refused_at_start_on_2_processes(retinanet_two_process_run, cats_data, tmp_path):
    """An error at start (the run machinery's refusal of a folder that holds another run) on 2 processes: the
    cats/dogs script pointed at the RetinaNet run's folder; RetinaNet's start-up errors on 2 processes are
    tests/test_run_launch.py's C10."""
    script = "train_catsdogs.py"
    data, flags = data_and_flags(script, cats_data, None)
    run = ForkedRun(script, data + flags + ["--epochs", "1", "--output_dir", retinanet_two_process_run], 2)
    code, _ = run.finish(f"{script} error at start (a folder of another run)")
    text = "\n".join(run.texts)
    assert code != 0 and "holds another run" in text and not traceback_through_our_code(text), text[-3000:]
    assert status(retinanet_two_process_run)["status"] == "finished"  # the other run's folder is left as it was


@pytest.mark.parametrize("script", ["train_catsdogs.py", "train_retinanet.py"])
def test_an_error_mid_run_is_a_failed_run(script, cats_data, detection_data, tmp_path):
    """An error mid-run (the checkpoint folder became a file), for both scripts."""
    data, flags = data_and_flags(script, cats_data, detection_data)
    mid = tmp_path / "mid"
    run = ForkedRun(script, data + flags + ["--epochs", "50", "--per_device_batch_size", "2", "--checkpoint_steps", "6",
                                            "--output_dir", mid])
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
    run = ForkedRun(script, data + flags + ["--epochs", "1", "--output_dir", out], 2)
    code, _ = run.finish(f"{script} 2 processes, a data check error")
    text = "\n".join(run.texts)  # both processes' output, as a launcher's terminal shows it
    assert run.codes == [1, 1] and not traceback_through_our_code(text), text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "the data check found 1 kinds of error" in errors[0] and expected in text
    assert "Connection closed by peer" not in text and status(out)["status"] == "failed"
