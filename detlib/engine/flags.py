"""The flags both training scripts share and their file: `--config FILE.yaml` reads one (timm's two-stage parse, docs/flags.md; paths:
docs/long_runs.md), and argparse types that refuse values that cannot work: a nonsense value (`--epochs 0`, `--lr
-1`), on the command line or in a --config file, is one argparse line at start (exit 2), never a traceback later.

Defaults that depend on the data (built-in or real) and the optimizer are one table per script, `{flag: (built-in,
real)}` or `{flag: {optimizer: (built-in, real)}}`, printed in the docstring and --help, and applied.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import sys

import yaml

from ..argtypes import duration_seconds, float_range, int_at_least, path, time_limit  # noqa: F401 (re-exported)
from ..files import atomic_write
from .exits import print_once, wait_for_the_first_process

REPORT_TO = ("wandb", "tensorboard", "all", "none")
DEFAULT_REPORT_TO = "tensorboard"  # on this machine, no account, prints nothing; wandb when asked

GROUPS = ("data", "model", "optimization", "evaluation", "checkpointing", "logging")
RUN_RECORD_KEYS = ("num_processes", "synthetic_data")  # in config.yaml beside the flags: what the run found
# What to do with the folder this time: a config.yaml re-run must not resume or wipe a folder because the recorded
# run did. Given on the command line only.
FOLDER_ACTION_KEYS = ("resume_from_checkpoint", "overwrite_output_dir")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# An evaluation-only run writes into OUTPUT_DIR/evaluate_only and records that folder as output_dir.
EVALUATE_ONLY_SUBDIR = "evaluate_only"


def _checkpoint(text: str) -> str:
    return text if text == "latest" else path(text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (commands to copy) and every flag's default, unless its help says "default"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings or action.required:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class ArgumentParser(argparse.ArgumentParser):
    """The parser of a script every process of a launch runs: usage, help and errors are printed by the first process
    only, and on an error all meet after it (`wait_for_the_first_process`), so a bad flag is one line. `flags`: its
    actions by dest, the groups' included. From its making on, the console escapes what its encoding cannot write."""

    def __init__(self, *args, **kwargs):
        from ..logtext import escape_unencodable

        self.flags: dict[str, argparse.Action] = {}
        self.reading_config = None  # the --config file whose values are being parsed: its errors name it
        # no abbreviations: with --tile and --tile_min_visible, `--tile 128` was read as the other one
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        escape_unencodable()

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        return self._record(super().add_argument(*args, **kwargs))

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument
        group.add_argument = lambda *a, **k: self._record(add(*a, **k))
        return group

    def _record(self, action: argparse.Action) -> argparse.Action:
        self.flags[action.dest] = action
        return action

    def print_usage(self, file=None):
        print_once(self.format_usage(), file or sys.stdout)

    def print_help(self, file=None):
        print_once(self.format_help(), file or sys.stdout)

    def error(self, message):
        if self.reading_config:
            self.exit(2, f"{self.prog}: error: --config {self.reading_config}: {message}\n")
        super().error(message)

    def exit(self, status=0, message=None):
        if message:
            print_once(message)
        if status:
            wait_for_the_first_process()  # returns at once on the first process
        raise SystemExit(status)


