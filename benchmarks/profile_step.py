"""Where the time of one train step (or one inference pass) goes, ours against torchvision's: torch.profiler's
operator table of both kits, side by side, for the setting of `run.py`'s train_step / inference rows.

    python benchmarks/profile_step.py                      # train step, 3 profiled steps of each after a warm-up
    python benchmarks/profile_step.py --mode inference --rows 30

Prints, per operator (aten op, self CPU time summed over the profiled steps, in ms per step), ours, the peer's and the
difference, sorted by the difference: the rows at the top are where our step spends more than torchvision's.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kit import Kit, build_model_pair  # noqa: E402

from detlib.engine.flags import HelpFormatter  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--mode", choices=["train", "inference"], default="train",
                   help="the train step (forward, loss, backward, SGD step) or inference with decoding")
    p.add_argument("--image_size", type=int, default=512, help="square input size in px")
    p.add_argument("--batch_size", type=int, default=2, help="real COCO images per step")
    p.add_argument("--steps", type=int, default=3, help="profiled steps of each kit (after one warm-up step)")
    p.add_argument("--rows", type=int, default=25, help="operators shown")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    p.add_argument("--channels_last", choices=["none", "ours", "peer", "both"], default="none",
                   help="which kit runs in channels_last (default none: both as the scripts run them, NCHW)")
    return p


def self_times_ms(fn, steps: int) -> tuple[dict[str, float], float]:
    """{op name: self CPU ms per step}, and the wall ms per step the profiler saw."""
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    per_op = collections.defaultdict(float)
    for e in prof.key_averages():
        per_op[e.key] += e.self_cpu_time_total / 1000 / steps
    return per_op, sum(per_op.values())


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    models = build_model_pair(args.image_size, args.batch_size)
    ours_model, peer_model, base = models
    train = args.mode == "train"
    kits = {"ours": Kit(copy.deepcopy(ours_model), channels_last=args.channels_last in ("ours", "both")),
            "peer": Kit(copy.deepcopy(peer_model), channels_last=args.channels_last in ("peer", "both"))}
    tables = {}
    for name, kit in kits.items():
        kit.model.train(train)
        batch = kit.batch(base)
        fn = (lambda k=kit, b=batch: k.train_step(b)) if train else (lambda k=kit, b=batch: k.infer(b))
        tables[name] = self_times_ms(fn, args.steps)
    (ours, ours_total), (peer, peer_total) = tables["ours"], tables["peer"]
    ops = sorted(set(ours) | set(peer), key=lambda k: ours.get(k, 0) - peer.get(k, 0), reverse=True)
    print(f"{args.mode}, R50-FPN {args.image_size} px, batch {args.batch_size}, {args.threads} thread(s), "
          f"channels_last: {args.channels_last}, "
          f"{args.steps} profiled steps; self CPU ms per step")
    print(f"{'operator':<44}{'ours':>10}{'peer':>10}{'ours-peer':>11}")
    shown = ops[:args.rows] + [op for op in ops[-8:] if op not in ops[:args.rows]]
    for op in shown:
        o, p = ours.get(op, 0.0), peer.get(op, 0.0)
        print(f"{op[:43]:<44}{o:>10.1f}{p:>10.1f}{o - p:>11.1f}")
    print(f"{'total (self CPU)':<44}{ours_total:>10.1f}{peer_total:>10.1f}{ours_total - peer_total:>11.1f}")


if __name__ == "__main__":
    main()
