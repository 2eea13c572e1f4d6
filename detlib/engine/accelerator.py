"""The Accelerator every script runs on (one maker for train, predict and export) and the line that says what it is."""

from __future__ import annotations

import logging
import os

import torch

from .trackers import resolve_trackers

logger = logging.getLogger(__name__)


def make_accelerator(mixed_precision: str | None = None, gradient_accumulation_steps: int = 1,
                     report_to: str = "none", output_dir: str = ".", seed: int = 0, verbose: bool = False,
                     compile_backend: str | None = None, compile_mode: str = "default", cpu: bool = False):
    """The scripts' `Accelerator`: the CPU without CUDA or with `cpu` (DDP over gloo on 2+ processes); seedable
    samplers (epoch e's order a function of (seed, e): disjoint shards, the same after a resume); `mixed_precision`
    None: the accelerate config's; `report_to`'s trackers; `compile_backend`: the prepared model compiled (training
    only: an evaluation runs uncompiled); None: never compiled, whatever the launcher's dynamo settings say."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration, set_seed

    from ..compiling import dynamo_plugin

    accelerator = Accelerator(
        cpu=cpu or not torch.cuda.is_available(), mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps, log_with=resolve_trackers(report_to, verbose) or None,
        project_config=ProjectConfiguration(project_dir=output_dir, logging_dir=os.path.join(output_dir, "tensorboard")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        step_scheduler_with_optimizer=False,
        dynamo_plugin=dynamo_plugin(compile_backend or "no", compile_mode))
    set_seed(seed, device_specific=False)
    return accelerator


def log_run_setup(accelerator) -> None:
    """The process count, device and precision; a warning where accelerate does not apply the precision; a line that
    the first step compiles under --compile."""
    logger.info("%d process(es), device %s, mixed precision %s", accelerator.num_processes, accelerator.device,
                accelerator.mixed_precision)
    plugin = getattr(accelerator.state, "dynamo_plugin", None)
    backend = str(getattr(plugin.backend, "value", plugin.backend)).lower() if plugin is not None else "no"
    if backend != "no":  # the compile is silent, and long: say so before the wait
        logger.info("torch.compile (%s): the first training step compiles the model's forward and backward before the "
                    "first train line (about a minute on a GPU, minutes on a CPU with inductor)", backend)
    asked = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()  # an `accelerate config` with dynamo
    if backend == "no" and asked != "no":
        logger.warning("the accelerate config asks for torch.compile (%s); not applied: this run compiles only with "
                       "--compile (--compile_backend, --compile_mode)", asked)
    if accelerator.mixed_precision != "no" and not accelerator.native_amp:
        logger.warning("mixed precision %s is not applied on %s by accelerate: the run computes in fp32 (bf16 "
                       "autocasts on CPUs)", accelerator.mixed_precision, accelerator.device.type)