def run_argument_parser(description: str, **defaults) -> tuple[argparse.ArgumentParser, dict]:
    """(a parser with `--config` and the shared flags, its groups by name for the script's own flags); `defaults`:
    the script's defaults of the shared flags. Parse with `parse_with_config`."""
    from .stopping import add_stopping_flags

    p = ArgumentParser(description=description, formatter_class=HelpFormatter, usage="%(prog)s [flags]")
    p.add_argument("--config", metavar="FILE.yaml", type=path, help="flag: value lines as defaults, the command line over them; a "
                   "run's OUTPUT_DIR/config.yaml re-runs it (default: none)")
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    g = groups["data"]
    g.add_argument("--num_workers", type=int_at_least(0), default=4, help="DataLoader workers per process")
    g = groups["model"]
    g.add_argument("--compile", action="store_true", help="torch.compile the model for training (accelerate's "
                   "TorchDynamoPlugin, around DDP; automatic dynamic shapes; evaluation runs uncompiled; the summary "
                   "counts the graphs; docs/mixed_precision.md)")
    g.add_argument("--compile_backend", default="inductor", choices=COMPILE_BACKENDS, help="torch.compile backend: "
                   "inductor, aot_eager (the traced graphs on eager kernels: the tracing without inductor's compile "
                   "time), eager (dynamo only)")
    g.add_argument("--compile_mode", default="default", choices=COMPILE_MODES, help="inductor's mode")
    g = groups["optimization"]
    g.add_argument("--epochs", type=int_at_least(1), help="epochs to train")
    g.add_argument("--max_steps", type=int_at_least(0), default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--per_device_batch_size", type=int_at_least(1), help="images per device and step")
    g.add_argument("--gradient_accumulation_steps", type=int_at_least(1), default=1, help="micro-batches per step")
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"], help="AdamW, or SGD with --momentum")
    g.add_argument("--momentum", type=float_range(0, 1), default=0.9, help="SGD momentum")
    g.add_argument("--max_grad_norm", type=float_range(0), help="gradient clipping norm (0: off)")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="default: the accelerate config")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the data order, the augmentation")
    g.add_argument("--max_nonfinite_steps", type=int_at_least(1), default=5, help="non-finite steps in a row (each "
                   "skipped) that stop the run")
    g.add_argument("--model_ema", metavar="DECAY", type=float_range(0, 1, lo_open=True, hi_open=True),
                   help="an exponential moving average of the weights (timm's ModelEmaV3), e.g. 0.9998: evaluated "
                        "beside them (ema_*), best/ takes the better, last_ema/ the final average (default: none)")
    g.add_argument("--model_ema_warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="timm's decay warm-up, 1 - step ** -0.75 capped at DECAY (0.99 after 460 steps), so that the "
                        "average does not stay near the initial weights")
    g = groups["evaluation"]
    g.add_argument("--eval_interval", type=int_at_least(1), help="evaluate every N epochs and after the last")
    g.add_argument("--per_device_eval_batch_size", type=int_at_least(1), help="images per device and evaluation batch")
    g.add_argument("--evaluate_only", metavar="PATH", type=path, help="evaluate a run, best/, last/, a checkpoint or a weights "
                   "file and exit (results in OUTPUT_DIR/evaluate_only/; default: train)")
    g = groups["checkpointing"]
    g.add_argument("--output_dir", help="the run folder (config.yaml, train.log, metrics.jsonl, checkpoints/, best/, ...)")
    g.add_argument("--checkpoint_total_limit", type=int_at_least(0), default=2, help="checkpoints kept, the newest (0: all)")
    g.add_argument("--checkpoint_interval", type=int_at_least(1), default=1, help="checkpoint every N epochs and at the end")
    g.add_argument("--checkpoint_steps", type=int_at_least(0), default=0, help="also a checkpoint every N steps (0: off)")
    g.add_argument("--resume_from_checkpoint", metavar="latest|PATH", type=_checkpoint, help="latest: the last good (newest intact) checkpoint of "
                   "OUTPUT_DIR; or a checkpoint folder (default: a new run)")
    g.add_argument("--overwrite_output_dir", action="store_true", help="a new run in a folder of another, deleting it")
    add_stopping_flags(groups["evaluation"], g)  # --early_stopping_patience, --time_limit (.stopping)
    g = groups["logging"]
    g.add_argument("--report_to", default=DEFAULT_REPORT_TO, choices=REPORT_TO, help="trackers: tensorboard "
                   "(OUTPUT_DIR/tensorboard), wandb (offline to OUTPUT_DIR/wandb without an account); metrics.jsonl "
                   "and plots/ either way")
    g.add_argument("--project", help="tracker project name")
    g.add_argument("--run_name", help="tracker run name (default: the name of OUTPUT_DIR)")
    g.add_argument("--log_interval", type=int_at_least(1), help="optimizer steps between train log lines")
    g.add_argument("--verbose", action="store_true", help="the libraries' INFO lines too, on the console and in train.log")
    p.set_defaults(**defaults)
    return p, groups


# ---- defaults that depend on the data and the optimizer

