"""What a training run leaves in best/ and last/ for the people who use the model: the score thresholds that
maximise F1 (predict's --score_thresh best_f1), the model card, the Hub."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from conftest import COCO_SUBSET, REPO, needs_coco_subset, read_metrics

pytestmark = [needs_coco_subset]

TINY = ["--backbone", "resnet18", "--image_size", "64", "--fpn_channels", "16", "--per_device_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--num_workers", "2", "--epochs", "2", "--eval_interval", "1",
        "--lr", "1e-3", "--report_to", "none", "--score_thresh", "0.0", "--num_log_images", "1"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_coco(root: Path, n: int = 4) -> list[str]:
    """The first n val images of the subset as both train and val set (so an evaluation finds something)."""
    d = json.loads((COCO_SUBSET / "annotations" / "instances_val.json").read_text())
    d["images"] = sorted(d["images"], key=lambda im: im["id"])[:n]
    ids = {im["id"] for im in d["images"]}
    d["annotations"] = [a for a in d["annotations"] if a["image_id"] in ids]
    root.mkdir(parents=True, exist_ok=True)
    (root / "set.json").write_text(json.dumps(d))
    images = str(COCO_SUBSET / "images")
    return ["--train_images", images, "--train_annotations", str(root / "set.json"), "--val_images", images,
            "--val_annotations", str(root / "set.json")]


class FakeHub:
    """huggingface_hub.HfApi's network calls, recorded: who am I, create the repo, upload a folder (with the
    files it holds at that moment)."""

    def __init__(self):
        self.calls = []

    def install(self, mp: pytest.MonkeyPatch) -> "FakeHub":
        from types import SimpleNamespace

        from huggingface_hub import HfApi

        def whoami(api, token=None, **kw):
            self.calls.append(("whoami", token))
            return {"name": "someone"}

        def create_repo(api, repo_id, **kw):
            self.calls.append(("create_repo", repo_id, kw.get("private")))
            return SimpleNamespace(repo_id=repo_id)

        def upload_folder(api, *, repo_id, folder_path, **kw):
            self.calls.append(("upload_folder", repo_id, str(folder_path), sorted(p.name for p in Path(folder_path).iterdir())))
            return SimpleNamespace(repo_url=f"https://hub.example/{repo_id}")

        mp.setattr(HfApi, "whoami", whoami)
        mp.setattr(HfApi, "create_repo", create_repo)
        mp.setattr(HfApi, "upload_folder", upload_folder)
        mp.setenv("HF_TOKEN", "hf_not_a_real_token")
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        return self


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A 2-epoch run that pushes best/ to the Hub at the end (the Hub's calls recorded, `FakeHub`)."""
    root = tmp_path_factory.mktemp("tiny_run")
    out = root / "run"
    with pytest.MonkeyPatch.context() as mp:
        hub = FakeHub().install(mp)
        load_script("train_retinanet").main([*tiny_coco(root / "data"), *TINY, "--output_dir", str(out),
                                             "--push_to_hub", "someone/tiny-retinanet", "--hub_private"])
    (out / "hub_calls.json").write_text(json.dumps(hub.calls))
    return out


