r"""Train and evaluate an image classifier (ResNet-18 by default, any timm model) on an ImageFolder with Accelerate.

Built-in data set (horizontal vs vertical stripes), CPU (generated on first use, no download):
    OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu.yaml scripts/train_catsdogs.py

Kaggle "Dogs vs. Cats" (or any folder of class sub-folders) on 2 GPUs (fp16 from the config):
    accelerate launch --config_file accelerate_configs/2gpu.yaml scripts/train_catsdogs.py \
        --train_dir data/train --val_dir data/validation --output_dir outputs/catsdogs

Fine-tuning from local ImageNet weights (the 1000-class fc is replaced), or timm's download when online:
    ... scripts/train_catsdogs.py --train_dir data/train --val_dir data/validation --weights resnet18.safetensors --lr 3e-4
    ... scripts/train_catsdogs.py --train_dir data/train --val_dir data/validation --model convnext_tiny --pretrained

2 CPU processes (gloo DDP), resume, evaluation only:
    OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_catsdogs.py \
        --train_dir ../shared/data/catsdogs/train --val_dir ../shared/data/catsdogs/val --image_size 128 --report_to none
    ... scripts/train_catsdogs.py --train_dir data/train --val_dir data/validation --output_dir outputs/catsdogs --resume_from_checkpoint latest
    ... scripts/train_catsdogs.py --val_dir data/validation --evaluate_only outputs/catsdogs/best

Long runs (a checkpoint every 200 steps; SIGTERM / SIGUSR1 / Ctrl-C write one and exit 75):
    ... scripts/train_catsdogs.py --train_dir data/train --val_dir data/validation --checkpoint_steps 200

The same run again, from the config.yaml a run writes (flags given after it override it):
    ... scripts/train_catsdogs.py --config outputs/catsdogs/config.yaml --output_dir outputs/catsdogs_again

Defaults that depend on the data (built-in: no --train_dir / --val_dir given) and the optimizer
(DATA_DEFAULTS in the script):
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
import time

from tqdm import tqdm  # not tqdm.auto: its asyncio bar calls iter() on a DataLoader as it is made (workers twice)

from detlib.data import VERIFY_MODES, add_sampler_flags, loader_settings, make_synthetic_image_folder
from detlib.datacheck import check_folders_for_training
from detlib.argtypes import float_range, int_at_least, path
from detlib.engine import (RunStop, data_defaults_table, format_given, not_used_evaluating, parse_with_config,
                           resolve_data_defaults, run_argument_parser, show_data_defaults, stop, stop_together)
from detlib.lazy import no_grad
from detlib.logtext import short_list
from detlib.schedules import step_scheduler
from detlib.weights import WeightsFileError, load_model_weights, read_model_config, require_model_keys, weights_path

logger = logging.getLogger("train_catsdogs")

# Defaults that depend on the data, {flag: (built-in data, real data)}: a GPU recipe for real folders, a CPU-sized
# one for the built-in set.
DATA_DEFAULTS = {
    "image_size": (64, 224),
    "epochs": (5, 10),
    "per_device_batch_size": (32, 64),
    "lr": {"adamw": (1e-3, 1e-3), "sgd": (0.05, 0.05)},
    "weight_decay": {"adamw": (0.05, 0.05), "sgd": (5e-5, 5e-5)},
    # a folder each, so a real-data run after a built-in one is not refused as "a folder of another run"
    "output_dir": ("outputs/catsdogs_builtin", "outputs/catsdogs"),
    # the built-in run keeps what a resume needs (one checkpoint), a long real run one to fall back on
    "checkpoint_total_limit": (1, 2),
}
__doc__ += data_defaults_table(DATA_DEFAULTS)  # the one table, in the docstring and so in --help
# This script's defaults of the run machinery's flags (detlib.engine.flags).
RUN_DEFAULTS = {"project": "detlib-catsdogs", "log_interval": 10, "eval_interval": 1,
                "per_device_eval_batch_size": 64, "max_grad_norm": 1.0, "checkpoint_total_limit": None}  # DATA_DEFAULTS
# What main writes to config.yaml beside the flags; --config reads them as a record and does not apply them.
RECORD_KEYS = ("classes", "num_val_images", "num_train_images", "data_train_dir", "data_val_dir", "not_used")
DEFAULT_MODEL = "resnet18"  # --model's default, resolved in main (None: not given)


def build_parser() -> argparse.ArgumentParser:
    p, groups = run_argument_parser(__doc__, **RUN_DEFAULTS)  # --config, epochs, batch, checkpoints, logging
    g = groups["model"]
    g.add_argument("--model", help=f"{DEFAULT_MODEL} (torchvision) or a timm model name (default: {DEFAULT_MODEL})")
    g.add_argument("--weights", type=path, help="local weights: .safetensors or torch state dict (classifier of another size is "
                   "reset; default: none, from scratch)")
    g.add_argument("--classes_by_name", action="store_true", help="--weights of a classifier trained on the same number "
                   "of classes under other names or in another order: match its outputs to this data's classes by "
                   "name (default: refused)")
    g.add_argument("--pretrained", action="store_true", help="ImageNet weights from torchvision / timm (online)")

    g = groups["data"]
    g.add_argument("--train_dir", type=path, help="ImageFolder root: DIR/<class>/<image> (default: none, the built-in data set)")
    g.add_argument("--val_dir", type=path, help="ImageFolder root with the same class folders (default: none, the built-in data set)")
    g.add_argument("--image_size", type=int_at_least(16), help="square input side in pixels")
    g.add_argument("--verify_images", default="full", choices=VERIFY_MODES,
                   help="check at start: full decode (finds truncated files), header only, or none (default: %(default)s)")
    g.add_argument("--strict_data", action="store_true", help="data repairs (unreadable files left out, files in two "
                   "classes left out, ...) stop the run like errors")
    add_sampler_flags(g, "class_balanced")  # --sampler (detlib.data.balanced)

    g = groups["optimization"]
    g.add_argument("--lr", type=float_range(0), help="peak learning rate")
    g.add_argument("--weight_decay", type=float_range(0), help="weight decay")
    g.add_argument("--warmup_steps", type=int_at_least(0), help="optimizer steps of linear warm-up from 0 before the "
                   "cosine decay (default: 5%% of the steps)")
    g.add_argument("--label_smoothing", type=float_range(0, 1), default=0.0, help="cross-entropy label smoothing")

    g = groups["evaluation"]
    g.add_argument("--num_misclassified", type=int_at_least(0), default=16, help="misclassified val images in the wandb table")
    show_data_defaults(p, DATA_DEFAULTS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The flags of `argv` (default: sys.argv[1:]) over those of --config; data-dependent ones stay None (main)."""
    return parse_with_config(build_parser(), argv, RECORD_KEYS)


