"""The training scripts' LR schedules (built in the scripts beside the optimizer): warm-up, multistep milestones,
cosine end points."""

import math
from types import SimpleNamespace

import pytest
import torch

from detlib.schedules import lr_factor
from helpers import load_script

retinanet = load_script("train_retinanet")
WARM = retinanet.WARMUP_START  # the detector's warm-up starts at 1/1000, the classifier's at 0


def test_multistep_with_warmup_worked_values():
    f = [lr_factor(s, "multistep", 100, warmup_steps=4, milestones=[10, 20], warmup_start=WARM) for s in (0, 3, 4, 9, 10, 19, 20, 99)]
    assert f[0] == pytest.approx(0.001 + 0.999 * 0.25)
    assert f[1:] == pytest.approx([1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_cosine_goes_from_one_to_zero_after_warmup():
    assert lr_factor(0, "cosine", 10, warmup_steps=2, warmup_start=WARM) == pytest.approx(0.001 + 0.999 * 0.5)
    assert lr_factor(2, "cosine", 10, warmup_steps=2, warmup_start=WARM) == pytest.approx(1.0)
    assert lr_factor(6, "cosine", 10, warmup_steps=2, warmup_start=WARM) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(10, "cosine", 10, warmup_steps=2, warmup_start=WARM) == pytest.approx(0.0)
    # the classifier's: from 0, then the half cosine
    assert [lr_factor(s, "cosine", 10, 2) for s in (0, 1, 2, 6, 10)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 2)), 0.0])


def test_the_scheduler_steps_the_optimizer_lr_per_step_and_plateau_per_epoch():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    args = SimpleNamespace(lr_scheduler="multistep", plateau_patience=3, warmup_steps=0, lr_steps=[1])
    sched = retinanet.build_scheduler(opt, args, steps_per_epoch=2, total_steps=10)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 0.5, 0.05, 0.05])  # epoch 1 ends after 2 steps
    plateau = retinanet.build_scheduler(opt, SimpleNamespace(**{**vars(args), "lr_scheduler": "plateau"}), 2, 10)
    assert isinstance(plateau, torch.optim.lr_scheduler.ReduceLROnPlateau) and plateau.patience == 3


def test_constant_warms_up_too_and_the_first_step_is_one_step_into_the_ramp():
    f = [lr_factor(s, "constant", 200, warmup_steps=500, warmup_start=WARM) for s in (0, 1, 199)]
    assert f == pytest.approx([0.001 + 0.999 / 500, 0.001 + 0.999 * 2 / 500, 0.001 + 0.999 * 200 / 500])
    assert lr_factor(3, "constant", 10, warmup_steps=4, warmup_start=WARM) == pytest.approx(1.0)


def test_a_warmup_as_long_as_the_run_is_a_warning(caplog):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    args = SimpleNamespace(lr_scheduler="constant", plateau_patience=3, warmup_steps=500, lr_steps=[8])
    retinanet.build_scheduler(opt, args, steps_per_epoch=20, total_steps=200)
    (record,) = [r for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert "500" in record.getMessage() and "200 optimizer steps" in record.getMessage()
    caplog.clear()
    retinanet.build_scheduler(opt, SimpleNamespace(**{**vars(args), "warmup_steps": 50}), 20, 200)
    assert not [r for r in caplog.records if "warmup_steps" in r.getMessage()]