def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _pair(builtin, real) -> str:
    return _fmt(builtin) if builtin == real else f"built-in data {_fmt(builtin)}, real data {_fmt(real)}"


def data_default_text(entry) -> str:
    """A table entry as help text: `(160, 600)` -> "built-in data 160, real data 600"; `{"adamw": (1e-3, 1e-4), "sgd":
    (0.01, 0.01)}` -> "adamw: built-in data 0.001, real data 0.0001; sgd: 0.01"."""
    return "; ".join(f"{k}: {_pair(*v)}" for k, v in entry.items()) if isinstance(entry, dict) else _pair(*entry)


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


def show_data_defaults(p: ArgumentParser, table: dict) -> None:
    """Append each table flag's defaults to its help ("(default: built-in data 160, real data 600)")."""
    for dest, action in p.flags.items():
        if dest in table:
            action.help = f"{action.help} (default: {data_default_text(table[action.dest])})"


def resolve_data_defaults(args: argparse.Namespace, table: dict, synthetic: bool) -> None:
    """Set each table flag left unset (None) to its default for the data (`synthetic`: the built-in set) and
    `args.optimizer`. A value given on the command line or in --config is kept."""
    for flag, entry in table.items():
        if getattr(args, flag) is None:
            builtin, real = entry[args.optimizer] if isinstance(entry, dict) else entry
            setattr(args, flag, builtin if synthetic else real)
    if isinstance(getattr(args, "output_dir", None), str):  # recorded in config.yaml like every path (`path`)
        args.output_dir = os.path.abspath(args.output_dir)


# ---- config.yaml: written by a run, read back by --config (timm's two-stage parse)

def save_config(config: dict, path: str) -> None:
    """`config` as YAML at `path` (a run's config.yaml: `--config` reads it back)."""
    with atomic_write(path) as f:
        yaml.safe_dump(config, f, sort_keys=False)


class Flags(argparse.Namespace):
    """The parsed flags (`parse_with_config`); beside them, outside `vars()` (so outside config.yaml): `given`, the
    flags the user chose on the command line or in the --config file, whatever their value (`--epochs 30` is given
    even where 30 is the default), and the `parser`."""
    __slots__ = ("given", "parser")


_UNSET = object()  # a flag's value before argparse sets it


def parse_with_config(p: ArgumentParser, argv: list[str] | None = None, record_keys: tuple[str, ...] = ()) -> Flags:
    """Parse `argv` (default sys.argv[1:]) over the values of `--config FILE.yaml` (`read_config`); `record_keys`: the
    script's keys in config.yaml beside its flags, not applied. A recorded absolute `path` the command line does not
    replace and that no longer exists: one line naming the file and the key, exit 2."""
    recorded = read_config(p, config, record_keys) if (config := _config_file(argv)) else {}
    p.set_defaults(**recorded)
    # argparse sets a default only where the namespace has no value yet: what keeps the marker was not typed
    dests = [d for d, a in p.flags.items() if a.default is not argparse.SUPPRESS]
    args = p.parse_args(argv, namespace=Flags(**dict.fromkeys(dests, _UNSET)))
    args.given, args.parser = {k for k in dests if getattr(args, k) is not _UNSET and k != "config"} | set(recorded), p
    for key in dests:
        if getattr(args, key) is _UNSET:
            setattr(args, key, p.get_default(key))
    for key, value in recorded.items():
        if (p.flags[key].type is path and value == getattr(args, key) and isinstance(value, str)
                and os.path.isabs(value) and not os.path.exists(value)):
            p.exit(2, f"{p.prog}: error: --config {config}: {key}: {value} does not exist (the run that wrote the file "
                      f"read it there); give --{key} on the command line to read another\n")
    return args


