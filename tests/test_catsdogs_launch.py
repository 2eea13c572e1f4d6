"""End-to-end runs of scripts/train_catsdogs.py on tiny folders (launched where they need processes, else
in-process), asserting on what the runs leave behind (metrics.jsonl, predictions, checkpoints, weights, the wandb
folder).

Cases of ../shared/cases/README.md: B13, B16, B19, B21, B24-B27 (a whole run), B31; and the one-line errors of
wrong weights paths and of weights trained on other classes (train_catsdogs.py and predict_catsdogs.py).
Every run uses the tiny timm model `test_resnet` at 32 px. A launch is kept where the behaviour needs the
launcher (a flag error printed once by 2 processes, the wait for the first process's line); 2-process runs whose
launcher plays no part (the one wandb run of B21, B13's evaluation, B31's shards) are forked from the test process
(`helpers.forked_ok`); everything else (the one-line errors, a whole run on a bad folder, a resume, mixed
precision, the 1-process evaluation of B13) is `main(argv)` called in-process, which costs only its work (a launch
costs ~8 s of start-up per process).
"""

from __future__ import annotations

import csv
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, run_script, traceback_through_our_code
from helpers import error_lines, forked_ok, make_bad_folder, make_tiny_folder, run_main, run_ok

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_catsdogs.py"
FAST = ["--model", "test_resnet", "--image_size", "32", "--num_workers", "0", "--per_device_batch_size", "4",
        "--log_interval", "1"]


def launch(config: str, args: list[str], script: Path = SCRIPT, timeout: int = 300, env: dict | None = None):
    """`run_script` with the config first, as these tests read best."""
    return run_script(script, args, config, timeout, env)


def train_and_eval_lines(out: Path) -> tuple[list[dict], list[dict]]:
    lines = read_metrics(out)
    return [m for m in lines if "loss" in m], [m for m in lines if "val_accuracy" in m]


def read_predictions(out: Path) -> dict[str, tuple[str, float]]:
    with open(out / "predictions_val.csv") as f:
        return {row["path"]: (row["pred"], float(row["confidence"])) for row in csv.DictReader(f)}


def assert_processes(out: Path, n: int) -> None:
    # `accelerate launch --cpu --num_processes 2` silently starts one process: check the count really used
    assert f" {n} process(es)" in (out / "train.log").read_text()


@pytest.mark.slow
def test_case_b13_b21_same_accuracy_on_1_and_2_processes_one_wandb_run(tmp_path, capsys):
    train = make_tiny_folder(tmp_path / "train", [8, 8])
    val = make_tiny_folder(tmp_path / "val", [3, 2], seed=1)  # 5 images: 2 processes x batch 2 pad to 6 / 8
    out = tmp_path / "run"
    forked_ok("train_catsdogs.py", [*FAST, "--train_dir", train, "--val_dir", val, "--epochs", "2",
                                    "--per_device_eval_batch_size", "2", "--output_dir", out, "--report_to", "wandb"],
              env={"WANDB_MODE": "offline"})  # 2 processes, forked
    assert_processes(out, 2)
    train_lines, evals = train_and_eval_lines(out)
    assert [m["epoch"] for m in evals] == [1, 2] and [m["num_val_samples"] for m in evals] == [5, 5]
    assert train_lines[-1]["step"] == evals[-1]["step"] == 4  # 16 images / (2 x 4) per step, 2 epochs
    trained = read_predictions(out)
    assert len(trained) == 5

    # B21: one wandb run (the main process), holding the confusion matrix and the misclassified table
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    tables = runs[0] / "files" / "media" / "table"
    assert len(list(tables.glob("val_confusion_matrix*.table.json"))) == 2  # one per evaluation
    wrong = sum(pred != Path(path).parent.name for path, (pred, _) in trained.items())
    last_table = sorted(tables.glob("val_misclassified*.table.json"), key=lambda p: p.stat().st_mtime)[-1]
    table = json.loads(last_table.read_text())
    assert table["columns"][:4] == ["image", "path", "label", "predicted"] and len(table["data"]) == wrong

    # B13: the last weights evaluated by 1 process (in-process), against the 2 processes' padded evaluation above
    ev = tmp_path / "eval_1"
    run_ok("train_catsdogs", ["--val_dir", val, "--evaluate_only", out / "last", "--per_device_eval_batch_size", 2,
                              "--output_dir", ev, "--report_to", "none", "--num_workers", "0"], capsys)
    ev = ev / "evaluate_only"  # evaluation never writes into the folder of a run
    assert_processes(ev, 1)
    (line,) = train_and_eval_lines(ev)[1]
    assert line["num_val_samples"] == 5
    assert line["val_accuracy"] == evals[-1]["val_accuracy"]
    assert line["val_confusion_matrix"] == evals[-1]["val_confusion_matrix"]
    assert line["val_loss"] == pytest.approx(evals[-1]["val_loss"], rel=1e-5)
    preds = read_predictions(ev)
    assert {p: v[0] for p, v in preds.items()} == {p: v[0] for p, v in trained.items()}
    for p in preds:
        assert preds[p][1] == pytest.approx(trained[p][1], abs=1e-5)