def check_flags(args, given: set[str], synthetic: bool) -> tuple[dict | None, list[str]]:
    """What can be checked before any work, one line and exit 1 or 2 each (`stop`). --evaluate_only rebuilds the
    model its model_config.json describes, at its size unless --image_size is given (a file without them stops in one
    line naming the flag). Returns (the saved model config or None, notes: one line each for
    what was missing and for flags this run cannot honour)."""
    from detlib.classification import check_classifier

    saved, notes = resolve_evaluated_model(args, given) if args.evaluate_only else (None, [])
    try:
        check_classifier(args.model, args.image_size)
    except ValueError as e:
        stop(f"--model: {e}" if not args.evaluate_only else f"model of {args.evaluate_only}: {e}")
    if args.weights and not args.evaluate_only and not os.path.isfile(args.weights):
        stop(f"weights file not found: {args.weights} (--weights)", code=1)
    if not synthetic and not args.val_dir:
        stop("--val_dir is required with --train_dir (a held-out ImageFolder with the same classes)")
    if not synthetic and not args.train_dir and not args.evaluate_only:
        stop("--train_dir is required for training (or pass --evaluate_only PATH)")
    if args.evaluate_only:  # never over a training run's files
        args.output_dir = os.path.join(args.output_dir, "evaluate_only")
    return saved, notes


