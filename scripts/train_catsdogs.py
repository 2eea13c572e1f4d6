"""Train and evaluate an image classifier (ResNet-18 by default, any timm model) on an ImageFolder with Accelerate.

Built-in data set (horizontal vs vertical stripes), CPU (generated on first use, no download):
    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/train_catsdogs.py

Kaggle "Dogs vs. Cats" (or any folder of class sub-folders) on 2 GPUs (fp16 from the config):
    accelerate launch --config_file accelerate_configs/2gpu.yaml scripts/train_catsdogs.py \
        --train_dir data/train --val_dir data/validation --output_dir outputs/catsdogs

Fine-tuning from local ImageNet weights (the 1000-class fc is replaced), or timm's download when online:
    ... scripts/train_catsdogs.py --train_dir data/train --val_dir data/validation --weights resnet18.safetensors --lr 3e-4
    ... scripts/train_catsdogs.py --train_dir data/train --val_dir data/validation --model convnext_tiny --pretrained

2 CPU processes (gloo DDP), resume, evaluation only:
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_catsdogs.py \
        --train_dir ../shared/data/catsdogs/train --val_dir ../shared/data/catsdogs/val --image_size 128 --report_to none
    ... scripts/train_catsdogs.py --train_dir data/train --val_dir data/validation --output_dir outputs/catsdogs --resume_from_checkpoint latest
    ... scripts/train_catsdogs.py --val_dir data/validation --evaluate_only outputs/catsdogs/best
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from detlib import checkpoint as ckpt
from detlib.classification import (VERIFY_MODES, ImageFolderDataset, build_classifier, classification_metrics,
                                   classification_transform, make_synthetic_image_folder, scan_image_folder)
from detlib.foldercheck import check_folders_for_training
from detlib.runtime import (REPORT_TO, MetricsLogger, check_shared_memory, init_trackers, log_run_setup,
                            make_accelerator, save_config, setup_logging)
from detlib.schedules import build_lr_scheduler

logger = logging.getLogger("train_catsdogs")

# Defaults that depend on the data: a GPU recipe for real folders, a CPU-sized one for the built-in set.
REAL_DEFAULTS = {"image_size": 224, "epochs": 10, "per_device_batch_size": 64}
SYNTHETIC_DEFAULTS = {"image_size": 64, "epochs": 5, "per_device_batch_size": 32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--train_dir", help="ImageFolder root: DIR/<class>/<image> (none: the built-in data set)")
    g.add_argument("--val_dir", help="ImageFolder root with the same class folders")
    g.add_argument("--image_size", type=int, help="square input side in pixels (224; 64 on the built-in data)")
    g.add_argument("--verify_images", default="full", choices=VERIFY_MODES,
                   help="check at start: full decode (finds truncated files), header only, or none")
    g.add_argument("--num_workers", type=int, default=4)
    g.add_argument("--strict_data", action="store_true", help="data repairs (unreadable files left out, files in two "
                   "classes left out, ...) stop the run like errors")

    g = p.add_argument_group("model")
    g.add_argument("--model", default="resnet18", help="resnet18 (torchvision) or a timm model name")
    g.add_argument("--weights", help="local weights: .safetensors or torch state dict (classifier of another size is reset)")
    g.add_argument("--pretrained", action="store_true", help="ImageNet weights from torchvision / timm (online)")

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, help="10 (5 on the built-in data)")
    g.add_argument("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--per_device_batch_size", type=int, help="images per device and step (64; 32 on the built-in data)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    g.add_argument("--lr", type=float, help="peak learning rate: 1e-3 for AdamW, 0.05 for SGD")
    g.add_argument("--weight_decay", type=float, help="0.05 for AdamW, 5e-5 for SGD")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--warmup_steps", type=int, help="linear warmup before the cosine decay (default: 5%% of the steps)")
    g.add_argument("--label_smoothing", type=float, default=0.0)
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping norm (0: off)")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="default: the accelerate config")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval_interval", type=int, default=1, help="evaluate every N epochs (and after the last)")
    g.add_argument("--per_device_eval_batch_size", type=int, default=64)
    g.add_argument("--evaluate_only", metavar="PATH", help="evaluate a checkpoint folder or model.safetensors and exit")
    g.add_argument("--num_misclassified", type=int, default=16, help="misclassified val images in the wandb table")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--output_dir", default="outputs/catsdogs")
    g.add_argument("--checkpoint_total_limit", type=int, default=2, help="keep the last N checkpoints (0: all)")
    g.add_argument("--resume_from_checkpoint", metavar="latest|PATH")

    g = p.add_argument_group("logging")
    g.add_argument("--report_to", default="wandb", choices=REPORT_TO)
    g.add_argument("--project", default="detlib-catsdogs", help="tracker project name")
    g.add_argument("--run_name")
    g.add_argument("--log_interval", type=int, default=10, help="optimizer steps between train log lines")
    return p.parse_args(argv)


def build_dataloaders(args, dirs: dict[str, str | None]):
    """Scan the folders, build the data sets and the (unprepared) loaders.

    The data check (detlib.foldercheck) runs here: the same class folders in train and val, files carrying two
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
    # errors (class lists that differ, an empty train class) stop here; report in output_dir/data_report.json
    scans = check_folders_for_training(scans, args.output_dir, strict=getattr(args, "strict_data", False), is_main=is_main)
    for name, scan in scans.items():
        if is_main:  # the other processes read the same folders; one report is enough
            for level, line in scan.report(name):
                logger.log(level, line)
        empty = [c for c, n in zip(scan.classes, scan.class_counts()) if n == 0]
        if empty and name == "train":
            raise ValueError(f"{scan.root}: no usable image for class(es) {empty}; a class needs training images")
        if empty and is_main:
            logger.warning("%s: no usable image for class(es) %s; their recall is reported as 0", scan.root, empty)

    # Batches leave the workers as float32 (4 bytes per value) through /dev/shm (case B23).
    bytes_per_batch = 4 * 3 * args.image_size ** 2 * max(args.per_device_batch_size, args.per_device_eval_batch_size)
    workers, msg = check_shared_memory(min(args.num_workers, os.cpu_count() or 1), bytes_per_batch)
    if msg:
        logger.warning(msg)
    common = dict(num_workers=workers, pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0)
    val_ds = ImageFolderDataset(scans["val"], classification_transform(args.image_size, train=False), train=False)
    val_loader = torch.utils.data.DataLoader(val_ds, batch_size=args.per_device_eval_batch_size, shuffle=False, **common)
    train_ds = train_loader = None
    if "train" in scans:
        train_ds = ImageFolderDataset(scans["train"], classification_transform(args.image_size, train=True), train=True)
        train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.per_device_batch_size, shuffle=True,
                                                   drop_last=len(train_ds) >= args.per_device_batch_size, **common)
    return train_ds, val_ds, train_loader, val_loader