@pytest.mark.slow
def test_case_b24_b25_b26_b27_bad_folder_trains_and_reports_skips(tmp_path, capsys):
    bad = make_bad_folder(tmp_path / "train", good_per_class=6)
    val = make_bad_folder(tmp_path / "val", good_per_class=2)  # the val set has the same faults
    out = tmp_path / "run"
    # also the other optimizer, label smoothing and gradient accumulation (4 batches -> 2 optimizer steps)
    run_ok("train_catsdogs", [*FAST, "--train_dir", bad.root, "--val_dir", val.root, "--epochs", "1", "--output_dir", out,
                              "--optimizer", "sgd", "--lr", "0.01", "--label_smoothing", "0.1",
                              "--gradient_accumulation_steps", "2"], capsys)
    log = (out / "train.log").read_text()
    # the data check says it once: the summaries, the unreadable files by reason, the hidden entries
    assert f"train: root {bad.root}, images 16, classes cats 8, dogs 8, ignored files 3 (" in log
    assert f"val: root {val.root}, images 8, classes cats 4, dogs 4, ignored files 3 (" in log
    assert log.count("image files that cannot be read: left out (1 empty file, 1 not an image, 1 truncated) [3]") == 2
    assert log.count("hidden entries of the root are not classes [1]; e.g. .ipynb_checkpoints") == 2
    assert "unreadable image files" not in log  # the scan's own report of the same files is gone
    findings = json.loads((out / "data_report.json").read_text())["findings"]
    (unreadable,) = [f for f in findings if f["split"] == "train" and f["message"].startswith("image files that cannot")]
    assert sorted(e.split(" (")[0] for e in unreadable["examples"]) == sorted(str(bad.root / "cats" / n) for n in bad.skipped)
    train_lines, evals = train_and_eval_lines(out)
    assert [m["step"] for m in train_lines] == [1, 2]  # 16 images / 4 / 2 accumulated: the whole epoch ran
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in train_lines)
    assert evals[-1]["num_val_samples"] == 8 and len(evals[-1]["val_confusion_matrix"]) == 2
    from safetensors.torch import load_file

    assert load_file(str(out / "best" / "model.safetensors"))["fc.weight"].shape == (2, 96)
    config = (out / "config.yaml").read_text()
    assert "classes:\n- cats\n- dogs\n" in config and "num_train_images: 16" in config


@pytest.mark.slow
def test_case_b19_resume_continues_the_same_run(tmp_path, capsys):
    train = make_tiny_folder(tmp_path / "train", [8, 8])
    val = make_tiny_folder(tmp_path / "val", [2, 2], seed=1)
    common = [*FAST, "--train_dir", train, "--val_dir", val, "--epochs", "3", "--checkpoint_total_limit", "0"]
    full = tmp_path / "full"
    run_ok("train_catsdogs", [*common, "--output_dir", full], capsys)
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["epoch_0001", "epoch_0002", "epoch_0003"]
    # a run that stopped after its first epoch: its output folder holds that checkpoint only
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "epoch_0001", resumed / "checkpoints" / "epoch_0001")
    run_ok("train_catsdogs", [*common, "--output_dir", resumed, "--resume_from_checkpoint", "latest"], capsys)
    assert "resumed from" in (resumed / "train.log").read_text()
    full_train, full_evals = train_and_eval_lines(full)
    res_train, res_evals = train_and_eval_lines(resumed)
    assert [m["step"] for m in res_train] == [5, 6, 7, 8, 9, 10, 11, 12]
    by_step = {m["step"]: m for m in full_train}
    for m in res_train:
        ref = by_step[m["step"]]
        assert m["epoch"] == ref["epoch"] and m["lr"] == ref["lr"]
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4)  # same data order, augmentation and weights
    assert [m["epoch"] for m in res_evals] == [2, 3]
    assert res_evals[-1]["val_loss"] == pytest.approx(full_evals[-1]["val_loss"], rel=1e-4)
    state = json.loads((resumed / "checkpoints" / "epoch_0003" / "trainer_state.json").read_text())
    assert state["epoch"] == 3 and state["global_step"] == 12 and state["step_in_epoch"] == 0


