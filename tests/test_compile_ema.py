"""`--compile` and `--model_ema` of both training scripts, on a CPU.

torch.compile runs with the "aot_eager" backend here (the traced forward and backward graphs, run by eager
kernels: what compiling changes about the model's tracing, without inductor's compile time on 2 cores) and
"eager" (dynamo alone) where only the guards and recompiles are counted.
"""

from __future__ import annotations

import contextlib
import os
import importlib.util
import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, read_metrics, write_coco, write_image
from detlib.retinanet.model import RetinaNet


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reset_dynamo():
    """A fresh dynamo cache and counters, and a fresh accelerate state (a singleton that keeps the first run's
    settings, the dynamo plugin included, for the rest of the process)."""
    import torch._dynamo
    from accelerate.state import AcceleratorState
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    AcceleratorState._reset_state(True)


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0)


# ---- --compile

def test_compiled_detector_recompiles_are_bounded():
    """torch's automatic dynamic shapes on the training shapes of a run (a fixed batch, sides that vary with the
    images): the first shape compiles static, the second makes the sizes symbolic and that graph serves every later
    shape; a side of at most 128 px (P7 1x1) gets one graph of its own. Dynamo's guards are counted with the
    "eager" backend (the same guards, no code generated)."""
    reset_dynamo()
    torch.manual_seed(0)
    model = torch.compile(RetinaNet(3, "resnet18", fpn_channels=16, freeze_backbone_bn=False), backend="eager")
    seen = []
    shapes = [(256, 320), (320, 256), (384, 320), (160, 608), (448, 224), (192, 192), (160, 128), (128, 160)]
    for h, w in shapes:
        model(torch.zeros(2, 3, h, w, dtype=torch.uint8))
        seen.append(graphs())
    assert seen == [1, 2, 2, 2, 2, 2, 3, 4]
    reset_dynamo()


@contextlib.contextmanager
def recompile_log():
    """The "Recompiling function ..." messages of torch's `recompiles` log (`torch._logging.set_logs`, what
    TORCH_LOGS=recompiles prints: each names the guards that failed) while inside; torch's log settings reset after."""
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Recompiling function"):
                messages.append(record.getMessage())

    torch._logging.set_logs(recompiles=True)
    handler = Keep()
    logging.getLogger("torch._dynamo").addHandler(handler)  # torch's own handler there does not propagate
    try:
        yield messages
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
        torch._logging.set_logs()


def mixed_aspect_batches(root, steps: int, size: int = 256, batch: int = 2) -> list[torch.Tensor]:
    """The images of `steps` training batches of a set of landscape, square and portrait images (h / w 0.5 to 2), as
    the training loader makes them: the real-data augmentation (flip, crop, translate), resized to `size` px on the
    longer side, batched by aspect group (`--aspect_grouping`), padded to multiples of 32; epoch after epoch."""
    from detlib.data import CocoDetection, GroupedBatchSampler, aspect_groups, build_transform, collate_detection

    whs = [(320, 160), (320, 240), (320, 288), (320, 320), (288, 320), (240, 320), (160, 320), (320, 200)] * 2
    images = [{"id": i + 1, "file_name": f"{i}.png", "width": w, "height": h} for i, (w, h) in enumerate(whs)]
    for i, (w, h) in enumerate(whs):
        write_image(root / "img" / f"{i}.png", w, h, seed=i)
    anns = [{"image_id": i + 1, "category_id": 1, "bbox": [w / 4, h / 4, w / 2, h / 2]} for i, (w, h) in enumerate(whs)]
    ds = CocoDetection(str(root / "img"), str(write_coco(root / "train.json", images, anns)),
                       build_transform(size, "flip_crop_translate"), seed=0)
    sampler = GroupedBatchSampler(aspect_groups([r["size"] for r in ds.records]), batch, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate_detection)
    out = []
    for epoch in range(steps):
        sampler.sampler.set_epoch(epoch)
        ds.set_epoch(epoch)
        out += [b["images"] for b in loader][:steps - len(out)]
        if len(out) == steps:
            return out