def build_scheduler(args, optimizer, total_steps: int):
    """Linear warmup from 0 then cosine decay to 0, per optimizer step (see detlib.schedules)."""
    warmup = args.warmup_steps if args.warmup_steps is not None else int(round(0.05 * total_steps))
    return build_lr_scheduler(optimizer, "cosine", total_steps, warmup_steps=warmup, warmup_start=0.0)


def epoch_loader(accelerator, train_loader, epoch: int, batches_done: int = 0):
    """The training batches of `epoch`: that epoch's seeded shuffle on every rank (set_epoch: a new order
    each epoch, disjoint shards, case B31), minus the first `batches_done` when resuming mid-epoch."""
    train_loader.set_epoch(epoch)
    if batches_done:
        return accelerator.skip_first_batches(train_loader, batches_done)
    return train_loader


@torch.no_grad()
def evaluate(model, loader, accelerator, classes: list[str]) -> tuple[dict, dict]:
    """Evaluate the val shard of every process and gather the per-image results (collective: every process
    runs it, case B15).

    `gather_for_metrics` drops the samples that the prepared loader repeats to even out the last batch, and
    the results are de-duplicated by data set index as well, so the numbers do not depend on the process
    count (case B13). Returns (metrics, per-image {"index", "label", "pred", "confidence"}: [N] tensors sorted
    by index), the same on every process.
    """
    model.eval()
    parts = []
    for batch in tqdm(loader, desc="eval", disable=not accelerator.is_local_main_process, leave=False):
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
    stats = {"val_accuracy": m["accuracy"], "val_loss": float(loss.double().mean()), "num_val_samples": int(index.numel())}
    for c, prec, rec in zip(classes, m["precision"], m["recall"]):
        stats[f"val_precision_{c}"] = prec
        stats[f"val_recall_{c}"] = rec
    stats["val_confusion_matrix"] = m["confusion"]
    model.train()
    return stats, {"index": index, "label": label, "pred": pred, "confidence": conf}


def write_predictions(path: str, val_ds, preds: dict) -> None:
    """One CSV row per val image: path, true class, predicted class, confidence (main process)."""
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "pred", "confidence"])
        for i, y, p, c in zip(preds["index"].tolist(), preds["label"].tolist(), preds["pred"].tolist(),
                              preds["confidence"].tolist()):
            w.writerow([val_ds.samples[i][0], val_ds.classes[y], val_ds.classes[p], f"{c:.6f}"])
    os.replace(path + ".tmp", path)