@pytest.mark.slow
def test_case_b16_mixed_precision_clips_the_fp32_gradient(tmp_path, capsys):
    # On the CPU accelerate autocasts bf16 only (fp16 runs in fp32, without a GradScaler); the fp16 + GradScaler
    # path is checked where a GPU is present (in-process, the run takes the GPU as a 1-GPU launch would).
    mixed = ("bf16", "fp16") if torch.cuda.is_available() else ("bf16",)
    train = make_tiny_folder(tmp_path / "train", [4, 4])
    val = make_tiny_folder(tmp_path / "val", [1, 1], seed=1)
    norms = {}
    for precision in ("no", *mixed):
        out = tmp_path / precision
        # run_ok starts from a fresh accelerate state: it keeps the first run's mixed precision and refuses another
        run_ok("train_catsdogs", [*FAST, "--train_dir", train, "--val_dir", val, "--max_steps", "1", "--epochs", "1",
                                  "--max_grad_norm", "1.0", "--mixed_precision", precision, "--output_dir", out], capsys)
        assert f"mixed precision {precision}" in (out / "train.log").read_text()
        (line,) = train_and_eval_lines(out)[0]
        norms[precision] = line["grad_norm"]
        from safetensors.torch import load_file

        weights = load_file(str(out / "last" / "model.safetensors"))
        assert {v.dtype for k, v in weights.items() if v.is_floating_point()} == {torch.float32}  # master weights
    assert norms["no"] > 1.0  # clipping is active in this test
    for precision in mixed:
        # a norm taken on loss-scaled fp16 gradients would be off by the scale (2**16 at the start)
        assert norms[precision] != norms["no"]  # the low-precision forward really ran
        assert norms[precision] == pytest.approx(norms["no"], rel=0.05), norms


B31_HELPER = textwrap.dedent('''
    import importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location("train_catsdogs", sys.argv[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from detlib.engine import make_accelerator
    out = sys.argv[3]
    args = script.parse_args(["--train_dir", sys.argv[2], "--val_dir", sys.argv[2], "--image_size", "16",
                              "--per_device_batch_size", "2", "--num_workers", "0", "--output_dir", out])
    accelerator = make_accelerator(None, 1, "none", out, seed=args.seed)
    _, _, train_loader, _ = script.build_dataloaders(args, {"train_dir": args.train_dir, "val_dir": args.val_dir})
    train_loader = accelerator.prepare(train_loader)
    seen = []
    for e in range(3):  # what the scripts' train_one_epoch does: the epoch's seeded order, minus a resume's done batches
        train_loader.set_epoch(e)
        seen.append([b["index"].tolist() for b in train_loader])
    train_loader.set_epoch(2)
    resumed = [b["index"].tolist() for b in accelerator.skip_first_batches(train_loader, 1)]
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"epochs": seen, "resumed": resumed, "processes": accelerator.num_processes}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group before the processes exit (else gloo may abort)
''')


@pytest.mark.slow
def test_case_b31_each_epoch_a_new_order_and_disjoint_shards(tmp_path):
    # the one 2-process check of a shuffled loader under make_accelerator (the grouped sampler's: test_sampler.py);
    # a probe with a DataLoader of range(8) checked the same, less (tests/test_distributed.py, merged here)
    data = make_tiny_folder(tmp_path / "data", [4, 4])  # 8 items
    helper = tmp_path / "b31_helper.py"
    helper.write_text(B31_HELPER)
    out = tmp_path / "out"
    out.mkdir()
    forked_ok(helper, [SCRIPT, data, out])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["processes"] for r in ranks] == [2, 2]
    orders = []
    for e in range(3):
        shards = [sum(r["epochs"][e], []) for r in ranks]
        assert len(shards[0]) == len(shards[1]) == 4
        assert not set(shards[0]) & set(shards[1])  # disjoint within the epoch
        assert sorted(shards[0] + shards[1]) == list(range(8))  # together: the whole data set
        orders.append(shards)
    assert orders[0] != orders[1] != orders[2] and orders[0] != orders[2]
    for r in ranks:  # resuming after 1 batch of epoch 2 gives that epoch's remaining batches
        assert r["resumed"] == r["epochs"][2][1:]


