"""The two collectives the run machinery needs beyond accelerate's `reduce` / `gather`, each a plain return on
one process (no process group there to call)."""

from __future__ import annotations

import torch


def broadcast_object(accelerator, obj):
    """The main process's `obj` (any picklable value) on every process. Collective."""
    from accelerate.utils import broadcast_object_list

    if accelerator.num_processes == 1:
        return obj
    box = [obj]
    broadcast_object_list(box)
    return box[0]


def min_over_processes(accelerator, value: int) -> int:
    """The smallest of every process's `value`, e.g. a 0/1 flag that must hold on all of them. Collective."""
    if accelerator.num_processes == 1:
        return int(value)
    return int(accelerator.gather(torch.tensor([float(value)], device=accelerator.device)).min())