def resolve_evaluated_model(args, given: set[str]) -> tuple[dict, list[str]]:
    try:
        weights_path(args.evaluate_only)  # a wrong path stops here, before the data is scanned
        saved = read_model_config(args.evaluate_only) or {}
    except (FileNotFoundError, WeightsFileError) as e:
        stop(f"--evaluate_only: {e}", code=1)
    try:  # the model, and its size unless given: never filled in from elsewhere
        require_model_keys(saved, args.evaluate_only, {k: f"--{k}" for k in ("model", "image_size") if k not in given})
    except WeightsFileError as e:
        stop(f"--evaluate_only: {e}", code=1)
    notes = []
    if "model" in given and args.model != saved.get("model", args.model):
        notes.append(f"--model {args.model} is not used: --evaluate_only rebuilds the model its model_config.json "
                     f"describes ({saved['model']})")
    args.model = saved.get("model", args.model)
    if "image_size" not in given:
        args.image_size = saved["image_size"]
    notes += not_used_evaluating(args, ("weights", "pretrained"))
    return saved, notes


def build_dataloaders(args, dirs: dict[str, str | None]):
    """Scan the folders, build the data sets and the (unprepared) loaders.

    The data check (detlib.datacheck.imagefolder) runs here: the same class folders in train and val, files carrying two
    labels, symlink loops (ValueError on errors, report in `output_dir/data_report.json`). Unreadable files are
    left out and reported; the decode result is cached in `output_dir/image_check_cache.json`.
    Returns (train_ds or None, val_ds, train_loader or None, val_loader).
    """
    import torch

    from detlib.classification import classification_transform
    from detlib.data import ImageFolderDataset, scan_image_folder, training_sampler

    from accelerate import PartialState

    is_main = PartialState().is_main_process
    cache = os.path.join(args.output_dir, "image_check_cache.json")
    scans = {}
    if dirs.get("train_dir"):
        scans["train"] = scan_image_folder(dirs["train_dir"], verify=args.verify_images, cache_file=cache)
    val_scan = scan_image_folder(dirs["val_dir"], verify=args.verify_images, cache_file=cache)
    scans["val"] = val_scan
    # errors (class lists that differ, a train class without a usable image) stop here, a val class without one is a
    # warning; the report is logged and written to output_dir/data_report.json
    scans = check_folders_for_training(scans, args.output_dir, strict=getattr(args, "strict_data", False), is_main=is_main)

    # Batches leave the workers as float32 (4 bytes per value) through /dev/shm.
    bytes_per_batch = 4 * 3 * args.image_size ** 2 * max(args.per_device_batch_size, args.per_device_eval_batch_size)
    common = loader_settings(args.num_workers, bytes_per_batch, persistent=True)
    val_ds = ImageFolderDataset(scans["val"], classification_transform(args.image_size, train=False), train=False)
    val_loader = torch.utils.data.DataLoader(val_ds, batch_size=args.per_device_eval_batch_size, shuffle=False, **common)
    train_ds = train_loader = None
    if "train" in scans:
        train_ds = ImageFolderDataset(scans["train"], classification_transform(args.image_size, train=True), seed=args.seed)
        sampler = training_sampler(args.sampler, [[t] for _, t in train_ds.samples], train_ds.classes, args.seed,
                                   args.output_dir, is_main)  # class_balanced: each class drawn equally often
        # workers not persistent: each epoch's copy the data set with its epoch set (ImageFolderDataset.set_epoch)
        train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.per_device_batch_size,
                                                   shuffle=sampler is None, sampler=sampler,
                                                   drop_last=len(train_ds) >= args.per_device_batch_size,
                                                   **{**common, "persistent_workers": False})
    return train_ds, val_ds, train_loader, val_loader


# Linear warm-up from 0 over --warmup_steps (default 5% of the steps), then cosine decay to 0, per optimizer step
# (detlib.schedules).
WARMUP_FRACTION = 0.05
# What a resume cannot change: the model and its classes, the optimizer with its settings (its state brings them back),
# the samples per step and the data position (process count, batch, accumulation, the sampler), fp16's GradScaler.
FIXED_ON_RESUME = ("model", "num_classes", "classes", "optimizer", "lr", "weight_decay", "momentum", "num_processes",
                   "per_device_batch_size", "gradient_accumulation_steps", "mixed_precision", "sampler")


