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
import csv
import logging
import math
import os
import sys

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from detlib.classification import (PER_CLASS_SCALARS, build_classifier, check_classifier, classification_metrics,
                                   classification_transform, per_class_summary, per_class_table)
from detlib.data import VERIFY_MODES, ImageFolderDataset, loader_settings, make_synthetic_image_folder, scan_image_folder
from detlib.datacheck import check_folders_for_training
from detlib.engine import (Run, RunSettings, build_scheduler, data_defaults_table, float_range,
                           format_given, given_flags, int_at_least, parse_with_config, resolve_data_defaults,
                           run_argument_parser, show_data_defaults, stop)
from detlib.evaluation import classifier_card, command_line, log_classification_extras, record_evaluation, write_card
from detlib.files import atomic_write
from detlib.logtext import short_list
from detlib.weights import WeightsFileError, complete_model_config, read_model_config, weights_path

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
}
__doc__ += data_defaults_table(DATA_DEFAULTS)  # the one table, in the docstring and so in --help
# This script's defaults of the run machinery's flags (detlib.engine.flags).
RUN_DEFAULTS = {"project": "detlib-catsdogs", "log_interval": 10, "eval_interval": 1,
                "per_device_eval_batch_size": 64, "max_grad_norm": 1.0}
# What main writes to config.yaml beside the flags; --config reads them as a record and does not apply them.
RECORD_KEYS = ("classes", "num_val_images", "num_train_images", "data_train_dir", "data_val_dir", "not_used")
DEFAULT_MODEL = "resnet18"  # --model's default, resolved in main (None: not given)


def build_parser() -> argparse.ArgumentParser:
    p, groups = run_argument_parser(__doc__, **RUN_DEFAULTS)  # --config, epochs, batch, checkpoints, logging
    g = groups["model"]
    g.add_argument("--model", help=f"{DEFAULT_MODEL} (torchvision) or a timm model name (default: {DEFAULT_MODEL})")
    g.add_argument("--weights", help="local weights: .safetensors or torch state dict (classifier of another size is "
                   "reset; default: none, from scratch)")
    g.add_argument("--classes_by_name", action="store_true", help="--weights of a classifier trained on the same number "
                   "of classes under other names or in another order: match its outputs to this data's classes by "
                   "name (default: refused)")
    g.add_argument("--pretrained", action="store_true", help="ImageNet weights from torchvision / timm (online)")

    g = groups["data"]
    g.add_argument("--train_dir", help="ImageFolder root: DIR/<class>/<image> (default: none, the built-in data set)")
    g.add_argument("--val_dir", help="ImageFolder root with the same class folders (default: none, the built-in data set)")
    g.add_argument("--image_size", type=int_at_least(16), help="square input side in pixels")
    g.add_argument("--verify_images", default="full", choices=VERIFY_MODES,
                   help="check at start: full decode (finds truncated files), header only, or none (default: %(default)s)")
    g.add_argument("--strict_data", action="store_true", help="data repairs (unreadable files left out, files in two "
                   "classes left out, ...) stop the run like errors")

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


def build_dataloaders(args, dirs: dict[str, str | None]):
    """Scan the folders, build the data sets and the (unprepared) loaders.

    The data check (detlib.datacheck.imagefolder) runs here: the same class folders in train and val, files carrying two
    labels, symlink loops (ValueError on errors, report in `output_dir/data_report.json`). Unreadable files are
    left out and reported; the decode result is cached in `output_dir/image_check_cache.json`.
    Returns (train_ds or None, val_ds, train_loader or None, val_loader).
    """
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
    common, msg = loader_settings(args.num_workers, bytes_per_batch, persistent=True)
    if msg:
        logger.warning(msg)
    val_ds = ImageFolderDataset(scans["val"], classification_transform(args.image_size, train=False), train=False)
    val_loader = torch.utils.data.DataLoader(val_ds, batch_size=args.per_device_eval_batch_size, shuffle=False, **common)
    train_ds = train_loader = None
    if "train" in scans:
        train_ds = ImageFolderDataset(scans["train"], classification_transform(args.image_size, train=True), train=True)
        train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.per_device_batch_size, shuffle=True,
                                                   drop_last=len(train_ds) >= args.per_device_batch_size, **common)
    return train_ds, val_ds, train_loader, val_loader