def log_wandb_extras(accelerator, val_ds, preds: dict, step: int, max_rows: int) -> None:
    """wandb (main process): the confusion matrix and a table of the first misclassified val images."""
    if not any(getattr(t, "name", "") == "wandb" for t in accelerator.trackers):
        return
    import wandb

    from detlib.images import load_rgb

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
    run.log({"val_confusion_matrix": wandb.plot.confusion_matrix(y_true=labels, preds=predicted,
                                                                 class_names=list(val_ds.classes)),
             "val_misclassified": table}, step=step)


def report_evaluation(accelerator, metrics, val_ds, stats: dict, preds: dict, epoch, step: int, args) -> None:
    metrics.log({"epoch": epoch, "step": step, **stats}, step=step)
    if accelerator.is_main_process:
        write_predictions(os.path.join(args.output_dir, "predictions_val.csv"), val_ds, preds)
        log_wandb_extras(accelerator, val_ds, preds, step, args.num_misclassified)
    per_class = " ".join(f"{c}: P {stats[f'val_precision_{c}']:.3f} R {stats[f'val_recall_{c}']:.3f}" for c in val_ds.classes)
    logger.info("epoch %s eval on %d images: accuracy %.4f, loss %.4f; %s; confusion (rows true) %s", epoch,
                stats["num_val_samples"], stats["val_accuracy"], stats["val_loss"], per_class, stats["val_confusion_matrix"])


