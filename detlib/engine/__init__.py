"""The run machinery both training scripts share, one concern a module, imported one way (bottom first):

    exits          exit codes, RunStop, the one exit with a line (`stop`), printed once on N processes
    flags          the shared flags, config.yaml written and read back (--config)
    stopping       early stopping and the time budget
    signals        the stop signals (training and predict)
    logs           the console and train.log
    trackers       tensorboard / wandb and metrics.jsonl
    accelerator    the one Accelerator maker
    train_state    the run's counters (trainer_state.json)
    checkpoints    save, verify, resume; the last good checkpoint
    model_folders  best/, last/, last_ema/
    run_folder     the folder's checks, its lock, run_status.json
    run            `running`: a run from its start-up checks to its last line
    run_log        config.yaml and the trackers at the start, the plan line, the summary
    bookkeeping    at each step boundary: the finite check, the train line, `step_done`, the stop poll

The scripts hold the run's state, its epoch loop and its step; these are the calls they make.
"""

from ..lazy import lazy_exports

# What the scripts use, by module, loaded on first use: most import torch and accelerate, and a script's --help
# (which needs `flags` only) should not wait for them.
__getattr__, __all__ = lazy_exports(__name__, {
    "accelerator": ("make_accelerator",),
    "bookkeeping": ("Preempted", "StepGuard", "TrainWindow", "run_length", "step_done", "stop_if_preempted"),
    "checkpoints": ("resume", "save_checkpoint"),
    "exits": ("EXIT_PREEMPTED", "RunStop", "stop", "stop_together"),
    "flags": ("ArgumentParser", "HelpFormatter", "data_defaults_table", "float_range", "format_given", "int_at_least",
              "not_used_evaluating", "parse_with_config", "path", "resolve_data_defaults", "run_argument_parser",
              "show_data_defaults"),
    "logs": ("setup_console_logging", "setup_logging"),
    "model_folders": ("finish_run", "keep_best"),
    "run": ("running",),
    "run_log": ("log_plan", "log_summary", "start_run"),
    "stopping": ("stop_early",),
    "trackers": ("MetricsLog", "start_trackers"),
    "train_state": ("TrainState",),
})
