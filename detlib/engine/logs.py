"""The log of a run or a tool: detlib's INFO lines and every library's warnings on the main process (--verbose: all),
the console (stdout on the main process, stderr elsewhere) and the run's train.log.
"""

from __future__ import annotations

import logging
import os
import sys

from ..logtext import escape_unencodable

OWN_LOGGERS = ("detlib", "train_retinanet", "train_catsdogs", "predict_retinanet", "predict_catsdogs",
               "export_retinanet", "check_dataset", "convert_weights", "compare_predictions")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def set_log_levels(is_main: bool = True, verbose: bool = False) -> None:
    """The main process: our INFO lines; the others: our errors (our warnings, alike on every rank, come once)."""
    logging.getLogger().setLevel(logging.INFO if is_main and verbose else logging.WARNING)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if is_main else logging.ERROR)


def setup_console_logging(verbose: bool = False) -> None:
    """The console log of a one-process tool (export, data check)."""
    escape_unencodable()
    logging.basicConfig(format=LOG_FORMAT)  # not force=True: that would remove handlers others attached (caplog)
    set_log_levels(True, verbose)


def setup_logging(output_dir: str, is_main: bool, filename: str = "train.log", verbose: bool = False) -> None:
    """The console (stdout on the main process, stderr elsewhere) and the main process's `output_dir/filename`; a
    record logged with extra={"console": False} goes to the file only (its text is printed elsewhere)."""
    escape_unencodable()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    console.setFormatter(fmt)
    console.addFilter(lambda record: getattr(record, "console", True))
    root.addHandler(console)
    if is_main:
        os.makedirs(output_dir, exist_ok=True)
        file = logging.FileHandler(os.path.join(output_dir, filename), encoding="utf-8")
        file.setFormatter(fmt)
        root.addHandler(file)
    set_log_levels(is_main, verbose)
