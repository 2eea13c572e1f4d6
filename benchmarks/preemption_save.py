"""How long the preemption checkpoint takes: a RetinaNet run gets SIGTERM after its first logged step, and
this prints the save time the run logged (torchrun kills workers ~30 s after forwarding SIGTERM, so this must
stay well below that on the cluster's file system).

    python benchmarks/preemption_save.py                      # ResNet-50, 256-channel head, AdamW, 1 process
    python benchmarks/preemption_save.py --config cpu_2proc.yaml --backbone resnet18 --fpn_channels 64

Runs on the built-in synthetic data set (generated once into ~/.cache/detlib), 160 px, batch 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from detlib.engine.flags import HelpFormatter

REPO = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--config", default="cpu.yaml", help="accelerate config in accelerate_configs/")
    p.add_argument("--backbone", default="resnet50", help="timm backbone of the model checkpointed")
    p.add_argument("--fpn_channels", default="256", help="FPN and head width")
    return p


def main() -> None:
    args = build_parser().parse_args()
    out = Path(tempfile.mkdtemp(prefix="preempt_")) / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / args.config),
           str(REPO / "scripts" / "train_retinanet.py"), "--backbone", args.backbone, "--fpn_channels", args.fpn_channels,
           "--image_size", "160", "--per_device_batch_size", "2", "--num_workers", "0", "--log_interval", "1",
           "--report_to", "none", "--output_dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    while not (out / "metrics.jsonl").is_file():
        if proc.poll() is not None:
            sys.exit(proc.stdout.read()[-3000:])
        time.sleep(0.2)
    t = time.time()
    os.kill(proc.pid, signal.SIGTERM)  # to the launcher, as a scheduler would
    text = proc.communicate(timeout=600)[0]
    wall = time.time() - t
    m = re.search(r"written in ([\d.]+) s", text)
    status = json.loads((out / "run_status.json").read_text())
    size = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file())
    print(f"{args.backbone}/{args.fpn_channels}, {args.config}: status {status['status']} at step {status['global_step']}, "
          f"checkpoint {size / 2**20:.0f} MiB written in {m.group(1) if m else '?'} s; "
          f"SIGTERM to exit of the launcher {wall:.1f} s")


if __name__ == "__main__":
    main()
