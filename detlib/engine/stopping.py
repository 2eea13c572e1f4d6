"""Ending a run before its last epoch, other than by a signal: early stopping and the time budget.

`--early_stopping_patience N`: the scripts ask `stop_early` after each epoch; the run ends as a finished run ends
(best/, last/, the summary, run_status.json "finished" with the reason; the evaluation that ends it is run as the
final one) after N evaluations in a row without a better best. The count is
`TrainState.evals_without_improvement` (`improves_best` keeps it), so it survives a resume.

`--time_limit HH:MM:SS`: the budget is polled at every step boundary (and every 10 evaluation batches) with the
stop signals (`bookkeeping.stop_if_preempted`), and ends the run the way a preemption does (a checkpoint, the line to
resume), with exit 0 and status "time_limit". The run stops while the time left still holds the longest stretch
seen between two polls (a step, or an epoch's end with its evaluation and checkpoint) plus the longest checkpoint
save seen (before the first: what the state's size takes at SAVE_BYTES_PER_S, `expect_save`): nothing can stop the
run between two polls, and the stop's checkpoint must be written before the budget runs out. The budget counts from the start of the launch (`launch_start`).
"""

from __future__ import annotations

import logging
import math
import os
import time

from ..argtypes import duration_seconds

logger = logging.getLogger(__name__)

TIME_LIMIT = "--time_limit"  # the name a time-limit stop has where a preemption has its signal's
# What the stop's checkpoint is given before one has been timed: a ResNet-50 RetinaNet's (0.4 GB with AdamW's state)
# takes 2-10 s on a local disk, a network file system is slower: MIN_SAVE_S plus its bytes at SAVE_BYTES_PER_S (24 s
# for it, 2 s for a test's tiny model, whose run would otherwise stop at its first step under a short budget);
# FIRST_SAVE_S when the size is not known.
FIRST_SAVE_S, MIN_SAVE_S, SAVE_BYTES_PER_S = 30.0, 2.0, 20e6


def stop_early(state, patience: int, metric: str) -> bool:
    """Whether the run ends now for --early_stopping_patience `patience` (0: never): `state.evals_without_improvement`
    reached it. Sets `state.stop_reason` (run_status.json's message) and logs it once."""
    done = patience > 0 and state.evals_without_improvement >= patience
    reason = (f"early stopping: no better {metric} than {state.best_metric:.4f} in the last {patience} evaluation(s) "
              "(--early_stopping_patience)") if done else ""
    if reason and reason != state.stop_reason:
        logger.info("%s: the run ends here", reason)
    state.stop_reason = reason
    return done


class TimeLimit:
    """The budget of one process: `up()` at each poll says whether the run must stop there."""

    def __init__(self, text: str, start: float):
        self.text, self.deadline = text, start + duration_seconds(text)
        self.last_poll, self.longest_gap, self.longest_save, self.first_save = None, 0.0, None, FIRST_SAVE_S

    def note_save(self, seconds: float) -> None:
        self.longest_save = max(self.longest_save or 0.0, seconds)

    def up(self) -> bool:
        now = time.time()
        if self.last_poll is not None:  # the first poll's gap holds the start-up: not a stretch of training
            self.longest_gap = max(self.longest_gap, now - self.last_poll)
        self.last_poll = now
        save = self.first_save if self.longest_save is None else self.longest_save
        return now + self.longest_gap + save >= self.deadline

    def left(self) -> float:
        return self.deadline - time.time()


_limit: list[TimeLimit] = []  # this process's budget, while `running` holds the run


def launch_start() -> float:
    """When the run started (seconds since the epoch): this process's start, or under a launcher (`accelerate launch`
    sets ACCELERATE_MIXED_PRECISION, torchrun LOCAL_RANK) the launcher's, its parent."""
    import psutil

    me = psutil.Process()
    launched = "LOCAL_RANK" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ
    parent = me.parent() if launched else None
    return min(me.create_time(), parent.create_time() if parent is not None else math.inf)


def start_time_limit(text: str | None) -> None:
    """Start this process's budget of `text` ([D-]HH:MM:SS), counted from `launch_start`; None: clear it."""
    _limit[:] = [TimeLimit(text, launch_start())] if text else []


def time_limit_up() -> bool | None:
    """None without a budget, else whether the run must stop now (`TimeLimit.up`)."""
    return _limit[0].up() if _limit else None


def note_save(seconds: float) -> None:
    """A checkpoint save took `seconds` (the stop's own save is given the longest)."""
    if _limit:
        _limit[0].note_save(seconds)


def expect_save(num_bytes: int) -> None:
    """The checkpoint will hold about `num_bytes`: the time kept for a save until one is timed."""
    if _limit:
        _limit[0].first_save = MIN_SAVE_S + num_bytes / SAVE_BYTES_PER_S


def time_limit_line(state, checkpoint: str, where: str) -> str:
    """The stop's line: where it stopped, the checkpoint, how to go on."""
    text, left = (_limit[0].text, _limit[0].left()) if _limit else ("", 0.0)
    return (f"{TIME_LIMIT} {text}: stopped at step {state.global_step} ({where}) with {max(left, 0):.0f} s of the "
            f"budget left: checkpoint {checkpoint} written; to continue, run the same command with "
            "--resume_from_checkpoint latest")


def add_stopping_flags(evaluation, checkpointing) -> None:
    """--early_stopping_patience on the `evaluation` argparse group, --time_limit on the `checkpointing` one."""
    from ..argtypes import int_at_least, time_limit

    evaluation.add_argument("--early_stopping_patience", metavar="N", type=int_at_least(0), default=0, help="end the "
                            "run, as a finished one ends, after N evaluations in a row without a better best (AP, "
                            "accuracy) (0: never)")
    checkpointing.add_argument("--time_limit", metavar="HH:MM:SS", type=time_limit, help="a time budget (a SLURM wall "
                               "time, a spot instance): stop at a step with a checkpoint while there is time to write "
                               "it, exit 0, resume with --resume_from_checkpoint latest; counted from the start of the "
                               "launcher (default: none)")
