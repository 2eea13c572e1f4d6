"""End-to-end runs of scripts/train_retinanet.py on a few real COCO images, 1 and 2 processes.

Small on purpose (resnet18, 128 px, a 32-channel head, a handful of steps): they check what the runs
leave behind, that 2 processes evaluate exactly like 1 (B13, B15), that a resumed run continues exactly
(B19), one wandb run under DDP (B21), two jobs at once (B22), fp16 settings (B16), bad data (B05).
Only the 2-process runs are launched (`accelerate launch`, ~8 s of start-up a process); the 1-process runs call
`main(argv)` in-process (`helpers.run_ok`: a fresh accelerate state each). Runs of more than a few steps and the
launches are marked `slow`.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import COCO_SUBSET, needs_coco_subset, read_metrics, start_script, write_coco, write_image
from helpers import run_main, run_ok

pytestmark = [needs_coco_subset]  # the launches are marked slow one by one; the one-line errors run in-process

TINY = ["--backbone", "resnet18", "--image_size", "128", "--fpn_channels", "32", "--per_device_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--num_workers", "0", "--lr", "1e-3", "--log_interval", "1"]


@pytest.fixture(scope="module")
def coco_tiny(tmp_path_factory) -> dict[str, str]:
    """8 training images and 5 validation images of the real subset (the val set includes the image that has
    no annotation), as COCO json files next to the shared image folder."""
    root = tmp_path_factory.mktemp("coco_tiny")
    out = {}
    for split, n in (("train", 8), ("val", 5)):
        d = json.loads((COCO_SUBSET / "annotations" / f"instances_{split}.json").read_text())
        images = sorted(d["images"], key=lambda im: im["id"])
        if split == "val":
            empty = [im for im in images if not any(a["image_id"] == im["id"] for a in d["annotations"])]
            images = empty[:1] + [im for im in images if im not in empty][: n - len(empty[:1])]
        else:
            images = images[:n]
        ids = {im["id"] for im in images}
        d["images"] = images
        d["annotations"] = [a for a in d["annotations"] if a["image_id"] in ids]
        path = root / f"{split}.json"
        path.write_text(json.dumps(d))
        out[split] = str(path)
    return {"train_images": str(COCO_SUBSET / "images"), "train_annotations": out["train"],
            "val_images": str(COCO_SUBSET / "images"), "val_annotations": out["val"]}


def data_args(d: dict[str, str]) -> list[str]:
    return [f"--{k}={v}" for k, v in d.items()]


def evals(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "AP" in m]


def trains(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "loss" in m]


@pytest.mark.slow  # in-process, but 8 steps and 2 evaluations (seconds)
def test_one_process_run_leaves_everything_behind(coco_tiny, tmp_path, capsys):
    out = tmp_path / "run"
    stdout = run_ok("train_retinanet", data_args(coco_tiny) + TINY + [
        "--epochs", "2", "--eval_interval", "1", "--checkpoint_total_limit", "1", "--output_dir", out, "--report_to", "none"],
        capsys)
    assert "1 process(es)" in stdout
    m = read_metrics(out)
    ev = evals(m)
    assert [e["epoch"] for e in ev] == [1, 2] and ev[-1]["step"] == 8
    for e in ev:
        assert all(isinstance(e[k], float) and math.isfinite(e[k]) for k in
                   ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl"))
    tr = trains(m)
    assert [t["step"] for t in tr] == list(range(1, 9))
    assert all(set(t) >= {"epoch", "step", "loss", "cls_loss", "box_loss", "lr"} and math.isfinite(t["loss"]) for t in tr)
    assert (out / "config.yaml").is_file() and "RetinaNet resnet18" in (out / "train.log").read_text()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["epoch_0002"]  # the limit removed epoch_0001
    state = json.loads((out / "checkpoints" / "epoch_0002" / "trainer_state.json").read_text())
    assert state["epoch"] == 2 and state["global_step"] == 8
    weights = load_file(str(out / "last" / "model.safetensors"))
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights)
    assert all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point())
    assert (out / "best" / "model.safetensors").is_file()
    # real data: the paper's heads (the built-in set's GroupNorm heads are its own default); the verdict gives AP50
    assert json.loads((out / "last" / "model_config.json").read_text())["head_norm"] == "none"
    assert stdout.rstrip().splitlines()[-1].endswith(f", AP50 {ev[-1]['AP50']:.4f}")
    preds = json.loads((out / "predictions_val.json").read_text())
    val_ids = {im["id"] for im in json.loads(Path(coco_tiny["val_annotations"]).read_text())["images"]}
    assert {p["image_id"] for p in preds} <= val_ids
    assert all(isinstance(p["bbox"], list) and len(p["bbox"]) == 4 for p in preds)


@pytest.mark.slow
def test_two_processes_two_jobs_wandb_and_exact_evaluation(coco_tiny, tmp_path, capsys):
    """B13, B15, B21, B22 in one go: two 2-process jobs at once on one machine (distinct ports chosen for
    them), one logging to wandb offline; both evaluate 5 val images on 2 processes (the sampler repeats one: 6).
    Then evaluation-only of the same weights on 1 process gives the 2-process evaluation's stats and detections
    (the padding repeat is never counted)."""
    a, b = tmp_path / "a", tmp_path / "b"
    # --score_thresh 0: two steps detect nothing above the default 0.05, and equal empty detections prove nothing;
    # an evaluation batch of 1: an image's padded size (and so its scores, in the last digits) does not depend on
    # the image it shares a batch with
    common = data_args(coco_tiny) + TINY + ["--epochs", "1", "--max_steps", "2", "--eval_interval", "1", "--score_thresh", "0",
                                            "--per_device_eval_batch_size", "1"]
    jobs = [start_script("train_retinanet.py", common + ["--output_dir", str(a), "--report_to", "wandb"], "cpu_2proc.yaml",
                         env={"WANDB_MODE": "offline"}, stderr=subprocess.PIPE),
            start_script("train_retinanet.py", common + ["--output_dir", str(b), "--report_to", "none"], "cpu_2proc.yaml",
                         stderr=subprocess.PIPE)]
    outs = [j.communicate(timeout=600) for j in jobs]
    for j, (so, se) in zip(jobs, outs):
        assert j.returncode == 0, so[-3000:] + se[-5000:]
        assert "2 process(es)" in so and "COCO evaluation on 5 images" in so  # never 6
    # B21: exactly one wandb run, created by the main process
    runs = list((a / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    ev_a, ev_b = evals(read_metrics(a))[-1], evals(read_metrics(b))[-1]
    for k in ("AP", "AP50", "AR100"):
        assert ev_a[k] == ev_b[k]  # same seed, same data: the two concurrent jobs agree

    # B22: the same weights (the run's only checkpoint, after step 2) evaluated by 1 process, in-process
    out = tmp_path / "eval1"
    stdout = run_ok("train_retinanet", [f"--val_images={coco_tiny['val_images']}",
                                        f"--val_annotations={coco_tiny['val_annotations']}",
                                        "--evaluate_only", str(next((a / "checkpoints").iterdir())),
                                        "--per_device_eval_batch_size", "1", "--num_workers", "0", "--output_dir", str(out),
                                        "--report_to", "none", "--score_thresh", "0"], capsys)
    assert "1 process(es)" in stdout and "COCO evaluation on 5 images" in stdout
    one = evals(read_metrics(out / "evaluate_only"))[-1]  # evaluation never writes over a training run's files
    for k in ("AP", "AP50", "AP75", "AR1", "AR10", "AR100"):
        assert one[k] == ev_a[k], k
    detections = lambda folder: sorted((p["image_id"], p["category_id"], round(p["score"], 5)) for p in  # noqa: E731
                                       json.loads((folder / "predictions_val.json").read_text()))
    assert detections(a) and detections(out / "evaluate_only") == detections(a)


@pytest.mark.slow  # in-process, but three trainings (seconds)
def test_resumed_run_continues_exactly_case_b19(coco_tiny, tmp_path, capsys):
    """Stopped by --max_steps mid-epoch, resumed from `latest`: the same LRs, losses and weights as the
    uninterrupted run, with the EMA loss normalizer (its running average is in the checkpoint), a multistep
    schedule after warmup and random augmentation (the data position and the RNG states are in it too)."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = data_args(coco_tiny) + TINY + ["--epochs", "3", "--eval_interval", "10", "--report_to", "none",
                                            "--lr_scheduler", "multistep", "--lr_steps", "1", "2", "--warmup_steps", "3",
                                            "--optimizer", "sgd", "--lr", "0.01", "--augmentation", "flip_crop_translate",
                                            "--loss_normalizer", "ema", "--num_log_images", "0"]
    run_ok("train_retinanet", common + ["--output_dir", full], capsys)
    # stop mid-epoch 2 (step 6 of 12), then resume from the latest checkpoint
    run_ok("train_retinanet", common + ["--output_dir", part, "--max_steps", "6"], capsys)
    assert (part / "checkpoints" / "step_00000006").is_dir()
    stdout = run_ok("train_retinanet", common + ["--output_dir", part, "--resume_from_checkpoint", "latest"], capsys)
    assert "resumed from" in stdout and "epoch 2, step 2 in epoch, global step 6" in stdout
    f, p = trains(read_metrics(full)), trains(read_metrics(part))
    assert [t["step"] for t in p] == list(range(1, 13)) and [t["epoch"] for t in p] == [t["epoch"] for t in f]
    for x, y in zip(f, p):
        assert x["lr"] == pytest.approx(y["lr"], rel=1e-9)
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)
    state = json.loads((part / "checkpoints" / "epoch_0003" / "trainer_state.json").read_text())
    assert state["epoch"] == 3 and state["global_step"] == 12
    wf, wp = load_file(str(full / "last" / "model.safetensors")), load_file(str(part / "last" / "model.safetensors"))
    for k in wf:
        torch.testing.assert_close(wf[k], wp[k], rtol=0, atol=1e-6)


