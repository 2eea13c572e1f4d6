"""Launched by tests/test_sampler.py with 2 processes: the batches each rank gets from the grouped sampler in
each epoch, and after skipping the first batch of epoch 2 (a mid-epoch resume)."""

import json
import sys

import torch
from accelerate.utils import gather_object

from detlib.data.sampler import GroupedBatchSampler
from detlib.engine import make_accelerator

out_path = sys.argv[1]
groups = [0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 1]  # 8 landscape, 8 portrait
accelerator = make_accelerator(None, 1, "none", "/tmp", seed=0)
sampler = GroupedBatchSampler(groups, batch_size=2, seed=3)
loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(16)), batch_sampler=sampler))
seen = []
for epoch in range(3):
    loader.set_epoch(epoch)
    seen.append([batch.tolist() for batch in loader])
loader.set_epoch(2)
resumed = [batch.tolist() for batch in accelerator.skip_first_batches(loader, 1)]
per_rank = gather_object([{"rank": accelerator.process_index, "epochs": seen, "resumed": resumed, "len": len(loader)}])
if accelerator.is_main_process:
    with open(out_path, "w") as f:
        json.dump({"num_processes": accelerator.num_processes, "ranks": per_rank, "groups": groups}, f)
accelerator.wait_for_everyone()
accelerator.end_training()
