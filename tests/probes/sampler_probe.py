"""Launched by tests/test_distributed.py with 2 processes: which items each rank sees in each epoch (B31).

Uses the same Accelerator set-up as the training scripts (detlib.runtime.make_accelerator).
"""

import json
import sys

import torch
from accelerate.utils import gather_object

from detlib.runtime import make_accelerator

out_path = sys.argv[1]
accelerator = make_accelerator(None, 1, "none", "/tmp", seed=0)
loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True))
seen = []
for epoch in range(3):
    loader.set_epoch(epoch)
    seen.append([int(i) for batch in loader for i in batch])
per_rank = gather_object([{"rank": accelerator.process_index, "epochs": seen}])
if accelerator.is_main_process:
    with open(out_path, "w") as f:
        json.dump({"num_processes": accelerator.num_processes, "ranks": per_rank}, f)
accelerator.wait_for_everyone()
accelerator.end_training()  # destroys the process group before the processes exit (else gloo may abort at exit)
