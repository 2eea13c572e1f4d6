"""The training run's counters (`TrainState`), trainer_state.json in every checkpoint."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass
class TrainState:
    """The training script's counters, trainer_state.json in every checkpoint.

    epoch: epochs done (the 0-based index of the epoch to run, or of the one in progress if step_in_epoch > 0).
    step_in_epoch, global_step: optimizer steps done in `epoch` and in all (skipped ones included).
    skipped_steps: steps skipped as non-finite (or by the fp16 GradScaler). best_metric: -1 before an evaluation.
    epoch_loss_sum, epoch_steps: the epoch's step losses (means over processes) and their count, so that the epoch
        mean ReduceLROnPlateau steps on covers the whole epoch after a resume.
    eval_pending: the epoch number (from 1) of an evaluation that was running, 0 when none: one preempted is run
        first on resume.
    run_id: the tracker run id, so that a resumed run logs into the same wandb run.
    evals_without_improvement: evaluations in a row since the best one (`improves_best`), for --early_stopping_patience.
    stop_reason: why the run ends before its last epoch (`detlib.engine.stopping.stop_early`), "" otherwise.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    skipped_steps: int = 0
    best_metric: float = -1.0
    epoch_loss_sum: float = 0.0
    epoch_steps: int = 0
    eval_pending: int = 0
    run_id: str | None = None
    evals_without_improvement: int = 0
    stop_reason: str = ""

    def load(self, values: dict) -> None:
        self.__dict__.update({f.name: values[f.name] for f in fields(self) if f.name in values})

    def step_done(self, stepped: bool, loss: float) -> None:
        """Count an optimizer step (`stepped` False: the weights were left as they were) and its `loss`, the mean over
        processes (nan: left out of the epoch's mean)."""
        self.global_step, self.step_in_epoch, self.skipped_steps = (self.global_step + 1, self.step_in_epoch + 1,
                                                                    self.skipped_steps + (not stepped))
        if math.isfinite(loss):
            self.epoch_loss_sum, self.epoch_steps = self.epoch_loss_sum + loss, self.epoch_steps + 1

    def end_epoch(self) -> float:
        """Count the epoch done; returns its mean step loss (the same on every rank)."""
        mean = self.epoch_loss_sum / max(self.epoch_steps, 1)
        self.epoch, self.step_in_epoch, self.epoch_loss_sum, self.epoch_steps = self.epoch + 1, 0, 0.0, 0
        return mean
