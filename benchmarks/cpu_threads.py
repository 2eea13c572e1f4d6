"""Threads per training process on a CPU: the built-in RetinaNet run for a few steps, launched the way a
user launches it, with OMP_NUM_THREADS unset (accelerate then picks physical cores / processes) and with
each value given; prints the wall time of each and its ratio to the fastest.

    python benchmarks/cpu_threads.py --steps 15 --threads 1 2
    python benchmarks/cpu_threads.py --busy 2   # the same with 2 busy-loop processes competing for the cores

On a machine shared with other jobs, the threads of one process wait for each other at every parallel
region (OpenMP barriers), so more threads than free cores costs far more than it gains.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

from detlib.engine.flags import HelpFormatter


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spin(stop):
    while not stop.is_set():
        pass


def run_once(threads: str | None, steps: int, config: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as out:
        cmd = ["accelerate", "launch", "--config_file", os.path.join(REPO, "accelerate_configs", config),
               os.path.join(REPO, "scripts", "train_retinanet.py"), "--output_dir", out, "--max_steps", str(steps),
               "--epochs", "1", "--eval_interval", "1", "--report_to", "none", "--num_workers", "1"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
        if proc.returncode != 0:  # a timing of a failed run means nothing: say why, in the run's own error line
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")] or proc.stderr.splitlines()[-1:]
            sys.exit(f"error: the run with OMP_NUM_THREADS={threads} failed (exit {proc.returncode}): "
                     f"{errors[0] if errors else 'no message'}")
        return time.perf_counter() - t0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=15, help="optimizer steps per run (at least 1)")
    p.add_argument("--threads", nargs="+", default=["unset", "1", "2"], help="values of OMP_NUM_THREADS ('unset')")
    p.add_argument("--config", default="cpu.yaml", help="accelerate config in accelerate_configs/")
    p.add_argument("--busy", type=int, default=0, help="busy-loop processes to start first (a shared machine)")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.steps < 1 or args.busy < 0:
        p.error("--steps must be >= 1 and --busy >= 0")
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    try:
        times = {t: run_once(None if t == "unset" else t, args.steps, args.config) for t in args.threads}
    finally:
        stop.set()
    best = min(times.values())
    print(f"{args.steps} steps, {args.config}, {args.busy} busy processes, {os.cpu_count()} logical CPUs")
    for t, s in times.items():
        print(f"  OMP_NUM_THREADS={t:<6} {s:7.1f} s  x{s / best:.2f}")


if __name__ == "__main__":
    sys.exit(main())
