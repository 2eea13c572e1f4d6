"""Issue 29, item 5: scripts/compare_predictions.py on two predictions files of the real val set."""

from __future__ import annotations

import json
import sys

import pytest

from detlib.evaluation.coco import evaluate_coco

from conftest import COCO_SUBSET, REPO, needs_coco_subset

sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))
from coco_eval_cases import model_like_detections, real_json  # noqa: E402
import compare_predictions  # noqa: E402


@needs_coco_subset
def test_compare_two_predictions_files(tmp_path, capsys):
    gt = real_json("val")
    a = model_like_detections(gt, seed=0)
    n_fp = 20 * len(gt["images"])
    b = a[:-n_fp] + [dict(r, score=r["score"] * 0.5) for r in a[-n_fp:]]  # background boxes scored lower: better
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    argv = ["--annotations", str(COCO_SUBSET / "annotations" / "instances_val.json"), "--a", str(tmp_path / "a.json"),
            "--b", str(tmp_path / "b.json"), "--n_bootstrap", "30", "--out", str(tmp_path / "cmp.json")]
    c = compare_predictions.main(argv)
    out = capsys.readouterr().out
    sa, sb = evaluate_coco(gt, a)[0], evaluate_coco(gt, b)[0]
    assert c["AP"]["A"] == sa["AP"] and c["AP"]["B"] == sb["AP"] and c["AP"]["delta"] > 0
    assert c["AP"]["prob_b_better"] > 0.9 and c["num_images"] == 30
    assert f"B - A {sb['AP'] - sa['AP']:+.4f}" in out
    assert json.loads((tmp_path / "cmp.json").read_text()) == json.loads(json.dumps(c))
    assert compare_predictions.main(argv) == c  # the seed repeats it
    with pytest.raises(SystemExit) as e:
        compare_predictions.main(argv[:2] + ["--a", str(tmp_path / "missing.json")] + argv[4:])
    assert e.value.code == 1
