"""The run machinery both training scripts share, one concern a module: `flags` (the shared flags, `--config`),
`run_folder` (the folder, its lock, how a run ends, the preemption signals), `checkpoints` (save, verify, resume,
best/), `step` (the all-reduced decision to take a step), `stopping` (early stopping, the time budget) and `logs`
(the Accelerator, the log, metrics.jsonl, trackers, the summary). The scripts hold the run's state and loop; these are the calls they make.
"""

from ..lazy import lazy_exports

# What the scripts use, by module, loaded on first use: `checkpoints`, `logs` and `run_folder` import torch and
# accelerate, and a script's --help (which needs `flags` only) should not wait for them.
__getattr__, __all__ = lazy_exports(__name__, {
    "checkpoints": ("EMA_WEIGHTS", "TrainState", "best_record", "best_weights", "divergence", "improves_best",
                    "list_checkpoints", "min_over_processes", "resume", "resume_ema", "save_checkpoint", "save_weights"),
    "flags": ("ArgumentParser", "HelpFormatter", "add_tile_flags", "data_defaults_table", "first_process", "float_range",
              "format_given", "int_at_least", "parse_with_config", "path", "resolve_data_defaults", "run_argument_parser",
              "show_data_defaults", "not_used_evaluating"),
    "logs": ("MetricsLog", "TrainWindow", "escape_unencodable", "log_plan", "make_accelerator", "record_config",
             "save_config", "setup_console_logging", "setup_logging", "start_trackers", "summary_lines"),
    "run_folder": ("EXIT_DIVERGED", "EXIT_PREEMPTED", "Preempted", "RunStop", "preempted", "running",
                   "stop", "stop_together", "wait_for_the_first_process"),
    "step": ("StepGuard", "TrainLoop", "accelerator_for", "evaluate_only", "run_length",
             "stop_if_preempted"),
    "stopping": ("stop_early",),
})