@pytest.mark.slow  # 50 forwards of up to 256 x 256 (about 25 s of CPU time on 2 cores)
def test_compiled_detector_recompiles_stay_bounded_over_loader_batches(tmp_path, monkeypatch):
    """50 training forwards on the padded shapes a mixed-aspect data set's loader gives (7 of them, landscape and
    portrait), the model compiled as --compile compiles it (`make_accelerator`'s plugin, `prepare`) in a process
    `accelerate launch` started before accelerate 1.16 (ACCELERATE_DYNAMO_USE_DYNAMIC=False, which made it
    torch.compile(dynamic=False): 6 recompiles here, one per new shape): torch's automatic dynamic shapes compile the
    first shape static, then make the height, then the width symbolic, so the recompiles (counted in torch's
    `recompiles` log, as TORCH_LOGS=recompiles shows them) stay at 2 whatever shapes come later. Each is a pause of
    the forward and backward's compile time on a GPU (inductor). The "eager" backend: dynamo's guards without code
    generation; the forwards run in training mode with gradients (what the training step compiles; the backward is
    not traced by dynamo and adds no guard). The compiled outputs are the eager model's."""
    from accelerate.state import AcceleratorState

    from detlib.engine import make_accelerator

    batches = mixed_aspect_batches(tmp_path, steps=50)
    shapes = {tuple(x.shape[-2:]) for x in batches}
    assert len(shapes) >= 5 and {h > w for h, w in shapes} == {True, False}, shapes  # landscape and portrait
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")
    torch.compiler.reset()
    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    model = RetinaNet(3, "resnet18", fpn_channels=32, head_norm="gn", freeze_backbone_bn=False).train()
    compiled = make_accelerator(None, 1, "none", str(tmp_path), compile_backend="eager").prepare(model)
    assert compiled is not model  # compiled
    with recompile_log() as recompiles:
        for images in batches:
            compiled(images)
    assert len(recompiles) <= 3, "\n".join(recompiles)
    eager, traced = model(batches[-1]), compiled(batches[-1])  # train mode: BatchNorm on the batch's statistics
    for k in ("cls_logits", "box_deltas"):
        torch.testing.assert_close(traced[k], eager[k], rtol=1e-5, atol=1e-6)
    torch.compiler.reset()
    AcceleratorState._reset_state(True)


def square_coco(root, n_train: int = 6, n_val: int = 4, size: int = 160) -> list[str]:
    """A tiny COCO set of `size` x `size` noise images with one box each: every padded batch has the same shape."""
    images = {split: [{"id": i + 1, "file_name": f"{split}_{i}.png", "width": size, "height": size} for i in range(n)]
              for split, n in (("train", n_train), ("val", n_val))}
    for split, ims in images.items():
        for i, im in enumerate(ims):
            write_image(root / "img" / im["file_name"], size, size, seed=i + (100 if split == "val" else 0))
        anns = [{"image_id": im["id"], "category_id": 1 + i % 2, "bbox": [10 + 7 * i, 12, 60, 50]} for i, im in enumerate(ims)]
        write_coco(root / f"{split}.json", ims, anns, [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}])
    return ["--train_images", str(root / "img"), "--train_annotations", str(root / "train.json"),
            "--val_images", str(root / "img"), "--val_annotations", str(root / "val.json")]


RETINANET_TINY = ["--backbone", "resnet18", "--fpn_channels", "16", "--image_size", "160", "--per_device_batch_size", "2",
                  "--per_device_eval_batch_size", "2", "--epochs", "1", "--eval_interval", "1", "--augmentation", "flip",
                  "--num_workers", "0", "--report_to", "none", "--log_interval", "1", "--lr", "1e-3",
                  "--num_log_images", "0", "--skip_image_check"]


def no_compile_prefix(path) -> None:
    keys = list(load_file(path))
    assert keys and not [k for k in keys if "_orig_mod" in k or k.startswith("module.")], path


