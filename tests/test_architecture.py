"""The package layout is the architecture: imports between detlib's packages run one way (docs/architecture.md).

Each detlib module belongs to a unit: its sub-package (`retinanet`, `data`, ...) or, for a module at the root, the
module itself. Units are in layers; a module may import its own unit and the units of lower layers, never a higher
one, and no two units of one layer import each other (the shared root modules excepted, which import each other
without a cycle). No module imports itself back through others, inside a package either: an import inside a function
and a package's table of lazy exports (`detlib.lazy.lazy_exports`) count as imports. Imports under
`if TYPE_CHECKING:` are type hints only and do not count.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import detlib

PACKAGE = pathlib.Path(detlib.__file__).parent
LAYERS = [
    ("boxes", "labels", "logtext", "files", "lazy", "weights", "hub", "backbones", "argtypes"),  # shared conventions and files
    ("datacheck",),  # the report and the checks of COCO json and ImageFolder trees
    ("data",),  # images, transforms, data sets, VOC/YOLO, the built-in sets
    ("retinanet", "classification", "tiling", "schedules", "compiling"),  # the models; tiles of an image and the
    # merge of their detections; the LR schedules; how --compile compiles
    ("evaluation",),  # COCO evaluation, per-class numbers, plots, drawn samples, model cards
    ("engine",),  # the run: folder and its lock, flags, checkpoints, resume, the step guard, logs and trackers
    ("inference", "deploy"),  # what the predict scripts share; the exported models' runtimes and their AP check
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(name: str) -> str | None:
    """The unit of a dotted module name under detlib (None for `detlib` itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def imported_modules(path: pathlib.Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every detlib import of the module at `path` (its text, or `source` read as
    if it were there), type-hint-only imports left out."""
    tree = ast.parse(path.read_text() if source is None else source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "detlib"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "detlib":
                continue
            if node.module is None or mod in ("detlib",) or (PACKAGE.parent / mod.replace(".", "/")).is_dir():
                found += [(node.lineno, f"{mod}.{a.name}") for a in node.names]  # `from pkg import module`
            else:
                found.append((node.lineno, mod))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def test_every_module_has_a_unit_in_a_layer():
    units = {unit_of(module_name(p)) for p in MODULES} - {None}
    assert units <= set(LAYER), f"units in no layer: {sorted(units - set(LAYER))}"
    assert set(LAYER) <= units, f"layers name units that do not exist: {sorted(set(LAYER) - units)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path):
    own = unit_of(module_name(path))
    wrong = []
    for line, target in imported_modules(path):
        unit = unit_of(target)
        if unit is None:
            wrong.append(f"line {line}: imports the top package `detlib` itself")
        elif own is not None and unit != own and LAYER[unit] >= LAYER[own] and LAYER[own] > 0:
            wrong.append(f"line {line}: {target} ({unit}, layer {LAYER[unit]}) from layer {LAYER[own]}")
    assert not wrong, "\n".join(wrong)


def test_shared_root_modules_import_no_cycle():
    shared = LAYERS[0]
    graph = {u: {unit_of(t) for _, t in imported_modules(PACKAGE / f"{u}.py")} - {u} for u in shared}
    assert all(deps <= set(shared) for deps in graph.values()), graph  # the shared layer imports nothing above it

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, (*seen, d))) for d in graph[start])

    assert not [u for u in shared if reaches(u, u)], graph


def test_the_check_finds_an_import_that_runs_up():
    """The check itself can fail: an upward import added to a low module is found, a type hint is not."""
    low = PACKAGE / "data" / "images.py"
    source = low.read_text() + "\nfrom ..engine.flags import stop\nif TYPE_CHECKING:\n    from ..evaluation import coco\n"
    found = [t for _, t in imported_modules(low, source)]
    assert "detlib.engine.flags" in found and LAYER["engine"] > LAYER["data"]
    assert "detlib.evaluation.coco" not in found


MODULE_NAMES = {module_name(p) for p in MODULES}


def module_of(target: str) -> str:
    """The module an import of `target` runs: `target` when it is one, else the module or package that defines the
    name (`detlib.data.CocoDetection` -> `detlib.data`)."""
    while target not in MODULE_NAMES:
        target = target.rsplit(".", 1)[0]
    return target


def lazy_export_modules(path: pathlib.Path, source: str) -> list[str]:
    """The modules of a package's `lazy_exports(__name__, {submodule: names})` table: its `__getattr__` imports each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("lazy_exports") and len(node.args) == 2
                and isinstance(node.args[1], ast.Dict)):
            found += [f"{module_name(path)}.{k.value}" for k in node.args[1].keys]
    return found


def import_graph(sources: dict[pathlib.Path, str] | None = None) -> dict[str, set[str]]:
    """{module: the modules it imports} over every detlib module (`sources`: texts read instead of some files): its
    imports at the top and inside functions, and a package's lazy exports; type hints left out."""
    graph = {}
    for path in MODULES:
        source = (sources or {}).get(path) or path.read_text()
        targets = [module_of(t) for _, t in imported_modules(path, source)] + lazy_export_modules(path, source)
        graph[module_name(path)] = set(targets)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of `graph` once, as [a, b, ..., a] from its first module in sorted order.

    The strongly connected components first (Tarjan): a cycle lies inside one, so the search for the cycles from a
    module walks its component only, through modules sorted after it (the cycle is found from its first module).
    """
    index, low, on_stack, stack, component = {}, {}, set(), [], {}

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the root of a component: the stack down to v
            members = set()
            while v not in members:
                members.add(stack.pop())
            on_stack.difference_update(members)
            for w in members:
                component[w] = members

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []

    def walk(path):
        for w in sorted(graph[path[-1]] & component[path[0]]):
            if w == path[0]:
                cycles.append(path + [w])
            elif w > path[0] and w not in path:
                walk(path + [w])

    for v in sorted(graph):
        walk([v])
    return cycles


def test_no_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_local_import_and_a_lazy_export():
    """The check itself can fail: an import inside a function that reaches the package's lazy exports back is a cycle,
    named module by module; a type hint is not."""
    low = PACKAGE / "data" / "images.py"
    source = low.read_text() + "\n\ndef f():\n    from . import CocoDetection\n"
    assert ["detlib.data", "detlib.data.coco", "detlib.data.images", "detlib.data"] in import_cycles(
        import_graph({low: source}))
    hint = low.read_text() + "\nif TYPE_CHECKING:\n    from .coco import CocoDetection\n"
    assert "detlib.data.coco" not in import_graph({low: hint})["detlib.data.images"]
    assert import_cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a", "c"}, "d": {"a"}}) == [
        ["a", "b", "a"], ["a", "c", "a"], ["c", "c"]]


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers.py and tests/conftest.py (and devtools/ for benchmarks too)."""
    tests = pathlib.Path(__file__).parent
    wrong = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[-1].startswith("test_") or n.startswith("tests.test_")]
    assert not wrong, wrong
