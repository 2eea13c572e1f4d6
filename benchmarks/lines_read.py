"""How much of detlib/ one training run reads: the lines a short run of each training script executes, and the
lines of the functions it enters (what a reader following the run from main() meets), against detlib/'s size.

    python benchmarks/lines_read.py            # a 2-step built-in run of each script, each in its own process

The README's claim about reading detlib is this script's output. Lines are source lines (comments and docstrings
inside an entered function count, as a reader reads them); a module's top level counts as entered when imported.
"""

from __future__ import annotations

import ast
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "detlib"


def function_spans(path: Path) -> dict[int, int]:
    """First line of each function (its `def`, or its first decorator) -> its last line."""
    spans = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            spans[node.lineno] = node.end_lineno
            for d in node.decorator_list:
                spans[d.lineno] = node.end_lineno
    return spans


def traced_run(script: str, argv: list[str]) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """Run scripts/<script>.py's main(argv) here: (the lines of detlib/ it executed, the first lines of the functions
    it entered), by file."""
    import importlib.util

    executed: dict[str, set[int]] = defaultdict(set)
    entered: dict[str, set[int]] = defaultdict(set)
    library = str(LIBRARY)

    def local(frame, event, arg):
        if event == "line":
            executed[frame.f_code.co_filename].add(frame.f_lineno)
        return local

    def on_call(frame, event, arg):
        if frame.f_code.co_filename.startswith(library):
            if frame.f_code.co_name != "<module>":  # an import runs the top level, `def` lines included
                entered[frame.f_code.co_filename].add(frame.f_code.co_firstlineno)
            return local
        return None

    spec = importlib.util.spec_from_file_location(script, REPO / "scripts" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "scripts"))
    sys.settrace(on_call)
    try:
        spec.loader.exec_module(module)
        try:
            module.main(argv)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
    finally:
        sys.settrace(None)
    return executed, entered


def report(name: str, executed: dict[str, set[int]], entered: dict[str, set[int]]) -> tuple[int, int, int]:
    """(files touched, lines executed, lines of the functions entered plus the touched modules' top level)."""
    lines_executed = sum(len(v) for v in executed.values())
    read = 0
    for filename in executed:
        path = Path(filename)
        spans = function_spans(path)
        inside = set()
        for first, last in spans.items():
            inside.update(range(first, last + 1))
        functions_read = set()
        for first, last in spans.items():
            if first in entered[filename]:
                functions_read.update(range(first, last + 1))
        total = len(path.read_text().splitlines())
        top_level = total - len(inside)
        read += len(functions_read) + top_level
    print(f"{name}: {len(executed)} files of detlib/, {lines_executed} lines executed, {read} lines read "
          "(the functions entered and the touched modules' top level)")
    return len(executed), lines_executed, read


RUNS = {"train_retinanet": "built-in set, 2 steps and the evaluation", "train_catsdogs": "built-in set, 2 steps and the evaluation"}


def build_parser():
    import argparse

    from detlib.engine.flags import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--script", choices=list(RUNS), help="one script, traced in this process (default: each, each "
                        "in its own process: accelerate's state is one per process)")
    return parser


def main() -> None:
    script = build_parser().parse_args().script
    if script:
        import torch

        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as tmp:
            executed, entered = traced_run(script, ["--max_steps", "2", "--epochs", "1", "--num_workers", "0", "--report_to",
                                           "none", "--output_dir", tmp])
        report(f"{script}.py ({RUNS[script]})", executed, entered)
        return
    import subprocess

    files = list(LIBRARY.rglob("*.py"))
    print(f"detlib/: {len(files)} files, {sum(len(p.read_text().splitlines()) for p in files)} lines")
    for script in RUNS:
        subprocess.run([sys.executable, __file__, "--script", script], check=True)


if __name__ == "__main__":
    main()