def save_classifier(folder: Path, classes: list[str], config_classes: list[str] | None = None) -> Path:
    """A `test_resnet` classifier's weights for `classes`, with a model_config.json listing `config_classes`."""
    from safetensors.torch import save_file

    from detlib.classification import build_classifier

    folder.mkdir(parents=True)
    model = build_classifier("test_resnet", len(classes))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    listed = config_classes or classes
    (folder / "model_config.json").write_text(json.dumps({"model": "test_resnet", "num_classes": len(listed),
                                                          "classes": listed, "image_size": 32}))
    return folder


def assert_one_error_line(result, expected: str) -> None:
    """Exit 1 and exactly one error line, `expected` or starting with it, and no traceback through our code;
    `result`: `run_main`'s (exit code, stdout, stderr)."""
    code, out, err = result
    errors = error_lines(err)
    assert code == 1 and len(errors) == 1 and errors[0].startswith(expected), err[-4000:]
    assert not traceback_through_our_code(err) and not traceback_through_our_code(out)


def test_train_wrong_weights_and_other_classes_are_one_line_errors(tmp_path, capsys):
    data = make_tiny_folder(tmp_path / "data", [2, 2])
    common = ["--num_workers", "0", "--report_to", "none", "--image_size", "32"]
    missing = tmp_path / "nothing"
    result = run_main("train_catsdogs", [*common, "--val_dir", data, "--evaluate_only", missing,
                                         "--output_dir", tmp_path / "ev"], capsys)
    assert_one_error_line(result, f"error: --evaluate_only: no model weights at {missing} (expected a file, a folder "
                                  "with model.safetensors, or a run folder with best/ or last/)")
    assert not (tmp_path / "ev").exists()  # stopped before the run folder and the data scan

    other = save_classifier(tmp_path / "abc", ["a", "b", "c"])
    out = tmp_path / "ev2"
    result = run_main("train_catsdogs", [*common, "--val_dir", data, "--evaluate_only", other, "--output_dir", out], capsys)
    message = f"{other} was trained on classes ['a', 'b', 'c'], but {data} has ['horizontal', 'vertical']"
    assert_one_error_line(result, f"error: {message}")
    status = json.loads((out / "evaluate_only" / "run_status.json").read_text())
    assert status["status"] == "failed" and status["exit_code"] == 1 and status["message"] == message

    # --weights that are not there: was a traceback from the model builder
    result = run_main("train_catsdogs", [*FAST, "--train_dir", data, "--val_dir", data, "--weights",
                                         missing / "w.safetensors", "--output_dir", tmp_path / "tr"], capsys)
    assert_one_error_line(result, f"error: weights file not found: {missing / 'w.safetensors'}")


def test_predict_wrong_weights_and_other_classes_are_one_line_errors(tmp_path, capsys):
    data = make_tiny_folder(tmp_path / "data", [1, 1])
    missing = tmp_path / "nothing"
    result = run_main("predict_catsdogs", ["--weights", missing, "--source", data, "--output_dir", tmp_path / "p1"], capsys)
    assert_one_error_line(result, f"error: no model weights at {missing} (expected a file")

    # weights of 3 classes beside a model_config.json that lists 2
    mixed = save_classifier(tmp_path / "mixed", ["a", "b", "c"], config_classes=["cat", "dog"])
    result = run_main("predict_catsdogs", ["--weights", mixed, "--source", data, "--output_dir", tmp_path / "p2"], capsys)
    assert_one_error_line(result, f"error: weights in {mixed / 'model.safetensors'} do not fit this model")
    assert "size mismatch for fc.weight" in result[2]


@pytest.mark.slow
def test_a_flag_error_before_the_run_is_printed_once_by_two_processes(tmp_path):
    proc = run_script("train_catsdogs.py", ["--train_dir", str(tmp_path), "--output_dir", str(tmp_path / "out")],
                      "cpu_2proc.yaml", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --val_dir is required with --train_dir (a held-out ImageFolder with the same classes)"]
    assert proc.returncode != 0 and not traceback_through_our_code(proc.stderr)


@pytest.mark.slow
def test_the_first_process_flag_error_line_survives_a_quicker_second_process(tmp_path):
    """`detlib.engine.stop` on 2 processes where the first one reaches it late (it was: the second one exited at
    once, the launcher stopped the first before it printed, and the launch ended with no error line at all)."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import os, time
        from detlib.engine import stop
        if os.environ.get("RANK") == "0":
            time.sleep(3.0)  # the first process is the slow one
        stop("a flag error found before the run")
    """))
    proc = run_script(probe, [], "cpu_2proc.yaml", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: a flag error found before the run"], proc.stderr[-3000:]
    assert proc.returncode != 0