@pytest.mark.slow
def test_each_evaluation_reports_the_best_f1_threshold_per_class(tiny_run):
    evals = [m for m in read_metrics(tiny_run) if "AP" in m]
    assert len(evals) == 2
    for e in evals:
        best = e["best_f1"]
        assert best["iou"] == 0.5 and set(best["per_class"]) == set(e["per_class"])  # the classes with ground truth
        for v in best["per_class"].values():
            assert set(v) == {"category_id", "score_thresh", "F1", "precision", "recall", "num_gt"}
            assert 0 <= v["F1"] <= 1 and (v["score_thresh"] is None) == (v["F1"] == 0)
        assert "curves" not in best
    found = [v for v in evals[-1]["best_f1"]["per_class"].values() if v["score_thresh"] is not None]
    assert found, "the tiny run should find something at score 0"
    assert (tiny_run / "plots" / "epoch_0002" / "f1_curve.png").is_file()
    curves = json.loads((tiny_run / "plots" / "epoch_0002" / "f1_curve.json").read_text())
    assert curves["per_class"] == evals[-1]["best_f1"]["per_class"] and len(curves["curves"]["all"]) == 101
    # beside the weights: the thresholds of the evaluation of those weights (last/: the final one)
    last = json.loads((tiny_run / "last" / "score_thresholds.json").read_text())
    assert last == {**evals[-1]["best_f1"], "epoch": 2, "step": evals[-1]["step"]}
    best_step = json.loads((tiny_run / "best" / "best.json").read_text())["step"]
    (of_best,) = [e for e in evals if e["step"] == best_step]
    assert json.loads((tiny_run / "best" / "score_thresholds.json").read_text())["per_class"] == of_best["best_f1"]["per_class"]


@pytest.mark.slow
def test_predict_with_score_thresh_best_f1_keeps_each_class_above_its_threshold(tiny_run, tmp_path, capsys):
    weights = tmp_path / "weights"
    shutil.copytree(tiny_run / "last", weights)
    thresholds = json.loads((weights / "score_thresholds.json").read_text())
    predict = load_script("predict_retinanet")
    source = str(COCO_SUBSET / "images" / "000000000790.jpg")
    common = ["--weights", str(weights), "--source", source, "--no_images", "--num_workers", "0"]
    every = predict.main([*common, "--score_thresh", "0", "--output_dir", str(tmp_path / "all")])
    # hand-set thresholds among the highest scores that no other detection shares (an early model ties many low
    # scores, and NMS and the cap of 100 choose among ties by position; how many lead untied depends on the CPU's
    # kernels): the top detection's class its own threshold, then the pooled one alone
    ranked = sorted(every, key=lambda r: -r["score"])
    scores = [r["score"] for r in ranked]
    first_tie = next((k for k in range(1, len(scores)) if scores[k] == scores[k - 1]), len(scores) + 1)
    untied = ranked[:first_tie - 1]
    assert untied, "no detection scores above every tie"
    top_class = untied[0]["category_id"]
    t_class = min(r["score"] for r in untied if r["category_id"] == top_class)
    for t_own, t_pooled in ((t_class, 1.0), (None, untied[-1]["score"])):
        thresholds["per_class"] = {} if t_own is None else {"top": {**next(iter(thresholds["per_class"].values())),
                                                                    "category_id": top_class, "score_thresh": t_own}}
        thresholds["all"]["score_thresh"] = t_pooled
        (weights / "score_thresholds.json").write_text(json.dumps(thresholds))
        kept = predict.main([*common, "--score_thresh", "best_f1", "--output_dir", str(tmp_path / "best")])
        expected = [r for r in every if r["score"] >= (t_own if r["category_id"] == top_class and t_own else t_pooled)]
        assert kept == expected and 0 < len(kept) < len(every)
    # no thresholds beside the weights: one line naming the file
    (weights / "score_thresholds.json").unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # engine.stop: the line on stderr, exit 1
        predict.main([*common, "--score_thresh", "best_f1", "--output_dir", str(tmp_path / "none")])
    assert e.value.code == 1
    assert "--score_thresh best_f1: no score_thresholds.json beside the weights" in capsys.readouterr().err


# ---- model cards


def card_results(path: Path) -> dict[str, float]:
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)
    return {r.metric_type: r.metric_value for r in card.data.eval_results}