def test_compile_retinanet_matches_eager_and_keeps_weight_names(tmp_path):
    """--compile --compile_backend aot_eager: 3 steps and an evaluation give the eager run's losses and AP, with 2
    graphs (the training step; evaluation runs uncompiled) and weights / checkpoints under their own names."""
    data = square_coco(tmp_path / "data")
    train = load_script("train_retinanet")
    train.main([*RETINANET_TINY, *data, "--output_dir", str(tmp_path / "eager")])
    reset_dynamo()
    train.main([*RETINANET_TINY, *data, "--output_dir", str(tmp_path / "compiled"), "--compile",
                "--compile_backend", "aot_eager"])
    compiled_graphs = graphs()
    reset_dynamo()
    runs = {name: read_metrics(tmp_path / name) for name in ("eager", "compiled")}
    losses = {name: [m["loss"] for m in rows if "loss" in m] for name, rows in runs.items()}
    assert len(losses["eager"]) == 3
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
    ap = {name: [m["AP"] for m in rows if "AP" in m] for name, rows in runs.items()}
    assert ap["compiled"] == pytest.approx(ap["eager"], abs=1e-4)
    assert compiled_graphs == 1  # one training shape, one graph; evaluation is eager
    for f in ("last/model.safetensors", "best/model.safetensors", "checkpoints/epoch_0001/model.safetensors"):
        no_compile_prefix(tmp_path / "compiled" / f)
        assert set(load_file(tmp_path / "compiled" / f)) == set(load_file(tmp_path / "eager" / f))


# ---- --model_ema

def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def test_model_ema_retinanet_resumes_exactly_and_is_evaluated_beside(tmp_path):
    """--model_ema 0.99: the EMA is evaluated beside the trained weights (ema_AP ...), checkpointed as
    model_ema.safetensors, and a run stopped after epoch 1 and resumed ends with the EMA weights of the
    uninterrupted run; last_ema/ and best/ are ordinary weights folders that predict reads."""
    data = square_coco(tmp_path / "data")
    train = load_script("train_retinanet")
    ema = [*RETINANET_TINY, *data, "--model_ema", "0.99"]
    reset_dynamo()
    train.main([*ema, "--epochs", "2", "--output_dir", str(tmp_path / "full")])
    reset_dynamo()
    train.main([*ema, "--epochs", "1", "--output_dir", str(tmp_path / "parts")])
    reset_dynamo()
    train.main([*ema, "--epochs", "2", "--output_dir", str(tmp_path / "parts"), "--resume_from_checkpoint", "latest"])
    reset_dynamo()
    full, parts = tmp_path / "full", tmp_path / "parts"
    ema_full = load_file(full / "last_ema" / "model.safetensors")
    assert max_diff(ema_full, load_file(parts / "last_ema" / "model.safetensors")) == 0.0
    assert max_diff(ema_full, load_file(full / "checkpoints" / "epoch_0002" / "model_ema.safetensors")) == 0.0
    raw = load_file(full / "last" / "model.safetensors")
    assert max_diff(load_file(full / "last" / "model.safetensors"), load_file(parts / "last" / "model.safetensors")) == 0.0
    assert max_diff(ema_full, raw) > 1e-6  # an average, not a copy of the weights
    no_compile_prefix(full / "last_ema" / "model.safetensors")
    assert json.loads((full / "last_ema" / "model_config.json").read_text()) == \
        json.loads((full / "last" / "model_config.json").read_text())
    evals = [m for m in read_metrics(full) if "AP" in m]
    assert len(evals) == 2 and all("ema_AP" in m and "ema_AP50" in m for m in evals)
    assert json.loads((full / "best" / "best.json").read_text())["weights"] in ("trained", "ema")
    # the EMA weights are ordinary weights: predict reads last_ema/ as it reads best/
    predict = load_script("predict_retinanet")
    predict.main(["--weights", str(full / "last_ema"), "--source", str(tmp_path / "data" / "img" / "val_0.png"),
                  "--output_dir", str(tmp_path / "pred"), "--num_workers", "0", "--score_thresh", "0.0",
                  "--detections_per_image", "5"])
    rows = json.loads((tmp_path / "pred" / "predictions.json").read_text())
    assert len(rows) == 5 and {r["file_name"] for r in rows} == {"val_0.png"}
    # and export reads it (ONNX, checked against PyTorch on a val image)
    export = load_script("export_retinanet")
    exported = export.main(["--weights", str(full / "last_ema"), "--output", str(tmp_path / "ema.onnx"),
                            "--check_source", str(tmp_path / "data" / "img" / "val_0.png"), "--num_check_images", "1",
                            "--score_thresh", "0.0", "--detections_per_image", "5"])
    assert [p["pass"] for p in exported["parity"]] == [True] and exported["parity"][0]["num_compared"] == 5
    assert (tmp_path / "ema.onnx").stat().st_size > 100_000
    # epochs count from 1 in the EMA's lines and files too
    assert [m["epoch"] for m in evals] == [1, 2]
    assert json.loads((full / "best" / "best.json").read_text())["epoch"] in (1, 2)
    assert (full / "last_ema" / "README.md").is_file() and (full / "checkpoints" / "epoch_0001" / "model_ema.safetensors").is_file()


