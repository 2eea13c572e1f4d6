"""The run machinery both training scripts share: the run folder and its lock, signals and preemption, flags,
checkpoints and resume, LR schedules, logs, metrics and trackers.

`run` (the `Run` the scripts call around their loop: its bookkeeping, where a run starts; `StepWindow`, the part
of a `Run` that is the finite check's memory and the train line's window), `flags` (the shared flags, --config),
`run_folder` (the folder, the lock, run_status.json, signals, DataLoader workers), `checkpoint_io` (the checkpoint
format: write, list, read; whether a checkpoint fits a resumed run; what a run saves: rotation, best/, last/),
`schedules` (LR schedules, built by the scripts), `tracking` (the Accelerator, logs, metrics.jsonl, trackers and
their steps after a resume, collectives).
"""

from .flags import (HelpFormatter, data_defaults_table, float_range, format_given, given_flags, int_at_least,
                    parse_with_config, resolve_data_defaults, run_argument_parser, show_data_defaults, stop)
from .run import Run, RunSettings
from .schedules import build_scheduler
from .flags import ArgumentParser, first_process, wait_for_the_first_process
from .tracking import broadcast_object, make_accelerator, setup_console_logging, setup_logging

__all__ = [
    "HelpFormatter", "data_defaults_table", "float_range", "format_given", "given_flags", "int_at_least",
    "parse_with_config", "resolve_data_defaults", "run_argument_parser", "show_data_defaults", "stop", "Run",
    "RunSettings", "build_scheduler", "broadcast_object",
    "setup_console_logging", "ArgumentParser", "first_process", "wait_for_the_first_process", "make_accelerator",
    "setup_logging",
]
