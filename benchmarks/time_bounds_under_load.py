"""Run tests/test_time_bounds.py (the tests whose assertions bound seconds) with the other core busy, as the suite's
second xdist worker keeps it, and print each time measured against its bound.

    python benchmarks/time_bounds_under_load.py [--spinners 1]

A spinner is a process in a busy loop; one stands for the other worker on a 2-core machine. Exit code: pytest's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from detlib.engine.flags import HelpFormatter  # noqa: E402


def spin() -> None:
    while True:
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--spinners", type=int, default=1, help="busy processes beside the tests (default: %(default)s)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.spinners)]
    for p in spinners:
        p.start()
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-s",
                              "tests/test_time_bounds.py"], cwd=REPO, capture_output=True, text=True)
    finally:
        for p in spinners:
            p.kill()
    measured = [ln.split("measured: ", 1)[1] for ln in run.stdout.splitlines() if "measured: " in ln]
    measured += [ln for ln in run.stdout.splitlines() if ln.startswith(("E   ", "FAILED"))][:20]
    print(f"{args.spinners} spinning process(es) beside the tests")
    print("\n".join(measured) or run.stdout[-3000:])
    print(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:])
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