CATSDOGS_TINY = ["--report_to", "none", "--num_workers", "0", "--image_size", "32", "--epochs", "1",
                 "--per_device_batch_size", "4", "--per_device_eval_batch_size", "4", "--log_interval", "1",
                 "--verify_images", "header"]


def stripes(root, n: int = 8) -> list[str]:
    """A 2-class ImageFolder of n noise images per class and split (32 px)."""
    for split in ("train", "val"):
        for c, cls in enumerate(("h", "v")):
            for i in range(n if split == "train" else 4):
                write_image(root / split / cls / f"{i}.png", 32, 32, seed=100 * c + i + (50 if split == "val" else 0))
    return ["--train_dir", str(root / "train"), "--val_dir", str(root / "val")]


def test_compile_and_model_ema_catsdogs(tmp_path):
    """The classifier: --compile (aot_eager) gives the eager run's losses and one graph, with plain weight names;
    --model_ema logs ema_val_accuracy beside val_accuracy and writes last_ema/ and model_ema.safetensors."""
    data = stripes(tmp_path / "data")
    train = load_script("train_catsdogs")
    reset_dynamo()
    train.main([*CATSDOGS_TINY, *data, "--output_dir", str(tmp_path / "eager")])
    reset_dynamo()
    train.main([*CATSDOGS_TINY, *data, "--output_dir", str(tmp_path / "compiled"), "--compile", "--compile_backend",
                "aot_eager", "--model_ema", "0.9"])
    compiled_graphs = graphs()
    reset_dynamo()
    runs = {name: read_metrics(tmp_path / name) for name in ("eager", "compiled")}
    losses = {name: [m["loss"] for m in rows if "loss" in m] for name, rows in runs.items()}
    assert len(losses["eager"]) == 4 and losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
    assert compiled_graphs == 1
    (ev,) = [m for m in runs["compiled"] if "val_accuracy" in m]
    assert 0.0 <= ev["ema_val_accuracy"] <= 1.0 and "ema_val_loss" in ev
    out = tmp_path / "compiled"
    for f in ("last/model.safetensors", "last_ema/model.safetensors", "best/model.safetensors",
              "checkpoints/epoch_0001/model.safetensors", "checkpoints/epoch_0001/model_ema.safetensors"):
        no_compile_prefix(out / f)
    assert set(load_file(out / "last_ema" / "model.safetensors")) == set(load_file(out / "last" / "model.safetensors"))
    # --evaluate_only reads last_ema/ like any weights; --compile and --model_ema are said not to be used there
    reset_dynamo()
    stats = train.main([*CATSDOGS_TINY, "--val_dir", data[3], "--evaluate_only", str(out / "last_ema"),
                        "--output_dir", str(tmp_path / "ev"), "--compile", "--model_ema", "0.9"])
    assert stats["val_accuracy"] == pytest.approx(ev["ema_val_accuracy"])
    assert graphs() == 0  # evaluated uncompiled
    log = (tmp_path / "ev" / "evaluate_only" / "train.log").read_text()
    assert "--compile is not used: --evaluate_only" in log and "--model_ema is not used: --evaluate_only" in log
    reset_dynamo()


