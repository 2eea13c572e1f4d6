"""Launched by tests/test_balanced_sampling.py with 2 processes: the batches each rank gets in each epoch from the
repeat factor sampler (in aspect-grouped batches) and from the class-balanced sampler (plain batches), and after
skipping the first batch of epoch 2 (a mid-epoch resume)."""

import json
import sys

import torch
from accelerate.utils import gather_object

from detlib.data.balanced import ClassBalancedSampler, RepeatFactorSampler
from detlib.data.sampler import GroupedBatchSampler
from detlib.engine import make_accelerator

out_path, setup = sys.argv[1], json.loads(sys.argv[2])
accelerator = make_accelerator(None, 1, "none", "/tmp", seed=0)
repeat = RepeatFactorSampler(setup["factors"], seed=setup["seed"])
balanced = ClassBalancedSampler(setup["labels"], seed=setup["seed"])
n = len(setup["factors"])
loaders = {  # the data sets give back the keys they are asked for
    "repeat_factor": torch.utils.data.DataLoader(range(n * 8), batch_sampler=GroupedBatchSampler(
        setup["groups"], setup["batch_size"], drop_last=True, sampler=repeat)),
    "class_balanced": torch.utils.data.DataLoader(range(len(setup["labels"]) ** 2), batch_size=setup["batch_size"],
                                                  sampler=balanced, drop_last=True),
}
seen = {}
for name, loader in loaders.items():
    loader = accelerator.prepare(loader)
    epochs = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        epochs.append([batch.tolist() for batch in loader])
    loader.set_epoch(2)
    resumed = [batch.tolist() for batch in accelerator.skip_first_batches(loader, 1)]
    seen[name] = {"epochs": epochs, "resumed": resumed, "len": len(loader)}
per_rank = gather_object([{"rank": accelerator.process_index, **seen}])
if accelerator.is_main_process:
    with open(out_path, "w") as f:
        json.dump({"num_processes": accelerator.num_processes, "ranks": per_rank}, f)
accelerator.wait_for_everyone()
accelerator.end_training()
