"""Distributed behaviour that needs no detection model: sampler shuffling across epochs and ranks (B31)."""

import json
import subprocess
import sys

from conftest import REPO


def test_sampler_reshuffles_each_epoch_with_disjoint_shards_case_b31(tmp_path):
    out = tmp_path / "seen.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu_2proc.yaml"),
           str(REPO / "tests" / "probes" / "sampler_probe.py"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["num_processes"] == 2  # `accelerate launch --cpu --num_processes 2` would start only one
    ranks = sorted(data["ranks"], key=lambda r: r["rank"])
    for epoch in range(3):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert len(a) == len(b) == 4
        assert not set(a) & set(b), "shards overlap within an epoch"
        assert set(a) | set(b) == set(range(8)), "an epoch must cover the data set"
    orders = [tuple(ranks[0]["epochs"][e] + ranks[1]["epochs"][e]) for e in range(3)]
    assert len(set(orders)) == 3, "the order must change between epochs"