def test_best_takes_the_ema_weights_when_they_score_higher(tmp_path):
    """best/ holds whichever weights score higher (`best_weights`), and only when they beat every earlier evaluation
    and the best/ on disk (`improves_best`); a non-finite EMA score never wins."""
    from accelerate import Accelerator

    from detlib.engine import TrainState
    from detlib.engine.model_folders import best_weights, improves_best

    acc, state, out, kept = Accelerator(cpu=True), TrainState(), str(tmp_path), []
    for trained, averaged in ((0.30, 0.32), (0.40, 0.35), (0.41, float("nan")), (0.39, 0.40)):
        evaluations = {"": {"AP": trained}, "ema_": {"AP": averaged}}
        prefix = best_weights(evaluations, "AP")
        if improves_best(acc, out, "AP", evaluations[prefix]["AP"], state):
            kept.append((prefix, evaluations[prefix]["AP"]))
    assert kept == [("ema_", 0.32), ("", 0.40), ("", 0.41)] and state.best_metric == 0.41
    assert best_weights({"": {"AP": 0.2}}, "AP") == "" and best_weights({"": {"AP": 0.2}, "ema_": {"AP": 0.2}}, "AP") == ""


@pytest.mark.parametrize("value", ["1", "0", "1.5", "nan"])
def test_model_ema_decay_outside_0_1_is_refused(value, capsys):
    train = load_script("train_catsdogs")
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--model_ema", value])
    assert e.value.code == 2
    assert f"--model_ema: must be a number > 0 and < 1, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("launcher_value", ["False", "True", None])
def test_every_backend_and_mode_keeps_automatic_dynamic_shapes_whatever_the_launcher_wrote(monkeypatch, launcher_value):
    """`accelerate launch` before 1.16 writes ACCELERATE_DYNAMO_USE_DYNAMIC into each process; --compile's plugin
    leaves torch.compile's `dynamic` at None (automatic) for every backend and mode a user can pick."""
    from detlib.compiling import dynamo_plugin
    from detlib.engine.flags import COMPILE_BACKENDS, COMPILE_MODES

    if launcher_value is None:
        monkeypatch.delenv("ACCELERATE_DYNAMO_USE_DYNAMIC", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", launcher_value)
    for backend in COMPILE_BACKENDS:
        for mode in COMPILE_MODES:
            plugin = dynamo_plugin(backend, mode)
            assert plugin.dynamic is None and str(plugin.backend.value).lower() == backend, (backend, mode)
            assert plugin.to_kwargs().get("dynamic") is None, (backend, mode)


@pytest.mark.parametrize("asked", ["INDUCTOR", "EAGER", "AOT_EAGER", "CUDAGRAPHS"])
def test_without_compile_the_launchers_dynamo_backend_compiles_nothing(monkeypatch, asked):
    """An `accelerate config` with dynamo makes `accelerate launch` write ACCELERATE_DYNAMO_BACKEND into each process;
    an Accelerator given no plugin would compile every script with it. `--compile` is the one switch."""
    from detlib.compiling import dynamo_plugin

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", asked)
    assert str(dynamo_plugin("no").backend.value) == "NO"


def test_the_run_says_in_one_line_that_the_launchers_compile_is_not_applied(tmp_path):
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
            "from detlib.engine.accelerator import make_accelerator, log_run_setup\n"
            f"a = make_accelerator('no', 1, 'none', {str(tmp_path)!r}, 0, False, None)\n"
            "log_run_setup(a); print('backend', a.state.dynamo_plugin.backend.value)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"})
    assert run.returncode == 0 and "backend NO" in run.stdout, run.stderr[-2000:]
    warned = [ln for ln in run.stderr.splitlines() if ln.startswith("WARNING")]
    assert warned == ["WARNING the accelerate config asks for torch.compile (inductor); not applied: this run compiles "
                      "only with --compile (--compile_backend, --compile_mode)"], run.stderr[-2000:]