@pytest.mark.slow
def test_model_cards_parse_back_with_huggingface_hub_and_hold_the_metrics_jsonl_numbers(tiny_run):
    from huggingface_hub import metadata_load

    evals = [m for m in read_metrics(tiny_run) if "AP" in m]
    best_step = json.loads((tiny_run / "best" / "best.json").read_text())["step"]
    config = json.loads((tiny_run / "best" / "model_config.json").read_text())
    for name, evaluation in (("best", next(e for e in evals if e["step"] == best_step)), ("last", evals[-1])):
        meta = metadata_load(tiny_run / name / "README.md")
        assert meta["library_name"] == "detlib" and meta["pipeline_tag"] == "object-detection"
        assert {"object-detection", "retinanet", "resnet18"} <= set(meta["tags"]) and meta["datasets"] == ["set"]
        assert meta["classes"] == config["category_names"] and meta["category_ids"] == config["category_ids"]
        results = card_results(tiny_run / name / "README.md")
        for k in ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl"):
            assert results[k] == evaluation[k]  # the same float, not a rounded copy
        pooled = evaluation["best_f1"]["all"]
        assert results["best_f1"] == pooled["F1"] and results["best_recall"] == pooled["recall"]
        text = (tiny_run / name / "README.md").read_text()
        assert f"epoch {evaluation['epoch']}, step {evaluation['step']}" in text
        assert "accelerate launch scripts/train_retinanet.py --train_images" in text and "--push_to_hub" in text
        where = "someone/tiny-retinanet" if name == "best" else str(tiny_run / name)
        assert f"predict_retinanet.py --weights {where} --source photos/ --output_dir out --score_thresh best_f1" in text
        assert f"export_retinanet.py --weights {where}" in text


@pytest.mark.slow
def test_convert_weights_writes_a_model_card(tmp_path):
    import torch
    from huggingface_hub import ModelCard
    from torchvision.models.detection import retinanet_resnet50_fpn

    from detlib.retinanet.torchvision_weights import torchvision_coco_categories

    _, names = torchvision_coco_categories()
    torch.manual_seed(0)
    torch.save(retinanet_resnet50_fpn(weights=None, weights_backbone=None).state_dict(), tmp_path / "tv.pth")
    load_script("convert_weights").main(["--from", "torchvision", str(tmp_path / "tv.pth"), "--out", str(tmp_path / "w")])
    card = ModelCard.load(tmp_path / "w" / "README.md")
    assert card.data.library_name == "detlib" and card.data.classes == names and card.data.eval_results is None
    assert "torchvision" in card.text and "Not evaluated" in card.text


# ---- the Hub


@pytest.mark.slow
def test_push_to_hub_checks_at_start_and_uploads_best_at_the_end(tiny_run):
    calls = json.loads((tiny_run / "hub_calls.json").read_text())
    assert [c[0] for c in calls] == ["whoami", "create_repo", "create_repo", "upload_folder"]
    assert calls[1] == ["create_repo", "someone/tiny-retinanet", True]
    upload = calls[-1]
    assert upload[1] == "someone/tiny-retinanet" and upload[2] == str(tiny_run / "best")
    assert upload[3] == ["README.md", "best.json", "model.safetensors", "model_config.json", "score_thresholds.json"]
    log = (tiny_run / "train.log").read_text()
    # the check comes before the first training step, the upload after the last
    assert log.index("the Hub is reachable") < log.index("epoch 1: mean loss") < log.index("--push_to_hub: uploaded")