# Linear warmup from 0 (5% of the run unless --warmup_steps), then cosine decay to 0, per optimizer step.
SCHEDULE = {"kind": "cosine", "warmup_fraction": 0.05, "warmup_start": 0.0}


@torch.no_grad()
def evaluate(model, loader, run: Run, classes: list[str], train_model=None) -> tuple[dict, dict]:
    """Evaluate the val shard of every process and gather the per-image results (collective: every process
    runs it).

    `gather_for_metrics` drops the samples that the prepared loader repeats to even out the last batch, and
    the results are de-duplicated by data set index as well, so the numbers do not depend on the process
    count. Returns (metrics, per-image {"index", "label", "pred", "confidence"}: [N] tensors sorted
    by index), the same on every process. Metrics: val_accuracy, val_loss, num_val_samples, the macro means
    val_mean_precision / val_mean_recall, and up to PER_CLASS_SCALARS classes val_precision_<class>,
    val_recall_<class> and val_confusion_matrix (beyond, they are in the evaluation's files only: report_evaluation).
    """
    accelerator = run.accelerator
    model.eval()
    parts = []
    for i, batch in enumerate(tqdm(loader, desc="eval", disable=not accelerator.is_local_main_process, leave=False)):
        run.poll_preemption(train_model, batch_index=i)
        logits = model(batch["image"]).float()
        loss = F.cross_entropy(logits, batch["label"], reduction="none")
        prob = logits.softmax(-1)
        conf, pred = prob.max(-1)
        parts.append(accelerator.gather_for_metrics((batch["index"], batch["label"], pred, conf, loss)))
    index, label, pred, conf, loss = (torch.cat([p[i] for p in parts]).cpu() for i in range(5))
    order = torch.argsort(index, stable=True)
    index, label, pred, conf, loss = (t[order] for t in (index, label, pred, conf, loss))
    keep = torch.ones_like(index, dtype=torch.bool)
    keep[1:] = index[1:] != index[:-1]
    if not bool(keep.all()):
        logger.warning("evaluation gathered %d repeated samples; counted once", int((~keep).sum()))
        index, label, pred, conf, loss = (t[keep] for t in (index, label, pred, conf, loss))
    m = classification_metrics(pred, label, len(classes))
    stats = {"val_accuracy": m["accuracy"], "val_loss": float(loss.double().mean()), "num_val_samples": int(index.numel()),
             "val_mean_precision": sum(m["precision"]) / len(classes), "val_mean_recall": sum(m["recall"]) / len(classes)}
    if len(classes) <= PER_CLASS_SCALARS:
        for c, prec, rec in zip(classes, m["precision"], m["recall"]):
            stats[f"val_precision_{c}"] = prec
            stats[f"val_recall_{c}"] = rec
        stats["val_confusion_matrix"] = m["confusion"]
    model.train()
    return stats, {"index": index, "label": label, "pred": pred, "confidence": conf}


def write_predictions(path: str, val_ds, preds: dict) -> None:
    """One CSV row per val image: path, true class, predicted class, confidence (main process)."""
    with atomic_write(path, newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "pred", "confidence"])
        for i, y, p, c in zip(preds["index"].tolist(), preds["label"].tolist(), preds["pred"].tolist(),
                              preds["confidence"].tolist()):
            w.writerow([val_ds.samples[i][0], val_ds.classes[y], val_ds.classes[p], f"{c:.6f}"])


# wandb's confusion-matrix chart is a table of K x K rows, of which wandb keeps 10,000: a true chart up to 100 classes
# (beyond, the PNG of detlib.evaluation.report.log_classification_extras shows the classes with the most errors).
WANDB_CONFUSION_CLASSES = 100