def main(argv=None):
    args = parse_args(argv)
    synthetic = not (args.train_dir or args.val_dir)
    if args.evaluate_only and args.image_size is None:
        saved = ckpt.read_model_config(args.evaluate_only) or {}
        args.image_size = saved.get("image_size")
    for k, v in (SYNTHETIC_DEFAULTS if synthetic else REAL_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.lr is None:
        args.lr = 1e-3 if args.optimizer == "adamw" else 0.05
    if args.weight_decay is None:
        args.weight_decay = 0.05 if args.optimizer == "adamw" else 5e-5
    if not synthetic and not args.val_dir:
        raise SystemExit("--val_dir is required with --train_dir (a held-out ImageFolder with the same classes)")
    if not synthetic and not args.train_dir and not args.evaluate_only:
        raise SystemExit("--train_dir is required for training (or pass --evaluate_only PATH)")
    os.makedirs(args.output_dir, exist_ok=True)

    accelerator = make_accelerator(args.mixed_precision, args.gradient_accumulation_steps, args.report_to,
                                   args.output_dir, seed=args.seed)
    setup_logging(args.output_dir, accelerator.is_main_process)
    log_run_setup(accelerator)

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
        except (FileNotFoundError, ValueError) as e:  # bad paths or data: one clear line, no traceback
            logger.error("%s", e)
            raise SystemExit(f"error: {e}") from None
    classes = val_ds.classes

    # ---- model
    model_config = {"model": args.model, "num_classes": len(classes), "classes": classes, "image_size": args.image_size}
    if args.evaluate_only:
        saved = ckpt.read_model_config(args.evaluate_only)
        if saved:
            if saved["classes"] != classes:
                raise ValueError(f"{args.evaluate_only} was trained on classes {saved['classes']}, "
                                 f"but {dirs['val_dir']} has {classes}")
            args.model = saved["model"]
            model_config["model"] = args.model
    model = build_classifier(args.model, len(classes), pretrained=args.pretrained and not args.evaluate_only,
                             weights=None if args.evaluate_only else args.weights)
    if args.evaluate_only:
        ckpt.load_model_weights(model, args.evaluate_only)
        logger.info("loaded weights from %s", ckpt.weights_path(args.evaluate_only))
    logger.info("%s: %.2fM parameters, %d classes %s", args.model, sum(p.numel() for p in model.parameters()) / 1e6,
                len(classes), classes)

    config = dict(vars(args))
    config.update(num_processes=accelerator.num_processes, mixed_precision=accelerator.mixed_precision,
                  synthetic_data=synthetic, classes=classes, num_val_images=len(val_ds),
                  num_train_images=len(train_ds) if train_ds else 0, **{f"data_{k}": v for k, v in dirs.items()})
    if accelerator.is_main_process:
        save_config(config, args.output_dir)
        logger.info("config: %s", json.dumps(config, default=str))
    metrics = MetricsLogger(accelerator, args.output_dir)

    if args.evaluate_only:
        model, val_loader = accelerator.prepare(model, val_loader)
        init_trackers(accelerator, args.project, config, args.output_dir, None, args.run_name)
        stats, preds = evaluate(model, val_loader, accelerator, classes)
        report_evaluation(accelerator, metrics, val_ds, stats, preds, None, 0, args)
        accelerator.end_training()
        return stats

    # ---- optimizer and schedule
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay, nesterov=True)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    # accumulate() also steps at the end of the loader, so a partial last group is one more step.
    steps_per_epoch = max(1, math.ceil(len(train_loader) / args.gradient_accumulation_steps))
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    scheduler = build_scheduler(args, optimizer, total_steps)
    accelerator.register_for_checkpointing(scheduler)
    state = ckpt.TrainState()  # saved as trainer_state.json with every checkpoint

    resume = ckpt.resolve_resume(args.output_dir, args.resume_from_checkpoint)
    if resume:
        accelerator.load_state(resume)
        state.load_state_dict(ckpt.read_train_state(resume).state_dict())
        logger.info("resumed from %s: epoch %d, step %d in epoch, global step %d, lr %.3g", resume, state.epoch,
                    state.step_in_epoch, state.global_step, optimizer.param_groups[0]["lr"])
    state.run_id = init_trackers(accelerator, args.project, config, args.output_dir, state.run_id, args.run_name)

    # ---- train
    progress = tqdm(total=total_steps, initial=state.global_step, desc="train", disable=not accelerator.is_local_main_process)
    last_stats = None
    done = state.global_step >= total_steps
    while state.epoch < args.epochs and not done:
        epoch = state.epoch
        model.train()
        loader = epoch_loader(accelerator, train_loader, epoch, state.step_in_epoch * args.gradient_accumulation_steps)
        sums = torch.zeros(3, device=accelerator.device)  # loss sum, correct, images: summed on device, read at log time
        epoch_sums = torch.zeros(3, device=accelerator.device)
        grad_norm = None
        t0 = time.time()
        for batch in loader:
            with accelerator.accumulate(model):
                logits = model(batch["image"])
                loss = F.cross_entropy(logits.float(), batch["label"], label_smoothing=args.label_smoothing)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    # after the GradScaler unscale (inside clip_grad_norm_), so the norm is the fp32 one (case B16)
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            n = batch["label"].numel()
            sums += torch.stack([loss.detach() * n, (logits.detach().argmax(-1) == batch["label"]).sum().float(),
                                 torch.tensor(float(n), device=sums.device)])
            if not accelerator.sync_gradients:
                continue
            state.global_step += 1
            state.step_in_epoch += 1
            progress.update(1)
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used
            scheduler.step()
            if state.global_step % args.log_interval == 0 or state.global_step == total_steps:
                s = accelerator.reduce(sums, reduction="sum")
                epoch_sums += s
                sums.zero_()
                loss_v, acc = (s[:2] / s[2].clamp(min=1)).tolist()
                if not math.isfinite(loss_v):
                    logger.error("non-finite loss %.4g at step %d", loss_v, state.global_step)
                progress.set_postfix(loss=f"{loss_v:.4f}", lr=f"{lr:.2e}")
                line = {"epoch": epoch, "step": state.global_step, "loss": loss_v, "lr": lr, "train_accuracy": acc,
                        "images_per_s": float(s[2]) / max(1e-9, time.time() - t0)}
                if grad_norm is not None:
                    line["grad_norm"] = float(grad_norm)
                metrics.log(line, step=state.global_step)
                t0 = time.time()
            if state.global_step >= total_steps:
                done = True
                break
        epoch_sums += accelerator.reduce(sums, reduction="sum")
        if not done or state.step_in_epoch >= steps_per_epoch:
            state.epoch, state.step_in_epoch = epoch + 1, 0
        loss_v, acc = (epoch_sums[:2] / epoch_sums[2].clamp(min=1)).tolist()
        logger.info("epoch %d: train loss %.4f, train accuracy %.4f, lr %.3g", epoch, loss_v, acc,
                    optimizer.param_groups[0]["lr"])

        last = done or state.epoch >= args.epochs
        if (epoch + 1) % args.eval_interval == 0 or last:
            stats, preds = evaluate(model, val_loader, accelerator, classes)
            last_stats = stats
            report_evaluation(accelerator, metrics, val_ds, stats, preds, epoch, state.global_step, args)
            if stats["val_accuracy"] > state.best_metric:
                state.best_metric = stats["val_accuracy"]
                ckpt.save_model_weights(accelerator, model, os.path.join(args.output_dir, "best"), model_config)
                logger.info("new best accuracy %.4f, saved %s/best/model.safetensors", stats["val_accuracy"], args.output_dir)
        path = ckpt.save_checkpoint(accelerator, args.output_dir, state, args.checkpoint_total_limit)
        logger.info("saved checkpoint %s", path)
    progress.close()
    ckpt.save_model_weights(accelerator, model, os.path.join(args.output_dir, "last"), model_config)
    accelerator.end_training()
    return last_stats


if __name__ == "__main__":
    main()
