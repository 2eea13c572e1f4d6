"""The command-line flags both training scripts share, and argparse types that refuse values that cannot work.

A nonsense value (`--epochs 0`, `--lr -1`, `--log_interval 0`) is an argparse error at start (exit code 2, one
line naming the flag), never a traceback or a lost epoch later.
"""

from __future__ import annotations

import argparse
import math

from .runtime import REPORT_TO

GROUPS = ("data", "model", "optimization", "evaluation", "checkpointing", "logging")


def int_at_least(lo: int):
    """argparse type: an integer >= `lo`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text}")
        return value
    parse.__name__ = f"integer >= {lo}"
    return parse


def float_range(lo: float, hi: float = math.inf, lo_open: bool = False):
    """argparse type: a finite number in [lo, hi] (or (lo, hi] with `lo_open`)."""
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
            raise argparse.ArgumentTypeError(f"must be a number {'>' if lo_open else '>='} {lo}"
                                             + (f" and <= {hi}" if hi != math.inf else "") + f", got {text}")
        return value
    parse.__name__ = "number"
    return parse


def run_argument_parser(description: str, helps: dict | None = None, **defaults) -> tuple[argparse.ArgumentParser, dict]:
    """A parser with the run machinery's flags (detlib.engine) in the groups both scripts use.

    `defaults` set the script's own defaults of these flags (e.g. `output_dir`, `eval_interval`), `helps` the
    help of those whose default depends on the script or the data (`describe`). Returns the parser and its
    groups by name, so the script adds its own flags beside them.
    """
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    g = groups["data"]
    g.add_argument("--num_workers", type=int_at_least(0), default=4, help="DataLoader workers per process (default: %(default)s)")
    g = groups["optimization"]
    g.add_argument("--epochs", type=int_at_least(1))
    g.add_argument("--max_steps", type=int_at_least(0), default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--per_device_batch_size", type=int_at_least(1))
    g.add_argument("--gradient_accumulation_steps", type=int_at_least(1), default=1)
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    g.add_argument("--momentum", type=float_range(0, 1), default=0.9, help="SGD momentum (default: %(default)s)")
    g.add_argument("--max_grad_norm", type=float_range(0), help="gradient clipping norm (0: off; default: %(default)s)")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="default: the accelerate config")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max_nonfinite_steps", type=int_at_least(1), default=5,
                   help="stop after this many non-finite optimizer steps in a row, each skipped (default: %(default)s)")
    g = groups["evaluation"]
    g.add_argument("--eval_interval", type=int_at_least(1), help="evaluate every N epochs and after the last (default: %(default)s)")
    g.add_argument("--per_device_eval_batch_size", type=int_at_least(1))
    g.add_argument("--evaluate_only", metavar="PATH", help="evaluate a run folder, best/, last/, a checkpoint folder "
                   "or a model.safetensors and exit (results in OUTPUT_DIR/evaluate_only/)")
    g = groups["checkpointing"]
    g.add_argument("--output_dir")
    g.add_argument("--checkpoint_total_limit", type=int_at_least(0), default=2,
                   help="keep the newest N checkpoints, epoch and step ones together (0: all; default: %(default)s)")
    g.add_argument("--checkpoint_interval", type=int_at_least(1), default=1, help="checkpoint every N epochs and at the end (default: %(default)s)")
    g.add_argument("--checkpoint_steps", type=int_at_least(0), default=0,
                   help="also checkpoint every N optimizer steps, mid-epoch included (0: off)")
    g.add_argument("--resume_from_checkpoint", metavar="latest|PATH",
                   help="latest: the newest intact checkpoint of OUTPUT_DIR; or a checkpoint folder")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="start a new run in a folder that holds another run, deleting its checkpoints, best/, last/ and logs")
    g = groups["logging"]
    g.add_argument("--report_to", default="wandb", choices=REPORT_TO)
    g.add_argument("--project", help="tracker project name")
    g.add_argument("--run_name")
    g.add_argument("--log_interval", type=int_at_least(1), help="optimizer steps between train log lines (default: %(default)s)")
    p.set_defaults(**defaults)
    describe(p, **(helps or {}))
    return p, groups


def describe(p: argparse.ArgumentParser, **helps: str) -> None:
    """Set the help text of flags added by `run_argument_parser` whose default depends on the script or data."""
    for action in p._actions:
        if action.dest in helps:
            action.help = helps[action.dest]