def log_wandb_extras(accelerator, val_ds, preds: dict, step: int, max_rows: int) -> None:
    """wandb (main process): the confusion matrix (up to WANDB_CONFUSION_CLASSES classes) and a table of the
    first misclassified val images."""
    if not any(getattr(t, "name", "") == "wandb" for t in accelerator.trackers):
        return
    import wandb

    from detlib.data.images import load_rgb

    run = accelerator.get_tracker("wandb", unwrap=True)
    labels, predicted = preds["label"].tolist(), preds["pred"].tolist()
    table = wandb.Table(columns=["image", "path", "label", "predicted", "confidence"])
    wrong = [k for k in range(len(labels)) if labels[k] != predicted[k]][:max_rows]
    for k in wrong:
        path = val_ds.samples[int(preds["index"][k])][0]
        img, _ = load_rgb(path)
        img.thumbnail((128, 128))
        table.add_data(wandb.Image(img), path, val_ds.classes[labels[k]], val_ds.classes[predicted[k]],
                       float(preds["confidence"][k]))
    log = {"val_misclassified": table}
    if len(val_ds.classes) <= WANDB_CONFUSION_CLASSES:
        log["val_confusion_matrix"] = wandb.plot.confusion_matrix(y_true=labels, preds=predicted,
                                                                  class_names=list(val_ds.classes))
    run.log(log, step=step)


def report_evaluation(run: Run, model, val_ds, stats: dict, preds: dict, args, weights: str | None = None,
                      ema_stats: dict | None = None) -> None:
    """Log the evaluation (metrics.jsonl with the EMA weights' `ema_stats` as ema_*, trackers, best/), write
    predictions_val.csv, the per-class files (plots/epoch_NNNN/: per_class.json, confusion_matrix.json / .png, also
    to the trackers) and the wandb extras; one log line of bounded length summarises it whatever the number of
    classes."""
    accelerator = run.accelerator
    epoch, step = record_evaluation(run, stats, model, weights=weights, ema_stats=ema_stats)  # evaluating only: weights
    m = classification_metrics(preds["pred"], preds["label"], len(val_ds.classes))
    per_class = per_class_table(val_ds.classes, m["confusion"])
    where = ""
    if accelerator.is_main_process:
        write_predictions(os.path.join(args.output_dir, "predictions_val.csv"), val_ds, preds)
        extras = log_classification_extras(accelerator, args.output_dir, epoch, step, val_ds.classes, m["confusion"],
                                           per_class)
        log_wandb_extras(accelerator, val_ds, preds, step, args.num_misclassified)
        where = f"; per class and confusion matrix in {extras['folder']}"
    logger.info("%s on %d images: accuracy %.4f, loss %.4f; %s%s", f"evaluation of {weights}" if weights else
                f"epoch {epoch} eval", stats["num_val_samples"], stats["val_accuracy"], stats["val_loss"],
                per_class_summary(per_class, m["confusion"]), where)


def match_classifier_classes(run: Run, model, weights: str, classes: list[str], by_name: bool) -> None:
    """--weights of one of our classifiers with as many classes as this data: its outputs keep their meaning. The
    same names in the same order load as they are; otherwise the run stops in one line naming both sides, or with
    `by_name` each output row moves to the class of its name (a class the weights lack keeps its fresh row)."""
    try:
        theirs = (read_model_config(weights) or {}).get("classes")
    except WeightsFileError as e:
        run.fail(f"--weights: {e}")
    if not theirs or len(theirs) != len(classes) or list(theirs) == list(classes):
        return  # another class count: build_classifier left the output layer fresh
    if not by_name:
        pairs = ", ".join(f"output {i} is {a!r} in {weights} but {b!r} here" for i, (a, b) in enumerate(zip(theirs, classes))
                          if a != b)
        run.fail(f"--weights: the classifier's classes are not this data's: {pairs}; pass --classes_by_name to match "
                 "them by name")
    head = model.get_classifier() if hasattr(model, "get_classifier") else model.fc
    weight, bias = head.weight.detach().clone(), head.bias.detach().clone()
    with torch.no_grad():
        for j, name in enumerate(classes):  # a class the weights lack starts from zero (no preference)
            head.weight[j], head.bias[j] = ((weight[theirs.index(name)], bias[theirs.index(name)]) if name in theirs
                                            else (torch.zeros_like(weight[j]), torch.zeros_like(bias[j])))
    logger.info("--classes_by_name: outputs of %s moved to this data's order %s (they were %s)", weights, classes, theirs)


