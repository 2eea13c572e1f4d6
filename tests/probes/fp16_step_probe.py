"""Launched by tests/test_mixed_precision.py with 2 processes: the fp16 training step on a CPU, through the
scripts' own step (clip, `StepGuard.check`, `optimizer.step()`, the train line, as in scripts/train_*.py).

accelerate runs `mixed_precision: fp16` on a CPU in fp32 (no autocast, no GradScaler), so the probe switches
on `torch.autocast("cpu", torch.float16)` and `torch.amp.GradScaler("cpu")` with tests/helpers.py's enable_cpu_fp16.
At step INF_STEP rank 1 alone gets an inf gradient (a hook on the class logits); the gradients are all-reduced,
so every rank's GradScaler sees it. The probe records per rank and step: the scale before and after, whether the
weights changed and by how much, the unscaled gradient norm computed here from the scaled gradients, and the class head's output
dtype inside the forward. The run's metrics.jsonl (log_interval 1) carries what the guard logged.

argv: OUTPUT_DIR RESULT_JSON
"""

import json
import sys

import torch
from accelerate.utils import gather_object

from detlib.engine import MetricsLog, StepGuard, TrainState, TrainWindow, make_accelerator, running
from detlib.retinanet.model import RetinaNet
from helpers import enable_cpu_fp16

INF_STEP = 2  # 1-based optimizer step whose gradient rank 1 makes inf
STEPS = 4
SIZE = 128  # not 64: at 64 px P6 is 1x1, where PyTorch's CPU half-precision conv kernels have misbehaved


def batches() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(2 * STEPS):  # one image per rank and step
        x0, y0 = (torch.rand(2, generator=g) * 60).tolist()
        items.append({"image": torch.randint(0, 255, (3, SIZE, SIZE), dtype=torch.uint8, generator=g),
                      "boxes": torch.tensor([[x0, y0, x0 + 48, y0 + 40]]), "labels": torch.tensor([i % 3])})
    return items


def collate(samples: list[dict]) -> dict:
    return {"images": torch.stack([s["image"] for s in samples]), "boxes": torch.stack([s["boxes"] for s in samples]),
            "labels": torch.stack([s["labels"] for s in samples])}


def main():
    out_dir, result_path = sys.argv[1], sys.argv[2]
    acc = make_accelerator("fp16", output_dir=out_dir)
    enable_cpu_fp16(acc)
    state = TrainState()
    with running(acc, out_dir, state):
        from detlib.retinanet.anchors import AnchorGenerator
        from detlib.retinanet.loss import retinanet_loss

        torch.manual_seed(0)
        model = RetinaNet(3, "resnet18", fpn_channels=16, freeze_backbone_bn=False)
        head_dtypes = []
        model.cls_head.register_forward_hook(lambda m, i, o: head_dtypes.append(str(o.dtype)))
        # plain SGD at lr 1: a step moves the weights by exactly the clipped gradient, so its norm shows whether the
        # clipping saw the unscaled gradient (0.1, --max_grad_norm) or the scaled one
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        loader = torch.utils.data.DataLoader(batches(), batch_size=1, shuffle=False, collate_fn=collate)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
        guard, window, metrics = StepGuard(acc, 5), TrainWindow(acc), MetricsLog(acc, out_dir)
        anchor_gen = AnchorGenerator()
        params = [q for q in model.parameters() if q.requires_grad]
        steps = []
        for batch in loader:
            step = state.global_step + 1
            guard.snapshot(model)
            with acc.accumulate(model):
                out = model(batch["images"])
                if step == INF_STEP and acc.process_index == 1:
                    out["cls_logits"].register_hook(lambda g: torch.full_like(g, float("inf")))
                anchors, _ = anchor_gen(SIZE, SIZE, device=acc.device)
                losses = retinanet_loss(out["cls_logits"], out["box_deltas"], anchors, batch["boxes"], batch["labels"])
                acc.backward(losses["loss"])
                scale = float(acc.scaler.get_scale())
                norm = float(torch.linalg.vector_norm(torch.stack([q.grad.double().norm() for q in params]))) / scale
                before = torch.cat([q.detach().double().flatten() for q in params]).clone()
                window.add({"loss": losses["loss"]}, 1)
                grad_norm = acc.clip_grad_norm_(model.parameters(), 0.1)
                finite = guard.check(losses["loss"], grad_norm, step, 1.0)
                if finite or acc.scaler is not None:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.step_done(finite and not acc.optimizer_step_was_skipped, guard.loss)
                window.log(metrics, state, [1.0], guard.grad_norm, STEPS)
                after = torch.cat([q.detach().double().flatten() for q in params])
            steps.append({"step": step, "scale_before": scale, "scale_after": float(acc.scaler.get_scale()),
                          "changed": bool((before != after).any()), "unscaled_norm": norm,
                          "update_norm": float((after - before).norm()), "loss": float(losses["loss"].detach()),
                          "loss_dtype": str(losses["loss"].dtype),
                          "output_dtype": str(out["cls_logits"].dtype)})
        per_rank = gather_object([{"rank": acc.process_index, "steps": steps, "head_dtypes": sorted(set(head_dtypes)),
                                   "scaler": f"{type(acc.scaler).__module__}.{type(acc.scaler).__name__}",
                                   "skipped_steps": state.skipped_steps,
                                   "param_dtypes": sorted({str(q.dtype) for q in params})}])
        if acc.is_main_process:
            with open(result_path, "w") as f:
                json.dump({"num_processes": acc.num_processes, "ranks": per_rank}, f)

if __name__ == "__main__":
    main()
