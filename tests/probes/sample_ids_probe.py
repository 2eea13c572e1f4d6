"""Launched by tests/test_visualize.py with 1 and 2 processes: the sample of val images each rank would log
at two evaluations (it must not depend on the rank, the process count or the evaluation)."""

import json
import sys

from accelerate.utils import gather_object

from detlib.engine import make_accelerator
from detlib.evaluation.drawing import select_sample_ids

annotations, out_path = sys.argv[1], sys.argv[2]
accelerator = make_accelerator(None, 1, "none", "/tmp", seed=0)
with open(annotations) as f:
    ids = [im["id"] for im in json.load(f)["images"]]
picks = [select_sample_ids(ids, 16, seed=0), select_sample_ids(reversed(ids), 16, seed=0)]
per_rank = gather_object([{"rank": accelerator.process_index, "picks": picks}])
if accelerator.is_main_process:
    with open(out_path, "w") as f:
        json.dump({"num_processes": accelerator.num_processes, "ranks": per_rank}, f)
accelerator.wait_for_everyone()
accelerator.end_training()  # destroys the process group before the processes exit
