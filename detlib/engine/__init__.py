"""The run machinery both training scripts share, one concern a module: `flags` (the shared flags, `--config`),
`run_folder` (the folder, its lock, how a run ends, the stop signals), `checkpoints` (save, verify, resume,
best/), `step` (the all-reduced decision to take a step), `stopping` (early stopping, the time budget) and `logs`
(the Accelerator, the log, metrics.jsonl, trackers, the summary). The scripts hold the run's state and loop; these are the calls they make.
"""

from ..lazy import lazy_exports

# What the scripts use, by module, loaded on first use: `checkpoints`, `logs` and `run_folder` import torch and
# accelerate, and a script's --help (which needs `flags` only) should not wait for them.
__getattr__, __all__ = lazy_exports(__name__, {
    "checkpoints": ("TrainState", "best_weights", "improves_best", "list_checkpoints", "resume", "resume_ema"),
    "flags": ("ArgumentParser", "HelpFormatter", "data_defaults_table", "float_range", "format_given",
              "int_at_least", "parse_with_config", "path", "resolve_data_defaults", "run_argument_parser",
              "show_data_defaults", "not_used_evaluating"),
    "logs": ("MetricsLog", "TrainWindow", "make_accelerator", "setup_console_logging", "setup_logging", "start_trackers"),
    "run_folder": ("RunStop", "running", "stop", "stop_if_preempted", "stop_together"),
    "step": ("StepGuard", "TrainLoop", "accelerator_for", "evaluate_only", "run_length"),
})