@pytest.mark.slow  # in-process, but 2 steps and an evaluation (seconds)
def test_fp16_flag_keeps_fp32_master_weights_case_b16(coco_tiny, tmp_path, capsys):
    out = tmp_path / "fp16"
    stdout = run_ok("train_retinanet", data_args(coco_tiny) + TINY + [
        "--max_steps", "2", "--epochs", "1", "--mixed_precision", "fp16", "--max_grad_norm", "1.0",
        "--output_dir", out, "--report_to", "none", "--num_log_images", "0"], capsys)
    assert "mixed precision fp16" in stdout
    w = load_file(str(out / "last" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in w.values() if v.is_floating_point())
    assert all(math.isfinite(t["loss"]) for t in trains(read_metrics(out)))


def test_crowd_only_training_set_stops_with_clear_message_case_b05(tmp_path, capsys):
    write_image(tmp_path / "img" / "a.jpg", 64, 64)
    images = [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 64}]
    ann = write_coco(tmp_path / "train.json", images, [{"image_id": 1, "category_id": 1, "bbox": [20, 10, 40, 30], "iscrowd": 1}])
    code, out, err = run_main("train_retinanet", ["--train_images", tmp_path / "img", "--train_annotations", ann,
                                                  "--val_images", tmp_path / "img", "--val_annotations", ann,
                                                  "--output_dir", tmp_path / "o", "--report_to", "none"], capsys)
    assert code != 0
    assert "no usable (non-crowd, non-degenerate) box" in err + out


def test_missing_annotation_file_or_image_folder_is_named(tmp_path, capsys):
    coco = tmp_path / "coco"
    (coco / "val2017").mkdir(parents=True)
    (coco / "train2017").mkdir()
    code, _, err = run_main("train_retinanet", ["--data_dir", coco, "--output_dir", tmp_path / "o", "--report_to", "none"],
                            capsys)
    assert code != 0
    assert f"annotation file not found: {coco / 'annotations' / 'instances_val2017.json'}" in err
    write_image(coco / "val2017" / "a.jpg", 32, 32)
    one = [{"id": 1, "file_name": "a.jpg", "width": 32, "height": 32}]
    write_coco(coco / "annotations" / "instances_val2017.json", one, [])
    write_coco(coco / "annotations" / "instances_train2017.json", one, [])
    (coco / "train2017").rmdir()
    code, _, err = run_main("train_retinanet", ["--data_dir", coco, "--output_dir", tmp_path / "o", "--report_to", "none"],
                            capsys)
    assert code != 0
    assert f"image folder not found: {coco / 'train2017'}" in err
