"""The command-line flags both training scripts share, and argparse types that refuse values that cannot work.

A nonsense value (`--epochs 0`, `--lr -1`, `--log_interval 0`) is an argparse error at start (exit code 2, one
line naming the flag), never a traceback or a lost epoch later.

Defaults that depend on the data (the built-in synthetic set or real data) and on the optimizer are written once
per script, as a table `{flag: (built-in data, real data)}` or `{flag: {optimizer: (built-in, real)}}`;
`data_defaults_table`, `show_data_defaults` and `resolve_data_defaults` print it in the docstring and `--help`
and apply it.
"""

from __future__ import annotations

import argparse
import copy
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (the script's docstring: commands to copy) and every flag's default, appended
    unless the help already states it (a help that says "default")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)  # argparse prints no help line for a flag without help, so no default either
            action.help = "default: %(default)s"
        return super()._format_action(action)


def run_argument_parser(description: str, **defaults) -> tuple[argparse.ArgumentParser, dict]:
    """A parser with the run machinery's flags (detlib.engine) in the groups both scripts use.

    `defaults` set the script's own defaults of these flags (e.g. `output_dir`, `eval_interval`). Returns the
    parser and its groups by name, so the script adds its own flags beside them.
    """
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    g = groups["data"]
    g.add_argument("--num_workers", type=int_at_least(0), default=4, help="DataLoader workers per process")
    g = groups["optimization"]
    g.add_argument("--epochs", type=int_at_least(1), help="epochs to train")
    g.add_argument("--max_steps", type=int_at_least(0), default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--per_device_batch_size", type=int_at_least(1), help="images per device and step")
    g.add_argument("--gradient_accumulation_steps", type=int_at_least(1), default=1)
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    g.add_argument("--momentum", type=float_range(0, 1), default=0.9, help="SGD momentum")
    g.add_argument("--max_grad_norm", type=float_range(0), help="gradient clipping norm (0: off)")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="default: the accelerate config")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max_nonfinite_steps", type=int_at_least(1), default=5,
                   help="stop after this many non-finite optimizer steps in a row, each skipped")
    g = groups["evaluation"]
    g.add_argument("--eval_interval", type=int_at_least(1), help="evaluate every N epochs and after the last")
    g.add_argument("--per_device_eval_batch_size", type=int_at_least(1))
    g.add_argument("--evaluate_only", metavar="PATH", help="evaluate a run folder, best/, last/, a checkpoint folder "
                   "or a model.safetensors and exit (results in OUTPUT_DIR/evaluate_only/; default: train)")
    g = groups["checkpointing"]
    g.add_argument("--output_dir")
    g.add_argument("--checkpoint_total_limit", type=int_at_least(0), default=2,
                   help="keep the newest N checkpoints, epoch and step ones together (0: all)")
    g.add_argument("--checkpoint_interval", type=int_at_least(1), default=1, help="checkpoint every N epochs and at the end")
    g.add_argument("--checkpoint_steps", type=int_at_least(0), default=0,
                   help="also checkpoint every N optimizer steps, mid-epoch included (0: off)")
    g.add_argument("--resume_from_checkpoint", metavar="latest|PATH",
                   help="latest: the newest intact checkpoint of OUTPUT_DIR; or a checkpoint folder (default: a new run)")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="start a new run in a folder that holds another run, deleting its checkpoints, best/, last/ and logs")
    g = groups["logging"]
    g.add_argument("--report_to", default="wandb", choices=REPORT_TO)
    g.add_argument("--project", help="tracker project name")
    g.add_argument("--run_name", help="tracker run name (default: the name of OUTPUT_DIR)")
    g.add_argument("--log_interval", type=int_at_least(1), help="optimizer steps between train log lines")
    p.set_defaults(**defaults)
    return p, groups


# ---- defaults that depend on the data and the optimizer

def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _pair(builtin, real) -> str:
    return _fmt(builtin) if builtin == real else f"built-in data {_fmt(builtin)}, real data {_fmt(real)}"


def data_default_text(entry) -> str:
    """One table entry as help text: `(160, 600)` -> "built-in data 160, real data 600"; `{"adamw": (1e-3, 1e-4),
    "sgd": (0.01, 0.01)}` -> "adamw: built-in data 0.001, real data 0.0001; sgd: 0.01"."""
    if isinstance(entry, dict):
        return "; ".join(f"{optimizer}: {_pair(*pair)}" for optimizer, pair in entry.items())
    return _pair(*entry)


def data_defaults_table(table: dict) -> str:
    """The table as docstring text: one line per flag (per flag and optimizer where it depends on the optimizer)."""
    rows = [("flag", "built-in data", "real data")]
    for flag, entry in table.items():
        if isinstance(entry, dict):
            rows += [(f"--{flag} with --optimizer {opt}", _fmt(b), _fmt(r)) for opt, (b, r) in entry.items()]
        else:
            rows.append((f"--{flag}", _fmt(entry[0]), _fmt(entry[1])))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"    {a:<{widths[0]}}   {b:<{widths[1]}}   {c}" for a, b, c in rows) + "\n"


def show_data_defaults(p: argparse.ArgumentParser, table: dict) -> None:
    """Append each table flag's defaults to its help ("(default: built-in data 160, real data 600)")."""
    for action in p._actions:
        if action.dest in table:
            action.help = f"{action.help} (default: {data_default_text(table[action.dest])})"


def resolve_data_defaults(args: argparse.Namespace, table: dict, synthetic: bool) -> None:
    """Set each table flag left unset (None) to its default for the data (`synthetic`: the built-in set) and
    `args.optimizer`. A value given on the command line is kept."""
    for flag, entry in table.items():
        if getattr(args, flag) is None:
            builtin, real = entry[args.optimizer] if isinstance(entry, dict) else entry
            setattr(args, flag, builtin if synthetic else real)