def train_one_epoch(model, optimizer, scheduler, loader, accelerator, state, guard, window, after_step, args) -> None:
    """Train from the run's position (`state`; a mid-epoch resume skips the batches it trained) to the end of the
    epoch or of the run. `guard`: whether to take each step, all-reduced (detlib.engine.StepGuard); `window`: the
    train line's means; `after_step(finite, lrs)`: the bookkeeping after each step (detlib.engine.step_done), true at
    the run's last step. Raises RunStop when the run diverges, Preempted on a stop signal or the time budget."""
    import torch.nn.functional as F
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    from detlib.evaluation import write_train_batch

    model.train()
    G = args.gradient_accumulation_steps
    done = state.step_in_epoch * G
    loader.set_epoch(state.epoch)  # the sampler's order; the data set's crops and flips (ImageFolderDataset.set_epoch)
    if hasattr(loader.dataset, "set_epoch"):  # accelerate's set_epoch skips a data set whose sampler has one
        loader.dataset.set_epoch(state.epoch)
    for i, batch in enumerate(window.timed(accelerator.skip_first_batches(loader, done) if done else loader), done):
        if i % G == 0:  # a step's first micro-batch: its LRs, and the buffers a skipped step puts back
            lrs, step_loss, micro_batches = [g["lr"] for g in optimizer.param_groups], 0.0, 0
            guard.snapshot(model)
        if i == state.global_step == 0 and accelerator.is_main_process:  # the run's first batch, as the model sees it
            write_train_batch(args.output_dir, batch["image"], loader.dataset.classes, batch["label"],
                              mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
        with accelerator.accumulate(model):
            logits = model(batch["image"])
            loss = F.cross_entropy(logits.float(), batch["label"], label_smoothing=args.label_smoothing)
            # a partial last window (fewer than G batches left) is weighted to the mean over its own batches
            accelerator.backward(loss * G / min(G, len(loader) - i // G * G))
            accuracy = (logits.detach().argmax(-1) == batch["label"]).float().mean()
            window.add({"loss": loss, "train_accuracy": accuracy}, batch["label"].numel())
            step_loss, micro_batches = step_loss + loss.detach(), micro_batches + 1
            if not accelerator.sync_gradients:
                continue
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
            finite = guard.check(step_loss / micro_batches, grad_norm, state.global_step + 1, lrs[0])  # alike on every rank
            if finite or accelerator.scaler is not None:  # fp16: the GradScaler skips a non-finite step itself
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if after_step(finite, lrs):  # EMA, counters, train line, divergence, step checkpoint, stop poll
            return


@no_grad
def evaluate(model, loader, accelerator, classes: list[str], poll: bool = False) -> tuple[dict, dict]:
    """Evaluate the val shard of every process and gather the per-image results (collective).

    The samples that the prepared loader repeats to even out the last batch are dropped (`gather_for_metrics`,
    then a de-duplication by data set index), so the numbers do not depend on the process count. Returns (metrics,
    per-image {"index", "label", "pred", "confidence"}: [N] tensors sorted by index), the same on every process:
    val_accuracy, val_loss, num_val_samples, the macro means val_mean_precision / val_mean_recall and, up to
    PER_CLASS_SCALARS classes, val_precision_<class>, val_recall_<class> and val_confusion_matrix.
    `poll`: check for preemption every 10 batches (raises Preempted).
    """
    import torch
    import torch.nn.functional as F

    from detlib.classification import PER_CLASS_SCALARS, classification_metrics
    from detlib.engine import stop_if_preempted

    model.eval()
    parts = []
    for i, batch in enumerate(tqdm(loader, desc="eval", disable=not accelerator.is_local_main_process, leave=False)):
        if poll and i % 10 == 0:
            stop_if_preempted(accelerator)
        logits = model(batch["image"]).float()
        loss = F.cross_entropy(logits, batch["label"], reduction="none")
        conf, pred = logits.softmax(-1).max(-1)
        parts.append(accelerator.gather_for_metrics((batch["index"], batch["label"], pred, conf, loss)))
    index, label, pred, conf, loss = (torch.cat([p[i] for p in parts]).cpu() for i in range(5))
    order = torch.argsort(index, stable=True)
    index, label, pred, conf, loss = (t[order] for t in (index, label, pred, conf, loss))
    keep = torch.ones_like(index, dtype=torch.bool)
    keep[1:] = index[1:] != index[:-1]
    index, label, pred, conf, loss = (t[keep] for t in (index, label, pred, conf, loss))
    m = classification_metrics(pred, label, len(classes))
    stats = {"val_accuracy": m["accuracy"], "val_loss": float(loss.double().mean()), "num_val_samples": int(index.numel()),
             "val_mean_precision": sum(m["precision"]) / len(classes), "val_mean_recall": sum(m["recall"]) / len(classes)}
    if len(classes) <= PER_CLASS_SCALARS:
        for c, prec, rec in zip(classes, m["precision"], m["recall"]):
            stats[f"val_precision_{c}"], stats[f"val_recall_{c}"] = prec, rec
        stats["val_confusion_matrix"] = m["confusion"]
    model.train()
    return stats, {"index": index, "label": label, "pred": pred, "confidence": conf}


def evaluate_and_log(models: dict, val_loader, val_ds, accelerator, metrics, state, args, epoch: int | None,
                     weights: str | None = None) -> dict:
    """Evaluate `models` ({"": the weights being trained or evaluated, "ema_": their EMA}) and log the evaluation: one
    metrics.jsonl line (the EMA's stats beside as ema_*), predictions_val.csv, the per-class files of
    plots/epoch_NNNN/ (also to the trackers), the wandb extras and one log line of bounded length at any number of
    classes. `epoch` counts from 1 (None evaluating only, with the `weights` file scored). Collective. Returns
    {prefix: stats}."""
    from detlib.classification import (classification_metrics, log_wandb_extras, per_class_summary, per_class_table,
                                       write_predictions)
    from detlib.evaluation import log_classification_extras

    stats, preds = {}, None
    for prefix, model in sorted(models.items(), reverse=True):  # the trained weights last: their predictions are kept
        stats[prefix], preds = evaluate(model, val_loader, accelerator, val_ds.classes, poll=True)
    line = {"epoch": epoch, "step": state.global_step, **stats[""],
            **{f"ema_{k}": v for k, v in stats.get("ema_", {}).items() if isinstance(v, (int, float))}}
    metrics.log({**line, **({"weights": os.path.abspath(weights)} if weights else {})}, step=state.global_step,
                tracker_epoch=epoch)
    m = classification_metrics(preds["pred"], preds["label"], len(val_ds.classes))
    per_class, where = per_class_table(val_ds.classes, m["confusion"]), ""
    if accelerator.is_main_process:
        write_predictions(os.path.join(args.output_dir, "predictions_val.csv"), val_ds.samples, val_ds.classes, preds)
        extras = log_classification_extras(accelerator, args.output_dir, epoch, state.global_step, val_ds.classes,
                                           m["confusion"], per_class)
        log_wandb_extras(accelerator, val_ds.samples, val_ds.classes, preds, state.global_step, args.num_misclassified)
        where = f"; per class and confusion matrix in {extras['folder']}"
    s = stats[""]
    logger.info("%s on %d images: accuracy %.4f, loss %.4f%s; %s%s", f"evaluation of {weights}" if weights else
                f"epoch {epoch} eval", s["num_val_samples"], s["val_accuracy"], s["val_loss"],
                "".join(f" (EMA weights: accuracy {e['val_accuracy']:.4f})" for e in [stats.get("ema_")] if e),
                per_class_summary(per_class, m["confusion"]), where)
    return stats


def match_classifier_classes(model, weights: str, classes: list[str], by_name: bool) -> None:
    """--weights of one of our classifiers with as many classes as this data: its outputs keep their meaning
    (`detlib.labels.model_classes_in_data`, output i the id of class i). The same names load as they are; otherwise
    the run stops in one line naming both sides, or with `by_name` each output row moves to the class of its name (a
    class the weights lack keeps a zero row)."""
    import torch

    from detlib.labels import CategoryMap, model_classes_in_data

    try:
        theirs = (read_model_config(weights) or {}).get("classes")
        if not theirs or len(theirs) != len(classes):
            return  # another class count: build_classifier left the output layer fresh
        _, source = model_classes_in_data(CategoryMap(range(len(theirs)), theirs), CategoryMap(range(len(classes)),
                                          classes), by_name, weights, "this data", "--classes_by_name", "output")
    except (WeightsFileError, ValueError) as e:
        raise RunStop(f"--weights: {e}") from None
    if source == list(range(len(classes))):
        return
    head = model.get_classifier() if hasattr(model, "get_classifier") else model.fc
    weight, bias = head.weight.detach().clone(), head.bias.detach().clone()
    with torch.no_grad():
        for j, i in enumerate(source):
            head.weight[j], head.bias[j] = (weight[i], bias[i]) if i is not None else (0.0, 0.0)
    logger.info("--classes_by_name: outputs of %s moved to this data's order %s (they were %s)", weights, classes, theirs)


def load_data(args, accelerator, synthetic: bool) -> tuple:
    """The folders (the built-in set's, generated once by the main process, without --train_dir / --val_dir) and
    `build_dataloaders`' data sets and loaders. Raises RunStop on every process for bad paths or data."""
    with accelerator.main_process_first():  # the main process generates / checks the files, the others reuse it
        try:
            dirs = make_synthetic_image_folder() if synthetic else {"train_dir": args.train_dir, "val_dir": args.val_dir}
            if synthetic:
                logger.info("no --train_dir / --val_dir given: using the built-in stripes data set (horizontal vs "
                            "vertical) in %s (%s, %d px); pass --train_dir and --val_dir for real data",
                            os.path.dirname(dirs["train_dir"]), args.model, args.image_size)
            dirs["train_dir"] = None if args.evaluate_only else dirs["train_dir"]
            data, error = build_dataloaders(args, dirs), None
        except (OSError, ValueError) as e:  # bad paths or data, a cache not writable: one line, no traceback
            dirs, data, error = None, None, str(e)
    stop_together(accelerator, error)  # out of main_process_first, whose barrier a lone exit would leave waiting
    return dirs, *data


def build_model(args, classes: list[str], saved: dict | None):
    """The classifier: --evaluate_only's weights loaded strictly (its classes the val folder's), or --weights /
    --pretrained. Returns (model, the weights file evaluated or None); raises RunStop in one line."""
    from detlib.classification import build_classifier

    check_classes(saved, classes, args)
    try:
        model = build_classifier(args.model, len(classes), pretrained=args.pretrained and not args.evaluate_only,
                                 weights=None if args.evaluate_only else args.weights)
        weights = load_model_weights(model, args.evaluate_only) if args.evaluate_only else None
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # a --weights / --model / --pretrained problem
        raise RunStop(str(e)) from None
    if args.weights and not args.evaluate_only:
        match_classifier_classes(model, args.weights, classes, args.classes_by_name)
    logger.info("%s: %.2fM parameters, %d classes (%s)%s", args.model, sum(p.numel() for p in model.parameters()) / 1e6,
                len(classes), short_list(classes), f"; weights {weights}" if weights else "")
    return model, weights


def write_model_files(model_config: dict, card: dict, folder: str, name: str, evaluation: dict | None) -> None:
    """Beside the weights in `folder` (`output_dir/name/`, main process): the model card of what the run knows of them
    (`card`: its data set and command; `evaluation`: of exactly these weights, or None)."""
    from detlib.evaluation import classifier_card, write_card

    write_card(classifier_card(model_config, evaluation=evaluation, weights_name=name, where=folder, **card), folder)


def check_classes(saved: dict | None, classes: list[str], args) -> None:
    """--evaluate_only: the evaluated model's classes are the val folder's (one line naming the difference)."""
    theirs, val_dir = (saved or {}).get("classes"), args.val_dir or "the built-in val set"
    if theirs in (None, classes):
        return
    if max(len(theirs), len(classes)) <= 8:
        raise RunStop(f"{args.evaluate_only} was trained on classes {theirs}, but {val_dir} has {classes}")
    raise RunStop(f"{args.evaluate_only} was trained on {len(theirs)} classes, {val_dir} has {len(classes)}: only in the "
                  f"model: {short_list(sorted(set(theirs) - set(classes))) or 'none'}; only in the folder: "
                  f"{short_list(sorted(set(classes) - set(theirs))) or 'none'}"
                  + ("; the same names in another order" if sorted(theirs) == sorted(classes) else ""))


def main(argv=None):
    args = parse_args(argv)  # --help and a bad flag are answered before the imports below
    import torch
    from timm.utils import ModelEmaV3

    from detlib.engine import (MetricsLog, Preempted, StepGuard, TrainState, TrainWindow, finish_run,
                               keep_best, log_plan, log_summary, make_accelerator, resume, run_length, running,
                               save_checkpoint, start_run, step_done, stop_early)
    from detlib.evaluation import command_line

    argv = sys.argv[1:] if argv is None else list(argv)  # the model cards' command
    given = args.given  # what the user chose (flags or --config)
    synthetic = not (args.train_dir or args.val_dir)
    args.model = args.model or DEFAULT_MODEL
    resolve_data_defaults(args, DATA_DEFAULTS, synthetic)
    saved, notes = check_flags(args, given, synthetic)
    accelerator = make_accelerator(args.mixed_precision, args.gradient_accumulation_steps, args.report_to, args.output_dir,
                                   args.seed, args.verbose, args.compile_backend if args.compile and not args.evaluate_only
                                   else None, args.compile_mode)
    state, t_start = TrainState(), time.time()
    with running(accelerator, args.output_dir, state, bool(args.evaluate_only), args.resume_from_checkpoint,
                 args.overwrite_output_dir, args.verbose, args.time_limit):
        for line in notes:
            logger.warning("%s", line)
        dirs, train_ds, val_ds, train_loader, val_loader = load_data(args, accelerator, synthetic)
        classes = val_ds.classes
        model, weights = build_model(args, classes, saved)
        model_config = {"model": args.model, "num_classes": len(classes), "classes": classes, "image_size": args.image_size}
        config = {**vars(args), "num_processes": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
                  "synthetic_data": synthetic, "classes": classes, "num_val_images": len(val_ds),
                  "num_train_images": len(train_ds) if train_ds else 0, **{f"data_{k}": v for k, v in dirs.items()},
                  "not_used": ["momentum"] if args.optimizer != "sgd" else []}
        card = {"command": command_line("train_catsdogs.py", argv), "dataset": {
            "name": "detlib synthetic" if synthetic else os.path.basename(os.path.dirname(os.path.abspath(dirs["val_dir"]))),
            "train": dirs.get("train_dir"), "val": dirs.get("val_dir")}}  # data/<name>/val
        metrics, given_line = MetricsLog(accelerator, args.output_dir), format_given(args, config)

        def evaluate(models: dict, epoch: int | None, final: bool = False) -> dict:
            return evaluate_and_log(models, val_loader, val_ds, accelerator, metrics, state, args, epoch, weights)

        if args.evaluate_only:
            model, val_loader = accelerator.prepare(model, val_loader)
            start_run(accelerator, state, config, given_line, args.output_dir, args.project, args.run_name, args.report_to)
            return evaluate({"": model}, None)[""]  # a stop signal during it: `running`'s line, exit 75

        # ---- optimizer, schedule, resume
        if args.optimizer == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                        weight_decay=args.weight_decay, nesterov=True)
        model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
        steps_per_epoch, total_steps = run_length(accelerator, train_loader, args.gradient_accumulation_steps,
                                                  args.epochs, args.max_steps)
        warmup = round(WARMUP_FRACTION * total_steps) if args.warmup_steps is None else args.warmup_steps
        ema = ModelEmaV3(accelerator.unwrap_model(model, keep_torch_compile=False), decay=args.model_ema,
                         use_warmup=args.model_ema_warmup, warmup_power=0.75) if args.model_ema else None
        resume(accelerator, args.output_dir, args.resume_from_checkpoint, state, config, model_config, FIXED_ON_RESUME,
               "--weights", RECORD_KEYS, ema=ema)
        # a function of the step (built at the resumed one), stepped per optimizer step; not prepared: a prepared
        # scheduler steps once per process on every call
        scheduler = step_scheduler(optimizer, "cosine", total_steps, warmup, done_steps=state.global_step)
        bare = accelerator.unwrap_model(model, keep_torch_compile=False)  # evaluated uncompiled, saved without prefixes
        models = {"": bare if args.compile else model, **({"ema_": ema.module} if ema else {})}
        start_run(accelerator, state, config, given_line, args.output_dir, args.project, args.run_name, args.report_to,
                  checkpointed=list(models.values()))
        log_plan(state, args.epochs, total_steps, steps_per_epoch, args.per_device_batch_size * accelerator.num_processes
                 * args.gradient_accumulation_steps, optimizer.param_groups[0]["lr"], args.max_grad_norm)
        write_files = functools.partial(write_model_files, model_config, card)

        def checkpoint() -> str:  # everything a resume needs (a second call at the same state keeps the first)
            return save_checkpoint(accelerator, args.output_dir, state, list(models.values()), args.checkpoint_total_limit,
                                   config, model_config, ema.module if ema else None)

        def evaluate_and_keep_best(epoch: int) -> dict:  # {"": the trained weights' evaluation, "ema_": ...}
            state.eval_pending = epoch  # a preemption's checkpoint says this evaluation is still to run
            evaluations = {p: {"epoch": epoch, "step": state.global_step, **v} for p, v in evaluate(models, epoch).items()}
            keep_best(accelerator, args.output_dir, "val_accuracy", evaluations, models, state, model_config, write_files)
            state.eval_pending = 0
            return evaluations

        # ---- train: the epoch's policy here, the step in train_one_epoch
        guard, window, evaluations = StepGuard(accelerator, args.max_nonfinite_steps), TrainWindow(accelerator), {}
        after_step = functools.partial(step_done, accelerator, state, guard=guard, window=window, metrics=metrics,
                                       steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                                       log_interval=args.log_interval, checkpoint_steps=args.checkpoint_steps,
                                       output_dir=args.output_dir, checkpoint=checkpoint, ema=ema, model=bare)
        start_step = state.global_step
        try:
            if state.eval_pending:  # an evaluation a preemption cut short runs first
                evaluations = evaluate_and_keep_best(state.eval_pending)
            for epoch in range(state.epoch, args.epochs):
                if state.global_step >= total_steps or stop_early(state, args.early_stopping_patience, "val_accuracy"):
                    break
                train_one_epoch(model, optimizer, scheduler, train_loader, accelerator, state, guard, window, after_step,
                                args)
                if state.step_in_epoch == steps_per_epoch:  # the epoch ran to its end (not the run's last step first)
                    logger.info("epoch %d: mean loss %.4f, lr %.3g, %d skipped steps so far", epoch + 1, state.end_epoch(),
                                optimizer.param_groups[0]["lr"], state.skipped_steps)
                last = state.global_step >= total_steps or epoch + 1 == args.epochs
                if (epoch + 1) % args.eval_interval == 0 or last:
                    evaluations = evaluate_and_keep_best(epoch + 1)
                if ((epoch + 1) % args.checkpoint_interval == 0 or last
                        or stop_early(state, args.early_stopping_patience, "val_accuracy")
                        or args.checkpoint_steps and state.global_step % args.checkpoint_steps == 0):
                    checkpoint()
        except Preempted as p:
            raise p.stop(state, checkpoint()) from None
        final = {p: e for p, e in evaluations.items() if e["step"] == state.global_step}  # of the weights at the end
        best = finish_run(accelerator, args.output_dir, "val_accuracy", models, final, state.global_step > start_step,
                          model_config, write_files)
    log_summary(args.output_dir, "val_accuracy", time.time() - t_start, state, best, final.get(""), window.images_seen,
                ema is not None)
    return final.get("")


if __name__ == "__main__":
    main()