def main(argv=None):
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)  # the model cards' command
    parser = build_parser()
    given = given_flags(parser, argv, RECORD_KEYS)  # what the user chose (flags or --config)
    synthetic = not (args.train_dir or args.val_dir)
    saved = None
    notes = []  # what an old model_config.json lacked and flags this run cannot honour: one line each, in train.log
    model_given, size_given = args.model is not None, args.image_size is not None
    args.model = args.model or DEFAULT_MODEL
    resolve_data_defaults(args, DATA_DEFAULTS, synthetic)
    if args.evaluate_only:
        try:
            weights_path(args.evaluate_only)  # a wrong path stops here, before the data is scanned
            saved = read_model_config(args.evaluate_only) or {}
        except (FileNotFoundError, WeightsFileError) as e:
            stop(f"--evaluate_only: {e}", code=1)
        # rebuild the evaluated model as it was trained, at its size; an old model_config.json without them: the
        # run's config.yaml, else the defaults, said in one line
        keys = {"model": args.model, **({} if size_given else {"image_size": args.image_size})}
        saved, note = complete_model_config(saved, args.evaluate_only, keys, hint="" if size_given else
                                            "pass --image_size with the size the model was trained at")
        notes.append(note)
        if model_given and args.model != saved["model"]:
            notes.append(f"--model {args.model} is not used: --evaluate_only rebuilds the model its model_config.json "
                         f"describes ({saved['model']})")
        args.model = saved["model"]
        if not size_given:
            args.image_size = saved["image_size"]
        notes += [f"--{k} is not used: --evaluate_only loads the weights it names" for k in ("weights", "pretrained")
                  if getattr(args, k)]
    # values checkable without data, before the folders are scanned and the model is built: one line, exit 2
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

    run = Run(RunSettings.from_flags(args), metric="val_accuracy")  # output folder and lock, accelerator, logging
    args.output_dir, accelerator = run.output_dir, run.accelerator  # OUTPUT_DIR/evaluate_only when evaluating only
    if accelerator.is_main_process:
        for line in filter(None, notes):
            logger.warning("%s", line)

    # ---- data
    with accelerator.main_process_first():  # the main process generates / checks the files, the others reuse it
        if synthetic:
            dirs = make_synthetic_image_folder()
            logger.info("no --train_dir / --val_dir given: using the built-in stripes data set (horizontal vs vertical) in %s "
                        "(%s, %d px); pass --train_dir and --val_dir for real data", os.path.dirname(dirs["train_dir"]),
                        args.model, args.image_size)
        else:
            dirs = {"train_dir": args.train_dir, "val_dir": args.val_dir}
        if args.evaluate_only:
            dirs["train_dir"] = None
        try:
            train_ds, val_ds, train_loader, val_loader = build_dataloaders(args, dirs)
            error = None
        except (FileNotFoundError, ValueError) as e:  # bad paths or data: one clear line, no traceback
            error = str(e)
    run.fail_together(error)  # out of main_process_first: a main exiting inside it leaves the others at its barrier
    classes = val_ds.classes

    # ---- model
    model_config = {"model": args.model, "num_classes": len(classes), "classes": classes, "image_size": args.image_size}
    if saved and saved.get("classes") not in (None, classes):
        theirs = saved["classes"]
        if max(len(theirs), len(classes)) <= 8:
            run.fail(f"{args.evaluate_only} was trained on classes {theirs}, but {dirs['val_dir']} has {classes}")
        run.fail(f"{args.evaluate_only} was trained on {len(theirs)} classes, {dirs['val_dir']} has {len(classes)}: "
                 f"only in the model: {short_list(sorted(set(theirs) - set(classes))) or 'none'}; only in the folder: "
                 f"{short_list(sorted(set(classes) - set(theirs))) or 'none'}"
                 + ("; the same names in another order" if sorted(theirs) == sorted(classes) else ""))
    try:
        model = build_classifier(args.model, len(classes), pretrained=args.pretrained and not args.evaluate_only,
                                 weights=None if args.evaluate_only else args.weights)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # a --weights / --model / --pretrained problem
        run.fail(str(e))
    if args.evaluate_only:
        weights = run.load_weights(model, args.evaluate_only)
    elif args.weights:
        match_classifier_classes(run, model, args.weights, classes, args.classes_by_name)
    logger.info("%s: %.2fM parameters, %d classes (%s)", args.model, sum(p.numel() for p in model.parameters()) / 1e6,
                len(classes), short_list(classes))

    config = dict(vars(args))
    config.update(num_processes=accelerator.num_processes, mixed_precision=accelerator.mixed_precision,
                  synthetic_data=synthetic, classes=classes, num_val_images=len(val_ds),
                  num_train_images=len(train_ds) if train_ds else 0, **{f"data_{k}": v for k, v in dirs.items()},
                  not_used=["momentum"] if args.optimizer != "sgd" else [])  # the flags this run ignores
    run.save_config(config, model_config, given=format_given(parser, config, given))

    def describe(folder: str, name: str) -> None:  # the model card beside best/'s, last/'s and last_ema/'s weights
        evaluation = run.evaluation_of(name)
        data = {"name": "detlib synthetic" if synthetic else os.path.basename(os.path.dirname(os.path.abspath(
                dirs["val_dir"]))), "train": dirs.get("train_dir"), "val": dirs.get("val_dir")}  # data/<name>/val
        write_card(classifier_card(model_config, evaluation=evaluation, dataset=data, weights_name=name, where=folder,
                                   command=command_line("train_catsdogs.py", argv)), folder)

    run.checkpointer.describe = describe

    if args.evaluate_only:
        model, val_loader = accelerator.prepare(model, val_loader)
        run.init_trackers()
        stats, preds = evaluate(model, val_loader, run, classes)
        report_evaluation(run, model, val_ds, stats, preds, args, weights=weights)
        run.finish()
        return stats

    # ---- optimizer and schedule
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay, nesterov=True)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    start = run.resume_point(train_loader)  # the run's length; a resumed checkpoint's counters (any process count)
    scheduler, schedule = build_scheduler(optimizer, start=start, epochs=args.epochs, max_steps=args.max_steps,
                                          warmup_steps=args.warmup_steps, **SCHEDULE)
    run.resume(model, optimizer, scheduler, schedule)  # the checkpoint's states, trackers, disk space
    max_grad_norm = args.max_grad_norm or math.inf  # 0: no clipping, the norm is still checked

    # ---- train
    while run.next_epoch():
        model.train()
        for batch in run.batches(train_loader):
            with accelerator.accumulate(model):
                logits = model(batch["image"])
                loss = F.cross_entropy(logits.float(), batch["label"], label_smoothing=args.label_smoothing)
                accelerator.backward(loss * run.loss_weight)  # weight: a partial accumulation window
                accuracy = (logits.detach().argmax(-1) == batch["label"]).float().mean()
                run.add_losses({"loss": loss, "train_accuracy": accuracy}, batch["label"].numel())
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    finite = run.all_finite(loss, grad_norm)  # one all-reduce: every rank steps or skips together
                    if finite or accelerator.scaler is not None:  # fp16: the GradScaler skips a non-finite step
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    stepped = finite and not accelerator.optimizer_step_was_skipped
                    if stepped and run.ema is not None:  # --model_ema; a skipped step has nothing to average in
                        run.ema.update(run.bare(model), step=run.state.global_step + 1)
                    run.end_step(model, stepped)  # train line, divergence stop, step checkpoint, preemption
        run.end_epoch()

        if run.evaluation_due():
            models = run.evaluation_models(model)  # the trained weights, and with --model_ema their average
            ema_stats = None
            if "ema_" in models:
                ema_stats, _ = evaluate(models["ema_"], val_loader, run, classes, train_model=model)
                logger.info("epoch %d eval, EMA weights: accuracy %.4f, loss %.4f", run.epoch_number,
                            ema_stats["val_accuracy"], ema_stats["val_loss"])
            stats, preds = evaluate(models[""], val_loader, run, classes, train_model=model)
            report_evaluation(run, model, val_ds, stats, preds, args, ema_stats=ema_stats)
        run.checkpoint_if_due(model)
    run.finish(model)
    return getattr(run, "last_stats", None)


if __name__ == "__main__":
    main()
