"""LR schedules: warmup, multistep milestones, cosine end points."""

import math

import pytest
import torch

from detlib.engine.schedules import build_lr_scheduler, lr_factor


def test_multistep_with_warmup_worked_values():
    f = [lr_factor(s, "multistep", 100, warmup_steps=4, warmup_start=0.001, milestones=[10, 20]) for s in (0, 3, 4, 9, 10, 19, 20, 99)]
    assert f[0] == pytest.approx(0.001 + 0.999 * 0.25)
    assert f[1:] == pytest.approx([1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_cosine_goes_from_one_to_zero_after_warmup():
    assert lr_factor(0, "cosine", 10, warmup_steps=2, warmup_start=0.0) == pytest.approx(0.5)
    assert lr_factor(2, "cosine", 10, warmup_steps=2, warmup_start=0.0) == pytest.approx(1.0)
    assert lr_factor(6, "cosine", 10, warmup_steps=2, warmup_start=0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(10, "cosine", 10, warmup_steps=2) == pytest.approx(0.0)


def test_scheduler_steps_the_optimizer_lr_and_rejects_unknown_kinds():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = build_lr_scheduler(opt, "multistep", 10, milestones=[2])
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 0.5, 0.05, 0.05])
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, "linear", 10)


def test_constant_warms_up_too_and_the_first_step_is_one_step_into_the_ramp():
    f = [lr_factor(s, "constant", 200, warmup_steps=500, warmup_start=0.0) for s in (0, 1, 199)]
    assert f == pytest.approx([1 / 500, 2 / 500, 200 / 500])  # a 200-step run never reaches its LR
    assert lr_factor(3, "constant", 10, warmup_steps=4, warmup_start=0.0) == pytest.approx(1.0)


def test_a_warmup_as_long_as_the_run_is_a_warning_once_at_the_start(caplog):
    from detlib.engine.schedules import RunPosition, build_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    start = RunPosition(steps_per_epoch=20, total_steps=200)
    with caplog.at_level("WARNING", logger="detlib"):
        build_scheduler(opt, "constant", start, epochs=10, max_steps=0, warmup_steps=500)
    (record,) = [r for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert "500" in record.getMessage() and "200 optimizer steps" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="detlib"):
        build_scheduler(opt, "constant", start, epochs=10, max_steps=0, warmup_steps=50)
    assert not [r for r in caplog.records if "warmup_steps" in r.getMessage()]
