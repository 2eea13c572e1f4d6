"""benchmarks/gpu_report.py: the GPU check's table from whatever the check left (no GPU needed)."""

import importlib.util
import json

from conftest import REPO


def load_report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPO / "benchmarks" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_report_table_from_partial_results(tmp_path):
    """Every row is there whatever ran: measured values, an out-of-memory, a stage skipped past its deadline,
    the overfit verdict against the seed-to-seed noise, and the published figures beside the rows."""
    report = load_report()
    r = lambda v, peak=10.0: {"images_per_s": v, "peak_memory_gib": peak, "warmup_s": 3.0}  # noqa: E731
    (tmp_path / "gpu_results.json").write_text(json.dumps({
        "device": "NVIDIA H200", "torch": "2.x", "batch_size": 16, "steps": 10, "data": "COCO subset",
        "train": {"800x800": {"detlib": {"bf16": r(200.0), "fp32": r(80.0), "fp16": r(190.0)},
                              "torchvision": {"bf16": r(100.0), "fp32": r(60.0), "fp16": {"error": "out of memory"}}},
                  "800x1333": {"detlib": {"bf16": r(120.0)}, "torchvision": {"bf16": r(70.0)}}},
        "detlib_nchw_bf16": r(160.0), "loader": {"images_per_s": 900.0, "workers": 16, "size": "800/1333"},
        "compiled_bf16": {"800x800": {**r(250.0), "backend": "inductor", "graphs": 1}},
        "syncs_per_train_step_bf16": 0, "skipped": ["compiled 800x1333 bf16"]}))
    for name, ap in (("fp32", 0.80), ("fp32_seed1", 0.77), ("bf16", 0.79)):
        (tmp_path / f"overfit_{name}.json").write_text(json.dumps({"AP": ap, "steps": 200, "image_size": 320, "data": "COCO subset"}))
    text = report.table(str(tmp_path))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 200.0 img/s | 100.0 img/s | 2.00x | 10.0 GiB | MLPerf" in rows["train 800x800, bf16"]
    assert "- (out of memory)" in rows["train 800x800, fp16"]
    assert "- (not run)" in rows["train 800x1333, fp32"] and "7.0 img/s per 2080 Ti" in rows["train 800x1333, fp32"]
    assert "channels_last / NCHW 1.25x" in rows["channels_last: detlib 800x800 bf16 in NCHW"]
    assert "compiled / eager 1.25x" in rows["torch.compile (inductor): detlib 800x800 bf16"]
    assert "4.5x the eager bf16 800x800 rate" in rows["data loader, 16 workers, 800/1333 flip_crop_translate + collate"]
    (fit,) = [v for k, v in rows.items() if k.startswith("overfit")]
    assert "bf16 - fp32 = -0.010" in fit and "equal within noise (noise 0.030)" in fit
    assert "Skipped past the deadline: compiled 800x1333 bf16." in text
    assert report.table(str(tmp_path / "nothing")).count("- (not run)") >= 6  # an empty folder: all dashes


def test_tensorrt_row_is_skipped_in_one_line_without_a_gpu(tmp_path):
    import shutil
    import subprocess
    import sys

    import pytest

    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        pytest.skip("a GPU is here: the row runs")
    repo = REPO
    r = subprocess.run([sys.executable, "benchmarks/tensorrt_row.py", "--out", str(tmp_path / "tensorrt.md")], cwd=repo,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.splitlines() == ["TensorRT row skipped: no CUDA GPU (nvidia-smi finds none)"]
    assert not (tmp_path / "tensorrt.md").exists()
    # gpu_check.sh's step 5 runs it, within the check's budget
    script = (repo / "benchmarks" / "gpu_check.sh").read_text()
    assert 'step tensorrt $T_TRT "$PY" benchmarks/tensorrt_row.py --out "$RESULTS/tensorrt.md"' in script


def test_update_prints_each_measured_row_once_and_rewrites_the_table(tmp_path, capsys):
    """gpu_check.sh streams the table: after each step `update` prints the rows measured since the last call (a
    device call killed at its limit returns nothing, so what was printed before is what survives) and rewrites the
    table file; rows still waiting for their measurement are not printed."""
    report = load_report()
    table_md = tmp_path / "out" / "gpu_table.md"
    table_md.parent.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    r = {"images_per_s": 100.0, "peak_memory_gib": 5.0, "warmup_s": 1.0}
    results = {"device": "NVIDIA H200", "train": {"800x800": {"detlib": {"bf16": r}}}}
    (work / "gpu_results.json").write_text(json.dumps(results))
    assert report.update(str(work), str(table_md)) == []  # the peer's half of the row is not measured yet
    results["train"]["800x800"]["torchvision"] = {"bf16": {**r, "images_per_s": 50.0}}
    (work / "gpu_results.json").write_text(json.dumps(results))
    (first,) = report.update(str(work), str(table_md))
    assert first.startswith("| train 800x800, bf16 | 100.0 img/s | 50.0 img/s | 2.00x |")
    assert capsys.readouterr().out.splitlines() == [first]
    assert report.update(str(work), str(table_md)) == []  # printed once
    assert first in table_md.read_text() and "- (not run)" in table_md.read_text()  # the whole table, dashes included