def test_push_to_hub_without_network_or_token_stops_at_start_in_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub

    from conftest import traceback_through_our_code

    data = tiny_coco(tmp_path / "data", n=2)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # a closed port: no traffic out
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for env, expected in (({"HF_TOKEN": "hf_not_a_real_token"}, "the Hub at http://127.0.0.1:9 cannot be reached"),
                          ({"HF_TOKEN": ""}, "no Hugging Face token"),
                          ({"HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set")):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
        out = tmp_path / f"run_{len(expected)}"
        with pytest.raises(SystemExit) as e:
            load_script("train_retinanet").main([*data, *TINY, "--output_dir", str(out), "--push_to_hub", "someone/x"])
        assert e.value.code == 1
        err = capsys.readouterr().err
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert line.startswith("error: --push_to_hub someone/x: ") and expected in line, line
        assert not traceback_through_our_code(err)
        assert not (out / "metrics.jsonl").exists() or "loss" not in (out / "metrics.jsonl").read_text()
        assert json.loads((out / "run_status.json").read_text())["status"] == "failed"
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def fake_hub_cache(root: Path, repo_id: str, folder: Path, revision: str = "main") -> Path:
    """A Hub cache holding one snapshot of `repo_id` with the files of `folder`, in huggingface_hub's layout
    (models--owner--name/refs/<revision> -> commit, snapshots/<commit>/<files>)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / revision).write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    return root


@pytest.mark.slow
def test_hub_repo_ids_resolve_from_the_cache_offline(tiny_run, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    cache = fake_hub_cache(tmp_path / "hub", "someone/cached-retinanet", tiny_run / "best")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = str(COCO_SUBSET / "images" / "000000000790.jpg")
    predict = load_script("predict_retinanet")
    common = ["--source", source, "--no_images", "--num_workers", "0", "--score_thresh", "best_f1"]
    from_hub = predict.main(["--weights", "someone/cached-retinanet", *common, "--output_dir", str(tmp_path / "p1")])
    local = predict.main(["--weights", str(tiny_run / "best"), *common, "--output_dir", str(tmp_path / "p2")])
    assert from_hub == local
    # --evaluate_only and --init_from take it too; one not in the cache is one line before any work
    stats = load_script("train_retinanet").main([*tiny_coco(tmp_path / "data"), *TINY, "--evaluate_only",
                                                 "someone/cached-retinanet", "--output_dir", str(tmp_path / "ev")])
    best_step = json.loads((tiny_run / "best" / "best.json").read_text())["step"]
    (best,) = [m for m in read_metrics(tiny_run) if "AP" in m and m["step"] == best_step]
    assert stats["AP"] == best["AP"]
    capsys.readouterr()
    for flag in ("--init_from", "--evaluate_only"):
        with pytest.raises(SystemExit) as e:
            load_script("train_retinanet").main([*tiny_coco(tmp_path / "data"), *TINY, flag, "someone/not-cached",
                                                 "--output_dir", str(tmp_path / "nc")])
        assert e.value.code == 1
        err = capsys.readouterr().err
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert line.startswith(f"error: {flag} someone/not-cached: no local file or folder someone/not-cached")
        assert "HF_HUB_OFFLINE is set and it is not in the Hub cache" in line
        assert not (tmp_path / "nc").exists()  # stopped before the run folder


@pytest.mark.slow
def test_classifier_runs_write_model_cards_too(tmp_path):
    from huggingface_hub import ModelCard

    from conftest import SHARED_DATA

    cats = SHARED_DATA / "catsdogs"
    if not (cats / "train" / "cat").is_dir():
        pytest.skip("../shared/data/catsdogs is not present")
    for split, n in (("train", 4), ("val", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / "pets" / split / cls).mkdir(parents=True)
            for p in sorted((cats / split / cls).glob("*.jpg"))[:n]:
                shutil.copy(p, tmp_path / "pets" / split / cls / p.name)
    out = tmp_path / "run"
    load_script("train_catsdogs").main(["--train_dir", str(tmp_path / "pets" / "train"), "--val_dir",
                                        str(tmp_path / "pets" / "val"), "--output_dir", str(out), "--report_to", "none",
                                        "--num_workers", "0", "--image_size", "16", "--epochs", "1",
                                        "--verify_images", "header"])
    (evaluation,) = [m for m in read_metrics(out) if "val_accuracy" in m]
    for name in ("best", "last"):
        card = ModelCard.load(out / name / "README.md")
        assert card.data.library_name == "detlib" and card.data.pipeline_tag == "image-classification"
        assert card.data.classes == ["cat", "dog"] and card.data.datasets == ["pets"]
        assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {
            "accuracy": evaluation["val_accuracy"], "loss": evaluation["val_loss"]}
        assert "scripts/train_catsdogs.py --train_dir" in card.text
