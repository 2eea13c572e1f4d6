"""benchmarks/run.py's method: each ratio is the median of paired rounds (ours and the peer back to back) with its
spread, so a regression is told from noise (no timing is asserted: the numbers are the machine's)."""

import importlib.util
import json
import sys

import pytest
from conftest import REPO


def load_run():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("benchmark_run", REPO / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_ratios_are_the_rounds_ratios_with_their_median_and_spread():
    run = load_run()
    r = run.paired_ratios([1.0, 2.0, 3.0, 4.0, 6.0], [2.0, 2.0, 2.0, 2.0, 2.0])
    assert r["ratios"] == [0.5, 1.0, 1.5, 2.0, 3.0] and r["pairs"] == 5
    assert r["ratio"] == 1.5 and (r["ratio_min"], r["ratio_max"]) == (0.5, 3.0)
    assert r["ratio_min"] <= r["ratio_p05"] <= r["ratio"] <= r["ratio_p95"] <= r["ratio_max"]
    # a slow spell that hits both sides of a round moves neither its ratio nor the median
    steady = run.paired_ratios([1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0])
    spell = run.paired_ratios([1.0, 5.0, 1.0, 1.0, 1.0], [2.0, 10.0, 2.0, 2.0, 2.0])
    assert spell["ratio"] == steady["ratio"] == 0.5 and spell["ratio_max"] == 0.5


def test_quick_mode_writes_each_ratio_with_its_spread(tmp_path, capsys):
    """`run.py --quick` on the COCO evaluation row (a few seconds; the model rows take minutes): results.json holds
    the medians, the paired ratio, its spread and the rounds, and the table prints them."""
    run = load_run()
    if not __import__("os").path.isfile(run.COCO_TRAIN_JSON):
        pytest.skip("no ../shared/data/coco_subset")
    out = tmp_path / "results.json"
    run.main(["--quick", "--only", "coco_eval", "--coco_images", "40", "--out", str(out)])
    r = json.loads(out.read_text())["coco_eval"]
    for key in ("ours_s", "peer_s", "ratio", "ratio_min", "ratio_max", "ratio_p05", "ratio_p95", "pairs", "ratios"):
        assert key in r, key
    assert r["pairs"] == len(r["ratios"]) == len(r["all_s"]["ours"]) >= 2
    assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"] and r["stats_identical"]
    assert f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}, {r['pairs']} pairs)" in capsys.readouterr().out