def _config_file(argv: list[str] | None) -> str | None:
    """The --config value of `argv` (default sys.argv[1:]), read before the full parse."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config")
    return first.parse_known_args(argv)[0].config


def format_given(args: Flags, config: dict) -> str:
    """The values in `config` of the flags given in `args` as a command line (`--epochs 2 --no-aspect_grouping
    --lr_steps 8 11`), in `config`'s order; "" when none is given."""
    parts = []
    for key, value in config.items():
        action = args.parser.flags.get(key)
        if key not in args.given or action is None or not action.option_strings:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            parts.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:  # store_true
            parts.append(flag if value else "")
        elif isinstance(value, (list, tuple)):
            parts.append(" ".join([flag, *(shlex.quote(str(v)) for v in value)]))
        else:
            parts.append(f"{flag} {shlex.quote(str(value))}")
    return " ".join(x for x in parts if x)


def read_config(p: ArgumentParser, path: str, record_keys: tuple[str, ...] = ()) -> dict:
    """The flag values of a --config file, parsed by `p` itself as the command line they stand for (`_command_line`).
    An unreadable file, no mapping, an unknown key or a value the flag refuses: one line naming the file and the key
    or flag, exit 2. Folder actions are not applied from a file (said)."""
    p.reading_config = path  # its errors name the file (`ArgumentParser.error`), ours and argparse's alike
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f)
    except OSError as e:
        p.error(e.strerror or str(e))
    except yaml.YAMLError as e:
        p.error("not valid YAML: " + " ".join(str(e).split()))
    if not isinstance(cfg, dict):
        p.error(f"must be a mapping of flag names to values (one `flag: value` per line), not {type(cfg).__name__}")
    flags = {d: a for d, a in p.flags.items() if a.option_strings and a.default is not argparse.SUPPRESS}
    ignored = {"config", *RUN_RECORD_KEYS, *record_keys}
    keys, line = [], []
    for key, value in cfg.items():
        if key in ignored:
            continue
        if key in FOLDER_ACTION_KEYS:
            if value:
                print_once(f"note: --config {path}: {key}: {value} is not applied from a file (give --{key} on the "
                           "command line)")
            continue
        if key not in flags:  # looked up here: argparse would take `epoch` for an abbreviation of --epochs
            close = difflib.get_close_matches(str(key), list(flags), n=1)
            p.error(f"unknown key {key!r}: not a flag of {p.prog}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        keys.append(key)
        line += _command_line(flags[key], value)
    parsed = p.parse_args(line)
    p.reading_config = None
    out = {key: getattr(parsed, key) for key in keys}
    if out.get("evaluate_only") and os.path.basename(os.path.normpath(out.get("output_dir") or "")) == EVALUATE_ONLY_SUBDIR:
        # the recorded folder of an evaluation-only run: re-running it writes to the same place, not one level down
        out["output_dir"] = os.path.dirname(os.path.normpath(out["output_dir"]))
    return out


def _command_line(action: argparse.Action, value) -> list[str]:
    """The command line a --config file's `value` (from YAML) of `action`'s flag stands for: `lr: 1e-4` is
    `--lr=1e-4`, `lr_steps: [8, 11]` `--lr_steps 8 11`, `aspect_grouping: false` `--no-aspect_grouping`; a value no
    command line gives (`strict_data: 1`, `seed: null`) is written so that argparse refuses it."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # store_true, --flag / --no-flag
        if value is False and isinstance(action, argparse.BooleanOptionalAction):
            return [f"--no-{flag[2:]}"]
        return [flag] if value is True else [] if value is False else [f"{flag}={value}"]
    if value is None:  # a flag without a default stays unset; one with a default is "expected one argument"
        return [] if action.default is None else [flag]
    if isinstance(value, list) and (action.nargs in ("+", "*") or isinstance(action.nargs, int)):
        return [flag, *map(str, value)]
    return [f"{flag}={value}"]


def not_used_evaluating(args, weights_flags: tuple[str, ...]) -> list[str]:
    """--evaluate_only: a line for each flag given that an evaluation does not use; `weights_flags`: the script's
    flags that load weights (the evaluated ones replace them)."""
    why = {**dict.fromkeys(weights_flags, "loads the weights it names"), "resume_from_checkpoint": "trains nothing",
           "compile": "runs the weights uncompiled, as every evaluation does",
           "model_ema": "trains nothing to average; evaluate an EMA with --evaluate_only RUN/last_ema"}
    return [f"--{k} is not used: --evaluate_only {why[k]}" for k in why if getattr(args, k)]
